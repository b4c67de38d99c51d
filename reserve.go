package idem

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/core"
)

// The reservation mode protects work that cannot join the database
// transaction: a card gateway, an e-mail provider, another team's API.
//
//	r, err := client.Reserve(ctx, pool, scope, key, fp, 30*time.Second)
//	// err != nil: do not execute. r.Replayed: answer r.Response.
//	charge, err := gateway.Charge(ctx, key, ...) // pass the key on when the provider takes one
//	// certainly not sent:  client.FailRetryable(ctx, pool, r, reason)
//	// may have happened:   client.MarkUnknown(ctx, pool, r, reason)
//	// done: in one transaction, the domain writes and client.Complete(ctx, tx, r, resp)
//
// One table and one state machine serve Do and the reservations:
//
//	(none)            --Reserve-->                      processing (lease, new token)
//	processing        --Complete (same token)-->        succeeded
//	processing        --FailRetryable (same token)-->   failed_retryable
//	processing        --MarkUnknown (same token)-->     unknown
//	processing        --Heartbeat (same token, live)--> processing (lease extended)
//	processing, lease ran out --Reserve, ExpireLeases--> unknown
//	failed_retryable  --Reserve (same fingerprint)-->   processing (new token)
//	failed_retryable  --Do (same fingerprint)-->        Do runs fn: succeeded | rejected
//	unknown, or processing whose lease ran out
//	                  --Resolve-->                      succeeded | failed_retryable (new token)
//	succeeded, rejected, failed_retryable past the TTL
//	                  --Reserve, Do-->                  a new request
//
// Every other event leaves the record as it is: Reserve replays succeeded
// and rejected records, answers ErrInProgress while a live lease holds the
// key and ErrOutcomeUnknown for unknown ones; a reservation that is no
// longer the owner gets ErrFenced. The database clock decides every lease.

// Reservation is the right to execute a request's outside work, or the
// stored outcome of an earlier execution (Replayed true, Token 0). Its
// Result holds the stored Response when Replayed is true; Scope and Key name
// the key; Token is the fencing token of this execution, greater than zero:
// no other reservation of any key ever had it, and Complete,
// FailRetryable, MarkUnknown and Heartbeat succeed only while the record
// still holds it; LeaseExpiresAt is when the lease runs out, by the
// database clock (after it, Reserve and ExpireLeases turn the record
// unknown). Its method CallKey(step) returns the idempotency key of the
// outgoing call step of the reservation's request, the same for every
// attempt (see WithCallKey).
type Reservation = core.Reservation

// MaxReasonLength is the longest reason, in bytes, that FailRetryable,
// MarkUnknown and Resolve store.
const MaxReasonLength = core.MaxReasonLength

// Reserve reserves (scope, key) for outside work. In a short transaction of
// its own, committed before it returns, it records the key as 'processing'
// with a lease of the given length and a new fencing token. It returns
// exactly one of:
//
//   - execute: a nil error and r.Token > 0: the key was free, past its TTL,
//     or its record was 'failed_retryable' with the same fingerprint. Do the
//     work, then record its outcome with Complete, FailRetryable or
//     MarkUnknown (and Heartbeat while it takes long).
//   - replay: a nil error and r.Replayed: an earlier execution succeeded (or
//     Do stored an outcome); r.Response is what it stored, r.Token is 0.
//   - ErrKeyReused: the record holds a different fingerprint.
//   - ErrInProgress (an *InProgressError): a live lease holds the key;
//     RetryAfter is the lease's remaining time, between one second and a
//     minute. The same comes back when a transaction of Do holds the key and
//     does not finish within Config.Wait.
//   - ErrOutcomeUnknown: the record is 'unknown', or its lease ran out
//     before an outcome was recorded. Reserve then turns it unknown in the
//     same transaction. It never runs again by itself: reconcile it with
//     Resolve.
//
// On any other error (the store failed) do not execute. If the connection
// broke while the reservation committed, the record may hold the key without
// an owner: it turns unknown when its lease runs out.
//
// Reserve needs a pool or a connection (it commits); a pgx.Tx, lease < 1µs,
// an invalid scope or key are refused before anything runs.
func Reserve(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint, lease time.Duration) (Reservation, error) {
	return defaultClient.c.Reserve(ctx, db, scope, key, fp, lease)
}

