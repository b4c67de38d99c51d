package idem_test

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"

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
}

// RFC 8785's own examples and number samples keep the plain SHA-256 of the
// canonical text the RFC gives for them.
func TestFingerprintJSONRFC8785Vectors(t *testing.T) {
	t.Parallel()
	plain := func(text, canonical string) {
		t.Helper()
		got, err := idem.FingerprintJSON([]byte(text))
		if err != nil {
			t.Fatalf("%s: %v", text, err)
		}
		if got != sha256.Sum256([]byte(canonical)) {
			t.Errorf("FingerprintJSON(%s) is not the SHA-256 of %s", text, canonical)
		}
	}
	// Section 3.2.2, with the first number as the RFC prints it: the RFC's
	// 333333333.33333329 is another decimal, which RFC 8785 rounds.
	example := `{
  "numbers": [%s, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}`
	canonical := `{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}`
	plain(fmt.Sprintf(example, "333333333.3333333"), canonical)
	plain(fmt.Sprintf(example, "3333333333333333e-7"), canonical)
	rounded, err := idem.FingerprintJSON([]byte(fmt.Sprintf(example, "333333333.33333329")))
	if err != nil {
		t.Fatal(err)
	}
	if rounded == sha256.Sum256([]byte(canonical)) {
		t.Error("333333333.33333329 shares a fingerprint with 333333333.3333333")
	}
	// Section 3.2.3: members sorted by their UTF-16 code units.
	plain(`{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}`, "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u0080\":\"Control\",\"ö\":\"Latin Small Letter O With Diaeresis\","+
		"\"€\":\"Euro Sign\",\"😀\":\"Emoji: Grinning Face\",\"\ufb33\":\"Hebrew Letter Dalet With Dagesh\"}")
	// Appendix B: IEEE 754 doubles and their RFC 8785 form, given as JSON
	// text in that form and in other spellings of the same decimal, and as
	// Go float64 values. NaN and Infinity have no JSON form.
	for _, v := range []struct{ bits, want string }{
		{"0000000000000000", "0"},
		{"8000000000000000", "0"}, // minus zero
		{"0000000000000001", "5e-324"},
		{"8000000000000001", "-5e-324"},
		{"7fefffffffffffff", "1.7976931348623157e+308"},
		{"ffefffffffffffff", "-1.7976931348623157e+308"},
		{"4340000000000000", "9007199254740992"},
		{"c340000000000000", "-9007199254740992"},
		{"4430000000000000", "295147905179352830000"},
		{"44b52d02c7e14af5", "9.999999999999997e+22"},
		{"44b52d02c7e14af6", "1e+23"},
		{"44b52d02c7e14af7", "1.0000000000000001e+23"},
		{"444b1ae4d6e2ef4e", "999999999999999700000"},
		{"444b1ae4d6e2ef4f", "999999999999999900000"},
		{"444b1ae4d6e2ef50", "1e+21"},
		{"3eb0c6f7a0b5ed8c", "9.999999999999997e-7"},
		{"3eb0c6f7a0b5ed8d", "0.000001"},
		{"41b3de4355555553", "333333333.3333332"},
		{"41b3de4355555554", "333333333.33333325"},
		{"41b3de4355555555", "333333333.3333333"},
		{"41b3de4355555556", "333333333.3333334"},
		{"41b3de4355555557", "333333333.33333343"},
		{"becbf647612f3696", "-0.0000033333333333333333"},
		{"43143ff3c1cb0959", "1424953923781206.2"},
	} {
		bits, err := strconv.ParseUint(v.bits, 16, 64)
		if err != nil {
			t.Fatal(err)
		}
		f := math.Float64frombits(bits)
		want := "[" + v.want + "]"
		plain(want, want)
		plain("[ "+respell(v.want)+" ]", want)
		got, err := idem.FingerprintJSON([]float64{f})
		if err != nil || got != sha256.Sum256([]byte(want)) {
			t.Errorf("FingerprintJSON([]float64{%v}) = %v, %v; want the SHA-256 of %s", f, got, err, want)
		}
		// The double's own exact value is another decimal, unless it is
		// one that RFC 8785 writes in full (an integer, or zero).
		r := new(big.Rat).SetFloat64(f)
		if printed, _ := new(big.Rat).SetString(v.want); r.Cmp(printed) == 0 {
			continue
		}
		exact := strings.TrimRight(r.FloatString(1100), "0")
		if got, _ := idem.FingerprintJSON([]byte("[" + exact + "]")); got == sha256.Sum256([]byte(want)) {
			t.Errorf("the exact value of %s shares its fingerprint", v.want)
		}
	}
	for _, f := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		if _, err := idem.FingerprintJSON([]float64{f}); !errors.Is(err, idem.ErrInvalidJSON) {
			t.Errorf("FingerprintJSON(%v) = %v, want ErrInvalidJSON", f, err)
		}
	}
}

