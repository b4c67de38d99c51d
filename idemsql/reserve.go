package idemsql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgerrcode"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/bridge"
	"github.com/pgidem/idem/internal/dbsql"
)

// The reservation mode and the operator calls on database/sql: idem's
// calls of the same names (see idem.Reserve for the state machine), each
// in a transaction of its own begun on a *sql.DB, except Complete, which
// runs in the caller's *sql.Tx beside the domain writes. Their statements
// are off the hot path and sent one per round trip.

// leaseExpiredReason is the last_error of a record whose lease ran out (as
// package idem stores it).
const leaseExpiredReason = "lease expired before the outcome was recorded"

// sqlLockTimeout bounds the waits of the rest of Reserve's transaction.
const sqlLockTimeout = "SELECT set_config('lock_timeout', $1, true)"

// maxReserveAttempts bounds the rounds of insert and read when the row that
// held a key keeps disappearing under Reserve (pruned, forgotten).
const maxReserveAttempts = 4

// errLeaseRanOut is Reserve's answer when it turned a record whose lease
// ran out unknown.
var errLeaseRanOut = fmt.Errorf("%w (its reservation's lease ran out)", idem.ErrOutcomeUnknown)

// Reserve is idem.Reserve on a *sql.DB: it reserves (scope, key) for
// outside work in a short transaction of its own, committed before it
// returns, and answers execute (r.Token > 0), replay (r.Replayed),
// idem.ErrKeyReused, idem.ErrInProgress or idem.ErrOutcomeUnknown exactly
// as idem.Reserve does. lease < 1µs, an invalid scope or key, or a nil db
// are refused before anything runs.
func Reserve(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint, lease time.Duration) (idem.Reservation, error) {
	return defaultClient.Reserve(ctx, db, scope, key, fp, lease)
}

// Reserve is the package-level Reserve with this client's configuration.
func (c *Client) Reserve(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint, lease time.Duration) (idem.Reservation, error) {
	if err := c.checkTarget(scope, key); err != nil {
		return idem.Reservation{}, err
	}
	if db == nil {
		return idem.Reservation{}, errNilDB
	}
	if lease < time.Microsecond {
		return idem.Reservation{}, fmt.Errorf("%w: lease %s must be at least 1µs", idem.ErrInvalidArgument, lease)
	}
	k := bridgeKey(scope, key)
	ctx, cl := core.Observe(c.c, ctx, "reserve", "idemsql.Reserve", k)
	var r idem.Reservation
	var refusal error // an outcome decided in a transaction that commits
	err := c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		var err error
		r, refusal, err = c.reserve(ctx, tx, k, fp, lease)
		return err
	})
	switch {
	case err != nil && sqlState(err) == pgerrcode.LockNotAvailable:
		err = core.InProgress(c.c, k)
	case err != nil:
		err = fmt.Errorf("idem: reserve: %w", err)
	case refusal == errLeaseRanOut:
		core.Count(c.c, ctx, "zombie_key", "reserve", scope.Operation, 1)
		err = refusal
	default:
		err = refusal
	}
	if err != nil {
		r, err = idem.Reservation{}, pooled(err)
	}
	cl.End(ctx, r.Result, err)
	return r, err
}

