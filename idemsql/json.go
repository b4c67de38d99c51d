package idemsql

import (
	"context"
	"database/sql"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/core"
)

// DoJSON is idem.DoJSON on a *sql.Tx: Do for code that deals in values. fn
// returns a T, stored as its JSON, and DoJSON returns the T decoded from
// that JSON, with replayed true when fn did not run. A refusal made with
// idem.RejectJSON comes back as an *idem.RejectedError, on the call that
// refused and on every replay. See idem.DoJSON for every case.
func DoJSON[T any](ctx context.Context, tx *sql.Tx, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (T, error)) (T, bool, error) {
	return DoJSONWith(ctx, defaultClient, tx, scope, key, fp, fn)
}

// DoJSONWith is DoJSON with c's configuration. A nil c is refused with
// idem.ErrInvalidArgument.
func DoJSONWith[T any](ctx context.Context, c *Client, tx *sql.Tx, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (T, error)) (T, bool, error) {
	return typed(core.DoJSON(ctx, c.core(), tx, core.Scope(scope), key, core.Fingerprint(fp), fn))
}

// DoInTxJSON is idem.DoInTxJSON on a *sql.DB: DoJSON in a transaction of
// its own begun on db, committed when DoJSON returns a T or an
// *idem.RejectedError.
func DoInTxJSON[T any](ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (T, error)) (T, bool, error) {
	return DoInTxJSONWith(ctx, defaultClient, db, scope, key, fp, fn)
}

// DoInTxJSONWith is DoInTxJSON with c's configuration. A nil c is refused
// with idem.ErrInvalidArgument.
func DoInTxJSONWith[T any](ctx context.Context, c *Client, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (T, error)) (T, bool, error) {
	return typed(core.DoInTxJSON(ctx, c.core(), db, core.Scope(scope), key, core.Fingerprint(fp), fn))
}

// core is c's protocol; nil for a nil c, which the typed calls refuse.
func (c *Client) core() *core.Client[*sql.Tx, *sql.DB] {
	if c == nil {
		return nil
	}
	return c.c
}
