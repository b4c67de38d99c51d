package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/gowebpki/jcs"
)

// Fingerprint identifies the content of a request: the SHA-256 of its
// canonical form. The same key with the same fingerprint is a retry; the same
// key with a different fingerprint is refused with ErrKeyReused.
type Fingerprint [32]byte

// String returns the fingerprint in lowercase hex.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// FingerprintJSON returns the SHA-256 of the RFC 8785 (JSON Canonicalization
// Scheme) form of v, so requests that differ only in whitespace, object key
// order or number spelling get the same fingerprint. Integers beyond what a
// double holds exactly (2^53), such as 64-bit ids, are bound by their exact
// value as well, where RFC 8785 alone would round two different ids to one.
//
// A []byte or json.RawMessage is taken as JSON text; any other value is
// marshalled with encoding/json first. Invalid JSON, including an object with
// a duplicate key, gives an error wrapping ErrInvalidJSON.
func FingerprintJSON(v any) (Fingerprint, error) {
	var text []byte
	switch t := v.(type) {
	case []byte:
		text = t
	case json.RawMessage:
		text = t
	default:
		b, err := json.Marshal(v)
		if err != nil {
			return Fingerprint{}, fmt.Errorf("%w: %v", ErrInvalidJSON, err)
		}
		text = b
	}
	if text == nil {
		return Fingerprint{}, fmt.Errorf("%w: no JSON text", ErrInvalidJSON)
	}
	canonical, err := jcs.Transform(text)
	if err != nil {
		return Fingerprint{}, fmt.Errorf("%w: %v", ErrInvalidJSON, err)
	}
	if !mayRoundIntegers(text) {
		return sha256.Sum256(canonical), nil
	}
	rounded, err := roundedIntegers(text)
	if err != nil {
		return Fingerprint{}, fmt.Errorf("%w: %v", ErrInvalidJSON, err)
	}
	if rounded == nil {
		return sha256.Sum256(canonical), nil
	}
	h := sha256.New()
	h.Write(canonical)
	h.Write([]byte{0}) // never in JSON text: control characters are escaped
	h.Write(rounded)
	var f Fingerprint
	h.Sum(f[:0])
	return f, nil
}

// FingerprintParts returns the SHA-256 of parts, each prefixed with its
// length, so that ("ab", "c") and ("a", "bc") differ. Use it for requests that
// are not JSON, or to bind a method and path to a body:
//
//	idem.FingerprintParts([]byte("POST"), []byte("/v1/draws"), body)
func FingerprintParts(parts ...[]byte) Fingerprint {
	h := sha256.New()
	var n [8]byte
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write(p)
	}
	var f Fingerprint
	h.Sum(f[:0])
	return f
}

// RFC 8785 writes numbers as IEEE 754 doubles, which hold integers exactly
// only up to 2^53: 64-bit ids such as 9007199254740993 and 9007199254740992
// would share a canonical form, so a changed id would replay the first
// response instead of being refused. FingerprintJSON therefore also binds
// the exact value of every integer that the canonical form rounds. JSON
// whose numbers survive as doubles (every number with at most 15
// significant digits, and every RFC 8785 test vector) keeps the plain
// SHA-256 of its canonical form.

// mayRoundIntegers reports whether text has a run of 16 or more digits
// (dots between them allowed): no shorter number can be an integer that a
// double rounds.
func mayRoundIntegers(text []byte) bool {
	digits := 0
	for _, c := range text {
		switch {
		case c >= '0' && c <= '9':
			if digits++; digits >= 16 {
				return true
			}
		case c == '.':
		default:
			digits = 0
		}
	}
	return false
}

// roundedIntegers returns the integers of text whose canonical (double)
// form differs from their exact value, each with its position among the
// numbers of the value walked in an order of its own (object members sorted
// by name), so that it does not depend on the order of the members in
// text; nil if there are none. text is valid JSON without duplicate keys
// (jcs checked it). Time and memory are linear in len(text).
func roundedIntegers(text []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	var out []byte
	n := uint64(0) // numbers seen
	var walk func(v any)
	walk = func(v any) {
		switch t := v.(type) {
		case map[string]any:
			names := make([]string, 0, len(t))
			for name := range t {
				names = append(names, name)
			}
			slices.Sort(names)
			for _, name := range names {
				walk(t[name])
			}
		case []any:
			for _, child := range t {
				walk(child)
			}
		case json.Number:
			if exact, ok := roundedInteger(string(t)); ok {
				out = binary.BigEndian.AppendUint64(out, n)
				out = binary.BigEndian.AppendUint64(out, uint64(len(exact)))
				out = append(out, exact...)
			}
			n++
		}
	}
	walk(v)
	return out, nil
}

// roundedInteger returns the exact value of the JSON number lit when it is
// an integer that its double (the shortest form, as RFC 8785 writes it)
// does not equal. Only magnitudes from 2^53 on can be, and a finite double
// is below 2^1024, so the integer has at most 309 digits however long lit
// is; the double is parsed from those digits, never from lit itself.
func roundedInteger(lit string) (string, bool) {
	exact, ok := integerDigits(lit)
	if !ok {
		return "", false
	}
	f, err := strconv.ParseFloat(exact, 64)
	if err != nil || math.Abs(f) < 1<<53 {
		return "", false // out of range (jcs refused it already), or held exactly
	}
	if exact == strconv.FormatFloat(f, 'f', -1, 64) {
		return "", false
	}
	return exact, true
}

// integerDigits returns the decimal digits of the JSON number lit, with its
// sign, when its value is an integer of at most 400 digits.
func integerDigits(lit string) (string, bool) {
	sign := ""
	if strings.HasPrefix(lit, "-") {
		sign, lit = "-", lit[1:]
	}
	mantissa, exp := lit, 0
	if i := strings.IndexAny(lit, "eE"); i >= 0 {
		e, err := strconv.Atoi(strings.TrimPrefix(lit[i+1:], "+"))
		if err != nil || e > 1<<40 || e < -(1<<40) {
			return "", false // far outside a double's range either way
		}
		mantissa, exp = lit[:i], e
	}
	intPart, frac, _ := strings.Cut(mantissa, ".")
	digits := strings.TrimLeft(intPart+frac, "0")
	// The value is digits * 10^(point - len(digits)).
	point := len(intPart) + exp - (len(intPart) + len(frac) - len(digits))
	if digits == "" || point <= 0 || point > 400 {
		return "", false
	}
	if point < len(digits) {
		if strings.Trim(digits[point:], "0") != "" {
			return "", false // a fraction
		}
		return sign + digits[:point], true
	}
	return sign + digits + strings.Repeat("0", point-len(digits)), true
}
