package idem_test

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/pgidem/idem"
)

func TestFingerprintJSONCanonical(t *testing.T) {
	t.Parallel()
	same := [][]any{
		{[]byte(`{"box_id":1,"quantity":2}`), []byte("{ \"quantity\" : 2,\n \"box_id\" : 1 }"),
			json.RawMessage(`{"quantity":2.0,"box_id":1e0}`), map[string]int{"quantity": 2, "box_id": 1},
			struct {
				BoxID    int `json:"box_id"`
				Quantity int `json:"quantity"`
			}{1, 2}},
		{[]byte(`"\u00e9"`), []byte(`"é"`)},
		{[]byte(`[1, 2, 3]`), []int{1, 2, 3}},
	}
	for _, group := range same {
		want, err := idem.FingerprintJSON(group[0])
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range group[1:] {
			got, err := idem.FingerprintJSON(v)
			if err != nil {
				t.Fatalf("%v: %v", v, err)
			}
			if got != want {
				t.Errorf("FingerprintJSON(%s) = %s, want %s (same as %s)", v, got, want, group[0])
			}
		}
	}
	a, _ := idem.FingerprintJSON([]byte(`{"quantity":1}`))
	b, _ := idem.FingerprintJSON([]byte(`{"quantity":2}`))
	c, _ := idem.FingerprintJSON([]byte(`{"quantity":"1"}`))
	if a == b || a == c {
		t.Fatal("different requests share a fingerprint")
	}
	// Known answer: SHA-256 of the canonical text {"a":1,"b":2}.
	k, err := idem.FingerprintJSON([]byte(`{"b":2,"a":1}`))
	if err != nil {
		t.Fatal(err)
	}
	if k.String() != "43258cff783fe7036d8a43033f830adfc60ec037382473548ac742b888292777" {
		t.Fatalf("known answer: %s", k)
	}
}

