package idem

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
func (r Reservation) CallKey(step string) string {
	return deriveCallKey(r.Scope, r.Key, step)
}
