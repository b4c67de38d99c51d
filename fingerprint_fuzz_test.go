package idem_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/gowebpki/jcs"

	"github.com/pgidem/idem"
)

// FuzzFingerprintJSON checks FingerprintJSON against three oracles:
//   - an independent RFC 8785 implementation (jcs) and exact arithmetic
//     (math/big): the two accept the same texts (apart from numbers beyond
//     a double, which only FingerprintJSON takes), and a document whose
//     numbers RFC 8785 writes exactly gets the SHA-256 of jcs's text, any
//     other a fingerprint that is not;
//   - the same value written again another way (members in another order,
//     other whitespace, ordinary characters as \u escapes, numbers spelled
//     another way, as a Go value) gets the same fingerprint;
//   - a change to one value (a character, a digit, true to false, an element
//     or member added, dropped or renamed) gets a different fingerprint.
//
// seed chooses the rewriting and the change.
func FuzzFingerprintJSON(f *testing.F) {
	for _, s := range []string{
		`{"b":2,"a":1}`, `[1,2.50,-0,1e300]`, `"\ud83d\ude00"`, `{"a":{"b":[null,true]}}`, `{`, `1 2`,
		`{"amount":1234567890123456.7}`, `[1e-400,0]`, `[0.10000000000000001,9007199254740993]`,
		`{"\u20ac":"Euro Sign","\r":"CR","\ufb33":"Dalet","1":"One","\ud83d\ude00":"Emoji","\u0080":"Ctl","\u00f6":"o"}`,
		`{"a":1,"a":2}`, `{"a":1,"\u0061":2}`, "\"\xff\"", `"\udc00"`, `[1e400]`, `[-0.0e-7, 5e-324]`,
		`{"to":9007199254740993}`, `[1e-7,0.000001,1e21,1e20,123e-20,-4.5E+2]`, `[1.7976931348623157e308,2.2250738585072014e-308,1.23456789012345e-310]`,
		`{"s":"\u0000\b\t\n\f\r\u001f\"\\\/\u007f\u2028"}`, `{"\ue000":1,"\ud800\udc00":2}`,
	} {
		f.Add([]byte(s), uint64(len(s)))
	}
	f.Fuzz(func(t *testing.T, text []byte, seed uint64) {
		fp, err := idem.FingerprintJSON(text)
		canonical, jcsErr := jcs.Transform(slices.Clone(text))
		if err != nil {
			if !errors.Is(err, idem.ErrInvalidJSON) {
				t.Fatalf("untyped error %v", err)
			}
			// jcs refuses the same texts, except for numbers whose exponent
			// has more than 18 digits, which it reads as 0 or infinity.
			if jcsErr == nil && !strings.Contains(err.Error(), "exponent") {
				t.Fatalf("FingerprintJSON refuses what jcs accepts: %v", err)
			}
			return
		}
		if again, _ := idem.FingerprintJSON(text); again != fp {
			t.Fatal("not deterministic")
		}
		v, err := decode(text)
		if err != nil {
			t.Fatalf("FingerprintJSON accepts what encoding/json refuses: %v", err)
		}
		if jcsErr != nil && !strings.Contains(jcsErr.Error(), "out of range") {
			t.Fatalf("FingerprintJSON accepts what jcs refuses: %v", jcsErr)
		}
		if exact, known := rfc8785Exact(v); known {
			var b strings.Builder
			canonicalText(&b, v)
			want := b.String()
			if exact && want != string(canonical) {
				t.Fatalf("the test's canonical text %q is not jcs's %q", want, canonical)
			}
			if !exact {
				want = "idem exact JSON v1\x00" + want
			}
			if fp != sha256.Sum256([]byte(want)) {
				t.Fatalf("%q (exact: %t) is not hashed as %q", text, exact, want)
			}
		}

		rnd := rand.New(rand.NewPCG(seed, uint64(len(text))))
		for range 3 {
			var b bytes.Buffer
			rewrite(&b, v, rnd)
			if got, err := idem.FingerprintJSON(b.Bytes()); err != nil || got != fp {
				t.Fatalf("%q rewritten as %q: %v, %v", text, b.Bytes(), got, err)
			}
		}
		if got, err := idem.FingerprintJSON(v); err != nil || got != fp {
			t.Fatalf("%q as a Go value: %v, %v", text, got, err)
		}
		changed, what := change(v, rnd)
		var b bytes.Buffer
		rewrite(&b, changed, rnd)
		got, err := idem.FingerprintJSON(b.Bytes())
		if err != nil {
			t.Fatalf("%q changed (%s) to %q: %v", text, what, b.Bytes(), err)
		}
		if got == fp {
			t.Fatalf("%q changed (%s) to %q keeps its fingerprint", text, what, b.Bytes())
		}
	})
}

