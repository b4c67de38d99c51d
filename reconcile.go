package idem

import (
	"context"
	"errors"
	"time"

	"github.com/pgidem/idem/internal/core"
)

// ErrNotResolvable means Resolve was asked to reconcile a record whose
// outcome is not in doubt: a live lease still holds it, or it is finished
// (succeeded, rejected, failed_retryable). Nothing changed.
var ErrNotResolvable = errors.New("idem: the record with this idempotency key is not awaiting reconciliation")

// Status is the state of a key's record.
type Status string

// The states of a record. Do writes succeeded and rejected records (its
// processing claim never commits); the reservation mode adds the others.
const (
	// StatusProcessing: a reservation holds the key with a lease.
	StatusProcessing Status = "processing"
	// StatusSucceeded: the outcome is stored and replayed.
	StatusSucceeded Status = "succeeded"
	// StatusRejected: Do stored a deterministic refusal, replayed.
	StatusRejected Status = "rejected"
	// StatusFailedRetryable: the work certainly did not happen; the next
	// Reserve with the same fingerprint executes again.
	StatusFailedRetryable Status = "failed_retryable"
	// StatusUnknown: the work may have happened; nothing runs again until
	// Resolve reconciles it, or, inside the window of a key reserved with
	// ReserveOptions.ResumeWithin, until the next Reserve resumes it.
	StatusUnknown Status = "unknown"
)

// Record is a key's record as stored.
type Record struct {
	Scope       Scope
	Key         string
	Status      Status
	Fingerprint Fingerprint
	// Token is the fencing token of the reservation that last held the key
	// (0 for records Do wrote).
	Token int64
	// LastError says why the record failed or became unknown; empty when
	// there is nothing to say. Resolve keeps it.
	LastError string
	// ResolveReason is the operator's reason (Resolution.Reason) when
	// Resolve reconciled the record; empty otherwise.
	ResolveReason string
	// CreatedAt is when the key was claimed or reserved (for a reservation,
	// its latest attempt).
	CreatedAt time.Time
	// CompletedAt is when an outcome was recorded; zero when none was.
	CompletedAt time.Time
	// ExpiresAt is the end of the TTL: past it a finished record is a new
	// request.
	ExpiresAt time.Time
	// LeaseExpiresAt is the end of the last reservation's lease; zero for
	// records Do wrote.
	LeaseExpiresAt time.Time
	// ResumeUntil is the end of the key's window
	// (ReserveOptions.ResumeWithin from the first reservation of its TTL
	// generation): before it, an attempt in doubt is resumed rather than
	// left for a person. Zero when the key was reserved without one, and for
	// records Do wrote.
	ResumeUntil time.Time
	// UnknownAt is when the record's latest attempt became unknown (by the
	// database clock), whoever made it so: its worker (MarkUnknown),
	// ExpireLeases, an operator's expiry in the console, or a call that
	// found a claim of Do or DoInTx left without an outcome. Marked unknown
	// again, it keeps the first time; a verdict (Resolve) keeps it; a new
	// attempt clears it. Zero when the attempt never became unknown, or
	// became unknown before migration 10, which records it.
	UnknownAt time.Time
	// BodyExpiresAt is when the stored response's body and headers are
	// dropped (Config.BodyTTL, BodyTTLFor: a replay past it gets
	// ErrResponseGone, and Prune drops them); zero when the body lives as
	// long as the key (the default, every reservation and every response
	// Resolve stored), and once Prune has dropped it (ResponseGone).
	BodyExpiresAt time.Time
	// Response is the stored outcome; nil when none is stored.
	Response *Response
	// ResponseGone: the response's body and headers were dropped, or their
	// time has passed (Config.BodyTTL); Response holds the stored status
	// only. A replay of the key returns ErrResponseGone.
	ResponseGone bool
}

// Resolution is an operator's verdict on a record whose outcome was unknown,
// after looking at the outside system. Set exactly one of Succeeded and
// Retryable, and the Token of the attempt the verdict is about.
type Resolution struct {
	// Token is the fencing token of the attempt being resolved, as
	// ListUnknown and Lookup show it (Record.Token). Required: a verdict
	// about one attempt must never land on a later one, so Resolve refuses
	// a token that is not the record's current one with ErrFenced.
	Token int64
	// Succeeded is the response to store and replay: the work did happen.
	Succeeded *Response
	// Retryable says the work certainly did not happen: the next Reserve with
	// the same fingerprint executes again.
	Retryable bool
	// Reason is stored as the record's ResolveReason (at most
	// MaxReasonLength bytes), for the audit trail, beside the LastError
	// that says why the record became unknown.
	Reason string
}

