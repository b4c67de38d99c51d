package core

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem/internal/driver"
)

// The protocol of one key, written once for every driver: Do and DoInTx,
// the call loop that claims a key, runs fn and stores its outcome, and
// runs again after a serialization failure or a deadlock (retry). What
// happens on the wire is the driver's: a Span for Do's savepoint in the
// caller's transaction or DoInTx's own transactions. judge decides what the
// row that holds a key means, for the reservations too (reserve.go); what
// a call answers when fn ended its transaction itself is fnended.go's.

// maxClaimAttempts bounds the rounds of claim, read and take-over when the
// row that holds the key keeps changing under a call (taken over or pruned
// by others, or given up by a twin after Reject).
const maxClaimAttempts = 4

// maxRetryAfter caps the retry hint of a key held by a long lease.
const maxRetryAfter = time.Minute

// Do runs fn at most once per key in a savepoint of the caller's
// transaction tx (see idem.Do).
func (c *Client[TTx, TDB]) Do(ctx context.Context, tx TTx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error)) (Result, error) {
	if err := c.checkTarget(scope, key); err != nil {
		return Result{}, err
	}
	if fn == nil {
		return Result{}, errNilFn
	}
	if c.drv.NilTx(tx) {
		return Result{}, errNilTx
	}
	ctx, cl := c.begin(ctx, "do", c.spanDo, scope, key)
	defer func() {
		if !cl.ended {
			cl.endIfPanicking(ctx)
		}
	}()
	res, err := c.do(ctx, tx, scope, key, fp, fn, &cl)
	if err != nil {
		err = c.preparedStatementsLost(err)
	}
	cl.end(ctx, res, err)
	return res, err
}

// do is Do after its checks, observed by cl.
func (c *Client[TTx, TDB]) do(ctx context.Context, tx TTx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error), cl *call) (Result, error) {
	return c.call(ctx, c.drv.SavepointSpan(tx), false, newKey(scope, key), fp, fn, cl)
}

// DoInTx runs Do in transactions of its own begun on db, and commits the
// one whose outcome it stores (see idem.DoInTx). Concurrent calls with the
// same key on one pool are coalesced (flight.go).
func (c *Client[TTx, TDB]) DoInTx(ctx context.Context, db TDB, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error)) (Result, error) {
	if err := c.checkTarget(scope, key); err != nil {
		return Result{}, err
	}
	if fn == nil {
		return Result{}, errNilFn
	}
	s, flight, err := c.drv.OwnSpan(db) // sends nothing
	if err != nil {
		return Result{}, errorf("idem: %w: %w", ErrInvalidArgument, err) // as checkDB
	}
	ctx, cl := c.begin(ctx, "do_in_tx", c.spanDoInTx, scope, key)
	defer func() {
		if !cl.ended {
			cl.endIfPanicking(ctx)
		}
	}()
	res, err := c.coalesced(ctx, db, s, flight, newKey(scope, key), fp, fn, &cl)
	if err != nil {
		err = c.preparedStatementsLost(err)
	}
	cl.end(ctx, res, err)
	return res, err
}

// call is one call in progress, as it is observed: begin starts it, its
// end method (observe.go) records it.
type call struct {
	o        *observer
	name     string // do, do_in_tx, reserve, ...
	scope    Scope
	key      string
	start    time.Time
	fnTime   time.Duration // time spent in fn
	rejected bool          // the stored outcome is a refusal made by this call
	panicErr error         // what the call would have returned, had fn returned its panic as an error
	ended    bool
	span     trace.Span // nil without a TracerProvider
}

// begin starts observing a call: its clock and, with a TracerProvider, its
// span (named idem.<Name>, for example idem.DoInTx).
func (c *Client[TTx, TDB]) begin(ctx context.Context, name, spanName string, scope Scope, key string) (context.Context, call) {
	cl := call{o: c.obs, name: name, scope: scope, key: key, start: time.Now()}
	if c.obs.tracer != nil {
		ctx, cl.span = c.obs.tracer.Start(ctx, spanName, trace.WithSpanKind(trace.SpanKindInternal),
			trace.WithAttributes(attribute.String("idem.operation", scope.Operation)))
	}
	return ctx, cl
}

// checkDB refuses a database handle the driver cannot use.
func (c *Client[TTx, TDB]) checkDB(db TDB, commits bool) error {
	if err := c.drv.CheckDB(db, commits); err != nil {
		return errorf("idem: %w: %w", ErrInvalidArgument, err)
	}
	return nil
}

