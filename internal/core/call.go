package core

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem/internal/driver"
)

// The protocol of one key, written once for every driver: Do and DoInTx
// (the call loop that claims a key, runs fn and stores its outcome), InTx,
// and the reservation mode (Reserve, Complete, FailRetryable, MarkUnknown,
// Heartbeat). What happens on the wire is the driver's: a Span for Do's
// savepoint in the caller's transaction or DoInTx's own transactions, an
// Executor for the statements of a reservation. judge decides what the row
// that holds a key means, for every one of them.

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
	ctx, cl := c.obs.begin(ctx, "do", c.spanDo, scope, key)
	defer cl.endIfPanicking(ctx)
	res, err := c.do(ctx, tx, scope, key, fp, fn, &cl)
	err = c.preparedStatementsLost(err)
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
	if err := c.checkDB(db, false); err != nil {
		return Result{}, err
	}
	ctx, cl := c.obs.begin(ctx, "do_in_tx", c.spanDoInTx, scope, key)
	defer cl.endIfPanicking(ctx)
	res, err := c.coalesced(ctx, db, scope, key, fp, fn, &cl)
	err = c.preparedStatementsLost(err)
	cl.end(ctx, res, err)
	return res, err
}

// coalesced runs DoInTx for scope and key once per concurrent group of
// callers on one handle: see flights.
func (c *Client[TTx, TDB]) coalesced(ctx context.Context, db TDB, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error), cl *call) (Result, error) {
	handle, ok := c.drv.FlightKey(db)
	if !ok {
		// A connection serves one call at a time, and other handles have
		// no identity to share a flight by.
		return c.doInTx(ctx, db, newKey(scope, key), fp, fn, cl)
	}
	k := newKey(scope, key)
	fk := flightKey{handle: handle, k: k}
	fl, leader := c.flights.join(fk, fp)
	if leader {
		finished := false
		defer func() {
			if !finished { // fn panicked: the panic goes on from here
				c.flights.finish(fk, fl, Result{}, errLeaderPanicked)
			}
		}()
		res, err := c.doInTx(ctx, db, k, fp, fn, cl)
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
		return c.doInTx(ctx, db, k, fp, fn, cl)
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
		return errorf("idem: waiting for a concurrent call with this key: %w", context.Cause(ctx))
	case <-t.C:
		return c.inProgress()
	}
}

