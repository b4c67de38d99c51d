package idemsql

import (
	"context"
	"database/sql"
	"github.com/pgidem/idem/internal/core"
	"time"

	"github.com/pgidem/idem"
)

// The reservation mode and the operator calls on database/sql: idem's
// calls of the same names (see idem.Reserve for the state machine), each
// in a transaction of its own begun on a *sql.DB, except Complete, which
// runs in the caller's *sql.Tx beside the domain writes. Their statements
// are off the hot path and sent one per round trip.

// Reserve is idem.Reserve on a *sql.DB: it reserves (scope, key) for
// outside work in a short transaction of its own, committed before it
// returns, and answers execute (r.Token > 0), replay (r.Replayed),
// idem.ErrKeyReused, idem.ErrInProgress or idem.ErrOutcomeUnknown exactly
// as idem.Reserve does, and resumes an attempt in doubt inside the key's
// window (r.Resumed) as it does. lease < 1µs, an invalid scope or key, or a nil db
// are refused before anything runs.
func Reserve(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint, lease time.Duration) (idem.Reservation, error) {
	return defaultClient.Reserve(ctx, db, scope, key, fp, lease)
}

// Reserve is the package-level Reserve with this client's configuration.
func (c *Client) Reserve(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint, lease time.Duration) (idem.Reservation, error) {
	r, err := c.c.Reserve(ctx, db, core.Scope(scope), key, core.Fingerprint(fp), lease)
	return reservation(r), publicErr(err)
}

// ReserveWith is idem.ReserveWith on a *sql.DB: Reserve with options
// (opts.Lease, idem.DefaultLease when zero, and opts.ResumeWithin, the
// window in which an attempt in doubt resumes by itself; see
// idem.ReserveOptions). It answers as Reserve does; like Reserve, it takes
// over an attempt in doubt inside the key's window (r.Resumed true: make
// the outside calls again with the same call keys). Negative options, a
// Lease under 1µs, a ResumeWithin shorter than the lease, an invalid scope or
// key, or a nil db are refused with idem.ErrInvalidArgument (or
// idem.ErrInvalidScope, idem.ErrInvalidKey) before anything runs.
func ReserveWith(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint, opts idem.ReserveOptions) (idem.Reservation, error) {
	return defaultClient.ReserveWith(ctx, db, scope, key, fp, opts)
}

// ReserveWith is the package-level ReserveWith with this client's
// configuration.
func (c *Client) ReserveWith(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint, opts idem.ReserveOptions) (idem.Reservation, error) {
	r, err := c.c.ReserveWith(ctx, db, core.Scope(scope), key, core.Fingerprint(fp), core.ReserveOptions(opts))
	return reservation(r), publicErr(err)
}

// Complete is idem.Complete on a *sql.Tx: it records the outcome of the
// reservation's work as 'succeeded' with resp in the caller's transaction
// tx, beside the domain writes, so they commit or roll back together.
// idem.ErrFenced when the record is no longer this reservation's
// 'processing' (nothing changed; roll tx back); idem.ErrInvalidResponse or
// idem.ErrResponseTooLarge for a response that cannot be stored; a zero or
// replayed Reservation, or a nil, closed or aborted tx,
// idem.ErrInvalidArgument.
func Complete(ctx context.Context, tx *sql.Tx, r idem.Reservation, resp idem.Response) error {
	return defaultClient.Complete(ctx, tx, r, resp)
}

// Complete is the package-level Complete with this client's configuration.
func (c *Client) Complete(ctx context.Context, tx *sql.Tx, r idem.Reservation, resp idem.Response) error {
	return publicErr(c.c.Complete(ctx, tx, coreReservation(r), core.Response(resp)))
}

// FailRetryable is idem.FailRetryable on a *sql.DB: the reservation's work
// certainly did not happen; the record becomes 'failed_retryable' with
// reason, in a transaction of its own. idem.ErrFenced when the record is no
// longer this reservation's 'processing'.
func FailRetryable(ctx context.Context, db *sql.DB, r idem.Reservation, reason string) error {
	return defaultClient.FailRetryable(ctx, db, r, reason)
}

// FailRetryable is the package-level FailRetryable with this client's
// configuration.
func (c *Client) FailRetryable(ctx context.Context, db *sql.DB, r idem.Reservation, reason string) error {
	return publicErr(c.c.FailRetryable(ctx, db, coreReservation(r), reason))
}

// MarkUnknown is idem.MarkUnknown on a *sql.DB: the reservation's work may
// have happened; the record becomes 'unknown' with reason until an operator
// resolves it (or, inside the key's window, the next Reserve resumes it).
// idem.ErrFenced when the record has moved on.
func MarkUnknown(ctx context.Context, db *sql.DB, r idem.Reservation, reason string) error {
	return defaultClient.MarkUnknown(ctx, db, r, reason)
}

