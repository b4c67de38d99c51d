package core

import (
	"bytes"
	"context"
	"errors"

	"github.com/pgidem/idem/internal/driver"
)

// When fn ends the transaction it runs in itself (a COMMIT or ROLLBACK of
// its own, or, on database/sql, its context ending), the call cannot store
// an outcome: these decide what the call answers and what is left of the
// claim (marked unknown for DoInTx, the enclosing transaction aborted for
// Do).

// orphanReason is the last_error of a record whose claim was committed
// without an outcome.
const orphanReason = "the claim was committed without an outcome (fn committed the transaction of Do or DoInTx itself): fn's writes may be durable"

// errOrphaned is the answer for a key whose claim was committed without an
// outcome.
var errOrphaned = errorf("idem: %w (its claim was committed without an outcome: fn committed the transaction of Do or DoInTx itself; reconcile it with Resolve)",
	ErrOutcomeUnknown)

// fnEnded is the error of a call whose transaction was found ended when
// the call went on with it, after fn returned fnErr (nil when it
// succeeded) or panicked, or when storing the outcome failed with storeErr:
// fn committed or rolled it back, or, once ctx had ended, database/sql
// rolled it back (it does so when the context a transaction began with
// ends: Driver.CtxEndsTx; pgx never does). For DoInTx the row of the
// claim, when fn's COMMIT made it durable, is marked unknown in a
// statement of its own, so that the key's retries get ErrOutcomeUnknown
// and an operator finds it (ListUnknown) and settles it (Resolve). Do has
// no connection of its own to do that on: the next DoInTx or Reserve of
// the key with the same fingerprint does it. (fnSavepointEnded: Do's
// transaction was a savepoint of an enclosing one.) Whether ctx had ended
// or not, the same is done: database/sql cannot undo a COMMIT fn made
// before.
func (c *Client[TTx, TDB]) fnEnded(ctx context.Context, s driver.Span[TTx], own bool, k driver.Key, fp Fingerprint,
	fnErr, storeErr error, cl *call) error {
	after := ""
	if fnErr != nil {
		after = ", and then returned an error"
	}
	if !own {
		return c.fnSavepointEnded(ctx, s, k, fp, fnErr, cl.api(), after)
	}
	ended := ctx.Err() != nil && c.drv.CtxEndsTx() // database/sql may have ended it
	if ended && c.fault(storeErr, driver.ErrCommitInDoubt) {
		// The completion ran, so fn had left the transaction open, and
		// its COMMIT was under way when ctx ended: no claim was left
		// without an outcome, whether it committed or not.
		return unavailableIf(c.isUnavailable(storeErr), errorf("idem: %w while DoInTx's outcome was being committed (%w): "+
			"it may have committed; no claim was left without an outcome, and a retry with the same key replays it or runs "+
			"the request", ctxError(ctx), storeErr))
	}
	cause := ctxError(ctx)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), driver.CleanupTimeout)
	defer cancel()
	committed, err := orphanedRow(ctx, s, k, fp)
	switch {
	case err != nil && ended:
		return unavailableIf(c.isUnavailable(err), errorf("idem: %w before DoInTx's outcome was committed, and its transaction "+
			"had ended (database/sql rolls it back when the context ends); whether fn had committed it could not be checked "+
			"(%w): if it had, fn's writes and the key's claim are durable, and the next DoInTx or Reserve of the key with the "+
			"same fingerprint marks the record unknown%w", cause, err, joinedText(fnErr)))
	case err != nil:
		return endedByFn(errorf("idem: %w: fn committed or rolled back DoInTx's transaction itself%s (idem could not tell which: marking "+
			"the key's record failed): nothing was stored; if it committed, fn's writes and the key's claim are durable, and the next DoInTx or "+
			"Reserve of the key with the same fingerprint marks the record unknown: %w%w", ErrInvalidArgument, after, err, joinedText(fnErr)))
	case committed:
		return endedByFn(errorf("idem: %w: fn committed DoInTx's transaction itself%s: fn's writes are durable, but no outcome was stored; "+
			"the key's record is now unknown (retries get ErrOutcomeUnknown; ListUnknown lists it, Resolve settles it)%w",
			ErrInvalidArgument, after, joinedText(fnErr)))
	case ended:
		return errorf("idem: %w before DoInTx's outcome was committed, and its transaction had ended (database/sql rolls "+
			"it back when the context ends): nothing was stored, nothing of fn's committed, and the key is free%w",
			cause, joinedText(fnErr))
	}
	return endedByFn(errorf("idem: %w: fn rolled back DoInTx's transaction itself%s: fn's writes and the claim are gone, nothing was stored, "+
		"and the key is free%w", ErrInvalidArgument, after, joinedText(fnErr)))
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
		return endedByFn(errorf("idem: %w: fn committed the transaction that %s runs in%s, a savepoint of an enclosing transaction: "+
			"that released fn's writes and the key's claim into the enclosing transaction, pending, and idem has aborted it so "+
			"that they cannot commit without an outcome: roll it back; nothing of fn's is committed and nothing was stored%w",
			ErrInvalidArgument, api, after, joinedText(fnErr)))
	case driver.EnclosingUsable:
		return endedByFn(errorf("idem: %w: fn rolled back the transaction that %s runs in%s, a savepoint of an enclosing transaction: "+
			"fn's writes and the claim are gone, nothing was stored, the key is free, and the enclosing transaction is usable%w",
			ErrInvalidArgument, api, after, joinedText(fnErr)))
	case driver.EnclosingUnknown:
		why := ""
		if err != nil {
			why = " (" + quiet{err}.Error() + ")"
		}
		return unavailableIf(c.isUnavailable(err), endedByFn(errorf("idem: %w: fn committed or rolled back the transaction that %s runs in%s, "+
			"a savepoint of an enclosing transaction, which is aborted%s: roll it back; nothing of fn's is committed and nothing "+
			"was stored%w", ErrInvalidArgument, api, after, why, joinedText(fnErr))))
	}
	// Enclosing says no more when the transaction was the connection's own,
	// or of a type it does not look into (EnclosingNotRead).
	durable := "durable"
	if enc == driver.EnclosingNotRead {
		durable = "durable (or, if the transaction, of a type idem does not look into, was a savepoint of another, pending " +
			"in that one: roll it back)"
	}
	rest := "nothing was stored; if it committed, fn's writes and the key's claim are " + durable + ", and the key answers " +
		"ErrOutcomeUnknown to DoInTx and Reserve with the same fingerprint, which mark it unknown for Resolve"
	if !c.drv.CtxEndsTx() {
		return endedByFn(errorf("idem: %w: fn committed or rolled back the caller's transaction that %s runs in%s (fn must leave it "+
			"open): %s%w", ErrInvalidArgument, api, after, rest, joinedText(fnErr)))
	}
	// database/sql also rolls the caller's transaction back when the
	// context it was begun with ends, which may not be the call's.
	if ctx.Err() != nil {
		return errorf("idem: %w before %s's savepoint was released, and the caller's transaction had ended (database/sql "+
			"rolls it back when its context ends; fn may have committed or rolled it back): %s%w",
			ctxError(ctx), api, rest, joinedText(fnErr))
	}
	return endedByFn(errorf("idem: %w: fn committed or rolled back the caller's transaction that %s runs in%s (fn must leave it "+
		"open), or the context it was begun with ended (database/sql then rolls it back): %s%w",
		ErrInvalidArgument, api, after, rest, joinedText(fnErr)))
}

// EndedByFn reports whether err is the error of a call whose fn committed
// or rolled back the transaction it was given (an ErrInvalidArgument that
// endedByFn marked), so that a front can tell it from an
// ErrInvalidArgument of fn's own error (idemhttp's webhook receiver).
func EndedByFn(err error) bool { return errors.Is(err, errFnEndedTx) }

// errFnEndedTx is the mark endedByFn puts in an error's chain.
var errFnEndedTx = errors.New("fn ended its transaction")

// endedByFn marks err, which blames fn for ending its transaction (see
// EndedByFn).
func endedByFn(err error) error { return fnEndedError{err} }

// fnEndedError is err, marked errFnEndedTx; its text is err's.
type fnEndedError struct{ err error }

func (e fnEndedError) Error() string   { return e.err.Error() }
func (e fnEndedError) Unwrap() []error { return []error{e.err, errFnEndedTx} }

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
