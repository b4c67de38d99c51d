package idem

import (
	"context"

	"github.com/google/uuid"

	"github.com/pgidem/idem/internal/core"
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

// CallKey returns the idempotency key for the outgoing call step ("charge",
// "refund", "email") of this reservation's request: the same for every
// attempt, token, worker, process and restart of the request, different for
// another step, key or scope. It is a UUID (36 characters), a valid key for
// idem and for providers that limit keys to a UUID, and reveals neither the
// actor nor the key (a one-way hash of them; someone who can guess both can
// confirm the guess).
//
// Send it with the call (WithCallKey with idem's clients, or the provider's
// own key parameter), so that the receiver deduplicates every retry of the
// call. CallKey returns "" when step is empty, longer than MaxStepLength
// bytes, not valid UTF-8 or holds a control character, or when r has no key
// or scope (a zero Reservation); idem's clients refuse a call with an empty
// key, before sending anything, with an error wrapping ErrInvalidKey.
//
// Past the key's TTL (Config.TTL) a new request under the same key derives
// the same call keys: keep the TTL at least as long as the receivers
// remember keys, or let clients use a key per operation that is never
// reused.
func (r Reservation) CallKey(step string) string {
	return core.Reservation{Scope: core.Scope(r.Scope), Key: r.Key}.CallKey(step)
}