// Integers a double cannot hold (64-bit ids) keep their exact value; the
// same integer spelt another way, in other member order, is still the same.
func TestFingerprintJSONLargeIntegers(t *testing.T) {
	t.Parallel()
	fp := func(s string) idem.Fingerprint {
		t.Helper()
		f, err := idem.FingerprintJSON([]byte(s))
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	differ := [][2]string{
		{`{"to":9007199254740993}`, `{"to":9007199254740992}`},
		{`[18446744073709551615]`, `[18446744073709551614]`},
		{`{"a":[1,{"id":1234567890123456789}]}`, `{"a":[1,{"id":1234567890123456788}]}`},
		{`{"a":9007199254740993,"b":9007199254740995}`, `{"a":9007199254740995,"b":9007199254740993}`},
		{`1000000000000000019884624838656`, `1e30`},
	}
	for _, d := range differ {
		if fp(d[0]) == fp(d[1]) {
			t.Errorf("%s and %s share a fingerprint", d[0], d[1])
		}
	}
	same := [][2]string{
		{`{"a":9007199254740993,"b":[12345678901234567890]}`, `{"b":[1234567890123456789.0e1],"a":9007199254740993}`},
		{`{"id":9007199254740993}`, `{ "id" : 90071992547409930e-1 }`},
	}
	for _, d := range same {
		if fp(d[0]) != fp(d[1]) {
			t.Errorf("%s and %s differ", d[0], d[1])
		}
	}
	// Integers a double holds keep the plain SHA-256 of the RFC 8785 form,
	// like the RFC's own example (whose fractions RFC 8785 rounds).
	text := `{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001],"big":9007199254740992}`
	canonical := `{"big":9007199254740992,"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27]}`
	if fp(text) != sha256.Sum256([]byte(canonical)) {
		t.Errorf("the fingerprint of %s is not the SHA-256 of %s", text, canonical)
	}
}

// Hostile numbers and nesting cost time and memory linear in the text (a
// quadratic walk or exact arithmetic on 1e-1000000 would take minutes here).
func TestFingerprintJSONHostileInput(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString(`[1234567890123456789`)
	for range 2000 {
		b.WriteString(`,1e-1000000,-1e-1000000,123456789012345678e-999999`)
	}
	b.WriteString(`]`)
	deep := strings.Repeat(`{"a":[9007199254740993,`, 4000) + `1` + strings.Repeat(`]}`, 4000)
	long := `[1` + strings.Repeat("0", 300) + `e-300, 9007199254740993` + strings.Repeat("0", 200) + `e-200, 1` + strings.Repeat("0", 300) + `]`
	for name, text := range map[string]string{"exponents": b.String(), "deep": deep, "long": long} {
		a, err := idem.FingerprintJSON([]byte(text))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if again, _ := idem.FingerprintJSON([]byte(text)); again != a {
			t.Fatalf("%s: not deterministic", name)
		}
	}
	// 1 followed by 300 zeros, then e-300, is 1; the long spelling of
	// 9007199254740993 is still that integer.
	short, _ := idem.FingerprintJSON([]byte(`[1,9007199254740993,1e300]`))
	if long, _ := idem.FingerprintJSON([]byte(long)); long != short {
		t.Fatal("long spellings of the same numbers differ")
	}
}

func TestFingerprintJSONInvalid(t *testing.T) {
	t.Parallel()
	for _, v := range []any{
		[]byte(`{"a":1,"a":2}`), []byte(`{"a":`), []byte(``), []byte(`{} {}`), []byte(nil),
		json.RawMessage(`nope`), make(chan int), map[string]any{"f": func() {}},
	} {
		if _, err := idem.FingerprintJSON(v); !errors.Is(err, idem.ErrInvalidJSON) {
			t.Errorf("FingerprintJSON(%v) = %v, want ErrInvalidJSON", v, err)
		}
	}
}

func TestFingerprintParts(t *testing.T) {
	t.Parallel()
	ab := idem.FingerprintParts([]byte("ab"), []byte("c"))
	if ab == idem.FingerprintParts([]byte("a"), []byte("bc")) || ab == idem.FingerprintParts([]byte("abc")) {
		t.Fatal("parts are not separated")
	}
	if ab != idem.FingerprintParts([]byte("ab"), []byte("c")) {
		t.Fatal("not deterministic")
	}
}

func FuzzFingerprintJSON(f *testing.F) {
	for _, s := range []string{`{"b":2,"a":1}`, `[1,2.50,-0,1e300]`, `"\ud83d\ude00"`, `{"a":{"b":[null,true]}}`, `{`, `1 2`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, text []byte) {
		fp, err := idem.FingerprintJSON(text)
		if err != nil {
			if !errors.Is(err, idem.ErrInvalidJSON) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		// Canonical JSON is stable: re-encoding the value through
		// encoding/json must give the same fingerprint when it parses the
		// same way (skip inputs encoding/json reads differently).
		var v any
		if json.Unmarshal(text, &v) != nil {
			return
		}
		again, err := idem.FingerprintJSON(v)
		if err != nil {
			return // e.g. numbers encoding/json cannot round-trip
		}
		if again != fp && isSafeRoundTrip(v) {
			t.Fatalf("fingerprint of %q changed after a round trip", text)
		}
	})
}

// isSafeRoundTrip reports whether v survives encoding/json unchanged for
// fingerprinting: no numbers (float64 may lose digits) and no strings that
// encoding/json rewrites (invalid UTF-8).
func isSafeRoundTrip(v any) bool {
	switch t := v.(type) {
	case float64:
		return false
	case []any:
		for _, e := range t {
			if !isSafeRoundTrip(e) {
				return false
			}
		}
	case map[string]any:
		for _, e := range t {
			if !isSafeRoundTrip(e) {
				return false
			}
		}
	}
	return true
}

func FuzzValidateKey(f *testing.F) {
	for _, s := range []string{"", "a", "550e8400-e29b-41d4-a716-446655440000", "a b", "é", "\x7f", "\x21\x7e"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		err := idem.ValidateKey(key)
		valid := len(key) >= 1 && len(key) <= 255
		for i := 0; i < len(key); i++ {
			if key[i] < 0x21 || key[i] > 0x7e {
				valid = false
			}
		}
		if valid != (err == nil) {
			t.Fatalf("ValidateKey(%q) = %v, want valid=%v", key, err, valid)
		}
		if err != nil && !errors.Is(err, idem.ErrInvalidKey) {
			t.Fatalf("untyped error %v", err)
		}
	})
}

// The request-path cost of FingerprintJSON, for typical bodies and for the
// forms that need more than RFC 8785 (64-bit ids, long decimals). Compare
// ns/op, B/op and allocs/op between commits; nothing asserts a time.
func BenchmarkFingerprintJSON(b *testing.B) {
	payment := []byte(`{"amount":"125.40","currency":"EUR","customer":{"id":"cus_9s6XKzkNRiz8i3","email":"a.b@example.com","name":"Émilie Dupont"},` +
		`"items":[{"sku":"SKU-1001","qty":2,"price":19.99},{"sku":"SKU-2002","qty":1,"price":85.42}],"metadata":{"order":"ord_12345","note":"leave at the door\n"},"capture":true,"tip":null}`)
	big := []byte(`{"from":1234567890123456789,"to":9007199254740993,"amount":1234567890123456.7,"ref":"x"}`)
	type draw struct {
		BoxID    int64  `json:"box_id"`
		Quantity int    `json:"quantity"`
		Note     string `json:"note"`
	}
	for _, bc := range []struct {
		name string
		v    any
	}{
		{"small", []byte(`{"box_id":1,"quantity":2}`)},
		{"payment", payment},
		{"struct", draw{BoxID: 42, Quantity: 3, Note: "for the kids"}},
		{"exact-decimals", big},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := idem.FingerprintJSON(bc.v); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
