package nullbytea_test

import (
	"testing"

	"github.com/pgidem/idem/internal/nullbytea"
)

// TestScan: only NULL reads as nil; an empty value, even one a driver
// hands over as a nil []byte (lib/pq in bytea's escape format), reads as
// empty bytes, and Value gives NULL back only for nil.
func TestScan(t *testing.T) {
	for _, c := range []struct {
		name string
		src  any
		null bool
		want string
	}{
		{"NULL", nil, true, ""},
		{"empty, as a nil []byte", []byte(nil), false, ""},
		{"empty", []byte{}, false, ""},
		{"bytes", []byte("ok"), false, "ok"},
		{"text", "ok", false, "ok"},
	} {
		var b nullbytea.Bytes
		if err := b.Scan(c.src); err != nil || (b == nil) != c.null || string(b) != c.want {
			t.Errorf("%s: %#v, %v", c.name, b, err)
		}
		v, err := b.Value()
		if err != nil || (v == nil) != c.null {
			t.Errorf("%s: Value %#v, %v", c.name, v, err)
		}
	}
	var b nullbytea.Bytes
	if err := b.Scan(42); err == nil {
		t.Error("Scan of an int: no error")
	}
}
