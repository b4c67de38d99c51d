package idem

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"

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
// order or number spelling get the same fingerprint.
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
	return sha256.Sum256(canonical), nil
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
