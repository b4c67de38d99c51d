package idemsql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/bridge"
	"github.com/pgidem/idem/internal/dbsql"
)

// The protocol of Do and DoInTx is package idem's, statement for
// statement, sent one statement per round trip: database/sql cannot
// pipeline. Every table statement is a method that sqlc generates into
// internal/dbsql from the same query files as package idem's
// internal/db; the statements below are the transaction control around
// them.
const (
	sqlSavepoint = "SAVEPOINT idem_do"
	sqlRelease   = "RELEASE SAVEPOINT idem_do"
	// sqlUndo undoes the claim and fn's writes and drops the savepoint; a
	// statement without arguments goes as one simple-protocol message, so
	// both commands cost one round trip (and a transaction fn left aborted
	// accepts it).
	sqlUndo        = "ROLLBACK TO SAVEPOINT idem_do; RELEASE SAVEPOINT idem_do"
	sqlIndexLookup = "SET LOCAL enable_seqscan = off"
)

// maxClaimAttempts bounds the rounds of claim, read and take-over when the
// row that holds the key keeps changing under a call (as in package idem).
const maxClaimAttempts = 4

// cleanupTimeout bounds the statements that undo a call's work, which run
// even when the caller's context is done.
const cleanupTimeout = 5 * time.Second

type outcome = bridge.Outcome[idem.Response]

const statusRejected = string(idem.StatusRejected)

// Do is idem.Do on a *sql.Tx: it runs fn at most once per key. It claims
// (scope, key) in tx, runs fn in tx, and stores fn's Response in tx, in a
// savepoint of tx that Do ends before it returns; everything commits or
// rolls back with tx, and Do never commits or rolls back tx itself. Every
// case (first call, replay, idem.ErrKeyReused, concurrent twins waiting at
// most Config.Wait then idem.ErrInProgress, Reject, fn's errors and panics
// undone, expired keys, keys held by reservations) is decided by package
// idem's own state machine and behaves as idem.Do documents.
//
// tx may come from database/sql directly or from an ORM that hands one out
// (Bun's and sqlx's transactions embed a *sql.Tx; GORM and ent can run on
// one): the examples module shows each.
//
// After a serialization failure (40001) or a deadlock (40P01) the whole
// transaction must be run again (InTx and DoInTx do so). A tx that is
// closed (committed or rolled back) or aborted (a statement failed in it)
// is idem.ErrInvalidArgument, as in idem.Do.
//
// Do uses the package defaults; see Client.Do.
func Do(ctx context.Context, tx *sql.Tx, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) (idem.Result, error) {
	return defaultClient.Do(ctx, tx, scope, key, fp, fn)
}

// Do is the package-level Do with this client's configuration.
func (c *Client) Do(ctx context.Context, tx *sql.Tx, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) (idem.Result, error) {
	if err := c.checkCall(scope, key, fn); err != nil {
		return idem.Result{}, err
	}
	if tx == nil {
		return idem.Result{}, errNilTx
	}
	ctx, cl := core.Observe(c.c, ctx, "do", "idemsql.Do", bridgeKey(scope, key))
	defer cl.EndIfPanicking(ctx)
	res, err := c.do(ctx, tx, bridgeKey(scope, key), fp, fn, cl)
	err = pooled(txUnusable(err))
	cl.End(ctx, res, err)
	return res, err
}

// checkCall validates the arguments of Do and DoInTx.
func (c *Client) checkCall(scope idem.Scope, key string, fn func(context.Context, *sql.Tx) (idem.Response, error)) error {
	if err := c.checkTarget(scope, key); err != nil {
		return err
	}
	if fn == nil {
		return fmt.Errorf("%w: nil function", idem.ErrInvalidArgument)
	}
	return nil
}

// do is Do after its checks, observed by cl.
func (c *Client) do(ctx context.Context, tx *sql.Tx, k bridge.Key, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error), cl bridge.Call[idem.Result]) (idem.Result, error) {
	var decided *outcome // a refusal, stored once the key is claimed again
	takeOver := false
	for range maxClaimAttempts {
		if _, err := tx.ExecContext(ctx, sqlSavepoint); err != nil { // nothing to undo
			return idem.Result{}, c.claimError(err, k)
		}
		claimed, err := c.claim(ctx, tx, k, fp, takeOver)
		if err != nil {
			return idem.Result{}, undone(ctx, tx, c.claimError(err, k))
		}

		if claimed {
			out := decided
			if out == nil {
				o, err := c.runFn(ctx, tx, fn, cl, func() { _ = undo(ctx, tx) })
				if err != nil {
					return idem.Result{}, undone(ctx, tx, err)
				}
				if o.Status == statusRejected {
					// Undo fn's writes (and the claim), then store the
					// refusal in a claim of its own.
					if err := undo(ctx, tx); err != nil {
						return idem.Result{}, err
					}
					decided = &o
					continue
				}
				out = &o
			}
			if out.Status == statusRejected {
				cl.Rejected()
			}
			err := c.complete(ctx, tx, k, fp, *out)
			if err == nil {
				_, err = tx.ExecContext(ctx, sqlRelease)
			}
			if err != nil {
				return idem.Result{}, undone(ctx, tx, err)
			}
			return core.Result(*out), nil
		}

		// Read the row that holds the key; rolling back to the savepoint
		// undoes the read's planner setting.
		row, found, err := c.read(ctx, tx, k)
		if err == nil {
			_, err = tx.ExecContext(ctx, sqlUndo)
		}
		if err != nil {
			return idem.Result{}, undone(ctx, tx, fmt.Errorf("idem: read key: %w", err))
		}
		res, next, err := core.Judge(c.c, row, found, fp, k)
		if next == bridge.Done {
			return res, err
		}
		takeOver = next == bridge.TakeOver
	}
	return idem.Result{}, core.InProgress(c.c, k)
}