// respell writes the JSON number lit another way: its digits with a zero
// added, moved behind "0.", and the exponent adjusted to match.
func respell(lit string) string {
	sign := ""
	if strings.HasPrefix(lit, "-") {
		sign, lit = "-", lit[1:]
	}
	mantissa, exp := lit, 0
	if i := strings.IndexAny(lit, "eE"); i >= 0 {
		exp, _ = strconv.Atoi(lit[i+1:])
		mantissa = lit[:i]
	}
	intPart, frac, _ := strings.Cut(mantissa, ".")
	// lit is 0.(intPart frac) × 10^(exp + len(intPart)).
	return fmt.Sprintf("%s0.%s%s0E%+d", sign, intPart, frac, exp+len(intPart))
}

// The holes of issue 11: every pair here shared a fingerprint before, since
// RFC 8785 rounds numbers through a double and encoding/json writes invalid
// UTF-8 as U+FFFD.
func TestFingerprintJSONExactNumbers(t *testing.T) {
	t.Parallel()
	fp := func(s string) idem.Fingerprint {
		t.Helper()
		f, err := idem.FingerprintJSON([]byte(s))
		if err != nil {
			t.Fatalf("%s: %v", s, err)
		}
		return f
	}
	for _, d := range [][2]string{
		{`{"amount":1234567890123456.7}`, `{"amount":1234567890123456.8}`},
		{`{"amount":1e-400}`, `{"amount":0}`},
		{`[0.1]`, `[0.10000000000000001]`},
		{`[1e400]`, `[1e401]`},
		{`[1e-400]`, `[-1e-400]`},
		{`[5e-324]`, `[4.9406564584124654e-324]`},
		{`[1.7976931348623157e+308]`, `[1.7976931348623158e+308]`},
		{`[0.3]`, `[0.299999999999999988897769753748434595763683319091796875]`},
		{`[123456789012345678901234567890]`, `[123456789012345678901234567891]`},
		{`{"a":1e-400,"b":2}`, `{"a":2e-400,"b":2}`},
		{`[1.00000000000000000000000000000000000000000001]`, `[1]`},
		{`[1.23456789012345e-310]`, `[1.23456789012346e-310]`}, // subnormal: fewer digits hold
	} {
		if fp(d[0]) == fp(d[1]) {
			t.Errorf("%s and %s share a fingerprint", d[0], d[1])
		}
	}
	// Spellings of one value share one, inexact or not.
	for _, group := range [][]string{
		{`[1]`, `[1.0]`, `[1e0]`, `[10e-1]`, `[0.1E+1]`, `[100e-2]`, `[1.000e000]`},
		{`[0]`, `[-0]`, `[0.0]`, `[-0.0e-5]`, `[0e400]`, `[0.000E+999999999999999999]`},
		{`{"amount":1234567890123456.7}`, `{"amount":12345678901234567e-1}`, `{ "amount" : 0.12345678901234567E16 }`},
		{`[1e-400]`, `[0.1e-399]`, `[10e-401]`, `[0.00000000001e-389]`},
		{`[1e400]`, `[10E399]`, `[1000000000000000000000e379]`},
		{`[-1.5e-1000000]`, `[-15e-1000001]`},
	} {
		for _, s := range group[1:] {
			if fp(s) != fp(group[0]) {
				t.Errorf("%s and %s differ", s, group[0])
			}
		}
	}
	// The exact form, as documented: a domain prefix, then RFC 8785 text
	// with the number as written.
	if got := fp(`{ "amount" : 12345678901234567e-1, "b":[1E30]}`); got != sha256.Sum256([]byte("idem exact JSON v1\x00"+`{"amount":1234567890123456.7,"b":[1e+30]}`)) {
		t.Errorf("exact form: %s", got)
	}
	if fp(`[0.10000000000000001]`) == sha256.Sum256([]byte(`[0.10000000000000001]`)) {
		t.Error("an inexact document hashes like RFC 8785 text")
	}
	// The same values given as Go values.
	for _, c := range []struct {
		v    any
		text string
	}{
		{map[string]json.Number{"amount": "1234567890123456.7"}, `{"amount":1234567890123456.7}`},
		{[]int64{9007199254740993, -1}, `[9007199254740993,-1]`},
		{[]uint64{18446744073709551615}, `[18446744073709551615]`},
		{[]float64{0.1, 1e21, 1e-7}, `[0.1,1e21,1e-7]`},
	} {
		got, err := idem.FingerprintJSON(c.v)
		if err != nil || got != fp(c.text) {
			t.Errorf("FingerprintJSON(%v) = %v, %v; want the fingerprint of %s", c.v, got, err, c.text)
		}
	}
}

