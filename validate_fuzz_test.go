package idem_test

import (
	"errors"
	"testing"

	"github.com/pgidem/idem"
)

// FuzzValidateKey checks that a key is accepted exactly when it is 1 to 255
// bytes of visible ASCII (0x21-0x7E), or min to max bytes for a Client
// configured so, and that every refusal wraps ErrInvalidKey.
func FuzzValidateKey(f *testing.F) {
	for _, s := range []string{"", "a", "550e8400-e29b-41d4-a716-446655440000", "a b", "é", "\x7f", "\x21\x7e", "\x00", "a\tb"} {
		f.Add(s, uint16(0), uint16(0))
	}
	f.Add("0123456789", uint16(10), uint16(10))
	f.Add("0123456789", uint16(11), uint16(1024))
	f.Add(string(make([]byte, 300)), uint16(1), uint16(1025))
	f.Fuzz(func(t *testing.T, key string, min, max uint16) {
		check := func(err error, lo, hi int) {
			t.Helper()
			valid := len(key) >= lo && len(key) <= hi
			for i := 0; i < len(key); i++ {
				if key[i] < 0x21 || key[i] > 0x7e {
					valid = false
				}
			}
			if valid != (err == nil) {
				t.Fatalf("ValidateKey(%q) with bounds %d..%d = %v, want valid=%t", key, lo, hi, err, valid)
			}
			if err != nil && !errors.Is(err, idem.ErrInvalidKey) {
				t.Fatalf("untyped error %v", err)
			}
		}
		check(idem.ValidateKey(key), 1, 255)
		c, err := idem.New(idem.Config{MinKeyLength: int(min), MaxKeyLength: int(max)})
		lo, hi := int(min), int(max)
		if lo == 0 {
			lo = 1
		}
		if hi == 0 {
			hi = 255
		}
		if valid := hi >= lo && hi <= 1024; valid != (err == nil) {
			t.Fatalf("New with key bounds %d..%d: %v", min, max, err)
		}
		if err == nil {
			check(c.ValidateKey(key), lo, hi)
		}
	})
}