// DoInTx is idem.DoInTx on a *sql.DB: Do in a transaction of its own begun
// on db (at Config.IsolationLevel), committed when Do returns a nil error:
// the claim, fn's writes and the stored response commit together. fn runs
// directly in the transaction (no savepoint): when fn fails the transaction
// is rolled back whole, and a refusal (Reject) is stored in a transaction
// of its own that claims the key again and runs nothing. Serialization
// failures and deadlocks are retried (Config.MaxRetries), and a retry of a
// duplicate replays the winner's response; under SERIALIZABLE such a
// failure can surface after fn ran, and then fn runs again and only one
// run's writes commit. A lost connection, or a COMMIT whose answer never
// came, is idem.ErrUnavailable: retry with the same key, which replays if
// the first attempt committed.
//
// Unlike idem.DoInTx on a pgx pool, concurrent duplicates in one process
// are not coalesced: they meet at the primary key (the first runs fn, the
// others wait at most Config.Wait and replay).
func DoInTx(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) (idem.Result, error) {
	return defaultClient.DoInTx(ctx, db, scope, key, fp, fn)
}

// DoInTx is the package-level DoInTx with this client's configuration.
func (c *Client) DoInTx(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) (idem.Result, error) {
	if err := c.checkCall(scope, key, fn); err != nil {
		return idem.Result{}, err
	}
	if db == nil {
		return idem.Result{}, errNilDB
	}
	k := bridgeKey(scope, key)
	ctx, cl := core.Observe(c.c, ctx, "do_in_tx", "idemsql.DoInTx", k)
	defer cl.EndIfPanicking(ctx)
	var res idem.Result
	err := c.retry(ctx, func() (err error) { res, err = c.doOwnTx(ctx, db, k, fp, fn, cl); return err })
	if err != nil {
		res, err = idem.Result{}, pooled(err)
	}
	cl.End(ctx, res, err)
	return res, err
}

// doOwnTx is one run of DoInTx:
//
//  1. BEGIN, then the claim, waiting at most Config.Wait for a twin.
//  2. fn runs in the transaction.
//  3. The outcome is stored and the transaction committed.
//
// When a committed row already holds the key, step 1 claims nothing: the
// row is read and the transaction (which wrote nothing) rolled back; then
// the call replays, fails, or claims again in a new transaction.
func (c *Client) doOwnTx(ctx context.Context, db *sql.DB, k bridge.Key, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error), cl bridge.Call[idem.Result]) (idem.Result, error) {
	var decided *outcome // a refusal, stored once the key is claimed again
	takeOver := false
	for range maxClaimAttempts {
		tx, err := c.begin(ctx, db)
		if err != nil {
			return idem.Result{}, err
		}
		claimed, err := c.claim(ctx, tx, k, fp, takeOver)
		if err != nil {
			return idem.Result{}, failed(ctx, tx, c.claimError(err, k))
		}

		if claimed {
			out := decided
			if out == nil {
				o, err := c.runFn(ctx, tx, fn, cl, func() { _ = rollback(ctx, tx) })
				if err != nil {
					return idem.Result{}, unavailableIf(serverSaidUnavailable(err) || connLost(rollback(ctx, tx)), err)
				}
				if o.Status == statusRejected {
					_ = rollback(ctx, tx) // undo fn's writes; claim again to store the refusal
					decided = &o
					continue
				}
				out = &o
			}
			if out.Status == statusRejected {
				cl.Rejected()
			}
			if err := c.complete(ctx, tx, k, fp, *out); err != nil {
				return idem.Result{}, failed(ctx, tx, err)
			}
			if err := commit(tx); err != nil {
				return idem.Result{}, err
			}
			return core.Result(*out), nil
		}

		row, found, err := c.read(ctx, tx, k)
		if err != nil {
			return idem.Result{}, failed(ctx, tx, fmt.Errorf("idem: read key: %w", err))
		}
		if err := rollback(ctx, tx); err != nil { // it wrote nothing; ends the read's planner setting
			return idem.Result{}, unavailableIf(connLost(err), fmt.Errorf("idem: read key: %w", err))
		}
		res, next, err := core.Judge(c.c, row, found, fp, k)
		if next == bridge.Done {
			return res, err
		}
		takeOver = next == bridge.TakeOver
	}
	return idem.Result{}, core.InProgress(c.c, k)
}