// Reserve is the package-level Reserve with this client's configuration.
func (c *Client) Reserve(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint, lease time.Duration) (Reservation, error) {
	return c.c.Reserve(ctx, db, scope, key, fp, lease)
}

// Complete records the outcome of the reservation's work as 'succeeded'
// with resp, in the caller's transaction tx, beside the domain writes that
// record the outside result: they commit or roll back together. Later calls
// of Reserve (and Do) replay resp.
//
// It succeeds while the record is this reservation's 'processing', also
// after the lease ran out as long as nobody turned the record unknown or
// took it over. Otherwise it returns ErrFenced and changes nothing: the
// record's outcome is no longer this reservation's to decide, and the
// caller must roll back tx (an operator reconciles the record with
// Resolve). A Response that cannot be stored returns ErrInvalidResponse or
// ErrResponseTooLarge; a zero or replayed Reservation, or a nil tx,
// ErrInvalidArgument. After a database error tx is aborted.
func Complete(ctx context.Context, tx pgx.Tx, r Reservation, resp Response) error {
	return defaultClient.c.Complete(ctx, tx, r, resp)
}

// Complete is the package-level Complete with this client's configuration.
func (c *Client) Complete(ctx context.Context, tx pgx.Tx, r Reservation, resp Response) error {
	return c.c.Complete(ctx, tx, r, resp)
}

// FailRetryable records that the reservation's work certainly did not
// happen (the request never left the process, or the provider refused it
// before acting): the record becomes 'failed_retryable' with reason, and the
// next Reserve with the same fingerprint executes again. It runs in a
// transaction of its own begun on db (a savepoint on a pgx.Tx).
//
// ErrFenced when the record is no longer this reservation's 'processing'
// (its lease ran out and it turned unknown, an operator resolved it);
// nothing changes. Use MarkUnknown whenever the work may have happened.
func FailRetryable(ctx context.Context, db Beginner, r Reservation, reason string) error {
	return defaultClient.c.FailRetryable(ctx, db, r, reason)
}

// FailRetryable is the package-level FailRetryable with this client's
// configuration.
func (c *Client) FailRetryable(ctx context.Context, db Beginner, r Reservation, reason string) error {
	return c.c.FailRetryable(ctx, db, r, reason)
}

// MarkUnknown records that the reservation's work may have happened (a
// timeout, a connection reset after the request was sent): the record
// becomes 'unknown' with reason. Nothing runs again for the key until an
// operator reconciles it with Resolve; Reserve and Do answer
// ErrOutcomeUnknown. It runs in a transaction of its own begun on db (a
// savepoint on a pgx.Tx).
//
// A record this reservation already left unknown (an earlier MarkUnknown, or
// its lease ran out first) stays unknown and takes the new reason. ErrFenced
// when the record has moved on otherwise; nothing changes.
func MarkUnknown(ctx context.Context, db Beginner, r Reservation, reason string) error {
	return defaultClient.c.MarkUnknown(ctx, db, r, reason)
}

// MarkUnknown is the package-level MarkUnknown with this client's
// configuration.
func (c *Client) MarkUnknown(ctx context.Context, db Beginner, r Reservation, reason string) error {
	return c.c.MarkUnknown(ctx, db, r, reason)
}

// Heartbeat extends the reservation's live lease to at least extend from now
// (the database clock; a lease is never shortened) and returns the
// reservation with its new LeaseExpiresAt. Call it while long work runs, well
// before the lease runs out.
//
// ErrFenced once the lease has run out (even if nobody has turned the record
// unknown yet), or when the record is no longer this reservation's
// 'processing'; nothing changes. extend < 1µs is ErrInvalidArgument. The
// database clock is now(), the start of the transaction: on a pgx.Tx that is
// the caller's, so call Heartbeat on a pool or a connection.
func Heartbeat(ctx context.Context, db Beginner, r Reservation, extend time.Duration) (Reservation, error) {
	return defaultClient.c.Heartbeat(ctx, db, r, extend)
}

// Heartbeat is the package-level Heartbeat with this client's configuration.
func (c *Client) Heartbeat(ctx context.Context, db Beginner, r Reservation, extend time.Duration) (Reservation, error) {
	return c.c.Heartbeat(ctx, db, r, extend)
}
