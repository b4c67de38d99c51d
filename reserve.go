package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	// Named store here: the parameter that takes a Beginner is called db.
	store "github.com/pgidem/idem/internal/db"
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
	// After it, Reserve and ExpireLeases turn the record unknown.
	LeaseExpiresAt time.Time
}

// MaxReasonLength is the longest reason, in bytes, that FailRetryable,
// MarkUnknown and Resolve store.
const MaxReasonLength = 1024

// leaseExpiredReason is the last_error of a record whose lease ran out.
const leaseExpiredReason = "lease expired before the outcome was recorded"

// errLeaseRanOut is Reserve's answer when it turned a record whose lease ran
// out unknown.
var errLeaseRanOut = fmt.Errorf("%w (its reservation's lease ran out)", ErrOutcomeUnknown)

// maxReserveAttempts bounds the rounds of insert and read when the row that
// held a key keeps disappearing under Reserve (pruned, forgotten).
const maxReserveAttempts = 4

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
	return defaultClient.Reserve(ctx, db, scope, key, fp, lease)
}

// Reserve is the package-level Reserve with this client's configuration.
func (c *Client) Reserve(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint, lease time.Duration) (Reservation, error) {
	if err := c.checkTarget(scope, key); err != nil {
		return Reservation{}, err
	}
	if err := checkOwnTx(db); err != nil {
		return Reservation{}, err
	}
	if lease < time.Microsecond {
		return Reservation{}, fmt.Errorf("%w: lease %s must be at least 1µs", ErrInvalidArgument, lease)
	}
	ctx, cl := c.obs.begin(ctx, "reserve", "idem.Reserve", scope, key)
	r, err := c.reserveTx(ctx, db, scope, key, fp, lease)
	err = preparedStatementsLost(err)
	cl.end(ctx, r.Result, err)
	return r, err
}

// reserveTx is Reserve after its checks: its transaction.
func (c *Client) reserveTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint, lease time.Duration) (Reservation, error) {
	var r Reservation
	var refusal error // an outcome decided in a transaction that commits
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		r, refusal, err = c.reserve(ctx, tx, scope, key, fp, lease)
		return err
	})
	switch {
	case err != nil && pgCode(err) == pgerrcode.LockNotAvailable:
		// Another transaction holds the key (a Do in flight, a Complete
		// not yet committed) and did not finish within Config.Wait.
		return Reservation{}, c.inProgressOn(newRowKey(scope, key))
	case err != nil:
		return Reservation{}, fmt.Errorf("idem: reserve: %w", unsupportedIf(err))
	case refusal == errLeaseRanOut:
		c.obs.count(ctx, "zombie_key", "reserve", scope.Operation, 1)
		return Reservation{}, refusal
	case refusal != nil:
		return Reservation{}, refusal
	}
	return r, nil
}

