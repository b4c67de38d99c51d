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
//	ctx := idem.WithCallKey(ctx, r.CallKey("charge")) // one key for every attempt of the call
//	charge, err := gateway.Charge(ctx, ...)
//	// certainly not sent:  client.FailRetryable(ctx, pool, r, reason)
//	// may have happened:   client.MarkUnknown(ctx, pool, r, reason)
//	// done: in one transaction, the domain writes and client.Complete(ctx, tx, r, resp)
//
// ReserveWith with ReserveOptions.ResumeWithin adds a window, from the key's
// first reservation, in which an attempt in doubt resumes by itself instead
// of waiting for a person: the receiver still deduplicates its call keys,
// so the calls can be made again. A recovery worker finds such attempts
// with ListResumable.
//
// One table and one state machine serve Do and the reservations ("in doubt":
// processing whose lease ran out, or unknown; "inside its window": the key
// was reserved with ResumeWithin, and its window has not ended):
//
//	(none)            --Reserve-->                      processing (lease, new token; window from now)
//	processing        --Complete (same token)-->        succeeded
//	processing        --FailRetryable (same token)-->   failed_retryable
//	processing        --MarkUnknown (same token)-->     unknown
//	processing        --Heartbeat (same token, live)--> processing (lease extended)
//	processing, lease ran out, no window or past it
//	                  --Reserve, ExpireLeases-->        unknown
//	in doubt, inside its window
//	                  --Reserve (same fingerprint)-->   processing (new token, Resumed; same window)
//	failed_retryable  --Reserve (same fingerprint)-->   processing (new token; same window)
//	failed_retryable  --Do (same fingerprint)-->        Do runs fn: succeeded | rejected
//	in doubt, inside its window or not
//	                  --Resolve-->                      succeeded | failed_retryable (new token)
//	succeeded, rejected, failed_retryable past the TTL
//	                  --Reserve, Do-->                  a new request (a window of its own)
//	processing without a lease (a claim of Do or DoInTx whose fn committed
//	the call's transaction itself)
//	                  --DoInTx (that very call), Reserve, DoInTx-->
//	                                                    unknown (new token, a lease that ended)
//
// Every other event leaves the record as it is: Reserve replays succeeded
// and rejected records, answers ErrInProgress while a live lease holds the
// key and ErrOutcomeUnknown for an unknown record without a window or past
// it; ExpireLeases leaves an attempt inside its window as it is; Do answers
// ErrOutcomeUnknown to every attempt in doubt, inside its window too (fn
// cannot make the outside calls again); a reservation that is no longer
// the owner gets ErrFenced. The database clock decides every lease and
// window. ListUnknown lists the unknown records that need a person (no
// window, or past it); ListResumable the attempts in doubt inside their
// window.

// Reservation is the right to execute a request's outside work, or the
// stored outcome of an earlier execution (Replayed true, Token 0).
type Reservation struct {
	// Result holds the stored Response when Replayed is true.
	Result
	Scope Scope
	Key   string
	// Token is the fencing token of this execution, greater than zero: no
	// other reservation of any key ever had it. Complete, FailRetryable,
	// MarkUnknown and Heartbeat succeed only while the record still holds it.
	Token int64
	// LeaseExpiresAt is when the lease runs out, by the database clock.
	// After it, Reserve and ExpireLeases turn the record unknown, or,
	// inside the key's window (ReserveOptions.ResumeWithin), the next
	// Reserve resumes it. A resumed reservation's lease ends no later than
	// the window.
	LeaseExpiresAt time.Time
	// Resumed is true when this reservation took over an attempt in doubt
	// (its lease ran out, or its worker marked it unknown) inside the key's
	// window: that attempt may have made its outside calls. Make them again
	// with the same call keys (CallKey), which the receiver deduplicates,
	// never with new ones.
	Resumed bool
}