// reserve is Reserve in its transaction. refusal is an outcome that is not
// an execution or a replay; err is a failure that rolls back.
func (c *Client) reserve(ctx context.Context, tx *sql.Tx, k bridge.Key, fp idem.Fingerprint, lease time.Duration) (
	r idem.Reservation, refusal error, err error) {
	r = idem.Reservation{Scope: idem.Scope{Actor: k.Actor, Operation: k.Operation}, Key: k.Key}
	insert := dbsql.ReserveInsertParams{
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Fingerprint: fp[:],
		LeaseMicros: lease.Microseconds(), TtlMicros: c.ttlMicros,
	}
	// Both settings are local to Reserve's own transaction: the wait for
	// a transaction that holds the key, and the read as an index lookup.
	// (set_config(..., true) is SET LOCAL lock_timeout, which takes no
	// parameter; package idem's Reserve sends the same.)
	if _, err := tx.ExecContext(ctx, sqlLockTimeout, c.wait); err != nil {
		return r, nil, err
	}
	if _, err := tx.ExecContext(ctx, sqlIndexLookup); err != nil {
		return r, nil, err
	}
	for range maxReserveAttempts {
		// Insert a fresh reservation, or else lock and read the committed
		// row that holds the key.
		ins, err := queries.ReserveInsert(ctx, tx, insert)
		if err == nil {
			r.Token, r.LeaseExpiresAt = ins.Token, ins.LeaseExpiresAt.Time
			return r, nil, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return r, nil, err
		}
		row, err := queries.ReserveLock(ctx, tx, dbsql.ReserveLockParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
		if errors.Is(err, sql.ErrNoRows) {
			continue // gone since the insert (pruned): insert again
		}
		if err != nil {
			return r, nil, err
		}

		// The one state machine of a key (package idem's judge) decides,
		// as for Do; Reserve adds what only it does.
		rec := row.IdemKey
		if len(rec.Fingerprint) != len(fp) {
			return r, nil, fmt.Errorf("stored fingerprint has %d bytes", len(rec.Fingerprint))
		}
		res, next, refusal := core.Judge(c.c, lockedRow(row), true, fp, k)
		switch {
		case next == bridge.TakeOver:
			// Past its TTL (a new request), or certainly not executed (a
			// new attempt): acquired below.
		case errors.Is(refusal, idem.ErrOutcomeUnknown) && idem.Status(rec.Status) == idem.StatusProcessing:
			// The lease ran out: the owner may have executed and vanished.
			// Never run again blindly: the record turns unknown.
			n, err := queries.ReserveMarkUnknown(ctx, tx, dbsql.ReserveMarkUnknownParams{
				Reason: leaseExpiredReason, Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: rec.Token,
			})
			if err == nil && n != 1 {
				err = fmt.Errorf("locked row not updated (%d rows)", n)
			}
			if err != nil {
				return r, nil, err
			}
			return r, errLeaseRanOut, nil
		case refusal != nil:
			return r, refusal, nil
		default:
			r.Result = res // a replay
			return r, nil, nil
		}
		acq, err := queries.ReserveAcquire(ctx, tx, dbsql.ReserveAcquireParams{
			Fingerprint: fp[:], TtlMicros: insert.TtlMicros, LeaseMicros: insert.LeaseMicros,
			Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: rec.Token,
		})
		if err != nil {
			return r, nil, err
		}
		r.Token, r.LeaseExpiresAt = acq.Token, acq.LeaseExpiresAt.Time
		return r, nil, nil
	}
	return r, core.InProgress(c.c, k), nil
}

// lockedRow is a row ReserveLock read, as judge reads it.
func lockedRow(row dbsql.ReserveLockRow) bridge.Row {
	k := row.IdemKey
	return bridge.Row{
		Fingerprint: k.Fingerprint, Status: k.Status,
		ResponseStatus: k.ResponseStatus.Int32, HasResponse: k.ResponseStatus.Valid,
		ResponseHeaders: k.ResponseHeaders, ResponseBody: k.ResponseBody,
		Expired: row.Expired, Leased: row.Leased, LeaseLeftMs: row.LeaseLeftMs,
	}
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
	if err := c.checkReservation(r); err != nil {
		return err
	}
	if tx == nil {
		return errNilTx
	}
	headers, valid, err := core.Encode(c.c, resp)
	if err != nil {
		return err
	}
	body := resp.Body
	if body == nil {
		body = []byte{}
	}
	n, err := queries.ReserveComplete(ctx, tx, dbsql.ReserveCompleteParams{
		ResponseStatus: int32(resp.Status), ResponseHeaders: sql.NullString{String: headers, Valid: valid},
		ResponseBody: body, TtlMicros: c.ttlMicros,
		Actor: r.Scope.Actor, Operation: r.Scope.Operation, IdemKey: r.Key, Token: r.Token,
	})
	switch {
	case err != nil:
		err = txUnusable(fmt.Errorf("idem: complete: %w", err))
	case n != 1:
		err = idem.ErrFenced
	}
	core.CountEnd(c.c, ctx, "complete", r.Scope.Operation, err, "")
	return err
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
	if err := c.checkOwnerCall(db, r, reason); err != nil {
		return err
	}
	return c.fence(ctx, db, "fail_retryable", r.Scope, "failed_retry", func(ctx context.Context, tx *sql.Tx) (int64, error) {
		return queries.ReserveFailRetryable(ctx, tx, dbsql.ReserveFailRetryableParams{
			Reason: reason, TtlMicros: c.ttlMicros, Actor: r.Scope.Actor, Operation: r.Scope.Operation, IdemKey: r.Key, Token: r.Token,
		})
	})
}

// MarkUnknown is idem.MarkUnknown on a *sql.DB: the reservation's work may
// have happened; the record becomes 'unknown' with reason until an operator
// resolves it. idem.ErrFenced when the record has moved on.
func MarkUnknown(ctx context.Context, db *sql.DB, r idem.Reservation, reason string) error {
	return defaultClient.MarkUnknown(ctx, db, r, reason)
}

// MarkUnknown is the package-level MarkUnknown with this client's
// configuration.
func (c *Client) MarkUnknown(ctx context.Context, db *sql.DB, r idem.Reservation, reason string) error {
	if err := c.checkOwnerCall(db, r, reason); err != nil {
		return err
	}
	return c.fence(ctx, db, "mark_unknown", r.Scope, "unknown", func(ctx context.Context, tx *sql.Tx) (int64, error) {
		return queries.ReserveMarkUnknown(ctx, tx, dbsql.ReserveMarkUnknownParams{
			Reason: reason, Actor: r.Scope.Actor, Operation: r.Scope.Operation, IdemKey: r.Key, Token: r.Token,
		})
	})
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
	if err := c.checkOwnerCall(db, r, ""); err != nil {
		return idem.Reservation{}, err
	}
	if extend < time.Microsecond {
		return idem.Reservation{}, fmt.Errorf("%w: extend %s must be at least 1µs", idem.ErrInvalidArgument, extend)
	}
	var lease sql.NullTime
	err := c.indexTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		var err error
		lease, err = queries.ReserveHeartbeat(ctx, tx, dbsql.ReserveHeartbeatParams{
			ExtendMicros: extend.Microseconds(),
			Actor:        r.Scope.Actor, Operation: r.Scope.Operation, IdemKey: r.Key, Token: r.Token,
		})
		return err
	})
	switch {
	case errors.Is(err, sql.ErrNoRows):
		err = idem.ErrFenced
	case err != nil:
		err = fmt.Errorf("idem: heartbeat: %w", err)
	}
	core.CountEnd(c.c, ctx, "heartbeat", r.Scope.Operation, err, "")
	if err != nil {
		return idem.Reservation{}, err
	}
	r.LeaseExpiresAt = lease.Time
	return r, nil
}

