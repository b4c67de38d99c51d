package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/big"
	"slices"
	"strconv"

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
// form differs from their exact value, each with its path, in an order
// that does not depend on the order of object members; nil if there are
// none. text is valid JSON without duplicate keys (jcs checked it).
func roundedIntegers(text []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	var entries [][]byte
	var walk func(path []byte, v any)
	walk = func(path []byte, v any) {
		switch t := v.(type) {
		case map[string]any:
			for name, child := range t {
				walk(appendPart(slices.Clip(path), 'o', name), child)
			}
		case []any:
			for i, child := range t {
				walk(appendPart(slices.Clip(path), 'a', strconv.Itoa(i)), child)
			}
		case json.Number:
			if exact, ok := roundedInteger(string(t)); ok {
				entries = append(entries, appendPart(slices.Clip(path), '=', exact))
			}
		}
	}
	walk(nil, v)
	if len(entries) == 0 {
		return nil, nil
	}
	slices.SortFunc(entries, bytes.Compare)
	return bytes.Join(entries, nil), nil
}

// appendPart appends a length-prefixed part of a path or value.
func appendPart(b []byte, kind byte, s string) []byte {
	b = append(b, kind)
	b = binary.BigEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}

// roundedInteger returns the exact value of the JSON number lit when it is
// an integer that its double (shortest form, as RFC 8785 writes it) does
// not equal.
func roundedInteger(lit string) (string, bool) {
	exact, ok := new(big.Rat).SetString(lit)
	if !ok || !exact.IsInt() {
		return "", false
	}
	f, err := strconv.ParseFloat(lit, 64)
	if err != nil {
		return "", false // out of range: jcs refused it already
	}
	shortest, _ := new(big.Rat).SetString(strconv.FormatFloat(f, 'g', -1, 64))
	if shortest.Cmp(exact) == 0 {
		return "", false
	}
	return exact.Num().String(), true
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