// reserve is Reserve in its transaction. refusal is an outcome that is not
// an execution or a replay; err is a failure that rolls back.
func (c *Client) reserve(ctx context.Context, tx pgx.Tx, scope Scope, key string, fp Fingerprint, lease time.Duration) (
	r Reservation, refusal error, err error) {
	r = Reservation{Scope: scope, Key: key}
	insert := store.ReserveInsertParams{
		Actor: scope.Actor, Operation: scope.Operation, IdemKey: key, Fingerprint: fp[:],
		LeaseMicros: lease.Microseconds(), TtlMicros: c.cfg.TTL.Microseconds(),
	}
	lock := store.ReserveLockParams{Actor: scope.Actor, Operation: scope.Operation, IdemKey: key}
	// SET LOCAL lock_timeout bounds the insert's wait for a twin; SET LOCAL
	// enable_seqscan makes the read an index lookup whatever the planner's
	// statistics say. The transaction is Reserve's own: both settings end
	// with it. (A SET LOCAL statement, not set_config: on Citus the wait
	// happens on the worker, which only a SET LOCAL statement reaches, with
	// citus.propagate_set_commands = 'local'.)
	for range maxReserveAttempts {
		// One round trip: insert a fresh reservation, or else lock and
		// read the committed row that holds the key. Under READ COMMITTED
		// the read sees the row the insert ran into, also one committed
		// while the insert waited for it.
		b := &pgx.Batch{}
		b.Queue(c.sqlSetWait)
		_, _ = queries.ReserveInsert(ctx, queuer{b}, insert)
		b.Queue(sqlIndexLookup)
		_, _ = queries.ReserveLock(ctx, queuer{b}, lock)
		br := tx.SendBatch(ctx, b)
		read := batchRead{br}
		_, err = br.Exec()
		var ins store.ReserveInsertRow
		inserted := false
		if err == nil {
			ins, err = queries.ReserveInsert(ctx, read, insert)
			inserted = err == nil
			if errors.Is(err, pgx.ErrNoRows) {
				err = nil
			}
		}
		if err == nil {
			_, err = br.Exec()
		}
		var row store.ReserveLockRow
		found := false
		if err == nil {
			row, err = queries.ReserveLock(ctx, read, lock)
			found = err == nil
			if errors.Is(err, pgx.ErrNoRows) {
				err = nil
			}
		}
		if err = closeBatch(br, err); err != nil {
			return r, nil, err
		}
		if inserted {
			r.Token, r.LeaseExpiresAt = ins.Token, ins.LeaseExpiresAt.Time
			return r, nil, nil
		}
		if !found {
			continue // gone since the insert (pruned): insert again
		}

		// The one state machine of a key (judge, claim.go) decides, as for
		// Do; Reserve adds what only it does.
		k := row.IdemKey
		if len(k.Fingerprint) != len(fp) {
			return r, nil, fmt.Errorf("stored fingerprint has %d bytes", len(k.Fingerprint))
		}
		res, nx, refusal := c.judge(keyRow{
			Fingerprint: k.Fingerprint, Status: k.Status, ResponseStatus: k.ResponseStatus,
			ResponseHeaders: k.ResponseHeaders, ResponseBody: k.ResponseBody,
			Expired: row.Expired, Leased: row.Leased, LeaseLeftMs: row.LeaseLeftMs,
		}, true, fp, newRowKey(scope, key))
		switch {
		case nx == nextTakeOver:
			// Past its TTL (a new request), or certainly not executed (a
			// new attempt): acquired below.
		case errors.Is(refusal, ErrOutcomeUnknown) && Status(k.Status) == StatusProcessing:
			// The lease ran out: the owner may have executed and vanished.
			// Never run again blindly: the record turns unknown.
			n, err := queries.ReserveMarkUnknown(ctx, planned{tx}, store.ReserveMarkUnknownParams{
				Reason: leaseExpiredReason, Actor: scope.Actor, Operation: scope.Operation, IdemKey: key, Token: k.Token,
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
		acq, err := queries.ReserveAcquire(ctx, planned{tx}, store.ReserveAcquireParams{
			Fingerprint: fp[:], TtlMicros: insert.TtlMicros, LeaseMicros: insert.LeaseMicros,
			Actor: scope.Actor, Operation: scope.Operation, IdemKey: key, Token: k.Token,
		})
		if err != nil {
			return r, nil, err
		}
		r.Token, r.LeaseExpiresAt = acq.Token, acq.LeaseExpiresAt.Time
		return r, nil, nil
	}
	return r, c.inProgressOn(newRowKey(scope, key)), nil
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
	if err := c.checkReservation(r); err != nil {
		return err
	}
	if isNil(tx) {
		return fmt.Errorf("%w: nil transaction", ErrInvalidArgument)
	}
	headers, err := c.encodeResponse(resp)
	if err != nil {
		return err
	}
	body := resp.Body
	if body == nil {
		body = []byte{}
	}
	n, err := queries.ReserveComplete(ctx, planned{tx}, store.ReserveCompleteParams{
		ResponseStatus: int32(resp.Status), ResponseHeaders: headers, ResponseBody: body, TtlMicros: c.ttlMicros,
		Actor: r.Scope.Actor, Operation: r.Scope.Operation, IdemKey: r.Key, Token: r.Token,
	})
	switch {
	case err != nil:
		err = txUnusable(fmt.Errorf("idem: complete: %w", unsupportedIf(err)))
	case n != 1:
		err = ErrFenced
	}
	c.countEnd(ctx, "complete", r.Scope, err, "")
	return err
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
	return defaultClient.FailRetryable(ctx, db, r, reason)
}

// FailRetryable is the package-level FailRetryable with this client's
// configuration.
func (c *Client) FailRetryable(ctx context.Context, db Beginner, r Reservation, reason string) error {
	if err := c.checkOwnerCall(db, r, reason); err != nil {
		return err
	}
	return c.fence(ctx, db, "fail_retryable", r.Scope, "failed_retry", func(ctx context.Context, tx pgx.Tx) (int64, error) {
		return queries.ReserveFailRetryable(ctx, planned{tx}, store.ReserveFailRetryableParams{
			Reason: reason, TtlMicros: c.ttlMicros, Actor: r.Scope.Actor, Operation: r.Scope.Operation, IdemKey: r.Key, Token: r.Token,
		})
	})
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
	return defaultClient.MarkUnknown(ctx, db, r, reason)
}

// MarkUnknown is the package-level MarkUnknown with this client's
// configuration.
func (c *Client) MarkUnknown(ctx context.Context, db Beginner, r Reservation, reason string) error {
	if err := c.checkOwnerCall(db, r, reason); err != nil {
		return err
	}
	return c.fence(ctx, db, "mark_unknown", r.Scope, outcomeUnknown, func(ctx context.Context, tx pgx.Tx) (int64, error) {
		return queries.ReserveMarkUnknown(ctx, planned{tx}, store.ReserveMarkUnknownParams{
			Reason: reason, Actor: r.Scope.Actor, Operation: r.Scope.Operation, IdemKey: r.Key, Token: r.Token,
		})
	})
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
	return defaultClient.Heartbeat(ctx, db, r, extend)
}

// Heartbeat is the package-level Heartbeat with this client's configuration.
func (c *Client) Heartbeat(ctx context.Context, db Beginner, r Reservation, extend time.Duration) (Reservation, error) {
	if err := c.checkOwnerCall(db, r, ""); err != nil {
		return Reservation{}, err
	}
	if extend < time.Microsecond {
		return Reservation{}, fmt.Errorf("%w: extend %s must be at least 1µs", ErrInvalidArgument, extend)
	}
	var lease pgtype.Timestamptz
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		lease, err = queries.ReserveHeartbeat(ctx, planned{tx}, store.ReserveHeartbeatParams{
			ExtendMicros: extend.Microseconds(),
			Actor:        r.Scope.Actor, Operation: r.Scope.Operation, IdemKey: r.Key, Token: r.Token,
		})
		return err
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		err = ErrFenced
	case err != nil:
		err = fmt.Errorf("idem: heartbeat: %w", unsupportedIf(err))
	}
	c.countEnd(ctx, "heartbeat", r.Scope, err, "")
	if err != nil {
		return Reservation{}, err
	}
	r.LeaseExpiresAt = lease.Time
	return r, nil
}

// fence runs update, a statement of the owner of a reservation, in a
// transaction begun on db, and returns ErrFenced when it changed no row.
// event is counted when it did.
func (c *Client) fence(ctx context.Context, db Beginner, call string, scope Scope, event string,
	update func(ctx context.Context, tx pgx.Tx) (int64, error)) error {
	var n int64
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		n, err = update(ctx, tx)
		return err
	})
	switch {
	case err != nil:
		err = fmt.Errorf("idem: %s: %w", call, unsupportedIf(err))
	case n != 1:
		err = ErrFenced
	}
	c.countEnd(ctx, call, scope, err, event)
	return err
}