type textKey string

func (k textKey) MarshalText() ([]byte, error) { return []byte("k" + string(k)), nil }

type rawJSON string

func (r rawJSON) MarshalJSON() ([]byte, error) { return []byte(r), nil }

// A string that is not UTF-8 is refused, in JSON text and in Go values,
// where encoding/json would write it as U+FFFD; U+FFFD itself is a
// character like any other.
func TestFingerprintJSONInvalidUTF8(t *testing.T) {
	t.Parallel()
	type note struct {
		Text   string `json:"text"`
		Hidden string `json:"-"`
		secret string
	}
	for _, v := range []any{
		"\xff", []string{"a", "b\xfe"}, map[string]int{"\xff": 1}, note{Text: "x\xc3"},
		&note{Text: "\xed\xa0\x80"}, []any{map[string]any{"a": []any{"\xff"}}}, textKey("\xff"),
		map[textKey]int{"\xff": 1}, struct {
			N string `json:"n,string"`
		}{"\xff"},
		[]byte("\"\xff\""), []byte(`{"a":"` + "\xc3\x28" + `"}`), []byte(`"\ud800"`), []byte(`"\udc00\ud800"`),
		[]byte(`"\ud800\u0041"`), []byte("\"\xef\xbf\""), []byte("\xef\xbb\xbf{}"), []byte(`["` + "\xc0\xaf" + `"]`),
	} {
		if f, err := idem.FingerprintJSON(v); !errors.Is(err, idem.ErrInvalidJSON) {
			t.Errorf("FingerprintJSON(%#v) = %v, %v; want ErrInvalidJSON", v, f, err)
		}
	}
	replacement, err := idem.FingerprintJSON([]byte(`"\ufffd"`))
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []any{
		"\ufffd", []byte("\"\ufffd\""), rawJSON(`"\ufffd"`), json.RawMessage(`"\uFFFD"`),
		note{Text: "\ufffd", Hidden: "\xff", secret: "\xff"}, // only Text is marshalled
	} {
		got, err := idem.FingerprintJSON(v)
		if err != nil {
			t.Errorf("FingerprintJSON(%#v): %v", v, err)
			continue
		}
		if _, isNote := v.(note); !isNote && got != replacement {
			t.Errorf("FingerprintJSON(%#v) is not the fingerprint of U+FFFD", v)
		}
	}
}

// selfRef refers to itself through an embedded pointer whose fields are all
// shadowed by its own, so encoding/json marshals a cyclic value of it
// (it never follows the pointer), as it does cycles through fields it
// leaves out.
type selfRef struct {
	*selfRef
	Name string
}

// The check for strings that are not UTF-8 walks a Go value that
// encoding/json marshalled; a cycle through a part that encoding/json
// leaves out ends the walk instead of overflowing the stack, a fatal error
// that no recover catches.
func TestFingerprintJSONCyclicValue(t *testing.T) {
	t.Parallel()
	bad := &selfRef{Name: "x\xff"}
	bad.selfRef = bad
	if _, err := json.Marshal(bad); err != nil {
		t.Fatalf("encoding/json refuses the value: %v", err)
	}
	if f, err := idem.FingerprintJSON(bad); !errors.Is(err, idem.ErrInvalidJSON) {
		t.Errorf("FingerprintJSON(cyclic value holding \\xff) = %v, %v; want ErrInvalidJSON", f, err)
	}
	// U+FFFD written as an escape by a json.Marshaler makes the check walk
	// the value, which is valid.
	good := &struct {
		selfRef
		Raw json.RawMessage
	}{selfRef{Name: "x"}, json.RawMessage(`"\ufffd"`)}
	good.selfRef.selfRef = &good.selfRef
	want, err := idem.FingerprintJSON([]byte(`{"Name":"x","Raw":"\ufffd"}`))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := idem.FingerprintJSON(good); err != nil || got != want {
		t.Errorf("FingerprintJSON(cyclic value) = %v, %v; want %v", got, err, want)
	}
}