// ExpireLeases turns at most limit 'processing' records whose lease ran out
// (by the database clock) into 'unknown', oldest attempt first, in one
// statement of a short transaction begun on db, and returns how many. Rows
// that another worker holds locked are skipped, so several workers can run
// it at once (on Citus, which has no SKIP LOCKED over a distributed table,
// they wait for each other instead); when it returns limit, more may be
// waiting: call it again.
//
// A record inside its key's window (ReserveOptions.ResumeWithin) stays as
// it is, for a recovery worker (ListResumable) or the next Reserve to
// resume; once the window has ended, ExpireLeases turns it unknown like the
// others. Records it turns unknown never run again by themselves: reconcile
// them with Resolve (ListUnknown finds them). Reserve turns such a record
// unknown on its own when it meets it, so ExpireLeases is about finding
// them early, not about correctness. limit <= 0 is ErrInvalidArgument.
func ExpireLeases(ctx context.Context, db Beginner, limit int) (int64, error) {
	return defaultClient.ExpireLeases(ctx, db, limit)
}

// ExpireLeases is the package-level ExpireLeases with this client's
// configuration.
func (c *Client) ExpireLeases(ctx context.Context, db Beginner, limit int) (int64, error) {
	n, err := c.c.ExpireLeases(ctx, db, limit)
	return n, publicErr(err)
}

// ListUnknown returns at most limit records in doubt that need a person,
// oldest first (by CreatedAt, then scope and key): 'unknown', and
// 'processing' whose lease ran out (a crashed worker's; listed at once, no
// ExpireLeases needed first; Resolve takes either), of keys reserved
// without a window, or whose window (ReserveOptions.ResumeWithin) has
// ended. An unknown record inside its window is ListResumable's. Pass nil
// for the first page and the last record of a page for the next; an empty
// page is the end. limit <= 0, or an after whose names are not valid UTF-8
// or hold NUL, or whose CreatedAt is outside PostgreSQL's range, is
// ErrInvalidArgument.
func ListUnknown(ctx context.Context, db Beginner, limit int, after *Record) ([]Record, error) {
	return defaultClient.ListUnknown(ctx, db, limit, after)
}

// ListUnknown is the package-level ListUnknown with this client's
// configuration.
func (c *Client) ListUnknown(ctx context.Context, db Beginner, limit int, after *Record) ([]Record, error) {
	return records(c.c.ListUnknown(ctx, db, limit, coreRecord(after)))
}

// ListResumable returns at most limit records that a recovery worker
// should re-drive, oldest first (by CreatedAt, then scope and key): the
// attempts in doubt inside their key's window (ReserveOptions.ResumeWithin),
// 'processing' whose lease ran out or 'unknown' (marked by its worker; the
// same promise covers it, and past the window it would be a person's
// anyway). For each, ReserveWith with the record's scope, key and
// fingerprint resumes the attempt (Reservation.Resumed) unless another
// worker or the client's retry took it first (ErrInProgress, a replay):
// make the outside calls again with the same call keys, then Complete,
// MarkUnknown (or FailRetryable, only when the receiver answered that it
// holds nothing under the call key: see FailRetryable). 'processing'
// attempts whose lease still runs are not listed ('unknown' ones are, at
// once: a recovery worker may wait for their lease to run out, to leave
// them to the client's retry first), nor anything past its window
// (ListUnknown lists those). Paging and the refusals of limit and after are
// ListUnknown's.
func ListResumable(ctx context.Context, db Beginner, limit int, after *Record) ([]Record, error) {
	return defaultClient.ListResumable(ctx, db, limit, after)
}

// ListResumable is the package-level ListResumable with this client's
// configuration.
func (c *Client) ListResumable(ctx context.Context, db Beginner, limit int, after *Record) ([]Record, error) {
	return records(c.c.ListResumable(ctx, db, limit, coreRecord(after)))
}

// Resolve reconciles the record of (scope, key) whose outcome was in doubt
// ('unknown', or 'processing' whose lease ran out, inside its key's window
// or not), in a transaction begun on db (a savepoint on a pgx.Tx): to
// 'succeeded' with res.Succeeded, which Reserve and Do then replay, or,
// with res.Retryable, to 'failed_retryable', so that the next Reserve with
// the same fingerprint executes again (inside the same window, if the key
// has one). Either way the token advances: the reservation that held the
// key is fenced, so a late Complete of it changes nothing.
//
// res.Token names the attempt the verdict is about (Record.Token, as
// ListUnknown and Lookup show it). When it is not the record's current token
// (another operator resolved it, or a later attempt holds it now), Resolve
// returns ErrFenced and changes nothing: look the record up again.
//
// ErrNotFound when no record holds the key; ErrNotResolvable when a live
// lease holds it or its outcome is already recorded. No token (0 or less),
// both or neither of res.Succeeded and res.Retryable, a reason too long or
// not valid text, or a response that cannot be stored is ErrInvalidArgument
// (ErrInvalidResponse, ErrResponseTooLarge for the response), refused before
// anything runs. The record keeps its LastError; res.Reason is stored as its
// ResolveReason.
func Resolve(ctx context.Context, db Beginner, scope Scope, key string, res Resolution) error {
	return defaultClient.Resolve(ctx, db, scope, key, res)
}

// Resolve is the package-level Resolve with this client's configuration.
func (c *Client) Resolve(ctx context.Context, db Beginner, scope Scope, key string, res Resolution) error {
	return publicErr(c.c.Resolve(ctx, db, core.Scope(scope), key, coreResolution(res)))
}
