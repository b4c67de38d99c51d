package idem

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Call keys are the idempotency keys of the calls a service makes to other
// services (a card gateway, another team's API): one key per operation,
// minted or derived once and sent again, unchanged, with every attempt,
// after every restart, until the outcome is known. The clients of idem
// (idemhttp.Transport, idemgrpc.UnaryClientInterceptor and
// idemconnect.NewClientInterceptor) read it from the context.
//
//	ctx := idem.WithCallKey(ctx, r.CallKey("charge")) // r from idem.Reserve
//	resp, err := client.Do(req.WithContext(ctx))     // client.Transport is an idemhttp.Transport

// callKeyCtx is the context key of the call key.
type callKeyCtx struct{}

// WithCallKey returns a copy of ctx that carries key as the idempotency key
// of the outgoing call made with it. idem's clients send it with every
// attempt of that call, unless the request carries a key of its own (an
// Idempotency-Key header, idempotency-key metadata).
//
// Use one context per call: two calls made with the same key are, to the
// receiver, one request and its retry (a replay, or a refusal when their
// requests differ). Give each call of an operation its own key
// (Reservation.CallKey with a step per call) or persist a NewCallKey with the
// operation before the first attempt.
//
// The key is checked when a call is made, not here: idem's clients refuse a
// call whose context carries a key that ValidateKey refuses (an empty one,
// as CallKey returns for an invalid step) before they send anything, with an
// error wrapping ErrInvalidKey.
func WithCallKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, callKeyCtx{}, key)
}

// CallKeyFrom returns the call key that WithCallKey put in ctx, and whether
// there is one (ok is true for an empty key given to WithCallKey too).
func CallKeyFrom(ctx context.Context) (key string, ok bool) {
	key, ok = ctx.Value(callKeyCtx{}).(string)
	return key, ok
}

// NewCallKey returns a new random call key: a version 4 UUID (122 random
// bits, 36 characters), a valid key for idem and for providers that want a
// UUID. Mint it once per operation and store it with the unfinished
// operation before the first attempt, so that retries, restarts and page
// reloads send the same key; a key minted per attempt makes every retry a
// new request.
func NewCallKey() string { return uuid.NewString() }

// MaxStepLength is the longest step, in bytes, that Reservation.CallKey
// takes.
const MaxStepLength = 255

// callKeySpace is the UUID namespace of derived call keys. It is part of
// the derivation: changing it changes every derived key.
var callKeySpace = uuid.MustParse("249c946d-56e2-43ff-a5b0-cabd9168bf49")

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
	return uuid.NewHash(sha256.New(), callKeySpace, data, 8).String()
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
