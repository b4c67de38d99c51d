package idem

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	// Named store here: the parameter that takes a Beginner is called db.
	store "github.com/pgidem/idem/internal/db"
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
	// Resolve reconciles it.
	StatusUnknown Status = "unknown"
)

// finished reports whether s is the final outcome of an attempt, which a
// new request may take over once the TTL has passed.
func (s Status) finished() bool {
	return s == StatusSucceeded || s == StatusRejected || s == StatusFailedRetryable
}

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
	// Response is the stored outcome; nil when none is stored.
	Response *Response
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
// (by the database clock) into 'unknown', oldest lease first, in one
// statement of a short transaction begun on db, and returns how many. Rows
// that another worker holds locked are skipped, so several workers can run
// it at once (on Citus, which has no SKIP LOCKED over a distributed table,
// they wait for each other instead); when it returns limit, more may be
// waiting: call it again.
//
// Records it turns unknown never run again by themselves: reconcile them
// with Resolve (ListUnknown finds them). Reserve turns such a record unknown
// on its own when it meets it, so ExpireLeases is about finding them early,
// not about correctness. limit <= 0 is ErrInvalidArgument.
func ExpireLeases(ctx context.Context, db Beginner, limit int) (int64, error) {
	return defaultClient.ExpireLeases(ctx, db, limit)
}

// ExpireLeases is the package-level ExpireLeases with this client's
// configuration.
func (c *Client) ExpireLeases(ctx context.Context, db Beginner, limit int) (int64, error) {
	if err := checkList(db, limit); err != nil {
		return 0, err
	}
	var n int64
	err := c.batchTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		citus, err := c.isCitus(ctx, tx.Conn())
		if err != nil {
			return err
		}
		arg := store.ReserveExpireLeasesParams{Reason: leaseExpiredReason, MaxRows: int32(min(limit, math.MaxInt32))}
		if citus {
			n, err = queries.ReserveExpireLeasesCitus(ctx, planned{tx}, store.ReserveExpireLeasesCitusParams(arg))
		} else {
			n, err = queries.ReserveExpireLeases(ctx, planned{tx}, arg)
		}
		return err
	})
	if err != nil {
		err = fmt.Errorf("idem: expire leases: %w", unsupportedIf(err))
		c.countEnd(ctx, "expire_leases", Scope{}, err, "")
		return 0, err
	}
	c.obs.count(ctx, "zombie_key", "expire_leases", "", n)
	return n, nil
}

// ListUnknown returns at most limit 'unknown' records, oldest first (by
// CreatedAt, then scope and key). Pass nil for the first page and the last
// record of a page for the next; an empty page is the end. limit <= 0, or
// an after whose names are not valid UTF-8 or hold NUL, or whose CreatedAt
// is outside PostgreSQL's range, is ErrInvalidArgument.
func ListUnknown(ctx context.Context, db Beginner, limit int, after *Record) ([]Record, error) {
	return defaultClient.ListUnknown(ctx, db, limit, after)
}

// ListUnknown is the package-level ListUnknown with this client's
// configuration.
func (c *Client) ListUnknown(ctx context.Context, db Beginner, limit int, after *Record) ([]Record, error) {
	if err := checkList(db, limit); err != nil {
		return nil, err
	}
	arg := store.ReserveListUnknownParams{
		AfterCreatedAt: pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true},
		MaxRows:        int32(min(limit, math.MaxInt32)),
	}
	if after != nil {
		if err := checkCursor(after); err != nil {
			return nil, err
		}
		arg.AfterCreatedAt = pgtype.Timestamptz{Time: after.CreatedAt, Valid: true}
		arg.AfterActor, arg.AfterOperation, arg.AfterKey = after.Scope.Actor, after.Scope.Operation, after.Key
	}
	var rows []store.IdemKey
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		rows, err = queries.ReserveListUnknown(ctx, planned{tx}, arg)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("idem: list unknown: %w", unsupportedIf(err))
	}
	records := make([]Record, 0, len(rows))
	for _, row := range rows {
		rec, err := newRecord(row)
		if err != nil {
			return nil, fmt.Errorf("idem: list unknown: %w", unsupportedIf(err))
		}
		records = append(records, rec)
	}
	return records, nil
}