// decode reads one JSON value, numbers as json.Number.
func decode(text []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	return v, nil
}

// rfc8785Exact reports whether every number of v is the decimal RFC 8785
// writes for its double, by exact arithmetic; known is false for numbers too
// large to check quickly.
func rfc8785Exact(v any) (exact, known bool) {
	exact, known = true, true
	walk(v, func(n json.Number) {
		lit := string(n)
		if len(lit) > 400 || exponent(lit) > 400 || exponent(lit) < -400 {
			known = false
			return
		}
		r, ok := new(big.Rat).SetString(lit)
		if !ok {
			panic(lit)
		}
		f, err := strconv.ParseFloat(lit, 64)
		if err != nil {
			exact = false // beyond a double
			return
		}
		printed, err := jcs.NumberToJSON(f)
		if err != nil {
			panic(err)
		}
		p, _ := new(big.Rat).SetString(printed)
		if r.Cmp(p) != 0 {
			exact = false
		}
	})
	return exact, known
}

func exponent(lit string) int64 {
	i := strings.IndexAny(lit, "eE")
	if i < 0 {
		return 0
	}
	e, err := strconv.ParseInt(strings.TrimPrefix(lit[i+1:], "+"), 10, 64)
	if err != nil {
		return 1 << 62
	}
	return e
}

func walk(v any, number func(json.Number)) {
	switch t := v.(type) {
	case json.Number:
		number(t)
	case []any:
		for _, e := range t {
			walk(e, number)
		}
	case map[string]any:
		for _, e := range t {
			walk(e, number)
		}
	}
}

