package core

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strings"
	"unicode"
	"unicode/utf8"
)

// The call keys of a reservation's outgoing calls (see idem.WithCallKey for
// how a client sends them).

// CallKey returns the idempotency key for the outgoing call step ("charge",
// "refund", "email") of this reservation's request: the same for every
// attempt, token, worker, process and restart of the request, different for
// another step, key or scope. It is a UUID (36 characters of hex digits and
// hyphens), a valid key for idem and for providers that limit keys to a UUID
// or to 36 characters and more. It reveals neither the actor nor the key:
// it is a one-way hash of them (someone who can guess both, such as a short
// key of a known user, can confirm the guess; random client keys cannot be
// guessed).
//
// Send it with the call (idem.WithCallKey with idem's clients, or the
// provider's own key parameter), so that a retry of the call, by this
// attempt or a later one, is deduplicated by the receiver. CallKey returns
// "" when step is empty, longer than MaxStepLength bytes, not valid UTF-8 or
// holds a control character, or when r has no key or scope (a zero
// Reservation); idem's clients refuse a call with an empty key, before
// sending anything, with an error wrapping ErrInvalidKey.
//
// Past the key's TTL (Config.TTL) idem takes the same key for a new
// request, and that request derives the same call keys: a receiver that
// still remembers them would answer it with the first request's result.
// Keep the TTL at least as long as the receivers remember keys (Stripe: 24
// hours, idem's default TTL), or let clients use a key per operation that
// is never reused.
func (r Reservation) CallKey(step string) string {
	return deriveCallKey(r.Scope, r.Key, step)
}

// MaxStepLength is the longest step, in bytes, that Reservation.CallKey
// takes.
const MaxStepLength = 255

// callKeySpace is the UUID namespace of derived call keys. It is part of
// the derivation: changing it changes every derived key.
var callKeySpace = mustUUID("249c946d-56e2-43ff-a5b0-cabd9168bf49")

// callKeyLabel separates this derivation (its version) from any other
// hash of the same parts.
const callKeyLabel = "idem call key/1"

// deriveCallKey is the call key of one outgoing call, step, of the request
// (scope, key): a name-based UUID (version 8, RFC 9562) whose 122 bits come
// from SHA-256 over a fixed namespace, a version label and the four parts,
// each prefixed by its length, so that no two different tuples encode
// alike. It depends on these parts only, never on a token, a time or the
// process, so every attempt, worker and restart derives the same key. It
// returns "" when step is empty, over MaxStepLength bytes, not valid UTF-8
// or holds a control character, or when scope or key is not usable (an
// empty key, a scope that ValidateScope refuses).
func deriveCallKey(scope Scope, key, step string) string {
	if !validStep(step) || key == "" || ValidateScope(scope) != nil {
		return ""
	}
	parts := [...]string{callKeyLabel, scope.Actor, scope.Operation, key, step}
	n := 0
	for _, p := range parts {
		n += binary.MaxVarintLen64 + len(p)
	}
	data := make([]byte, 0, n)
	for _, p := range parts {
		data = binary.AppendUvarint(data, uint64(len(p)))
		data = append(data, p...)
	}
	return hashUUID(callKeySpace, data)
}

// hashUUID is the name-based UUID of data in namespace space, version 8
// (RFC 9562), from SHA-256 (as github.com/google/uuid's NewHash with
// version 8 makes it; written here because that package imports
// database/sql/driver, and the core imports no database package:
// TestHashUUIDIsGoogleUUIDs).
func hashUUID(space [16]byte, data []byte) string {
	h := sha256.New()
	h.Write(space[:])
	h.Write(data)
	var u [16]byte
	copy(u[:], h.Sum(nil))
	u[6] = u[6]&0x0f | 8<<4 // version 8
	u[8] = u[8]&0x3f | 0x80 // the RFC's variant
	var b [36]byte
	hex.Encode(b[0:8], u[0:4])
	hex.Encode(b[9:13], u[4:6])
	hex.Encode(b[14:18], u[6:8])
	hex.Encode(b[19:23], u[8:10])
	hex.Encode(b[24:36], u[10:16])
	b[8], b[13], b[18], b[23] = '-', '-', '-', '-'
	return string(b[:])
}

// mustUUID parses a UUID written with hyphens.
func mustUUID(s string) [16]byte {
	var u [16]byte
	if n, err := hex.Decode(u[:], []byte(strings.ReplaceAll(s, "-", ""))); err != nil || n != 16 {
		panic("idem: bad UUID " + s)
	}
	return u
}

// validStep reports whether step can name a call: 1 to MaxStepLength
// bytes of valid UTF-8 without control characters.
func validStep(step string) bool {
	if step == "" || len(step) > MaxStepLength || !utf8.ValidString(step) {
		return false
	}
	for _, r := range step {
		if unicode.IsControl(r) {
			return false
		}
	}
	return true
}