// coalesced runs DoInTx for k once per concurrent group of callers on one
// handle, the flight the driver named with the span s (nil: none): see
// flights.
func (c *Client[TTx, TDB]) coalesced(ctx context.Context, db TDB, s driver.Span[TTx], flight any, k driver.Key, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error), cl *call) (Result, error) {
	if flight == nil {
		// A connection serves one call at a time, and other handles have
		// no identity to share a flight by.
		return c.doInTx(ctx, db, s, k, fp, fn, cl)
	}
	fk := flightKey{handle: flight, k: k}
	fl, leader := c.flights.join(fk, fp)
	if leader {
		finished := false
		defer func() {
			if !finished { // fn panicked: the panic goes on from here
				c.flights.finish(fk, fl, Result{}, errLeaderPanicked)
			}
		}()
		res, err := c.doInTx(ctx, db, s, k, fp, fn, cl)
		finished = true
		c.flights.finish(fk, fl, res, err)
		return res, err
	}

	if err := c.await(ctx, fl); err != nil {
		return Result{}, err
	}
	switch {
	case heldElsewhere(fl.err, k):
		// The leader's claim of this very key waited in vain: waiting again
		// in the database would double the bound.
		return Result{}, c.inProgress()
	case fl.err != nil:
		// Nothing was stored: let the database decide for this call.
		return c.doInTx(ctx, db, s, k, fp, fn, cl)
	case fl.fp != fp:
		return Result{}, ErrKeyReused
	}
	// Each waiter gets its own copy: callers may change what they get.
	return Result{Response: cloneResult(fl.res).Response, Replayed: true}, nil
}

// await waits for fl to finish, at most Config.Wait.
func (c *Client[TTx, TDB]) await(ctx context.Context, fl *flight) error {
	if c.cfg.Wait < 0 { // do not wait
		select {
		case <-fl.done:
			return nil
		default:
			return c.inProgress()
		}
	}
	t := time.NewTimer(c.cfg.Wait)
	defer t.Stop()
	select {
	case <-fl.done:
		return nil
	case <-ctx.Done():
		return errorf("idem: waiting for a concurrent call with this key: %w", ctxError(ctx))
	case <-t.C:
		return c.inProgress()
	}
}

// doInTx is DoInTx after its checks, without coalescing: the call loop in
// transactions of its own (s), run again after a serialization failure or
// a deadlock; or, on a handle that cannot give one (a caller's
// transaction: s nil), Do in a transaction of InTx.
func (c *Client[TTx, TDB]) doInTx(ctx context.Context, db TDB, s driver.Span[TTx], k driver.Key, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error), cl *call) (res Result, err error) {
	if s == nil {
		err = c.InTx(ctx, db, func(ctx context.Context, tx TTx) (err error) {
			res, err = c.call(ctx, c.drv.SavepointSpan(tx), false, k, fp, fn, cl)
			return err
		})
		if err != nil {
			return Result{}, err
		}
		return res, nil
	}
	// A call that stored its outcome or read the stored one ended with a
	// COMMIT, which gave back the connection the span took (Span.Complete,
	// Span.Read); after a failure, or fn's panic, Close gives it back.
	ended := false
	defer func() {
		if !ended {
			s.Close()
		}
	}()
	err = c.retry(ctx, false, func() (err error) { res, err = c.call(ctx, s, true, k, fp, fn, cl); return err })
	ended = err == nil
	return res, err
}