// Resolve reconciles the record of (scope, key) whose outcome was in doubt
// ('unknown', or 'processing' whose lease ran out), in a transaction begun on
// db (a savepoint on a pgx.Tx): to 'succeeded' with res.Succeeded, which
// Reserve and Do then replay, or, with res.Retryable, to 'failed_retryable',
// so that the next Reserve with the same fingerprint executes again. Either
// way the token advances: the reservation that held the key is fenced, so a
// late Complete of it changes nothing.
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
	if err := c.checkTarget(scope, key); err != nil {
		return err
	}
	if isNil(db) {
		return fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	if res.Token <= 0 {
		return fmt.Errorf("%w: a Resolution names the Token of the attempt it resolves (Record.Token)", ErrInvalidArgument)
	}
	if (res.Succeeded != nil) == res.Retryable {
		return fmt.Errorf("%w: a Resolution sets exactly one of Succeeded and Retryable", ErrInvalidArgument)
	}
	if err := checkReason(res.Reason); err != nil {
		return err
	}
	arg := store.ReserveResolveParams{
		Status: string(StatusFailedRetryable), Reason: res.Reason, TtlMicros: c.ttlMicros,
		Actor: scope.Actor, Operation: scope.Operation, IdemKey: key,
	}
	if resp := res.Succeeded; resp != nil {
		headers, err := c.encodeResponse(*resp)
		if err != nil {
			return err
		}
		arg.Status = string(StatusSucceeded)
		arg.ResponseStatus = pgtype.Int4{Int32: int32(resp.Status), Valid: true}
		arg.ResponseHeaders = headers
		arg.ResponseBody = resp.Body
		if arg.ResponseBody == nil {
			arg.ResponseBody = []byte{}
		}
	}
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		row, err := queries.ReserveLock(ctx, planned{tx}, store.ReserveLockParams{
			Actor: scope.Actor, Operation: scope.Operation, IdemKey: key,
		})
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		if err := resolvable(Status(row.IdemKey.Status), row.IdemKey.Token, res.Token, row.Leased, row.LeaseLeftMs); err != nil {
			return err
		}
		arg.Token = row.IdemKey.Token
		n, err := queries.ReserveResolve(ctx, planned{tx}, arg)
		if err == nil && n != 1 {
			err = fmt.Errorf("locked row not updated (%d rows)", n)
		}
		return err
	})
	if err != nil && !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrNotResolvable) && !errors.Is(err, ErrFenced) {
		err = fmt.Errorf("idem: resolve: %w", unsupportedIf(err))
	}
	if err != nil {
		c.obs.count(ctx, "reconcile_failed", "resolve", scope.Operation, 1)
	}
	c.countEnd(ctx, "resolve", scope, err, "reconcile_resolved")
	return err
}

// resolvable decides whether Resolve may reconcile the locked record of a
// key, which is in status and holds token (leased and leaseLeftMs as
// ReserveLock reads them), with a Resolution that names the token want:
// nil, ErrFenced or ErrNotResolvable. Package idemsql decides through it
// too (internal/bridge).
func resolvable(status Status, token, want int64, leased bool, leaseLeftMs int64) error {
	// (Token 0: a record Do wrote, which has no attempt to name and is
	// never awaiting reconciliation: ErrNotResolvable below.)
	if token != want && token != 0 {
		return fmt.Errorf("%w: token %d was resolved or replaced; the record holds token %d now (status %s)",
			ErrFenced, want, token, status)
	}
	switch {
	case status == StatusUnknown:
	case status == StatusProcessing && leased && leaseLeftMs > 0:
		return fmt.Errorf("%w: a live lease holds it", ErrNotResolvable)
	case status == StatusProcessing && leased:
		// The lease ran out before an outcome was recorded.
	default:
		return fmt.Errorf("%w: it is %s", ErrNotResolvable, status)
	}
	return nil
}

// PostgreSQL's range of timestamptz: 4713 BC to 294276 AD.
var (
	minTimestamp = time.Date(-4712, 1, 1, 0, 0, 0, 0, time.UTC)
	maxTimestamp = time.Date(294277, 1, 1, 0, 0, 0, 0, time.UTC)
)

// checkCursor validates the Record after which ListUnknown continues: its
// names must be text PostgreSQL can hold (valid UTF-8 without NUL), its
// CreatedAt within PostgreSQL's range.
func checkCursor(after *Record) error {
	for _, f := range [...]struct{ name, v string }{
		{"actor", after.Scope.Actor}, {"operation", after.Scope.Operation}, {"key", after.Key},
	} {
		if err := checkHeaderText(f.v); err != nil {
			return fmt.Errorf("%w: cursor %s %v", ErrInvalidArgument, f.name, err)
		}
	}
	if t := after.CreatedAt; t.Before(minTimestamp) || !t.Before(maxTimestamp) {
		return fmt.Errorf("%w: cursor CreatedAt %s is outside PostgreSQL's range", ErrInvalidArgument, t.UTC().Format(time.RFC3339))
	}
	return nil
}

// checkList validates the arguments of ExpireLeases and ListUnknown.
func checkList(db Beginner, limit int) error {
	if isNil(db) {
		return fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	if limit <= 0 {
		return fmt.Errorf("%w: limit %d must be positive", ErrInvalidArgument, limit)
	}
	return nil
}

// newRecord turns a stored row into a Record.
func newRecord(k store.IdemKey) (Record, error) {
	if len(k.Fingerprint) != len(Fingerprint{}) {
		return Record{}, fmt.Errorf("stored fingerprint has %d bytes", len(k.Fingerprint))
	}
	rec := Record{
		Scope:          Scope{Actor: k.Actor, Operation: k.Operation},
		Key:            k.IdemKey,
		Status:         Status(k.Status),
		Fingerprint:    Fingerprint(k.Fingerprint),
		Token:          k.Token,
		LastError:      k.LastError.String,
		ResolveReason:  k.ResolveReason.String,
		CreatedAt:      k.CreatedAt.Time,
		CompletedAt:    k.CompletedAt.Time,
		ExpiresAt:      k.ExpiresAt.Time,
		LeaseExpiresAt: k.LeaseExpiresAt.Time,
	}
	if k.ResponseStatus.Valid {
		res, err := replay(keyRow{ResponseStatus: k.ResponseStatus, ResponseHeaders: k.ResponseHeaders, ResponseBody: k.ResponseBody})
		if err != nil {
			return Record{}, err
		}
		rec.Response = &res.Response
	}
	return rec, nil
}