// ReserveOptions configures ReserveWith. The zero value means the
// defaults: a lease of DefaultLease and no window.
type ReserveOptions struct {
	// Lease is how long the reservation holds the key before it counts as
	// stuck (extend it with Heartbeat). Default DefaultLease; otherwise at
	// least 1µs.
	Lease time.Duration

	// ResumeWithin is the window in which an attempt in doubt resumes by
	// itself. Setting it promises that every outside call made under the
	// reservation carries its call key (Reservation.CallKey) and that the
	// receiver deduplicates by that key for at least ResumeWithin from the
	// key's first reservation. Then, until the window ends, an attempt
	// whose lease ran out, or that its worker marked unknown, is not a case
	// for a person: the next Reserve (a retry of the client, or a recovery
	// worker that ListResumable feeds) takes it over with a new token and
	// Resumed true, and makes the calls again with the same keys. Past the
	// window such an attempt is unknown, for a person, as without one.
	//
	// The window is measured from the first reservation of the key's TTL
	// generation and stored with the record; resumes and new attempts after
	// FailRetryable keep it and never extend it, and a Reserve of the same
	// generation, with or without ResumeWithin, honours the stored window.
	// 0, the default, means no window; otherwise it must be at least the
	// lease, since a lease that outlives the window could never resume.
	ResumeWithin time.Duration
}

// DefaultLease is ReserveOptions.Lease's default.
const DefaultLease = 30 * time.Second

// MaxReasonLength is the longest reason, in bytes, that FailRetryable,
// MarkUnknown and Resolve store.
const MaxReasonLength = 1024

// Reserve reserves (scope, key) for outside work. In a short transaction of
// its own, committed before it returns, it records the key as 'processing'
// with a lease of the given length and a new fencing token. It returns
// exactly one of:
//
//   - execute: a nil error and r.Token > 0: the key was free, past its TTL,
//     or its record was 'failed_retryable' with the same fingerprint. Do the
//     work, then record its outcome with Complete, FailRetryable or
//     MarkUnknown (and Heartbeat while it takes long). When r.Resumed is
//     true, the key was reserved with a window (ReserveWith) and its
//     attempt in doubt is resumed: make the outside calls again with the
//     same call keys.
//   - replay: a nil error and r.Replayed: an earlier execution succeeded (or
//     Do stored an outcome); r.Response is what it stored, r.Token is 0.
//   - ErrResponseGone: an earlier execution succeeded (or Do stored an
//     outcome), but its body was dropped after its life (Config.BodyTTL);
//     r.Replayed is true and r.Status the stored status, with no body or
//     header. Do not execute.
//   - ErrKeyReused: the record holds a different fingerprint.
//   - ErrInProgress (an *InProgressError): a live lease holds the key;
//     RetryAfter is the lease's remaining time, between one second and a
//     minute. The same comes back when a transaction of Do holds the key and
//     does not finish within Config.Wait.
//   - ErrOutcomeUnknown: the record is 'unknown', or its lease ran out
//     before an outcome was recorded, and the key has no window or its
//     window ended. Reserve then turns it unknown in the same transaction.
//     It never runs again by itself: reconcile it with Resolve.
//
// On any other error (the store failed) do not execute. If the connection
// broke while the reservation committed, the record may hold the key without
// an owner: it turns unknown when its lease runs out.
//
// Reserve needs a pool or a connection (it commits); a pgx.Tx, lease < 1µs,
// an invalid scope or key are refused before anything runs.
func Reserve(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint, lease time.Duration) (Reservation, error) {
	return defaultClient.Reserve(ctx, db, scope, key, fp, lease)
}

// Reserve is the package-level Reserve with this client's configuration.
func (c *Client) Reserve(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint, lease time.Duration) (Reservation, error) {
	r, err := c.c.Reserve(ctx, db, core.Scope(scope), key, core.Fingerprint(fp), lease)
	return reservation(r), publicErr(err)
}

// ReserveWith is Reserve with options: opts.Lease (DefaultLease when zero)
// and opts.ResumeWithin, the window in which an attempt in doubt resumes
// by itself (see ReserveOptions). It answers as Reserve does; like
// Reserve, it takes over an attempt in doubt inside the key's window (the
// window the key's first reservation set): a nil error, a new r.Token and
// r.Resumed true. Make the outside calls again
// with the same call keys (r.CallKey), then record the outcome as after
// any execution. A stale worker of the attempt it took over is fenced.
//
// A negative opts.Lease or opts.ResumeWithin, a Lease under 1µs, a
// ResumeWithin shorter than the lease, a pgx.Tx, an invalid scope or key
// are refused with ErrInvalidArgument (ErrInvalidScope, ErrInvalidKey)
// before anything runs.
func ReserveWith(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint, opts ReserveOptions) (Reservation, error) {
	return defaultClient.ReserveWith(ctx, db, scope, key, fp, opts)
}