// canonicalText writes v as RFC 8785 does, except that numbers keep their
// exact value, in RFC 8785's notation: the digits d1d2...dk and the point n
// of the value 0.d1d2...dk × 10^n are written as ECMAScript writes a number.
func canonicalText(b *strings.Builder, v any) {
	switch t := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(t))
	case string:
		b.WriteByte('"')
		for _, r := range t {
			switch {
			case r == '"' || r == '\\':
				b.WriteString(`\` + string(r))
			case r < 0x20:
				if short, ok := map[rune]string{'\b': `\b`, '\f': `\f`, '\n': `\n`, '\r': `\r`, '\t': `\t`}[r]; ok {
					b.WriteString(short)
				} else {
					fmt.Fprintf(b, `\u%04x`, r)
				}
			default:
				b.WriteRune(r)
			}
		}
		b.WriteByte('"')
	case json.Number:
		lit := string(t)
		neg := strings.HasPrefix(lit, "-")
		mantissa, exp := strings.TrimPrefix(lit, "-"), int64(0)
		if i := strings.IndexAny(mantissa, "eE"); i >= 0 {
			mantissa, exp = mantissa[:i], exponent(lit)
		}
		intPart, frac, _ := strings.Cut(mantissa, ".")
		all := intPart + frac
		digits := strings.Trim(all, "0")
		if digits == "" {
			b.WriteString("0")
			return
		}
		n := exp + int64(len(intPart)) - int64(len(all)-len(strings.TrimLeft(all, "0")))
		k := int64(len(digits))
		if neg {
			b.WriteByte('-')
		}
		switch {
		case k <= n && n <= 21:
			b.WriteString(digits + strings.Repeat("0", int(n-k)))
		case 0 < n && n <= 21:
			b.WriteString(digits[:n] + "." + digits[n:])
		case -6 < n && n <= 0:
			b.WriteString("0." + strings.Repeat("0", int(-n)) + digits)
		default:
			b.WriteString(digits[:1])
			if k > 1 {
				b.WriteString("." + digits[1:])
			}
			fmt.Fprintf(b, "e%+d", n-1)
		}
	case []any:
		b.WriteByte('[')
		for i, e := range t {
			if i > 0 {
				b.WriteByte(',')
			}
			canonicalText(b, e)
		}
		b.WriteByte(']')
	case map[string]any:
		names := make([]string, 0, len(t))
		for name := range t {
			names = append(names, name)
		}
		slices.SortFunc(names, func(a, b string) int {
			return slices.Compare(utf16.Encode([]rune(a)), utf16.Encode([]rune(b)))
		})
		b.WriteByte('{')
		for i, name := range names {
			if i > 0 {
				b.WriteByte(',')
			}
			canonicalText(b, name)
			b.WriteByte(':')
			canonicalText(b, t[name])
		}
		b.WriteByte('}')
	}
}

// rewrite writes v as JSON text in a random way of its own: members in a
// random order, random whitespace, characters escaped at random, numbers
// spelled at random.
func rewrite(b *bytes.Buffer, v any, rnd *rand.Rand) {
	space := func() {
		for range rnd.IntN(3) {
			b.WriteByte(" \t\n\r"[rnd.IntN(4)])
		}
	}
	space()
	switch t := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(t))
	case string:
		rewriteString(b, t, rnd)
	case json.Number:
		b.WriteString(respellNumber(string(t), rnd))
	case []any:
		b.WriteByte('[')
		for i, e := range t {
			if i > 0 {
				b.WriteByte(',')
			}
			rewrite(b, e, rnd)
		}
		space()
		b.WriteByte(']')
	case map[string]any:
		names := make([]string, 0, len(t))
		for name := range t {
			names = append(names, name)
		}
		rnd.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
		b.WriteByte('{')
		for i, name := range names {
			if i > 0 {
				b.WriteByte(',')
			}
			space()
			rewriteString(b, name, rnd)
			space()
			b.WriteByte(':')
			rewrite(b, t[name], rnd)
		}
		space()
		b.WriteByte('}')
	default:
		panic(fmt.Sprintf("%T", v))
	}
	space()
}

func rewriteString(b *bytes.Buffer, s string, rnd *rand.Rand) {
	u := func(r rune) {
		digits := fmt.Sprintf("%04x", r)
		if rnd.IntN(2) == 0 {
			digits = strings.ToUpper(digits)
		}
		b.WriteString(`\u` + digits)
	}
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r >= 0x10000 && rnd.IntN(3) == 0:
			hi, lo := utf16.EncodeRune(r)
			u(hi)
			u(lo)
		case r < 0x10000 && rnd.IntN(3) == 0:
			u(r)
		case r == '"' || r == '\\':
			b.WriteString(`\` + string(r))
		case r == '/' && rnd.IntN(2) == 0:
			b.WriteString(`\/`)
		case r < 0x20:
			if short, ok := map[rune]string{'\b': `\b`, '\f': `\f`, '\n': `\n`, '\r': `\r`, '\t': `\t`}[r]; ok && rnd.IntN(2) == 0 {
				b.WriteString(short)
			} else {
				u(r)
			}
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
}

// respellNumber writes the JSON number lit as another literal of the same
// value: zeros added, the point moved, the exponent adjusted and spelled e,
// E, e+ or with leading zeros, zero with any sign.
func respellNumber(lit string, rnd *rand.Rand) string {
	sign := ""
	if strings.HasPrefix(lit, "-") {
		sign, lit = "-", lit[1:]
	}
	mantissa, exp := lit, int64(0)
	if i := strings.IndexAny(lit, "eE"); i >= 0 {
		if exp, mantissa = exponent(lit), lit[:i]; exp > 1e15 || exp < -1e15 {
			return sign + lit // keep away from the 18-digit limit
		}
	}
	intPart, frac, _ := strings.Cut(mantissa, ".")
	digits := strings.TrimLeft(intPart+frac, "0")
	if digits == "" {
		return []string{"", "-"}[rnd.IntN(2)] + []string{"0", "0.0", "0e5", "0.000E-3"}[rnd.IntN(4)]
	}
	// The value is digits × 10^e.
	e := exp - int64(len(frac))
	zeros := rnd.IntN(3)
	digits += strings.Repeat("0", zeros)
	e -= int64(zeros)
	// Put the point after p digits, or write 0.digits.
	var out string
	switch p := rnd.IntN(len(digits) + 1); {
	case p == 0:
		out = "0." + digits
		e += int64(len(digits))
	case p < len(digits):
		out = digits[:p] + "." + digits[p:]
		e += int64(len(digits) - p)
	default:
		out = digits
	}
	if e != 0 || rnd.IntN(2) == 0 {
		out += []string{"e", "E"}[rnd.IntN(2)]
		switch {
		case e < 0:
			out += "-"
		case rnd.IntN(2) == 0:
			out += "+"
		}
		out += strings.Repeat("0", rnd.IntN(2)) + strconv.FormatInt(max(e, -e), 10)
	}
	return sign + out
}

// change returns a copy of v with one value changed, and what it did.
func change(v any, rnd *rand.Rand) (any, string) {
	switch t := v.(type) {
	case nil:
		return false, "null to false"
	case bool:
		return !t, "flipped a boolean"
	case string:
		if t == "" || rnd.IntN(2) == 0 {
			return t + "x", "appended to a string"
		}
		r, n := utf8.DecodeRuneInString(t)
		return string(r^1) + t[n:], "changed a character"
	case json.Number:
		if rnd.IntN(4) == 0 {
			return string(t), "number to string"
		}
		// Add a nonzero digit at the end of the mantissa.
		lit, exp := string(t), ""
		if i := strings.IndexAny(lit, "eE"); i >= 0 {
			lit, exp = lit[:i], lit[i:]
		}
		if !strings.Contains(lit, ".") {
			lit += "."
		}
		return json.Number(lit + strconv.Itoa(1+rnd.IntN(9)) + exp), "added a digit"
	case []any:
		c := slices.Clone(t)
		switch {
		case len(c) > 0 && rnd.IntN(2) == 0:
			i := rnd.IntN(len(c))
			c[i], _ = change(c[i], rnd)
			return c, "changed an element"
		case len(c) > 0 && rnd.IntN(2) == 0:
			return c[:len(c)-1], "dropped an element"
		}
		return append(c, nil), "added an element"
	case map[string]any:
		c := make(map[string]any, len(t))
		var names []string
		for name, e := range t {
			c[name] = e
			names = append(names, name)
		}
		slices.Sort(names)
		fresh := "x"
		for c[fresh] != nil || slices.Contains(names, fresh) {
			fresh += "x"
		}
		if len(names) == 0 {
			c[fresh] = nil
			return c, "added a member"
		}
		name := names[rnd.IntN(len(names))]
		switch rnd.IntN(4) {
		case 0:
			c[name], _ = change(c[name], rnd)
			return c, "changed a member"
		case 1:
			delete(c, name)
			return c, "dropped a member"
		case 2:
			c[fresh] = c[name]
			delete(c, name)
			return c, "renamed a member"
		}
		c[fresh] = true
		return c, "added a member"
	}
	panic(fmt.Sprintf("%T", v))
}