// countEnd counts the end of a reservation or reconciliation call that is
// not Reserve (which ends like Do, see observe.go): event when it
// succeeded (none when event is ""), a fenced reservation, or a store
// failure.
func (c *Client) countEnd(ctx context.Context, call string, scope Scope, err error, event string) {
	switch {
	case err == nil && event != "":
		c.obs.count(ctx, event, call, scope.Operation, 1)
	case errors.Is(err, ErrFenced):
		c.obs.count(ctx, outcomeFenced, call, scope.Operation, 1)
	case Unavailable(err):
		c.obs.count(ctx, outcomeStoreError, call, scope.Operation, 1)
	}
}

// checkOwnTx refuses database handles that Reserve cannot commit on.
func checkOwnTx(db Beginner) error {
	if isNil(db) {
		return fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	if _, ok := db.(pgx.Tx); ok {
		return fmt.Errorf("%w: Reserve commits a transaction of its own before the work starts; "+
			"pass a pool or a connection, not a pgx.Tx", ErrInvalidArgument)
	}
	return nil
}

// checkReservation validates a Reservation given back to the library.
func (c *Client) checkReservation(r Reservation) error {
	if r.Token <= 0 {
		return fmt.Errorf("%w: the Reservation holds no token (a zero value, or a replay)", ErrInvalidArgument)
	}
	return c.checkTarget(r.Scope, r.Key)
}

// checkOwnerCall validates the arguments of FailRetryable, MarkUnknown and
// Heartbeat.
func (c *Client) checkOwnerCall(db Beginner, r Reservation, reason string) error {
	if err := c.checkReservation(r); err != nil {
		return err
	}
	if isNil(db) {
		return fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	return checkReason(reason)
}

// checkReason validates a reason to store.
func checkReason(reason string) error {
	if len(reason) > MaxReasonLength {
		return fmt.Errorf("%w: reason is %d bytes, limit %d", ErrInvalidArgument, len(reason), MaxReasonLength)
	}
	if err := checkHeaderText(reason); err != nil {
		return fmt.Errorf("%w: reason %v", ErrInvalidArgument, err)
	}
	return nil
}