// ReserveWith is the package-level ReserveWith with this client's
// configuration.
func (c *Client) ReserveWith(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint, opts ReserveOptions) (Reservation, error) {
	r, err := c.c.ReserveWith(ctx, db, core.Scope(scope), key, core.Fingerprint(fp), core.ReserveOptions(opts))
	return reservation(r), publicErr(err)
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
	return defaultClient.Complete(ctx, tx, r, resp)
}

// Complete is the package-level Complete with this client's configuration.
func (c *Client) Complete(ctx context.Context, tx pgx.Tx, r Reservation, resp Response) error {
	return publicErr(c.c.Complete(ctx, tx, coreReservation(r), core.Response(resp)))
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
//
// For a resumed reservation (r.Resumed) "certainly did not happen" covers
// the earlier attempts too: that this attempt's call never left the
// process says nothing of theirs. Unless the receiver itself answered that
// it holds nothing under the call key, use MarkUnknown (inside the window
// the record stays resumable) or let the lease run out.
func FailRetryable(ctx context.Context, db Beginner, r Reservation, reason string) error {
	return defaultClient.FailRetryable(ctx, db, r, reason)
}

// FailRetryable is the package-level FailRetryable with this client's
// configuration.
func (c *Client) FailRetryable(ctx context.Context, db Beginner, r Reservation, reason string) error {
	return publicErr(c.c.FailRetryable(ctx, db, coreReservation(r), reason))
}

// MarkUnknown records that the reservation's work may have happened (a
// timeout, a connection reset after the request was sent): the record
// becomes 'unknown' with reason. Nothing runs again for the key until an
// operator reconciles it with Resolve; Reserve and Do answer
// ErrOutcomeUnknown. Inside the key's window (ReserveOptions.ResumeWithin)
// the next Reserve resumes it instead, and ListResumable lists it, not
// ListUnknown. It runs in a transaction of its own begun on db (a
// savepoint on a pgx.Tx).
//
// A record this reservation already left unknown (an earlier MarkUnknown, or
// its lease ran out first) stays unknown and takes the new reason. ErrFenced
// when the record has moved on otherwise; nothing changes.
func MarkUnknown(ctx context.Context, db Beginner, r Reservation, reason string) error {
	return defaultClient.MarkUnknown(ctx, db, r, reason)
}

// MarkUnknown is the package-level MarkUnknown with this client's
// configuration.
func (c *Client) MarkUnknown(ctx context.Context, db Beginner, r Reservation, reason string) error {
	return publicErr(c.c.MarkUnknown(ctx, db, coreReservation(r), reason))
}

// Heartbeat extends the reservation's live lease to at least extend from now
// (the database clock; a lease is never shortened) and returns the
// reservation with its new LeaseExpiresAt. Call it while long work runs, well
// before the lease runs out.
//
// ErrFenced once the lease has run out (even if nobody has turned the record
// unknown yet), or when the record is no longer this reservation's
// 'processing'; nothing changes. The lease of a resumed reservation
// (r.Resumed) never passes the key's window: near its end, Heartbeat
// extends it only that far. extend < 1µs is ErrInvalidArgument. The
// database clock is now(), the start of the transaction: on a pgx.Tx that is
// the caller's, so call Heartbeat on a pool or a connection.
func Heartbeat(ctx context.Context, db Beginner, r Reservation, extend time.Duration) (Reservation, error) {
	return defaultClient.Heartbeat(ctx, db, r, extend)
}

// Heartbeat is the package-level Heartbeat with this client's configuration.
func (c *Client) Heartbeat(ctx context.Context, db Beginner, r Reservation, extend time.Duration) (Reservation, error) {
	next, err := c.c.Heartbeat(ctx, db, coreReservation(r), extend)
	return reservation(next), publicErr(err)
}
