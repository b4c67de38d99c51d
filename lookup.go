package idem

import (
	"context"
	"github.com/pgidem/idem/internal/core"
)

// Lookup returns the committed record of (scope, key): its status,
// fingerprint, timestamps, lease and token, and the stored response. It
// returns ErrNotFound when no record holds the key; a claim whose
// transaction has not committed is not visible. Lookup does not check who
// asks: an HTTP endpoint that shows records must check that the caller is
// scope.Actor first (idemhttp.StatusHandler does).
func Lookup(ctx context.Context, db Beginner, scope Scope, key string) (Record, error) {
	return defaultClient.Lookup(ctx, db, scope, key)
}

// Lookup is the package-level Lookup with this client's key limits.
func (c *Client) Lookup(ctx context.Context, db Beginner, scope Scope, key string) (Record, error) {
	r, err := c.c.Lookup(ctx, db, core.Scope(scope), key)
	return record(r), publicErr(err)
}

// Forget deletes the record of a finished key (succeeded, rejected or
// failed_retryable), so that the next request with it runs as a new one:
// for a client stuck on ErrKeyReused with a key it reused by mistake, or a
// refusal that should not be replayed any more. It refuses a key in flight
// with ErrInProgress (a reservation's 'processing' record whose lease is
// live, or a record a transaction holds right now) and a key whose outcome
// is unknown with ErrOutcomeUnknown, as Reserve and Do do (an 'unknown'
// record, or a reservation whose lease ran out before it recorded an
// outcome: Resolve it instead, since forgetting it could run its work
// twice). ErrNotFound when no committed record holds the key. Nothing
// changes on an error.
func Forget(ctx context.Context, db Beginner, scope Scope, key string) error {
	return defaultClient.Forget(ctx, db, scope, key)
}

// Forget is the package-level Forget with this client's key limits.
func (c *Client) Forget(ctx context.Context, db Beginner, scope Scope, key string) error {
	return publicErr(c.c.Forget(ctx, db, core.Scope(scope), key))
}