// fence runs update, a statement of the owner of a reservation, in a
// transaction begun on db, and returns idem.ErrFenced when it changed no
// row. event is counted when it did.
func (c *Client) fence(ctx context.Context, db *sql.DB, call string, scope idem.Scope, event string,
	update func(ctx context.Context, tx *sql.Tx) (int64, error)) error {
	var n int64
	err := c.indexTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		var err error
		n, err = update(ctx, tx)
		return err
	})
	switch {
	case err != nil:
		err = fmt.Errorf("idem: %s: %w", call, err)
	case n != 1:
		err = idem.ErrFenced
	}
	core.CountEnd(c.c, ctx, call, scope.Operation, err, event)
	return err
}

// checkReservation validates a Reservation given back to the library.
func (c *Client) checkReservation(r idem.Reservation) error {
	if r.Token <= 0 {
		return fmt.Errorf("%w: the Reservation holds no token (a zero value, or a replay)", idem.ErrInvalidArgument)
	}
	return c.checkTarget(r.Scope, r.Key)
}

// checkOwnerCall validates the arguments of FailRetryable, MarkUnknown and
// Heartbeat.
func (c *Client) checkOwnerCall(db *sql.DB, r idem.Reservation, reason string) error {
	if err := c.checkReservation(r); err != nil {
		return err
	}
	if db == nil {
		return errNilDB
	}
	return core.CheckReason(reason)
}