// call is the one loop of Do and DoInTx: claim the key, run fn, store the
// outcome. s is where that happens (Do's savepoint in the caller's
// transaction, or, own, a transaction of DoInTx's own) and how it begins
// and ends; everything else is the same for both.
//
//  1. One round trip: the savepoint (or BEGIN) and the claim, waiting at
//     most Config.Wait for a twin.
//  2. fn runs in the savepoint (or transaction).
//  3. One round trip: the outcome is stored and the savepoint released (or
//     the transaction committed). When fn changed the key's row, the
//     completion fails and the end does not run (ErrKeyRowChanged).
//
// When a committed row already holds the key, step 1 claims nothing and a
// second round trip reads the row and ends the savepoint (or transaction),
// which also undoes the read's planner setting and the claim's lock_timeout;
// then the call replays, fails, or claims again (judge). When fn fails, its
// writes and the claim are undone; a refusal (Reject) is then stored by a
// claim of its own that runs nothing.
func (c *Client[TTx, TDB]) call(ctx context.Context, s driver.Span[TTx], own bool, k driver.Key, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error), cl *call) (Result, error) {
	var decided outcome // a refusal, stored once the key is claimed again (none: status "")
	claim := driver.Claim{Key: k, Fingerprint: fp}
	for range maxClaimAttempts {
		// Round trip 1: begin, and claim.
		tx, claimed, begun, err := s.Claim(ctx, claim)
		switch {
		case err != nil && !begun && !own:
			// Do's savepoint did not begin: the failure happened in the
			// caller's transaction itself, which a refusal would promise
			// is untouched. Never one here.
			return Result{}, c.txUnusable(errorf("idem: %w", c.unsupportedIf(err)))
		case err != nil && !begun:
			// DoInTx's transaction did not begin: nothing to undo.
			return Result{}, unavailableIf(s.Lost() || c.isUnavailable(err), c.claimError(c.ctxEnded(ctx, err), k))
		case err != nil:
			return Result{}, c.fail(ctx, s, own, c.claimError(err, k))
		}

		if claimed {
			out := decided
			if out.status == "" {
				out, err = c.runFn(ctx, s, tx, own, k, fp, fn, cl)
				if err != nil {
					return Result{}, c.failFn(ctx, s, own, k, fp, err, cl)
				}
				if out.status == StatusRejected {
					// Undo fn's writes (and the claim), then store the
					// refusal in a claim of its own.
					switch err := s.Undo(ctx); {
					case c.drv.TxClosed(err):
						return Result{}, c.fnEnded(ctx, s, own, k, fp, nil, nil, cl)
					case err != nil && !own:
						return Result{}, errorf("idem: %w", err)
					}
					decided = out
					continue
				}
			}
			cl.rejected = out.status == StatusRejected
			// Round trip 2: store the outcome, and end.
			err := s.Complete(ctx, driver.Outcome{Key: k, Fingerprint: fp, Status: string(out.status), Reply: out.reply})
			if err == nil {
				return out.result(), nil
			}
			switch {
			case c.keyRowChanged(err):
				err = ErrKeyRowChanged
			case c.fault(err, driver.ErrTxAborted):
				// fn swallowed a failed statement and returned a response:
				// its transaction cannot store it.
				return Result{}, c.fail(ctx, s, own, errorf("idem: %w: %w", ErrTxAborted, err))
			case c.drv.TxClosed(err):
				// fn ended the transaction (pgx sent nothing on it;
				// database/sql ran the completion, then found it ended
				// at COMMIT or RELEASE), or database/sql rolled it back
				// when ctx ended: fnEnded tells them apart.
				return Result{}, c.fnEnded(ctx, s, own, k, fp, nil, err, cl)
			}
			if ctx.Err() == nil {
				return Result{}, c.fail(ctx, s, own, errorf("idem: %w", c.unsupportedIf(err)))
			}
			// Once ctx has ended, database/sql refuses every statement
			// with ctx's error, whatever fn did before, and rolls the
			// transaction back (also while its COMMIT is under way):
			// should fn have ended the transaction, or database/sql, the
			// undo finds it ended, and fnEnded tells how.
			undoErr := s.Undo(ctx)
			if c.drv.TxClosed(undoErr) {
				return Result{}, c.fnEnded(ctx, s, own, k, fp, nil, err, cl)
			}
			return Result{}, c.undone(s, own, undoErr, errorf("idem: %w", c.unsupportedIf(c.ctxEnded(ctx, err))))
		}

		// Round trip 2: read the row that holds the key, and end.
		row, found, err := s.Read(ctx, k)
		if err != nil {
			return Result{}, c.fail(ctx, s, own, errorf("idem: %w", err))
		}
		res, then, err := c.judge(row, found, fp, k, own)
		if err == errOrphaned {
			err = c.orphaned(ctx, s, k, fp)
		}
		if then == nextDone {
			return res, err
		}
		claim.TakeOver = then == nextTakeOver
	}
	return Result{}, c.inProgressOn(k)
}

