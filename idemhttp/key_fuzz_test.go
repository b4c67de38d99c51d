package idemhttp

import (
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/pgidem/idem"
)

// sfItem is the grammar of an RFC 8941 Item whose bare item is a String,
// with parameters (sections 3.1.2 and 3.3), as one regular expression: an
// oracle written apart from parseKey's hand-written parser.
var sfItem = func() *regexp.Regexp {
	str := `"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"`
	bare := strings.Join([]string{
		`-?[0-9]{1,15}`,             // Integer
		`-?[0-9]{1,12}\.[0-9]{1,3}`, // Decimal
		str,                         // String
		`[A-Za-z*][!#$%&'*+\-.^_` + "`" + `|~0-9A-Za-z:/]*`, // Token
		`:[A-Za-z0-9+/=]*:`, // Byte Sequence
		`\?[01]`,            // Boolean
	}, "|")
	params := `(?:;[ ]*[a-z*][a-z0-9_.*-]*(?:=(?:` + bare + `))?)*`
	return regexp.MustCompile(`^"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"` + params + `$`)
}()

// FuzzParseKeyHeader checks the Idempotency-Key header parser against an
// oracle of its own: one header line is a bare key when it does not start
// with a double quote (refused with ErrMultipleKeys if it holds a comma),
// otherwise an RFC 8941 String with parameters, matched by sfItem, or
// ErrMalformedKey; no line is ErrMissingKey, two ErrMultipleKeys. A key the
// middleware accepts (parseKey, then ValidateKey) is 1 to 255 bytes of
// visible ASCII, and reads back the same bare and quoted.
func FuzzParseKeyHeader(f *testing.F) {
	for _, seed := range []string{
		"abc", `"abc"`, `"a\"b\\c"`, `"abc";x=1;y="z";w=?0;v=:YQ==:;u=tok/1:2;t=-1.5;*s`, `"abc`, "a,b", " \t ", "",
		`"abc";x=1.2345`, `"abc";x=1234567890123456`, `"abc";X=1`, `"abc" ;x`, `"abc";  x`, "\"a\tb\"", `"é"`,
		"0f8fad5b-d9cb-469f-a165-70867728950e", `"0f8fad5b-d9cb-469f-a165-70867728950e"`, `"a", "b"`, `"abc"x`,
	} {
		f.Add(seed, uint8(1))
	}
	f.Add("a", uint8(0))
	f.Add("a", uint8(2))
	f.Fuzz(func(t *testing.T, v string, lines uint8) {
		values := make([]string, lines%3)
		for i := range values {
			values[i] = v
		}
		key, err := parseKey(values)
		var want error
		wantKey := ""
		trimmed := strings.Trim(v, " \t")
		switch {
		case len(values) == 0:
			want = ErrMissingKey
		case len(values) > 1:
			want = ErrMultipleKeys
		case !strings.HasPrefix(trimmed, `"`) && strings.Contains(trimmed, ","):
			want = ErrMultipleKeys
		case !strings.HasPrefix(trimmed, `"`):
			wantKey = trimmed
		default:
			if m := sfItem.FindStringSubmatch(trimmed); m != nil {
				wantKey = strings.NewReplacer(`\"`, `"`, `\\`, `\`).Replace(m[1])
			} else {
				want = ErrMalformedKey
			}
		}
		if want != nil {
			if !errors.Is(err, want) {
				t.Fatalf("parseKey(%q) = %q, %v; want %v", values, key, err, want)
			}
			for _, other := range []error{ErrMissingKey, ErrMultipleKeys, ErrMalformedKey} {
				if other != want && errors.Is(err, other) {
					t.Fatalf("parseKey(%q) = %v: wraps %v as well", values, err, other)
				}
			}
			return
		}
		if err != nil || key != wantKey {
			t.Fatalf("parseKey(%q) = %q, %v; want %q", values, key, err, wantKey)
		}
		if idem.ValidateKey(key) != nil {
			return // refused by the middleware with 400
		}
		if len(key) < 1 || len(key) > 255 || strings.ContainsFunc(key, func(r rune) bool { return r < 0x21 || r > 0x7e }) {
			t.Fatalf("accepted key %q is not 1-255 bytes of visible ASCII", key)
		}
		// The key as a bare token (when it can be one) and as an sf-string,
		// with whitespace and parameters, reads back the same.
		forms := []string{quote(key), "\t" + quote(key) + ";a=1;b ", quote(key) + `;x="y";z=:YQ==:`}
		if !strings.HasPrefix(key, `"`) && !strings.Contains(key, ",") {
			forms = append(forms, key, " "+key+"\t")
		}
		for _, form := range forms {
			if again, err := parseKey([]string{form}); err != nil || again != key {
				t.Fatalf("%q parsed as %q; its form %q as %q, %v", v, key, form, again, err)
			}
		}
	})
}