// MarkUnknown is the package-level MarkUnknown with this client's
// configuration.
func (c *Client) MarkUnknown(ctx context.Context, db *sql.DB, r idem.Reservation, reason string) error {
	return publicErr(c.c.MarkUnknown(ctx, db, coreReservation(r), reason))
}

// Heartbeat is idem.Heartbeat on a *sql.DB: it extends the reservation's
// live lease to at least extend from now (the database clock) and returns
// the reservation with its new LeaseExpiresAt. idem.ErrFenced once the
// lease has run out or the record moved on; extend < 1µs is
// idem.ErrInvalidArgument.
func Heartbeat(ctx context.Context, db *sql.DB, r idem.Reservation, extend time.Duration) (idem.Reservation, error) {
	return defaultClient.Heartbeat(ctx, db, r, extend)
}

// Heartbeat is the package-level Heartbeat with this client's
// configuration.
func (c *Client) Heartbeat(ctx context.Context, db *sql.DB, r idem.Reservation, extend time.Duration) (idem.Reservation, error) {
	next, err := c.c.Heartbeat(ctx, db, coreReservation(r), extend)
	return reservation(next), publicErr(err)
}

// ExpireLeases is idem.ExpireLeases on a *sql.DB: it turns at most limit
// 'processing' records whose lease ran out, outside their key's window,
// into 'unknown', oldest attempt first, and returns how many. limit <= 0 is
// idem.ErrInvalidArgument.
func ExpireLeases(ctx context.Context, db *sql.DB, limit int) (int64, error) {
	return defaultClient.ExpireLeases(ctx, db, limit)
}

// ExpireLeases is the package-level ExpireLeases with this client's
// configuration.
func (c *Client) ExpireLeases(ctx context.Context, db *sql.DB, limit int) (int64, error) {
	n, err := c.c.ExpireLeases(ctx, db, limit)
	return n, publicErr(err)
}

// ListUnknown is idem.ListUnknown on a *sql.DB: at most limit 'unknown'
// records that need a person (no window, or past it), oldest first; pass
// nil for the first page and the last record of a page for the next. limit
// <= 0, or an after that idem.ListUnknown refuses (names that are not valid
// text, a CreatedAt outside PostgreSQL's range), is
// idem.ErrInvalidArgument.
func ListUnknown(ctx context.Context, db *sql.DB, limit int, after *idem.Record) ([]idem.Record, error) {
	return defaultClient.ListUnknown(ctx, db, limit, after)
}

// ListUnknown is the package-level ListUnknown with this client's
// configuration.
func (c *Client) ListUnknown(ctx context.Context, db *sql.DB, limit int, after *idem.Record) ([]idem.Record, error) {
	return records(c.c.ListUnknown(ctx, db, limit, coreRecord(after)))
}

// ListResumable is idem.ListResumable on a *sql.DB: at most limit records
// a recovery worker should re-drive (in doubt inside their key's window:
// 'processing' whose lease ran out, or 'unknown'), oldest first, paged as
// ListUnknown; ReserveWith resumes each.
func ListResumable(ctx context.Context, db *sql.DB, limit int, after *idem.Record) ([]idem.Record, error) {
	return defaultClient.ListResumable(ctx, db, limit, after)
}

// ListResumable is the package-level ListResumable with this client's
// configuration.
func (c *Client) ListResumable(ctx context.Context, db *sql.DB, limit int, after *idem.Record) ([]idem.Record, error) {
	return records(c.c.ListResumable(ctx, db, limit, coreRecord(after)))
}

// Resolve is idem.Resolve on a *sql.DB: it reconciles the record of (scope,
// key) whose outcome was in doubt ('unknown', or 'processing' whose lease
// ran out) to 'succeeded' with res.Succeeded or, with res.Retryable, to
// 'failed_retryable'; the token advances, fencing the reservation that held
// the key. idem.ErrNotFound when no record holds the key,
// idem.ErrNotResolvable when a live lease holds it or its outcome is
// recorded; idem.ErrFenced when res.Token is not the record's current token
// (look it up again); invalid resolutions (no token, both or neither
// verdict) are refused before anything runs. The record keeps its
// LastError; res.Reason is stored as its ResolveReason.
func Resolve(ctx context.Context, db *sql.DB, scope idem.Scope, key string, res idem.Resolution) error {
	return defaultClient.Resolve(ctx, db, scope, key, res)
}

// Resolve is the package-level Resolve with this client's configuration.
func (c *Client) Resolve(ctx context.Context, db *sql.DB, scope idem.Scope, key string, res idem.Resolution) error {
	return publicErr(c.c.Resolve(ctx, db, core.Scope(scope), key, coreResolution(res)))
}
