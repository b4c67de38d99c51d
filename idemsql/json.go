package idemsql

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/pgidem/idem"
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
	var zero T
	if err := checkJSONCall(c, fn); err != nil {
		return zero, false, err
	}
	res, err := c.Do(ctx, tx, scope, key, fp, jsonFn(fn))
	return decodeResult[T](res, err)
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
	var zero T
	if err := checkJSONCall(c, fn); err != nil {
		return zero, false, err
	}
	res, err := c.DoInTx(ctx, db, scope, key, fp, jsonFn(fn))
	return decodeResult[T](res, err)
}

func checkJSONCall[T any](c *Client, fn func(ctx context.Context, tx *sql.Tx) (T, error)) error {
	if c == nil {
		return fmt.Errorf("%w: nil client", idem.ErrInvalidArgument)
	}
	if fn == nil {
		return fmt.Errorf("%w: nil function", idem.ErrInvalidArgument)
	}
	return nil
}

// jsonFn adapts fn to Do with package idem's encoding (see idem.DoJSON).
func jsonFn[T any](fn func(ctx context.Context, tx *sql.Tx) (T, error)) func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
	return func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		v, err := fn(ctx, tx)
		return core.JSONResponse(v, err, new(T))
	}
}

// decodeResult turns Do's outcome into DoJSON's with package idem's
// decoding.
func decodeResult[T any](res idem.Result, err error) (T, bool, error) {
	var v T
	replayed, err := core.DecodeInto(res, err, &v)
	if err != nil {
		var zero T
		return zero, replayed, err
	}
	return v, replayed, nil
}