// unexportedText is a non-struct type that a struct embeds unexported:
// encoding/json leaves such a field out.
type unexportedText string

// A string that encoding/json leaves out does not count, also when the
// check for strings that are not UTF-8 runs (a json.Marshaler wrote U+FFFD
// as an escape): the fingerprint is that of the JSON.
func TestFingerprintJSONIgnoresWhatJSONLeavesOut(t *testing.T) {
	t.Parallel()
	v := struct {
		unexportedText
		Raw json.RawMessage
	}{"\xff", json.RawMessage(`"\ufffd"`)}
	text, err := json.Marshal(v)
	if err != nil || string(text) != `{"Raw":"\ufffd"}` {
		t.Fatalf("encoding/json: %s, %v", text, err)
	}
	want, err := idem.FingerprintJSON(text)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := idem.FingerprintJSON(v); err != nil || got != want {
		t.Errorf("FingerprintJSON(%#v) = %v, %v; want %v, the fingerprint of %s", v, got, err, want, text)
	}
}

// textByte is a byte that marshals as text: encoding/json writes a slice
// of them as an array of strings, not as base64.
type textByte uint8

func (b textByte) MarshalText() ([]byte, error) { return []byte{'x', byte(b)}, nil }

// Strings that are not UTF-8 from the elements of a byte slice whose
// element type is a TextMarshaler are refused too: encoding/json would
// write both of these slices as ["x\ufffd"].
func TestFingerprintJSONByteSliceOfTextMarshalers(t *testing.T) {
	t.Parallel()
	for _, v := range []any{[]textByte{0xff}, []textByte{0xfe}, [1]textByte{0xff}} {
		if f, err := idem.FingerprintJSON(v); !errors.Is(err, idem.ErrInvalidJSON) {
			t.Errorf("FingerprintJSON(%#v) = %v, %v; want ErrInvalidJSON", v, f, err)
		}
	}
	if _, err := idem.FingerprintJSON([]textByte{'a'}); err != nil {
		t.Errorf("FingerprintJSON of valid text: %v", err)
	}
}

// dualKey marshals as JSON one way and as text another; as a map key,
// encoding/json writes its text.
type dualKey int

func (k dualKey) MarshalJSON() ([]byte, error) { return []byte("1"), nil }
func (k dualKey) MarshalText() ([]byte, error) { return []byte{'k', byte(k)}, nil }