// failed rolls back DoInTx's transaction after a statement of idem's failed
// with err, and returns err, wrapped with idem.ErrUnavailable when the
// store failed.
func failed(ctx context.Context, tx *sql.Tx, err error) error {
	return unavailableIf(connLost(rollback(ctx, tx)) || idem.Unavailable(err), err)
}

// claim claims k for fp in tx, bounded by Config.Wait: a fresh claim, or
// with takeOver the take-over of a row that is over. claimed is false when
// a committed row holds the key.
//
// The statement sets the bound and, when it claims, restores the caller's
// lock_timeout itself (see KeyClaim); when it claims nothing the savepoint
// or transaction ends before the caller's code runs, which restores it.
func (c *Client) claim(ctx context.Context, tx *sql.Tx, k bridge.Key, fp idem.Fingerprint, takeOver bool) (claimed bool, err error) {
	if takeOver {
		claimed, err = queries.KeyTakeOver(ctx, tx, dbsql.KeyTakeOverParams{Actor: k.Actor, Operation: k.Operation,
			IdemKey: k.Key, Fingerprint: fp[:], TtlMicros: c.ttlMicros, LockTimeout: c.wait})
	} else {
		claimed, err = queries.KeyClaim(ctx, tx, dbsql.KeyClaimParams{Actor: k.Actor, Operation: k.Operation,
			IdemKey: k.Key, Fingerprint: fp[:], TtlMicros: c.ttlMicros, LockTimeout: c.wait})
	}
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return claimed, err
}

// claimError turns the failure of a claim into the error a call returns: a
// wait for a twin that ran out is idem.ErrInProgress.
func (c *Client) claimError(err error, k bridge.Key) error {
	if sqlState(err) == pgerrcode.LockNotAvailable {
		return core.InProgress(c.c, k)
	}
	return fmt.Errorf("idem: claim: %w", err)
}

// read reads the committed row that holds k as an index lookup (the
// planner setting lasts until the savepoint or transaction ends). found is
// false when no row holds the key any more.
func (c *Client) read(ctx context.Context, tx *sql.Tx, k bridge.Key) (row bridge.Row, found bool, err error) {
	if _, err := tx.ExecContext(ctx, sqlIndexLookup); err != nil {
		return row, false, err
	}
	r, err := queries.KeyGet(ctx, tx, dbsql.KeyGetParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	if errors.Is(err, sql.ErrNoRows) {
		return row, false, nil
	}
	if err != nil {
		return row, false, err
	}
	if len(r.Fingerprint) != len(idem.Fingerprint{}) {
		return row, false, fmt.Errorf("stored fingerprint has %d bytes", len(r.Fingerprint))
	}
	return bridge.Row{
		Fingerprint: r.Fingerprint, Status: r.Status,
		ResponseStatus: r.ResponseStatus.Int32, HasResponse: r.ResponseStatus.Valid,
		ResponseHeaders: r.ResponseHeaders, ResponseBody: r.ResponseBody,
		Expired: r.Expired, Leased: r.Leased, LeaseLeftMs: r.LeaseLeftMs,
	}, true, nil
}

// complete stores the outcome of a claimed key.
func (c *Client) complete(ctx context.Context, tx *sql.Tx, k bridge.Key, fp idem.Fingerprint, out outcome) error {
	body := out.Response.Body
	if body == nil {
		body = []byte{}
	}
	_, err := queries.KeyComplete(ctx, tx, dbsql.KeyCompleteParams{
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Fingerprint: fp[:],
		Status: out.Status, TtlMicros: c.ttlMicros, ResponseStatus: int32(out.Response.Status),
		ResponseHeaders: sql.NullString{String: out.Headers, Valid: out.HasHeaders}, ResponseBody: body,
	})
	if sqlState(err) == pgerrcode.InvalidTextRepresentation && strings.Contains(err.Error(), "idem_keys row changed under fn") {
		return idem.ErrKeyRowChanged
	}
	if err != nil {
		return fmt.Errorf("idem: store response: %w", err)
	}
	return nil
}

// runFn runs fn and decides the outcome to store. If fn panics, undo runs
// before the panic goes on.
func (c *Client) runFn(ctx context.Context, tx *sql.Tx, fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error),
	cl bridge.Call[idem.Result], undo func()) (outcome, error) {
	panicked := true
	defer func() {
		if panicked {
			undo()
		}
	}()
	var resp idem.Response
	var err error
	cl.TimeFn(func() { resp, err = fn(ctx, tx) })
	panicked = false
	return core.Decide(c.c, resp, err)
}

// undone undoes Do's savepoint and returns err, joined with the error of
// the undo if that failed too.
func undone(ctx context.Context, tx *sql.Tx, err error) error {
	if undoErr := undo(ctx, tx); undoErr != nil {
		return errors.Join(err, undoErr)
	}
	return err
}

// undo rolls tx back to Do's savepoint and drops it: the claim and fn's
// writes are gone and the key is free again. It runs even when ctx is
// done.
func undo(ctx context.Context, tx *sql.Tx) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if _, err := tx.ExecContext(ctx, sqlUndo); err != nil {
		return fmt.Errorf("idem: undo: %w", err)
	}
	return nil
}
