package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/pgidem/idem/internal/driver/pgxdriver"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/core"
)

// ErrStoredValue means a stored outcome does not decode into the type asked
// for: the type changed since the outcome was stored (a field that was a
// string is now a number), or the scope's operation was also used with Do
// and holds bytes that are not the JSON of a T. Nothing ran and nothing
// changed; the error wraps the encoding/json error.
var ErrStoredValue = errors.New("idem: stored value does not decode into the requested type")

// RejectedError is the refusal of a request made with RejectJSON (or Reject),
// as DoJSON and DoInTxJSON return it: on the call whose fn refused, and on
// every replay of the refusal. Check for it with errors.As.
type RejectedError struct {
	// Status is the status given to RejectJSON (100 to 999).
	Status int
	// Body is the JSON of the value given to RejectJSON, exactly as stored.
	Body []byte
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("idem: request rejected with status %d", e.Status)
}

// Decode decodes the refusal's value into v (a pointer), with encoding/json.
// A body that does not decode into v gives an error wrapping ErrStoredValue;
// a v that is not a non-nil pointer, one wrapping ErrInvalidArgument.
func (e *RejectedError) Decode(v any) error {
	if err := json.Unmarshal(e.Body, v); err != nil {
		if _, notPointer := err.(*json.InvalidUnmarshalError); notPointer {
			return core.Errorf("idem: %w: Decode needs a non-nil pointer, not %T", ErrInvalidArgument, v)
		}
		return core.Errorf("idem: %w: refusal (%T): %w", ErrStoredValue, v, err)
	}
	return nil
}

// RejectJSON is Reject with v marshalled as the body: fn returns it to refuse
// a request deterministically, and the refusal is stored and replayed as
// Reject's is. Under DoJSON and DoInTxJSON the refusal comes back as a
// *RejectedError holding status and v's JSON; under Do as a Response with
// that status and body.
//
// status must be 100 to 999, and v must marshal with encoding/json;
// otherwise RejectJSON returns an error wrapping ErrInvalidResponse instead,
// which fn returns like any other error: fn's writes and the claim are
// undone and nothing is stored.
func RejectJSON(status int, v any) error { return publicErr(core.RejectJSON(status, v)) }

// DoJSON is Do for code that deals in values rather than bytes: fn returns a
// T, which is stored as its JSON (encoding/json), and DoJSON returns the T
// decoded from that JSON, with replayed true when fn did not run and the
// value is the stored outcome of an earlier call. Everything else is as in
// Do: the claim, fn's writes and the stored value commit or roll back with
// tx, and DoJSON never commits or rolls back tx itself.
//
//   - The first call and every replay return the same value: both decode
//     the stored JSON. What encoding/json leaves out (unexported fields,
//     fields tagged "-", a time's monotonic clock) is left out of both.
//   - fn returns RejectJSON(status, v): fn's writes are undone, the refusal
//     is stored, and DoJSON returns a zero T and a *RejectedError carrying
//     status and v's JSON; every replay returns the same error, with replayed
//     true. A refusal is an outcome, not a failure: commit tx, or it is not
//     remembered (the key is free again when tx rolls back, and a retry runs
//     fn again). fn may also return Reject(resp) with a status of 100 to
//     999; a rejection with status 0 is refused with ErrInvalidResponse.
//   - fn returns a T that json.Marshal refuses (a channel, a NaN), or whose
//     JSON does not decode back into a T: fn's writes and the claim are
//     undone, nothing is stored, and the error wraps ErrInvalidResponse and
//     the encoding/json error. tx stays usable and the key is free.
//   - A stored outcome that does not decode into T: a zero T and an error
//     wrapping ErrStoredValue; fn does not run.
//   - A stored outcome whose body was dropped (Config.BodyTTL): a zero T,
//     replayed true and an error wrapping ErrResponseGone; fn does not run.
//
// A value is stored as Response{Status: 0, Body: its JSON} and a refusal as
// Response{Status: status, Body: its JSON}: DoJSON tells them apart by the
// status. Use an operation with DoJSON only, not also with Do, so that every
// stored outcome under it is one DoJSON wrote.
//
// DoJSON uses the package defaults; DoJSONWith takes a configured Client.
func DoJSON[T any](ctx context.Context, tx pgx.Tx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, bool, error) {
	return DoJSONWith(ctx, defaultClient, tx, scope, key, fp, fn)
}

// DoJSONWith is DoJSON with c's configuration (TTL, wait, limits). It is a
// function rather than a method of Client because Go methods cannot have
// type parameters. A nil c is refused with ErrInvalidArgument.
func DoJSONWith[T any](ctx context.Context, c *Client, tx pgx.Tx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, bool, error) {
	return typed(core.DoJSON(ctx, c.core(), tx, core.Scope(scope), key, core.Fingerprint(fp), fn))
}

// DoInTxJSON is DoInTx for code that deals in values: DoJSON in a
// transaction of its own begun on db, committed when DoJSON returns a T or a
// *RejectedError (a refusal is committed too, so that retries replay it).
// As with DoInTx, fn may run more than once after serialization failures,
// and only one run commits; concurrent duplicates on one pool are coalesced.
//
// DoInTxJSON uses the package defaults; DoInTxJSONWith takes a configured
// Client.
func DoInTxJSON[T any](ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, bool, error) {
	return DoInTxJSONWith(ctx, defaultClient, db, scope, key, fp, fn)
}

// DoInTxJSONWith is DoInTxJSON with c's configuration (isolation level,
// retries, TTL, wait, limits). A nil c is refused with ErrInvalidArgument.
func DoInTxJSONWith[T any](ctx context.Context, c *Client, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, bool, error) {
	return typed(core.DoInTxJSON(ctx, c.core(), pgxdriver.Beginner(db), core.Scope(scope), key, core.Fingerprint(fp), fn))
}

// core is c's protocol; nil for a nil c, which the typed calls refuse.
func (c *Client) core() *core.Client[pgx.Tx, pgxdriver.Beginner] {
	if c == nil {
		return nil
	}
	return c.c
}

// typed is the outcome of the protocol's DoJSON as this package returns it.
func typed[T any](v T, replayed bool, err error) (T, bool, error) {
	if rej, ok := err.(*core.RejectedError); ok {
		return v, replayed, &RejectedError{Status: rej.Status, Body: rej.Body}
	}
	return v, replayed, publicErr(err)
}
