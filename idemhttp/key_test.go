package idemhttp

import (
	"errors"
	"strings"
	"testing"

	"github.com/pgidem/idem"
)

func TestParseKey(t *testing.T) {
	ok := map[string]string{
		"abc":                                    "abc",
		"  0f8fad5b-d9cb-469f-a165-70867728950e": "0f8fad5b-d9cb-469f-a165-70867728950e",
		`"abc"`:                                  "abc",
		`"a\"b\\c"`:                              `a"b\c`,
		`"abc";x`:                                "abc",
		`"abc";x=1;y=-2.5;z="q";w=tok:/1;v=:YQ==:;u=?1;*t=*`: "abc",
		"\t\"abc\" ":           "abc",
		`abc;not=params`:       "abc;not=params",
		`""`:                   "",
		`"a b"`:                "a b",
		"1754321000_Ab-9_x":    "1754321000_Ab-9_x",
		`"1754321000_Ab-9_x" `: "1754321000_Ab-9_x",
	}
	for in, want := range ok {
		got, err := parseKey([]string{in})
		if err != nil || got != want {
			t.Errorf("parseKey(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	bad := map[string]error{
		`"abc`:                     ErrMalformedKey,
		`"ab\c"`:                   ErrMalformedKey,
		`"abc" x`:                  ErrMalformedKey,
		`"abc";`:                   ErrMalformedKey,
		`"abc";X=1`:                ErrMalformedKey,
		`"abc";x=`:                 ErrMalformedKey,
		`"abc";x=?`:                ErrMalformedKey,
		`"abc";x=:YQ`:              ErrMalformedKey,
		`"abc";x=1.`:               ErrMalformedKey,
		`"abc";x=1.5555`:           ErrMalformedKey,
		`"abc";x=1234567890123456`: ErrMalformedKey,
		`"abc";x=-`:                ErrMalformedKey,
		`"ab` + "\x7f" + `"`:       ErrMalformedKey,
		`"abc"\`:                   ErrMalformedKey,
		"a,b":                      ErrMultipleKeys,
		`"a", "b"`:                 ErrMalformedKey,
	}
	for in, want := range bad {
		if got, err := parseKey([]string{in}); !errors.Is(err, want) {
			t.Errorf("parseKey(%q) = %q, %v; want %v", in, got, err, want)
		}
	}
	if _, err := parseKey(nil); !errors.Is(err, ErrMissingKey) {
		t.Errorf("no header: %v", err)
	}
	if _, err := parseKey([]string{"a", "a"}); !errors.Is(err, ErrMultipleKeys) {
		t.Errorf("two headers: %v", err)
	}
}

// quote returns key as a structured-field string.
func quote(key string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
}

// FuzzParseKey checks that parseKey never panics, that a bare value is
// taken as is, and that any valid key survives quoting.
func FuzzParseKey(f *testing.F) {
	for _, seed := range []string{
		"abc", `"abc"`, `"a\"b"`, `"abc";x=1;y="z";w=?0;v=:YQ==:`, `"abc`, "a,b", " \t ", "",
		`"abc";x=1.25`, `"abc";x=-12`, `"abc";*a.b-c_d`, `"abc"` + "\x00", "0f8fad5b-d9cb-469f-a165-70867728950e",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, v string) {
		key, err := parseKey([]string{v})
		if err != nil {
			if !errors.Is(err, ErrMalformedKey) && !errors.Is(err, ErrMultipleKeys) {
				t.Fatalf("parseKey(%q): unexpected error %v", v, err)
			}
			return
		}
		trimmed := strings.Trim(v, " \t")
		if !strings.HasPrefix(trimmed, `"`) && key != trimmed {
			t.Fatalf("bare %q parsed as %q", v, key)
		}
		if idem.ValidateKey(key) != nil {
			return
		}
		// A valid key reads back the same from its quoted form, with or
		// without parameters.
		for _, q := range []string{quote(key), quote(key) + ";p=1", " " + quote(key) + " "} {
			if again, err := parseKey([]string{q}); err != nil || again != key {
				t.Fatalf("%q -> %q -> %q: %q, %v", v, key, q, again, err)
			}
		}
		if !strings.Contains(key, ",") && !strings.HasPrefix(key, `"`) {
			if again, err := parseKey([]string{key}); err != nil || again != key {
				t.Fatalf("bare %q: %q, %v", key, again, err)
			}
		}
	})
}
