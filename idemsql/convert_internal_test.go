package idemsql

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
)

// TestSentinelsAsIdems: idemsql maps every sentinel of the protocol that
// package idem maps (convert.go at the root lists them), each to idem's.
func TestSentinelsAsIdems(t *testing.T) {
	src, err := os.ReadFile("../convert.go")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(src), ", core.Err"); n != len(sentinels) {
		t.Errorf("package idem maps %d sentinels, idemsql %d: update idemsql/convert.go", n, len(sentinels))
	}
	for _, s := range sentinels {
		err := publicErr(fmt.Errorf("idem: %w", s.core))
		if !errors.Is(err, s.public) || s.public.Error() != s.core.Error() {
			t.Errorf("%v: not idem's %v", err, s.public)
		}
	}
}
