package core

import (
	"context"
	"errors"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// The reservation mode: work that cannot join the database transaction
// gets a lease and a fencing token (see idem.Reserve for the state
// machine). One table and one state machine serve Do and the
// reservations: judge (call.go) decides what a row means for both. Each
// call is observed like Do (observe.go).

// leaseExpiredReason is the last_error of a record whose lease ran out.
const leaseExpiredReason = "lease expired before the outcome was recorded"

// errLeaseRanOut is Reserve's answer when it turned a record whose lease ran
// out unknown.
var errLeaseRanOut = errorf("idem: %w (its reservation's lease ran out)", ErrOutcomeUnknown)

// maxReserveAttempts bounds the rounds of insert and read when the row that
// held a key keeps disappearing under Reserve (pruned, forgotten).
const maxReserveAttempts = 4

// Reserve reserves (scope, key) for outside work in a short transaction of
// its own begun on db, committed before it returns (see idem.Reserve).
func (c *Client[TTx, TDB]) Reserve(ctx context.Context, db TDB, scope Scope, key string, fp Fingerprint, lease time.Duration) (Reservation, error) {
	return c.reserveWith(ctx, db, scope, key, fp, ReserveOptions{Lease: lease}, false)
}

// ReserveWith is Reserve with options: a default lease, and a window in
// which an attempt in doubt resumes (see idem.ReserveWith).
func (c *Client[TTx, TDB]) ReserveWith(ctx context.Context, db TDB, scope Scope, key string, fp Fingerprint, opts ReserveOptions) (Reservation, error) {
	return c.reserveWith(ctx, db, scope, key, fp, opts, true)
}

// reserveWith checks the arguments of Reserve (defaults false: a lease is
// given) and ReserveWith, and reserves.
func (c *Client[TTx, TDB]) reserveWith(ctx context.Context, db TDB, scope Scope, key string, fp Fingerprint,
	opts ReserveOptions, defaults bool) (Reservation, error) {
	if err := c.checkTarget(scope, key); err != nil {
		return Reservation{}, err
	}
	if err := c.checkDB(db, true); err != nil {
		return Reservation{}, err
	}
	if !defaults && opts.Lease < time.Microsecond {
		return Reservation{}, errorf("idem: %w: lease %s must be at least 1µs", ErrInvalidArgument, opts.Lease)
	}
	if err := checkReserveOptions(&opts); err != nil {
		return Reservation{}, err
	}
	ctx, cl := c.begin(ctx, "reserve", c.spanReserve, scope, key)
	r, err := c.reserveTx(ctx, db, driver.Reserve{Key: newKey(scope, key), Fingerprint: fp, Lease: opts.Lease, ResumeWithin: opts.ResumeWithin})
	err = c.preparedStatementsLost(err)
	cl.end(ctx, r.Result, err)
	return r, err
}

// checkReserveOptions refuses options out of range and fills in the
// default lease.
func checkReserveOptions(opts *ReserveOptions) error {
	switch {
	case opts.Lease < 0:
		return errorf("idem: %w: ReserveOptions.Lease %s must not be negative", ErrInvalidArgument, opts.Lease)
	case opts.Lease == 0:
		opts.Lease = DefaultLease
	case opts.Lease < time.Microsecond:
		return errorf("idem: %w: ReserveOptions.Lease %s must be at least 1µs", ErrInvalidArgument, opts.Lease)
	}
	switch {
	case opts.ResumeWithin < 0:
		return errorf("idem: %w: ReserveOptions.ResumeWithin %s must not be negative", ErrInvalidArgument, opts.ResumeWithin)
	case opts.ResumeWithin > 0 && opts.ResumeWithin < opts.Lease:
		return errorf("idem: %w: ReserveOptions.ResumeWithin %s is shorter than the lease %s: the lease of an attempt would always run out past its window",
			ErrInvalidArgument, opts.ResumeWithin, opts.Lease)
	}
	return nil
}

// reserveTx is Reserve after its checks: its transaction.
func (c *Client[TTx, TDB]) reserveTx(ctx context.Context, db TDB, req driver.Reserve) (Reservation, error) {
	var r Reservation
	var refusal error // an outcome decided in a transaction that commits
	err := c.InTx(ctx, db, func(ctx context.Context, tx TTx) error {
		var err error
		r, refusal, err = c.reserve(ctx, c.drv.Executor(tx), req)
		return err
	})
	switch {
	case err != nil && c.lockNotAvailable(err):
		// Another transaction holds the key (a Do in flight, a Complete
		// not yet committed, another Reserve resuming it) and did not
		// finish within Config.Wait.
		return Reservation{}, c.inProgressOn(req.Key)
	case err != nil:
		return Reservation{}, errorf("idem: reserve: %w", c.unsupportedIf(err))
	case refusal == errLeaseRanOut:
		c.obs.count(ctx, "zombie_key", "reserve", req.Key.Operation, 1)
		return Reservation{}, refusal
	case errors.Is(refusal, ErrResponseGone):
		return r, refusal // r.Result: the stored status, replayed
	case refusal != nil:
		return Reservation{}, refusal
	case r.Resumed:
		c.obs.count(ctx, "resumed", "reserve", req.Key.Operation, 1)
	}
	return r, nil
}

// reserve is Reserve in its transaction. refusal is an outcome that is not
// an execution or a replay; err is a failure that rolls back.
func (c *Client[TTx, TDB]) reserve(ctx context.Context, ex driver.Executor, req driver.Reserve) (
	r Reservation, refusal error, err error) {
	r = Reservation{Scope: Scope{Actor: req.Key.Actor, Operation: req.Key.Operation}, Key: req.Key.Key}
	for range maxReserveAttempts {
		// Insert a fresh reservation, or else lock and read the committed
		// row that holds the key. Under READ COMMITTED the read sees the
		// row the insert ran into, also one committed while the insert
		// waited for it.
		got, err := ex.ReserveInsertOrLock(ctx, req)
		if err != nil {
			return r, nil, err
		}
		if got.Inserted {
			r.Token, r.LeaseExpiresAt = got.Token, got.LeaseExpiresAt
			return r, nil, nil
		}
		if !got.Found {
			continue // gone since the insert (pruned): insert again
		}

		// The one state machine of a key decides, as for Do; Reserve adds
		// what only it does.
		res, nx, refusal := c.judge(got.Row, true, Fingerprint(req.Fingerprint), req.Key, true)
		status := Status(got.Row.Status)
		attempt := driver.NewAttempt
		switch {
		case refusal == errOrphaned:
			// A claim of Do committed without an outcome: in doubt, for a
			// person to reconcile, as fnEnded leaves it.
			n, err := ex.KeyMarkUnknown(ctx, req.Key, req.Fingerprint, orphanReason)
			if err == nil && n != 1 {
				err = errorf("idem: locked row not updated (%d rows)", n)
			}
			if err != nil {
				return r, nil, err
			}
			return r, refusal, nil
		case nx == nextTakeOver && status.finished() && got.Row.Expired:
			// Past its TTL: a new request, with a window of its own.
			attempt = driver.NewRequest
		case nx == nextTakeOver:
			// Certainly not executed: a new attempt, in the same window.
		case errors.Is(refusal, ErrOutcomeUnknown) && got.Row.InWindow:
			// In doubt (the lease ran out, or the worker marked it
			// unknown) while the receiver still deduplicates the calls'
			// keys: resumed, to make the same calls again.
			attempt, r.Resumed = driver.Resume, true
		case errors.Is(refusal, ErrOutcomeUnknown) && status == StatusProcessing:
			// The lease ran out: the owner may have executed and vanished.
			// Never run again blindly: the record turns unknown.
			n, err := ex.ReserveMarkUnknown(ctx, req.Key, got.Row.Token, leaseExpiredReason)
			if err == nil && n != 1 {
				err = errorf("idem: locked row not updated (%d rows)", n)
			}
			if err != nil {
				return r, nil, err
			}
			return r, errLeaseRanOut, nil
		case errors.Is(refusal, ErrResponseGone):
			r.Result = res // the stored status, its body dropped
			return r, refusal, nil
		case refusal != nil:
			return r, refusal, nil
		default:
			r.Result = res // a replay
			return r, nil, nil
		}
		r.Token, r.LeaseExpiresAt, err = ex.ReserveAcquire(ctx, req, got.Row.Token, attempt)
		return r, nil, err
	}
	return r, c.inProgressOn(req.Key), nil
}

// Complete records the outcome of the reservation's work as 'succeeded'
// with resp, in the caller's transaction tx (see idem.Complete).
func (c *Client[TTx, TDB]) Complete(ctx context.Context, tx TTx, r Reservation, resp Response) error {
	if err := c.checkReservation(r); err != nil {
		return err
	}
	if c.drv.NilTx(tx) {
		return errNilTx
	}
	reply, err := c.reply(resp)
	if err != nil {
		return err
	}
	n, err := c.drv.Executor(tx).ReserveComplete(ctx, newKey(r.Scope, r.Key), r.Token, reply)
	switch {
	case err != nil && c.fault(err, driver.ErrPreparedStatementsLost):
		err = c.txUnusable(errorf("idem: complete: %w", c.preparedStatementsLost(err)))
	case err != nil:
		err = c.txUnusable(errorf("idem: complete: %w", c.unsupportedIf(err)))
	case n != 1:
		err = ErrFenced
	}
	c.countEnd(ctx, "complete", r.Scope, r.Key, err, "")
	return err
}

// FailRetryable records that the reservation's work certainly did not
// happen, in a transaction of its own begun on db (see idem.FailRetryable).
func (c *Client[TTx, TDB]) FailRetryable(ctx context.Context, db TDB, r Reservation, reason string) error {
	if err := c.checkOwnerCall(db, r, reason); err != nil {
		return err
	}
	return c.fence(ctx, db, "fail_retryable", r.Scope, r.Key, "failed_retry", func(ctx context.Context, ex driver.Executor) (int64, error) {
		return ex.ReserveFailRetryable(ctx, newKey(r.Scope, r.Key), r.Token, reason)
	})
}

// MarkUnknown records that the reservation's work may have happened, in a
// transaction of its own begun on db (see idem.MarkUnknown).
func (c *Client[TTx, TDB]) MarkUnknown(ctx context.Context, db TDB, r Reservation, reason string) error {
	if err := c.checkOwnerCall(db, r, reason); err != nil {
		return err
	}
	return c.fence(ctx, db, "mark_unknown", r.Scope, r.Key, outcomeUnknown, func(ctx context.Context, ex driver.Executor) (int64, error) {
		return ex.ReserveMarkUnknown(ctx, newKey(r.Scope, r.Key), r.Token, reason)
	})
}

// Heartbeat extends the reservation's live lease to at least extend from
// now (see idem.Heartbeat).
func (c *Client[TTx, TDB]) Heartbeat(ctx context.Context, db TDB, r Reservation, extend time.Duration) (Reservation, error) {
	if err := c.checkOwnerCall(db, r, ""); err != nil {
		return Reservation{}, err
	}
	if extend < time.Microsecond {
		return Reservation{}, errorf("idem: %w: extend %s must be at least 1µs", ErrInvalidArgument, extend)
	}
	var lease time.Time
	err := c.lookupTx(ctx, db, func(ctx context.Context, ex driver.Executor) error {
		var err error
		lease, err = ex.ReserveHeartbeat(ctx, newKey(r.Scope, r.Key), r.Token, extend, r.Resumed)
		return err
	})
	switch {
	case errors.Is(err, driver.ErrNoRows):
		err = ErrFenced
	case err != nil:
		err = errorf("idem: heartbeat: %w", c.unsupportedIf(err))
	}
	c.countEnd(ctx, "heartbeat", r.Scope, r.Key, err, "")
	if err != nil {
		return Reservation{}, err
	}
	r.LeaseExpiresAt = lease
	return r, nil
}

// fence runs update, a statement of the owner of a reservation, in a
// transaction begun on db, and returns ErrFenced when it changed no row.
// event is counted when it did.
func (c *Client[TTx, TDB]) fence(ctx context.Context, db TDB, call string, scope Scope, key, event string,
	update func(ctx context.Context, ex driver.Executor) (int64, error)) error {
	var n int64
	err := c.lookupTx(ctx, db, func(ctx context.Context, ex driver.Executor) error {
		var err error
		n, err = update(ctx, ex)
		return err
	})
	switch {
	case err != nil:
		err = errorf("idem: %s: %w", call, c.unsupportedIf(err))
	case n != 1:
		err = ErrFenced
	}
	c.countEnd(ctx, call, scope, key, err, event)
	return err
}

// countEnd counts the end of a reservation, reconciliation or maintenance
// call that is not Reserve (which ends like Do, see observe.go): event when
// it succeeded (none when event is ""), a fenced reservation, or a store
// failure, which is logged too. key is the call's key ("" for the
// maintenance calls, which have none). A call cut by its own context (a
// pruner given a minute, say: the error is the context's) is the caller's
// doing, not the store's: neither counted nor logged.
func (c *Client[TTx, TDB]) countEnd(ctx context.Context, call string, scope Scope, key string, err error, event string) {
	switch {
	case err == nil && event != "":
		c.obs.count(ctx, event, call, scope.Operation, 1)
	case errors.Is(err, ErrFenced):
		c.obs.count(ctx, outcomeFenced, call, scope.Operation, 1)
	case ctx.Err() != nil && (errors.Is(err, ctx.Err()) || c.fault(err, driver.ErrCanceled)):
	case c.obs.unavailable(err):
		c.obs.count(ctx, outcomeStoreError, call, scope.Operation, 1)
		c.obs.logStoreError(ctx, call, scope, key, err)
	}
}

// checkOwnerCall validates the arguments of FailRetryable, MarkUnknown and
// Heartbeat.
func (c *Client[TTx, TDB]) checkOwnerCall(db TDB, r Reservation, reason string) error {
	if err := c.checkReservation(r); err != nil {
		return err
	}
	if err := c.checkDB(db, false); err != nil {
		return err
	}
	return checkReason(reason)
}

// lookupTx runs fn, an operator or reservation call's statements, in a
// transaction of its own begun on db (a savepoint on a caller's
// transaction), whose statements find rows through an index whatever the
// planner's statistics say (Executor.UseIndexes).
func (c *Client[TTx, TDB]) lookupTx(ctx context.Context, db TDB, fn func(ctx context.Context, ex driver.Executor) error) error {
	return c.InTx(ctx, db, func(ctx context.Context, tx TTx) error {
		ex := c.drv.Executor(tx)
		if err := ex.UseIndexes(ctx); err != nil {
			return err
		}
		return fn(ctx, ex)
	})
}