// fail undoes the span after a statement of the call failed with err, and
// returns err: for DoInTx, an ErrUnavailable when the connection was lost
// or the server cannot serve. For Do, when the undo failed too, the
// caller's transaction is not as err promises (a refusal leaves it "as it
// was", ErrKeyRowChanged "usable"): the call returns the undo's error (an
// ErrUnavailable when the connection was lost), and names err in words
// only.
func (c *Client[TTx, TDB]) fail(ctx context.Context, s driver.Span[TTx], own bool, err error) error {
	ended := ctx.Err() != nil // when the statement failed, not after the undo
	undoErr := s.Undo(ctx)
	if ended {
		err = c.ctxEnded(ctx, err)
		if !own && c.drv.CtxEndsTx() && (c.drv.TxClosed(undoErr) || c.isUnavailable(undoErr)) {
			// database/sql rolled the caller's transaction back when ctx
			// ended (it was begun with it), or the driver cut the
			// connection to cancel the statement (pgx's stdlib): nothing
			// of the call remains, and no savepoint was left to undo.
			return unavailableIf(c.isUnavailable(undoErr), errorf("idem: %w before Do's outcome was stored, and the caller's "+
				"transaction is gone (database/sql rolls it back when the context it was begun with ends; a driver may cut the "+
				"connection to cancel a statement): nothing of it or of the call remains (the call had failed: %s)",
				ctxError(ctx), quiet{err}.Error()))
		}
	}
	return c.undone(s, own, undoErr, err)
}

// ctxEnded is err, a failure of a statement once ctx has ended, naming
// ctx's error too when the driver gave its own instead (lib/pq breaks the
// connection, or cancels the statement, and says so in its words).
func (c *Client[TTx, TDB]) ctxEnded(ctx context.Context, err error) error {
	if ctx.Err() == nil || errors.Is(err, ctx.Err()) || !c.isUnavailable(err) {
		return err
	}
	return errorf("%w (the context had ended: %w)", err, ctxError(ctx))
}

// undone is fail once the span's undo has returned undoErr.
func (c *Client[TTx, TDB]) undone(s driver.Span[TTx], own bool, undoErr, err error) error {
	if !own {
		if undoErr != nil {
			return unavailableIf(c.isUnavailable(undoErr),
				errorf("idem: %w (Do's savepoint was not undone; the call had failed: %s)", undoErr, quiet{err}.Error()))
		}
		return err
	}
	return unavailableIf(s.Lost() || c.isUnavailable(err), err)
}

// failFn undoes the span after fn failed with err (or its response cannot
// be stored), and returns err: for DoInTx, an ErrUnavailable when the
// connection was lost or the server said it cannot serve; for Do, when the
// undo failed, the undo's error, naming err in words only (as fail). When
// fn had ended the transaction itself, the call's error says so (fnEnded).
func (c *Client[TTx, TDB]) failFn(ctx context.Context, s driver.Span[TTx], own bool, k driver.Key, fp Fingerprint, err error, cl *call) error {
	undoErr := s.Undo(ctx)
	if c.drv.TxClosed(undoErr) {
		return c.fnEnded(ctx, s, own, k, fp, err, nil, cl)
	}
	if !own {
		// When the undo failed, the caller's transaction is not as fn's
		// error may promise (a refusal fn passed on, such as a nested
		// call's ErrInProgress): as in fail, the undo's error is the
		// call's, and fn's is named in words only.
		if undoErr != nil {
			return unavailableIf(c.isUnavailable(undoErr),
				errorf("idem: %w (Do's savepoint was not undone; fn had failed: %s)", undoErr, quiet{err}.Error()))
		}
		return err
	}
	return unavailableIf(s.Lost() || c.serverSaidUnavailable(err), err)
}

// claimError turns the failure of a claim into the error a call returns: a
// wait for a twin that ran out is ErrInProgress.
func (c *Client[TTx, TDB]) claimError(err error, k driver.Key) error {
	if c.lockNotAvailable(err) {
		return c.inProgressOn(k)
	}
	return errorf("idem: %w", c.unsupportedIf(err))
}

// runFn runs fn in the span's transaction tx and decides the outcome to
// store. If fn panics,
// the call ends as it would have had fn returned an error: its writes and
// the claim are undone, and when fn had ended the transaction itself, a
// claim its COMMIT made durable is marked unknown (DoInTx) or an enclosing
// transaction that holds it is aborted (Do, fnEnded); then the panic goes
// on.
func (c *Client[TTx, TDB]) runFn(ctx context.Context, s driver.Span[TTx], tx TTx, own bool, k driver.Key, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error), cl *call) (outcome, error) {
	panicked := true
	start := time.Now() // fn's time, which the call's overhead leaves out
	defer func() {
		if panicked {
			cl.fnTime += time.Since(start)
			cl.panicErr = c.failFn(ctx, s, own, k, fp, errPanicked, cl)
		}
	}()
	resp, err := fn(ctx, tx)
	cl.fnTime += time.Since(start)
	panicked = false
	return c.decide(resp, err)
}

// outcome is what a claimed key ends with: fn's response, or a refusal.
type outcome struct {
	status Status // StatusSucceeded or StatusRejected
	resp   Response
	reply  driver.Reply // resp as stored
}