// ExpireLeases is idem.ExpireLeases on a *sql.DB: it turns at most limit
// 'processing' records whose lease ran out into 'unknown', oldest lease
// first, and returns how many. limit <= 0 is idem.ErrInvalidArgument.
func ExpireLeases(ctx context.Context, db *sql.DB, limit int) (int64, error) {
	return defaultClient.ExpireLeases(ctx, db, limit)
}

// ExpireLeases is the package-level ExpireLeases with this client's
// configuration.
func (c *Client) ExpireLeases(ctx context.Context, db *sql.DB, limit int) (int64, error) {
	if err := checkList(db, limit); err != nil {
		return 0, err
	}
	var n int64
	err := c.batchTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		var err error
		n, err = queries.ReserveExpireLeases(ctx, tx, dbsql.ReserveExpireLeasesParams{
			Reason: leaseExpiredReason, MaxRows: int32(min(limit, math.MaxInt32)),
		})
		return err
	})
	if err != nil {
		err = fmt.Errorf("idem: expire leases: %w", err)
		core.CountEnd(c.c, ctx, "expire_leases", "", err, "")
		return 0, err
	}
	core.Count(c.c, ctx, "zombie_key", "expire_leases", "", n)
	return n, nil
}

// ListUnknown is idem.ListUnknown on a *sql.DB: at most limit 'unknown'
// records, oldest first; pass nil for the first page and the last record
// of a page for the next. limit <= 0, or an after that idem.ListUnknown
// refuses (names that are not valid text, a CreatedAt outside PostgreSQL's
// range), is idem.ErrInvalidArgument.
func ListUnknown(ctx context.Context, db *sql.DB, limit int, after *idem.Record) ([]idem.Record, error) {
	return defaultClient.ListUnknown(ctx, db, limit, after)
}

// ListUnknown is the package-level ListUnknown with this client's
// configuration.
func (c *Client) ListUnknown(ctx context.Context, db *sql.DB, limit int, after *idem.Record) ([]idem.Record, error) {
	if err := checkList(db, limit); err != nil {
		return nil, err
	}
	// The first page starts before every timestamp PostgreSQL stores
	// (database/sql has no -infinity).
	arg := dbsql.ReserveListUnknownParams{
		AfterCreatedAt: time.Date(-4713, time.November, 24, 0, 0, 0, 0, time.UTC),
		MaxRows:        int32(min(limit, math.MaxInt32)),
	}
	if after != nil {
		if err := core.CheckCursor(after); err != nil {
			return nil, err
		}
		arg.AfterCreatedAt = after.CreatedAt
		arg.AfterActor, arg.AfterOperation, arg.AfterKey = after.Scope.Actor, after.Scope.Operation, after.Key
	}
	var rows []dbsql.IdemKey
	err := c.indexTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		var err error
		rows, err = queries.ReserveListUnknown(ctx, tx, arg)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("idem: list unknown: %w", err)
	}
	records := make([]idem.Record, 0, len(rows))
	for _, row := range rows {
		rec, err := record(row)
		if err != nil {
			return nil, fmt.Errorf("idem: list unknown: %w", err)
		}
		records = append(records, rec)
	}
	return records, nil
}

