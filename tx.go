package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Beginner starts transactions. *pgxpool.Pool, *pgx.Conn and pgx.Tx (which
// begins a savepoint) satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// txBeginner is the richer form that *pgxpool.Pool and *pgx.Conn offer; InTx
// uses it to set the isolation level in the BEGIN statement itself.
type txBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// InTx runs fn in a transaction begun on db and commits it when fn returns
// nil; when fn returns an error or panics the transaction is rolled back and
// the error (or panic) is passed on.
//
// After a serialization failure (40001) or a deadlock (40P01), anywhere in
// fn or at commit, the whole transaction is rolled back and run again, up to
// Config.MaxRetries times with jittered exponential backoff, so fn must be
// safe to run again: everything it did in the rolled-back transaction is
// gone. On a pgx.Tx, InTx runs fn in a savepoint and does not retry: such a
// failure dooms the caller's whole transaction, which only the caller can
// run again.
//
// fn's errors are returned as they are, except when the store failed under
// them (the connection broke, or the server answered that it cannot serve:
// SQLSTATE classes 08, 53 and 58, a shutdown): then InTx returns an error
// that wraps both ErrUnavailable and fn's error. Failures to begin or commit
// because the server cannot be reached are ErrUnavailable too.
//
// InTx uses the package defaults; see Client.InTx.
func InTx(ctx context.Context, db Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return defaultClient.InTx(ctx, db, fn)
}

// InTx is the package-level InTx with this client's isolation level and
// retry budget.
func (c *Client) InTx(ctx context.Context, db Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	if isNil(db) {
		return fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	if fn == nil {
		return fmt.Errorf("%w: nil function", ErrInvalidArgument)
	}
	return c.inTx(ctx, db, false, fn)
}

// inTx is InTx; with fold, Do may commit the transaction itself.
func (c *Client) inTx(ctx context.Context, db Beginner, fold bool, fn func(ctx context.Context, tx pgx.Tx) error) error {
	_, nested := db.(pgx.Tx)
	for attempt := 0; ; attempt++ {
		err := c.inTxOnce(ctx, db, fold, fn)
		// In a savepoint of a caller's transaction a serialization failure
		// dooms the whole transaction: only the caller can run it again.
		if err == nil || !isRetryable(err) || nested || attempt >= c.cfg.MaxRetries {
			return err
		}
		if sleepErr := sleep(ctx, backoff(attempt)); sleepErr != nil {
			return err
		}
	}
}

// DoInTx runs Do in a transaction of its own begun on db (with InTx), and
// commits it when Do returns a nil error: the claim, fn's writes and the
// stored response commit together. Serialization failures and deadlocks are
// retried (not on a pgx.Tx, see InTx), and a retry of a duplicate replays the
// winner's response. Under SERIALIZABLE such a failure can surface after fn
// ran (when the response is stored, or at COMMIT): then fn runs again in the
// retry, and only one run's writes commit. Invalid input is refused before a
// transaction begins; so is a *pgx.Conn that is already in a transaction.
//
// Concurrent DoInTx calls with the same scope and key on one Client (the
// package-level functions share one) and one *pgxpool.Pool are coalesced in
// this process: the first goes to the database; the others wait for it, at
// most Config.Wait, and get its committed outcome as a replay (ErrKeyReused
// if their fingerprint differs). If its claim gave up waiting for a
// transaction elsewhere that holds the key, they get ErrInProgress too; if it
// fails otherwise, nothing was stored and each of them goes to the database
// itself. Duplicates in other processes, or on other pools, meet at the
// primary key as always.
func DoInTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	return defaultClient.DoInTx(ctx, db, scope, key, fp, fn)
}

// DoInTx is the package-level DoInTx with this client's configuration.
func (c *Client) DoInTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	if err := c.checkCall(scope, key, fn); err != nil {
		return Result{}, err
	}
	if isNil(db) {
		return Result{}, fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	return c.coalesced(ctx, db, scope, key, fp, fn)
}

// doInTx is DoInTx after its checks, without coalescing.
func (c *Client) doInTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	var res Result
	err := c.inTx(ctx, db, true, func(ctx context.Context, tx pgx.Tx) error {
		r, err := c.Do(ctx, tx, scope, key, fp, fn)
		res = r
		return err
	})
	if err != nil {
		return Result{}, err
	}
	return res, nil
}

func (c *Client) inTxOnce(ctx context.Context, db Beginner, fold bool, fn func(ctx context.Context, tx pgx.Tx) error) (err error) {
	tx, release, err := c.begin(ctx, db, fold)
	if err != nil {
		return unavailableIf(isUnavailable(err), fmt.Errorf("idem: begin: %w", err))
	}
	defer release()
	committed := false
	defer func() {
		if committed {
			return
		}
		// Roll back even when ctx is done; bound it so a dead server cannot
		// hold the caller.
		rbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rbCtx)
	}()
	// fn's errors come back as they are, unless the store failed under
	// them: the connection is gone, or the server said it cannot serve.
	// (Looking at the connection is safe only while it is held here: a
	// transaction of another Beginner may have given it back already.)
	held := isHeld(db, tx)
	if err := fn(ctx, tx); err != nil {
		return unavailableIf(held && connLost(tx) || serverSaidUnavailable(err), err)
	}
	if err := tx.Commit(ctx); err != nil {
		return unavailableIf(held && connLost(tx) || isUnavailable(err), fmt.Errorf("idem: commit: %w", err))
	}
	committed = true
	return nil
}

// unavailableIf wraps err with ErrUnavailable when lost is true.
func unavailableIf(lost bool, err error) error {
	if !lost || errors.Is(err, ErrUnavailable) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// isHeld reports whether the connection under tx stays with this call
// until it returns: a pipeTx holds a pooled or given connection, and a
// savepoint of the caller's transaction cannot end before the caller does.
func isHeld(db Beginner, tx pgx.Tx) bool {
	if _, ok := tx.(*pipeTx); ok {
		return true
	}
	_, nested := db.(pgx.Tx)
	return nested
}

// serverSaidUnavailable reports whether err holds a server error that
// says it cannot serve now (see serverUnavailable).
func serverSaidUnavailable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && serverUnavailable(pgErr)
}

// connLost reports whether the connection under tx is closed: the server
// went away or the connection broke while the transaction was open.
func connLost(tx pgx.Tx) bool {
	conn := tx.Conn()
	return conn != nil && conn.IsClosed()
}

// begin starts a transaction on db. On a pool or a connection it is a
// pipeTx, which sends BEGIN with the first statement; fold lets Do commit it
// in its last round trip. release gives the connection back.
func (c *Client) begin(ctx context.Context, db Beginner, fold bool) (tx pgx.Tx, release func(), err error) {
	conn, release, ok, err := connFor(ctx, db)
	if err != nil {
		return nil, nil, err
	}
	if ok {
		return &pipeTx{conn: conn, opts: c.txOptions, fold: fold}, release, nil
	}
	release = func() {}
	level := c.cfg.IsolationLevel
	if _, nested := db.(pgx.Tx); level == "" || nested {
		// A savepoint runs at its transaction's isolation level.
		tx, err := db.Begin(ctx)
		return tx, release, err
	}
	if tb, ok := db.(txBeginner); ok {
		tx, err := tb.BeginTx(ctx, c.txOptions)
		return tx, release, err
	}
	tx, err = db.Begin(ctx)
	if err != nil {
		return nil, nil, err
	}
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL "+string(level)); err != nil {
		_ = tx.Rollback(ctx)
		return nil, nil, err
	}
	return tx, release, nil
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