// doInTx is DoInTx after its checks, without coalescing: the call loop in
// transactions of its own, run again after a serialization failure or a
// deadlock; or, on a handle that cannot give one (a caller's transaction),
// Do in a transaction of InTx.
func (c *Client[TTx, TDB]) doInTx(ctx context.Context, db TDB, k driver.Key, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error), cl *call) (res Result, err error) {
	s, own, err := c.drv.OwnSpan(ctx, db)
	if err != nil {
		return Result{}, unavailableIf(c.isUnavailable(err), errorf("idem: begin: %w", err))
	}
	if !own {
		err = c.InTx(ctx, db, func(ctx context.Context, tx TTx) (err error) {
			res, err = c.call(ctx, c.drv.SavepointSpan(tx), false, k, fp, fn, cl)
			return err
		})
		if err != nil {
			return Result{}, err
		}
		return res, nil
	}
	defer s.Close()
	err = c.retry(ctx, false, func() (err error) { res, err = c.call(ctx, s, true, k, fp, fn, cl); return err })
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
		claimed, begun, err := s.Claim(ctx, claim)
		switch {
		case err != nil && !begun && !own:
			// Do's savepoint did not begin: the failure happened in the
			// caller's transaction itself, which a refusal would promise
			// is untouched. Never one here.
			return Result{}, c.txUnusable(errorf("idem: %w", c.unsupportedIf(err)))
		case err != nil && !begun:
			// DoInTx's transaction did not begin: nothing to undo.
			return Result{}, unavailableIf(s.Lost() || c.isUnavailable(err), c.claimError(err, k))
		case err != nil:
			return Result{}, c.fail(ctx, s, own, c.claimError(err, k))
		}

		if claimed {
			out := decided
			if out.status == "" {
				out, err = c.runFn(ctx, s, own, k, fp, fn, cl)
				if err != nil {
					return Result{}, c.failFn(ctx, s, own, k, fp, err, cl)
				}
				if out.status == StatusRejected {
					// Undo fn's writes (and the claim), then store the
					// refusal in a claim of its own.
					switch err := s.Undo(ctx); {
					case c.drv.TxClosed(err) && ctx.Err() == nil:
						return Result{}, c.fnEnded(ctx, s, own, k, fp, nil, cl)
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
			switch {
			case c.keyRowChanged(err):
				err = ErrKeyRowChanged
			case errors.Is(err, driver.ErrTxAborted):
				// fn swallowed a failed statement and returned a response:
				// its transaction cannot store it.
				return Result{}, c.fail(ctx, s, own, errorf("idem: %w: %w", ErrTxAborted, err))
			case c.drv.TxClosed(err) && ctx.Err() == nil:
				// fn ended the transaction: pgx sent nothing on it;
				// database/sql ran the completion, then found it ended
				// at COMMIT or RELEASE.
				return Result{}, c.fnEnded(ctx, s, own, k, fp, nil, cl)
			case c.drv.TxClosed(err):
				// database/sql rolled the transaction back when ctx
				// ended, after the completion ran (as failFn).
				return Result{}, c.endedWithCtx(ctx, own, cl)
			}
			if err != nil {
				return Result{}, c.fail(ctx, s, own, errorf("idem: %w", c.unsupportedIf(err)))
			}
			return out.result(), nil
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
	undoErr := s.Undo(ctx)
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
	if c.drv.TxClosed(undoErr) && ctx.Err() == nil { // (with ctx done, database/sql ends the transaction itself)
		return c.fnEnded(ctx, s, own, k, fp, err, cl)
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

// endedWithCtx is the error of a call whose transaction had ended when its
// outcome was to be committed, once ctx had ended too: database/sql rolls a
// transaction back when the context it began with ends, so nothing of the
// call's committed and nothing was stored. (pgx never ends a transaction
// for its context: there fn did, and, should it have committed, the next
// DoInTx or Reserve of the key with the same fingerprint marks its claim.)
func (c *Client[TTx, TDB]) endedWithCtx(ctx context.Context, own bool, cl *call) error {
	if own {
		return errorf("idem: %w before DoInTx's COMMIT: database/sql rolled the transaction back, and nothing was stored", context.Cause(ctx))
	}
	return errorf("idem: %w before %s's savepoint was released: the caller's transaction had ended (database/sql rolls it "+
		"back when its context ends), and nothing was stored", context.Cause(ctx), cl.api())
}

// orphanReason is the last_error of a record whose claim was committed
// without an outcome.
const orphanReason = "the claim was committed without an outcome (fn committed the transaction of Do or DoInTx itself): fn's writes may be durable"

// errOrphaned is the answer for a key whose claim was committed without an
// outcome.
var errOrphaned = errorf("idem: %w (its claim was committed without an outcome: fn committed the transaction of Do or DoInTx itself; reconcile it with Resolve)",
	ErrOutcomeUnknown)

// fnEnded is the error of a call whose fn committed or rolled back the
// transaction it runs in (found closed when the call went on with it,
// after fn returned fnErr: nil when it succeeded). For DoInTx the row of
// the claim, when fn's COMMIT made it durable, is marked unknown in a
// statement of its own, so that the key's retries get ErrOutcomeUnknown
// and an operator finds it (ListUnknown) and settles it (Resolve). Do has
// no connection of its own to do that on: the next DoInTx or Reserve of
// the key with the same fingerprint does it. (fnSavepointEnded: Do's
// transaction was a savepoint of an enclosing one.)
func (c *Client[TTx, TDB]) fnEnded(ctx context.Context, s driver.Span[TTx], own bool, k driver.Key, fp Fingerprint, fnErr error, cl *call) error {
	after := ""
	if fnErr != nil {
		after = ", and then returned an error"
	}
	if !own {
		return c.fnSavepointEnded(ctx, s, k, fp, fnErr, cl.api(), after)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), driver.CleanupTimeout)
	defer cancel()
	committed, err := orphanedRow(ctx, s, k, fp)
	switch {
	case err != nil:
		return errorf("idem: %w: fn committed or rolled back DoInTx's transaction itself%s (idem could not tell which: marking "+
			"the key's record failed): nothing was stored; if it committed, fn's writes and the key's claim are durable, and the next DoInTx or "+
			"Reserve of the key with the same fingerprint marks the record unknown: %w%w", ErrInvalidArgument, after, err, joinedText(fnErr))
	case committed:
		return errorf("idem: %w: fn committed DoInTx's transaction itself%s: fn's writes are durable, but no outcome was stored; "+
			"the key's record is now unknown (retries get ErrOutcomeUnknown; ListUnknown lists it, Resolve settles it)%w",
			ErrInvalidArgument, after, joinedText(fnErr))
	}
	return errorf("idem: %w: fn rolled back DoInTx's transaction itself%s: fn's writes and the claim are gone, nothing was stored, "+
		"and the key is free%w", ErrInvalidArgument, after, joinedText(fnErr))
}

// fnSavepointEnded is fnEnded for Do, whose transaction is a savepoint of
// the caller's (as is DoInTx's on a caller's transaction: api names the
// call the caller made). When that transaction was itself a savepoint of a
// transaction still open (pgx's Begin on a pgx.Tx), fn's COMMIT released
// the claim and fn's writes into that enclosing transaction, pending: the
// driver aborts it (Span.Enclosing), so that it cannot commit them without
// an outcome.
func (c *Client[TTx, TDB]) fnSavepointEnded(ctx context.Context, s driver.Span[TTx], k driver.Key, fp Fingerprint,
	fnErr error, api, after string) error {
	enc, err := s.Enclosing(ctx, k, fp)
	switch enc {
	case driver.EnclosingAborted:
		return errorf("idem: %w: fn committed the transaction that %s runs in%s, a savepoint of an enclosing transaction: "+
			"that released fn's writes and the key's claim into the enclosing transaction, pending, and idem has aborted it so "+
			"that they cannot commit without an outcome: roll it back; nothing of fn's is committed and nothing was stored%w",
			ErrInvalidArgument, api, after, joinedText(fnErr))
	case driver.EnclosingUsable:
		return errorf("idem: %w: fn rolled back the transaction that %s runs in%s, a savepoint of an enclosing transaction: "+
			"fn's writes and the claim are gone, nothing was stored, the key is free, and the enclosing transaction is usable%w",
			ErrInvalidArgument, api, after, joinedText(fnErr))
	case driver.EnclosingUnknown:
		why := ""
		if err != nil {
			why = " (" + quiet{err}.Error() + ")"
		}
		return unavailableIf(c.isUnavailable(err), errorf("idem: %w: fn committed or rolled back the transaction that %s runs in%s, "+
			"a savepoint of an enclosing transaction, which is aborted%s: roll it back; nothing of fn's is committed and nothing "+
			"was stored%w", ErrInvalidArgument, api, after, why, joinedText(fnErr)))
	}
	return errorf("idem: %w: fn committed or rolled back the caller's transaction that %s runs in%s (fn must leave it open; "+
		"on database/sql, its context may have ended): nothing was stored; if it committed, fn's writes and the key's claim "+
		"are durable, and the key answers ErrOutcomeUnknown to DoInTx and Reserve with the same fingerprint, which mark it "+
		"unknown for Resolve%w", ErrInvalidArgument, api, after, joinedText(fnErr))
}

// joinedText is ": " and err for a message that wraps it, or nothing for
// nil.
func joinedText(err error) error {
	if err == nil {
		return noText{}
	}
	return prefixed{err}
}

// noText is an error that writes nothing and wraps nothing.
type noText struct{}

func (noText) Error() string { return "" }

// prefixed writes ": " before err and wraps it.
type prefixed struct{ err error }

func (p prefixed) Error() string { return ": " + quiet(p).Error() }
func (p prefixed) Unwrap() error { return p.err }

// orphanedRow marks the row of k that fn's COMMIT left without an outcome
// unknown, and reports whether there was such a row: marked now, or by
// another call of the key first (unknown with orphanReason, fingerprint
// fp, no outcome); false when fn rolled back, and the claim with it.
func orphanedRow[TTx any](ctx context.Context, s driver.Span[TTx], k driver.Key, fp Fingerprint) (bool, error) {
	n, now, err := s.Orphaned(ctx, k, fp, orphanReason)
	switch {
	case errors.Is(err, driver.ErrNoRows):
		return false, nil
	case err != nil || n == 1:
		return n == 1, err
	}
	return now.Status == "unknown" && now.LastError == orphanReason && now.CompletedAt.IsZero() && bytes.Equal(now.Fingerprint, fp[:]), nil
}

// orphaned marks the row of k, found committed by a claim without an
// outcome, unknown (the same statement as fnEnded), and returns what the
// call answers: ErrOutcomeUnknown.
func (c *Client[TTx, TDB]) orphaned(ctx context.Context, s driver.Span[TTx], k driver.Key, fp Fingerprint) error {
	if _, _, err := s.Orphaned(ctx, k, fp, orphanReason); err != nil && !errors.Is(err, driver.ErrNoRows) {
		return errorf("idem: %w (marking it unknown failed: %w)", errOrphaned, c.unsupportedIf(err))
	}
	return errOrphaned
}

// claimError turns the failure of a claim into the error a call returns: a
// wait for a twin that ran out is ErrInProgress.
func (c *Client[TTx, TDB]) claimError(err error, k driver.Key) error {
	if c.lockNotAvailable(err) {
		return c.inProgressOn(k)
	}
	return errorf("idem: %w", c.unsupportedIf(err))
}

// runFn runs fn in the span and decides the outcome to store. If fn panics,
// the call ends as it would have had fn returned an error: its writes and
// the claim are undone, and when fn had ended the transaction itself, a
// claim its COMMIT made durable is marked unknown (DoInTx) or an enclosing
// transaction that holds it is aborted (Do, fnEnded); then the panic goes
// on.
func (c *Client[TTx, TDB]) runFn(ctx context.Context, s driver.Span[TTx], own bool, k driver.Key, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (Response, error), cl *call) (outcome, error) {
	panicked := true
	defer func() {
		if panicked {
			cl.panicErr = c.failFn(ctx, s, own, k, fp, errPanicked, cl)
		}
	}()
	var resp Response
	var err error
	cl.timeFn(func() { resp, err = fn(ctx, s.Tx()) })
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

// InTx runs fn in a transaction begun on db and commits it when fn returns
// nil, running it again after a serialization failure or a deadlock (see
// idem.InTx).
func (c *Client[TTx, TDB]) InTx(ctx context.Context, db TDB, fn func(ctx context.Context, tx TTx) error) error {
	if err := c.checkDB(db, false); err != nil {
		return err
	}
	if fn == nil {
		return errNilFn
	}
	return c.preparedStatementsLost(c.retry(ctx, c.drv.Nested(db), func() error { return c.inTx(ctx, db, fn) }))
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

// inTx is one transaction of InTx. fn's errors come back as they are,
// unless the store failed under them: the connection is gone, or the
// server said it cannot serve.
func (c *Client[TTx, TDB]) inTx(ctx context.Context, db TDB, fn func(ctx context.Context, tx TTx) error) error {
	tx, err := c.drv.Begin(ctx, db)
	if err != nil {
		err = unavailableIf(c.isUnavailable(err), errorf("idem: begin: %w", err))
		if c.drv.Nested(db) { // a savepoint of the caller's transaction
			err = c.txUnusable(err)
		}
		return err
	}
	ended := false
	defer func() {
		if !ended { // fn panicked
			c.drv.Rollback(ctx, db, tx)
		}
	}()
	err = fn(ctx, tx)
	ended = true
	if err != nil {
		return unavailableIf(c.drv.Rollback(ctx, db, tx) || c.serverSaidUnavailable(err), err)
	}
	if err := c.drv.Commit(ctx, tx); err != nil {
		return unavailableIf(c.isUnavailable(err), errorf("idem: commit: %w", err))
	}
	return nil
}

// backoff returns a jittered exponential delay for retry number attempt.
func backoff(attempt int) time.Duration {
	d := 5 * time.Millisecond << min(attempt, 6)
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return errors.Join(ctx.Err(), context.Cause(ctx))
	}
}

// The reservation mode: work that cannot join the database transaction
// gets a lease and a fencing token (see idem.Reserve for the state
// machine). One table and one state machine serve Do and the
// reservations: judge (call.go) decides what a row means for both.

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
	ctx, cl := c.obs.begin(ctx, "reserve", c.spanReserve, scope, key)
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
	case err != nil:
		err = c.txUnusable(errorf("idem: complete: %w", c.unsupportedIf(err)))
	case n != 1:
		err = ErrFenced
	}
	c.countEnd(ctx, "complete", r.Scope, err, "")
	return err
}

// FailRetryable records that the reservation's work certainly did not
// happen, in a transaction of its own begun on db (see idem.FailRetryable).
func (c *Client[TTx, TDB]) FailRetryable(ctx context.Context, db TDB, r Reservation, reason string) error {
	if err := c.checkOwnerCall(db, r, reason); err != nil {
		return err
	}
	return c.fence(ctx, db, "fail_retryable", r.Scope, "failed_retry", func(ctx context.Context, ex driver.Executor) (int64, error) {
		return ex.ReserveFailRetryable(ctx, newKey(r.Scope, r.Key), r.Token, reason)
	})
}

// MarkUnknown records that the reservation's work may have happened, in a
// transaction of its own begun on db (see idem.MarkUnknown).
func (c *Client[TTx, TDB]) MarkUnknown(ctx context.Context, db TDB, r Reservation, reason string) error {
	if err := c.checkOwnerCall(db, r, reason); err != nil {
		return err
	}
	return c.fence(ctx, db, "mark_unknown", r.Scope, outcomeUnknown, func(ctx context.Context, ex driver.Executor) (int64, error) {
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
	c.countEnd(ctx, "heartbeat", r.Scope, err, "")
	if err != nil {
		return Reservation{}, err
	}
	r.LeaseExpiresAt = lease
	return r, nil
}

// fence runs update, a statement of the owner of a reservation, in a
// transaction begun on db, and returns ErrFenced when it changed no row.
// event is counted when it did.
func (c *Client[TTx, TDB]) fence(ctx context.Context, db TDB, call string, scope Scope, event string,
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
	c.countEnd(ctx, call, scope, err, event)
	return err
}

// countEnd counts the end of a reservation or reconciliation call that is
// not Reserve (which ends like Do, see observe.go): event when it
// succeeded (none when event is ""), a fenced reservation, or a store
// failure.
func (c *Client[TTx, TDB]) countEnd(ctx context.Context, call string, scope Scope, err error, event string) {
	switch {
	case err == nil && event != "":
		c.obs.count(ctx, event, call, scope.Operation, 1)
	case errors.Is(err, ErrFenced):
		c.obs.count(ctx, outcomeFenced, call, scope.Operation, 1)
	case c.obs.unavailable(err):
		c.obs.count(ctx, outcomeStoreError, call, scope.Operation, 1)
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

// How a call is observed: begin starts its clock and span, end turns its
// result into a counter, the histograms, a log record and the span's
// outcome (observe.go holds the instruments).

// call is one observed call in progress.
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
func (o *observer) begin(ctx context.Context, name, spanName string, scope Scope, key string) (context.Context, call) {
	cl := call{o: o, name: name, scope: scope, key: key, start: time.Now()}
	if o.tracer != nil {
		ctx, cl.span = o.tracer.Start(ctx, spanName, trace.WithSpanKind(trace.SpanKindInternal),
			trace.WithAttributes(attribute.String("idem.operation", scope.Operation)))
	}
	return ctx, cl
}

// api names the public call observed: Do, or DoInTx (which runs Do on a
// caller's transaction).
func (cl *call) api() string {
	if cl.name == "do_in_tx" {
		return "DoInTx"
	}
	return "Do"
}

// timeFn runs f and adds its duration to the call's time in fn.
func (cl *call) timeFn(f func()) {
	start := time.Now()
	defer func() { cl.fnTime += time.Since(start) }()
	f()
}

// outcomeOf names the outcome of a call that returned res and err.
func (o *observer) outcomeOf(res Result, err error, rejected bool) string {
	switch {
	case err == nil && res.Replayed:
		return outcomeReplay
	case err == nil && rejected:
		return outcomeRejected
	case err == nil:
		return outcomeCreated
	case errors.Is(err, ErrInProgress):
		return outcomeInProgress
	case errors.Is(err, ErrKeyReused):
		return outcomeKeyMisuse
	case errors.Is(err, ErrOutcomeUnknown):
		return outcomeUnknown
	case errors.Is(err, ErrFenced):
		return outcomeFenced
	case o.unavailable(err):
		return outcomeStoreError
	default:
		return outcomeFailed
	}
}

// end records the call's outcome: its counter, the histograms, a log
// record and the span.
func (cl *call) end(ctx context.Context, res Result, err error) {
	cl.ended = true
	o := cl.o
	outcome := o.outcomeOf(res, err, cl.rejected)
	elapsed := time.Since(cl.start)
	m := o.measuresOf(cl.name, cl.scope.Operation, outcome)
	m.counter.Add(ctx, 1, m.add...)
	withOutcome := m.record
	switch outcome {
	case outcomeReplay, outcomeInProgress:
		o.wait.Record(ctx, elapsed.Seconds(), withOutcome...)
	}
	o.overhead.Record(ctx, (elapsed - cl.fnTime).Seconds(), withOutcome...)
	if cl.span != nil {
		cl.span.SetAttributes(attribute.String("idem.outcome", outcome))
		if outcome == outcomeStoreError || outcome == outcomeFailed {
			cl.span.RecordError(err)
			cl.span.SetStatus(codes.Error, outcome)
		}
		cl.span.End()
	}
	if o.log == nil {
		return
	}
	level, msg := slog.LevelDebug, ""
	switch outcome {
	case outcomeReplay:
		level, msg = slog.LevelInfo, "idem: replayed a stored outcome"
	case outcomeInProgress:
		level, msg = slog.LevelInfo, "idem: refused, the key is in progress"
	case outcomeKeyMisuse:
		level, msg = slog.LevelWarn, "idem: refused, the key was used for a different request"
	case outcomeUnknown:
		level, msg = slog.LevelWarn, "idem: refused, the key's outcome is unknown; reconcile it"
	case outcomeFenced:
		level, msg = slog.LevelWarn, "idem: refused, the reservation no longer owns its key"
	case outcomeStoreError:
		level, msg = slog.LevelError, "idem: the store is unavailable"
	case outcomeFailed:
		level, msg = slog.LevelDebug, "idem: the call failed; nothing was stored"
	default:
		level, msg = slog.LevelDebug, "idem: stored a new outcome"
	}
	if !o.log.Enabled(ctx, level) {
		return
	}
	attrs := []slog.Attr{
		slog.String("call", cl.name),
		slog.String("operation", cl.scope.Operation),
		slog.String("key_hash", o.hash.Sum(cl.key)),
		slog.String("actor_hash", o.hash.Sum(cl.scope.Actor)),
		slog.String("outcome", outcome),
		slog.Duration("duration", elapsed),
	}
	if err != nil && (outcome == outcomeStoreError || outcome == outcomeFailed) {
		attrs = append(attrs, slog.String("error", err.Error()))
	}
	o.log.LogAttrs(ctx, level, msg, attrs...)
}

// endIfPanicking records a call that did not end as failed: deferred, it
// runs when fn panicked, and the panic goes on.
func (cl *call) endIfPanicking(ctx context.Context) {
	if !cl.ended {
		err := cl.panicErr
		if err == nil {
			err = errPanicked
		}
		cl.end(ctx, Result{}, err)
	}
}

var errPanicked = errors.New("idem: fn panicked")

// count adds n to the counter of a maintenance or reservation event.
func (o *observer) count(ctx context.Context, event, callName, operation string, n int64) {
	if n != 0 {
		m := o.measuresOf(callName, operation, event)
		m.counter.Add(ctx, n, m.add...)
	}
}