// record turns a stored row into an idem.Record.
func record(k dbsql.IdemKey) (idem.Record, error) {
	return core.Record(bridge.RecordRow{
		Row: bridge.Row{
			Fingerprint: k.Fingerprint, Status: k.Status,
			ResponseStatus: k.ResponseStatus.Int32, HasResponse: k.ResponseStatus.Valid,
			ResponseHeaders: k.ResponseHeaders, ResponseBody: k.ResponseBody,
		},
		Key:       bridge.Key{Actor: k.Actor, Operation: k.Operation, Key: k.IdemKey},
		Token:     k.Token,
		LastError: k.LastError.String, ResolveReason: k.ResolveReason.String,
		CreatedAt: k.CreatedAt, CompletedAt: k.CompletedAt.Time, ExpiresAt: k.ExpiresAt,
		LeaseExpiresAt: k.LeaseExpiresAt.Time,
	})
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
	if err := c.checkTarget(scope, key); err != nil {
		return err
	}
	if db == nil {
		return errNilDB
	}
	if res.Token <= 0 {
		return fmt.Errorf("%w: a Resolution names the Token of the attempt it resolves (Record.Token)", idem.ErrInvalidArgument)
	}
	if (res.Succeeded != nil) == res.Retryable {
		return fmt.Errorf("%w: a Resolution sets exactly one of Succeeded and Retryable", idem.ErrInvalidArgument)
	}
	if err := core.CheckReason(res.Reason); err != nil {
		return err
	}
	arg := dbsql.ReserveResolveParams{
		Status: string(idem.StatusFailedRetryable), Reason: res.Reason, TtlMicros: c.ttlMicros,
		Actor: scope.Actor, Operation: scope.Operation, IdemKey: key,
	}
	if resp := res.Succeeded; resp != nil {
		headers, valid, err := core.Encode(c.c, *resp)
		if err != nil {
			return err
		}
		arg.Status = string(idem.StatusSucceeded)
		arg.ResponseStatus = sql.NullInt32{Int32: int32(resp.Status), Valid: true}
		arg.ResponseHeaders = sql.NullString{String: headers, Valid: valid}
		arg.ResponseBody = resp.Body
		if arg.ResponseBody == nil {
			arg.ResponseBody = []byte{}
		}
	}
	err := c.indexTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		row, err := queries.ReserveLock(ctx, tx, dbsql.ReserveLockParams{Actor: scope.Actor, Operation: scope.Operation, IdemKey: key})
		if errors.Is(err, sql.ErrNoRows) {
			return idem.ErrNotFound
		}
		if err != nil {
			return err
		}
		if err := core.Resolvable(row.IdemKey.Status, row.IdemKey.Token, res.Token, row.Leased, row.LeaseLeftMs); err != nil {
			return err
		}
		arg.Token = row.IdemKey.Token
		n, err := queries.ReserveResolve(ctx, tx, arg)
		if err == nil && n != 1 {
			err = fmt.Errorf("locked row not updated (%d rows)", n)
		}
		return err
	})
	if err != nil && !errors.Is(err, idem.ErrNotFound) && !errors.Is(err, idem.ErrNotResolvable) && !errors.Is(err, idem.ErrFenced) {
		err = fmt.Errorf("idem: resolve: %w", err)
	}
	if err != nil {
		core.Count(c.c, ctx, "reconcile_failed", "resolve", scope.Operation, 1)
	}
	core.CountEnd(c.c, ctx, "resolve", scope.Operation, err, "reconcile_resolved")
	return err
}

// checkList validates the arguments of ExpireLeases and ListUnknown.
func checkList(db *sql.DB, limit int) error {
	if db == nil {
		return errNilDB
	}
	if limit <= 0 {
		return fmt.Errorf("%w: limit %d must be positive", idem.ErrInvalidArgument, limit)
	}
	return nil
}