// decide checks fn's result and turns it into the outcome to store. A
// rejection is a valid outcome; any other error of fn is returned as is.
func (c *Client[TTx, TDB]) decide(resp Response, fnErr error) (outcome, error) {
	out := outcome{status: StatusSucceeded, resp: resp}
	if fnErr != nil {
		refusal, rejected := RejectedResponse(fnErr)
		if !rejected {
			return outcome{}, fnErr
		}
		out = outcome{status: StatusRejected, resp: refusal}
	}
	reply, err := c.reply(out.resp)
	if err != nil {
		return outcome{}, err
	}
	out.reply = reply
	return out, nil
}

// result is what a call that stored out returns.
func (out outcome) result() Result {
	res := Result{Response: out.resp}
	if res.Body == nil {
		res.Body = []byte{} // as a replay of it reads back
	}
	return res
}

// next is what a call does after reading the row that holds its key.
type next int

const (
	nextDone     next = iota // return the result or the error
	nextClaim                // the row is gone: claim the key afresh
	nextTakeOver             // the row is over: take it over
)

// judge tells what the committed row that holds a key means for a call with
// fingerprint fp: a replay, an error, or another claim. Every state of the
// key is decided here, for Do, DoInTx and Reserve alike. own: the row was
// read in a transaction of the call's own, which holds no claim of its own
// yet (DoInTx, Reserve); Do's savepoint may read its caller's own claim.
func (c *Client[TTx, TDB]) judge(row driver.Row, found bool, fp Fingerprint, k driver.Key, own bool) (Result, next, error) {
	status := Status(row.Status)
	switch {
	case !found:
		return Result{}, nextClaim, nil
	case len(row.Fingerprint) != len(fp):
		return Result{}, nextDone, errorf("idem: stored fingerprint has %d bytes", len(row.Fingerprint))
	case status.finished() && row.Expired:
		return Result{}, nextTakeOver, nil // an expired key is a new request
	case [32]byte(row.Fingerprint) != fp:
		return Result{}, nextDone, ErrKeyReused
	case status == StatusSucceeded || status == StatusRejected:
		res, err := replay(row.Stored)
		return res, nextDone, err
	case status == StatusFailedRetryable:
		return Result{}, nextTakeOver, nil // certainly not executed: it may run
	case status == StatusUnknown:
		return Result{}, nextDone, ErrOutcomeUnknown
	case status == StatusProcessing && row.Leased && row.LeaseLeftMs <= 0:
		return Result{}, nextDone, ErrOutcomeUnknown // the owner's lease ran out
	case status == StatusProcessing && row.Leased:
		left := time.Duration(row.LeaseLeftMs) * time.Millisecond
		return Result{}, nextDone, &InProgressError{RetryAfter: min(max(left.Round(time.Second), time.Second), maxRetryAfter)}
	case status == StatusProcessing && own:
		// A claim of Do or DoInTx (no lease), committed: a twin's claim in
		// flight is invisible to another transaction, and Do's never
		// commits before its outcome. fn committed its transaction
		// itself, and the call that ran it did not mark the record (it
		// stopped first, or it was Do).
		return Result{}, nextDone, errOrphaned
	default:
		return Result{}, nextDone, c.inProgressOn(k)
	}
}

func (c *Client[TTx, TDB]) inProgress() error {
	return &InProgressError{RetryAfter: c.retryAfter}
}

// inProgressOn is inProgress for the claim of k, which a twin holds.
func (c *Client[TTx, TDB]) inProgressOn(k driver.Key) error {
	e := &InProgressError{RetryAfter: c.retryAfter}
	e.held = k
	return e
}

// newKey is the driver's name of (scope, key).
func newKey(scope Scope, key string) driver.Key {
	return driver.Key{Actor: scope.Actor, Operation: scope.Operation, Key: key}
}

// retry runs once until it succeeds, fails with an error other than a
// serialization failure or a deadlock, or runs out of Config.MaxRetries. In
// a savepoint of a caller's transaction (nested) such a failure dooms the
// whole transaction, so only the caller can run it again.
func (c *Client[TTx, TDB]) retry(ctx context.Context, nested bool, once func() error) error {
	for attempt := 0; ; attempt++ {
		err := once()
		if err == nil || !c.isRetryable(err) || nested || attempt >= c.cfg.MaxRetries {
			return err
		}
		if sleepErr := sleep(ctx, backoff(attempt)); sleepErr != nil {
			return err
		}
	}
}