// A map key is checked as encoding/json writes it: the text of a key that
// is both a json.Marshaler and a TextMarshaler. Both maps would be written
// as {"k\ufffd":1}.
func TestFingerprintJSONMapKeyText(t *testing.T) {
	t.Parallel()
	for _, v := range []any{map[dualKey]int{0xff: 1}, map[dualKey]int{0xfe: 1}} {
		if f, err := idem.FingerprintJSON(v); !errors.Is(err, idem.ErrInvalidJSON) {
			t.Errorf("FingerprintJSON(%#v) = %v, %v; want ErrInvalidJSON", v, f, err)
		}
	}
	want, err := idem.FingerprintJSON([]byte(`{"ka":1}`))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := idem.FingerprintJSON(map[dualKey]int{'a': 1}); err != nil || got != want {
		t.Errorf("FingerprintJSON of a valid key: %v, %v; want %v", got, err, want)
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

// Large documents, written out in pieces, hash as one RFC 8785 text.
func TestFingerprintJSONLargeDocuments(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString(`{"raw":"` + strings.Repeat("abc\u00e9", 3000) + `","escaped":"` + strings.Repeat(`\u00e9\n\"x`, 3000) + `","list":[`)
	for i := range 5000 {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"n":%d,"f":%d.5,"s":"v\u%04x"}`, i, i, 0x20+i%1000)
	}
	b.WriteString(`]}`)
	text := []byte(b.String())
	canonical, err := jcs.Transform(slices.Clone(text))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := idem.FingerprintJSON(text); err != nil || got != sha256.Sum256(canonical) {
		t.Fatalf("%d bytes: %v, %v; want the SHA-256 of jcs's text", len(text), got, err)
	}
	inexact := append([]byte(`[0.10000000000000001,`), text...)
	inexact = append(inexact, ']')
	want := sha256.Sum256([]byte("idem exact JSON v1\x00[0.10000000000000001," + string(canonical) + "]"))
	if got, err := idem.FingerprintJSON(inexact); err != nil || got != want {
		t.Fatalf("%d bytes: %v, %v; want the exact form", len(inexact), got, err)
	}
}

// Documents of 1 MiB shaped to hurt: each costs memory linear in its size
// (bounded here at 16 bytes a byte of text, whatever the shape), and the
// time to match. Not parallel, so that the allocation figure is its own.
func TestFingerprintJSONHostileMemory(t *testing.T) {
	const size = 1 << 20
	fill := func(prefix, item, sep, suffix string) string {
		var b strings.Builder
		b.WriteString(prefix)
		for b.Len() < size {
			if b.Len() > len(prefix) {
				b.WriteString(sep)
			}
			b.WriteString(item)
		}
		b.WriteString(suffix)
		return b.String()
	}
	var members strings.Builder
	members.WriteString("{")
	for i := 0; members.Len() < size; i++ {
		if i > 0 {
			members.WriteString(",")
		}
		fmt.Fprintf(&members, `"\u00%02x%d":[]`, 0x41+i%26, i)
	}
	members.WriteString("}")
	for name, text := range map[string]string{
		"small numbers":  fill("[", "1", ",", "]"),
		"empty arrays":   fill("[", "[]", ",", "]"),
		"long mantissa":  "[0." + strings.Repeat("0", size) + "1e-99999]",
		"long integer":   "[" + strings.Repeat("9", size) + "]",
		"escapes":        `"` + strings.Repeat(`\ud83d\ude00\u0000`, size/18) + `"`,
		"escaped names":  members.String(),
		"nesting":        strings.Repeat(`{"a":[`, 4999) + fill("[", `1e-400`, ",", "]") + strings.Repeat(`]}`, 4999),
		"huge exponents": fill("[", "-1.5e-999999999999999999", ",", "]"),
		"numbers grow":   fill("[", "1e20", ",", "]"),
		"punctuation":    `"` + strings.Repeat(`:,[{`, size/4) + `"`,
	} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		if _, err := idem.FingerprintJSON([]byte(text)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		runtime.ReadMemStats(&after)
		n := after.TotalAlloc - before.TotalAlloc
		if n > 16*uint64(len(text)) {
			t.Errorf("%s: %d bytes allocated for %d bytes of text", name, n, len(text))
		}
		t.Logf("%s: %.1f bytes allocated a byte of text", name, float64(n)/float64(len(text)))
	}
	for name, text := range map[string]string{
		"too deep":         strings.Repeat("[", 10001) + strings.Repeat("]", 10001),
		"exponent":         "[1e1000000000000000000]",
		"exponent of zero": "[0e-0001000000000000000000]",
	} {
		if _, err := idem.FingerprintJSON([]byte(text)); !errors.Is(err, idem.ErrInvalidJSON) {
			t.Errorf("%s: %v, want ErrInvalidJSON", name, err)
		}
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

// textByteBox is a TextMarshaler whose text is one byte, which need not be
// UTF-8.
type textByteBox struct{ n byte }

func (b *textByteBox) MarshalText() ([]byte, error) { return []byte{b.n}, nil }

// otherText is a second embedded TextMarshaler: with two, neither's method
// is promoted, and encoding/json writes the struct's fields.
type otherText struct{ T string }

func (otherText) MarshalText() ([]byte, error) { return []byte("b"), nil }

// aliasOuter holds one pointer twice: as an unexported embedded field
// (which encoding/json does not write, and whose methods a walk cannot
// call) and as the exported P (written through MarshalText).
type aliasOuter struct {
	*textByteBox
	otherText
	P *textByteBox
}

// A pointer first met through an unexported field, where its text cannot
// be read, is still checked where encoding/json does read it: text that is
// not UTF-8 there is refused, not hashed as U+FFFD (two different values
// sharing one fingerprint).
func TestFingerprintJSONPointerSeenTwice(t *testing.T) {
	for _, n := range []byte{0xff, 0xfe} {
		b := &textByteBox{n}
		if f, err := idem.FingerprintJSON(aliasOuter{textByteBox: b, P: b}); !errors.Is(err, idem.ErrInvalidJSON) {
			t.Errorf("P's text %#x: %v, %v; want ErrInvalidJSON", n, f, err)
		}
	}
}
