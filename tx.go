package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
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
// see Unavailable): then InTx returns an error that wraps both
// ErrUnavailable and fn's error. Failures to begin or commit because the
// server cannot be reached are ErrUnavailable too.
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
	_, nested := db.(pgx.Tx)
	return preparedStatementsLost(c.retry(ctx, nested, func() error { return c.inTx(ctx, db, fn) }))
}

// retry runs once until it succeeds, fails with an error other than a
// serialization failure or a deadlock, or runs out of Config.MaxRetries. In
// a savepoint of a caller's transaction (nested) such a failure dooms the
// whole transaction, so only the caller can run it again.
func (c *Client) retry(ctx context.Context, nested bool, once func() error) error {
	for attempt := 0; ; attempt++ {
		err := once()
		if err == nil || !isRetryable(err) || nested || attempt >= c.cfg.MaxRetries {
			return err
		}
		if sleepErr := sleep(ctx, backoff(attempt)); sleepErr != nil {
			return err
		}
	}
}

// inTx is one transaction of InTx.
func (c *Client) inTx(ctx context.Context, db Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	tx, err := c.begin(ctx, db)
	if err != nil {
		return unavailableIf(isUnavailable(err), fmt.Errorf("idem: begin: %w", err))
	}
	committed := false
	defer func() {
		if !committed {
			rollback(ctx, tx)
		}
	}()
	// fn's errors come back as they are, unless the store failed under
	// them: the connection is gone, or the server said it cannot serve.
	// (The connection is looked at only while fn's transaction holds it: a
	// transaction of another Beginner may have given it back already.)
	if err := fn(ctx, tx); err != nil {
		return unavailableIf(connHeld(db) && connLost(tx.Conn()) || serverSaidUnavailable(err), err)
	}
	if err := tx.Commit(ctx); err != nil {
		return unavailableIf(isUnavailable(err), fmt.Errorf("idem: commit: %w", err))
	}
	committed = true
	return nil
}

// DoInTx runs Do in a transaction of its own begun on db, and commits it
// when Do returns a nil error: the claim, fn's writes and the stored
// response commit together. Serialization failures and deadlocks are
// retried (not on a pgx.Tx, see InTx), and a retry of a duplicate replays
// the winner's response. Under SERIALIZABLE such a failure can surface
// after fn ran (when the response is stored, or at COMMIT): then fn runs
// again in the retry, and only one run's writes commit. Invalid input is
// refused before a transaction begins; so is a *pgx.Conn that is already in
// a transaction.
//
// On a *pgxpool.Pool or a *pgx.Conn, DoInTx sends BEGIN with the claim and
// COMMIT with the stored response, so the transaction costs no round trip
// of its own, and fn runs directly in it (no savepoint): when fn fails the
// transaction is rolled back whole. On a pgx.Tx or another Beginner it is
// InTx around Do.
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
	if conn, ok := db.(*pgx.Conn); ok && conn.PgConn().TxStatus() != 'I' {
		return Result{}, errConnInTx
	}
	ctx, cl := c.obs.begin(ctx, "do_in_tx", "idem.DoInTx", scope, key)
	defer cl.endIfPanicking(ctx)
	res, err := c.coalesced(ctx, db, scope, key, fp, fn, &cl)
	err = preparedStatementsLost(err)
	cl.end(ctx, res, err)
	return res, err
}

// doInTx is DoInTx after its checks, without coalescing.
func (c *Client) doInTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error), cl *call) (res Result, err error) {
	k := newRowKey(scope, key)
	switch d := db.(type) {
	case *pgxpool.Pool:
		conn, err := d.Acquire(ctx)
		if err != nil {
			return Result{}, unavailableIf(isUnavailable(err), fmt.Errorf("idem: begin: %w", err))
		}
		defer conn.Release()
		err = c.retry(ctx, false, func() (err error) { res, err = c.doOwnTx(ctx, conn.Conn(), k, fp, fn, cl); return err })
		return res, err
	case *pgx.Conn:
		err = c.retry(ctx, false, func() (err error) { res, err = c.doOwnTx(ctx, d, k, fp, fn, cl); return err })
		return res, err
	}
	err = c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) (err error) {
		res, err = c.do(ctx, tx, k, fp, fn, cl)
		return err
	})
	if err != nil {
		return Result{}, err
	}
	return res, nil
}

// doOwnTx is one run of DoInTx in transactions of its own on conn: the call
// loop (idem.go) with BEGIN sent with the claim and COMMIT with the stored
// outcome (or with the read of a row that holds the key). fn runs directly
// in the transaction; when it fails, the transaction is rolled back.
func (c *Client) doOwnTx(ctx context.Context, conn *pgx.Conn, k rowKey, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error), cl *call) (Result, error) {
	return c.call(ctx, &span{conn: conn, txOptions: c.txOptions}, k, fp, fn, cl)
}

// commitResult checks the result of a COMMIT sent in a batch.
func commitResult(tag pgconn.CommandTag, err error) error {
	if err == nil && tag.String() == "ROLLBACK" {
		err = pgx.ErrTxCommitRollback // the transaction was aborted
	}
	if err != nil {
		return fmt.Errorf("idem: commit: %w", err)
	}
	return nil
}

// rollback rolls tx back, even when ctx is done. A transaction that a
// batch already ended answers with a warning only.
func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	_ = tx.Rollback(ctx)
}

// unavailableIf wraps err with ErrUnavailable when lost is true.
func unavailableIf(lost bool, err error) error {
	if !lost || errors.Is(err, ErrUnavailable) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// connHeld reports whether the connection of a transaction begun on db
// stays with that transaction until it ends: it does for a pool, a
// connection and a caller's transaction; another Beginner may hand it back
// early.
func connHeld(db Beginner) bool {
	switch db.(type) {
	case *pgxpool.Pool, *pgx.Conn, pgx.Tx:
		return true
	}
	return false
}

// serverSaidUnavailable reports whether err holds a server error that
// says it cannot serve now (see serverUnavailable).
func serverSaidUnavailable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && serverUnavailable(pgErr)
}

// connLost reports whether conn is closed: the server went away or the
// connection broke.
func connLost(conn *pgx.Conn) bool {
	return conn != nil && conn.IsClosed()
}

var errConnInTx = fmt.Errorf("%w: the connection is in a transaction; pass that pgx.Tx instead", ErrInvalidArgument)

// begin starts a transaction on db, at the configured isolation level
// unless db is a pgx.Tx (a savepoint runs at its transaction's level).
func (c *Client) begin(ctx context.Context, db Beginner) (pgx.Tx, error) {
	if conn, ok := db.(*pgx.Conn); ok && conn.PgConn().TxStatus() != 'I' {
		// BEGIN would only warn, and COMMIT would end the caller's
		// transaction.
		return nil, errConnInTx
	}
	level := c.cfg.IsolationLevel
	if _, nested := db.(pgx.Tx); level == "" || nested {
		return db.Begin(ctx)
	}
	if tb, ok := db.(txBeginner); ok {
		return tb.BeginTx(ctx, c.txOptions)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL "+string(level)); err != nil {
		rollback(ctx, tx)
		return nil, err
	}
	return tx, nil
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
