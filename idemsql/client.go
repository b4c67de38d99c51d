package idemsql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/bridge"
	"github.com/pgidem/idem/internal/dbsql"
)

// core is package idem's state machine and checks (see internal/bridge).
var core = bridge.Core.(bridge.Funcs[*idem.Client, idem.Result, idem.Response, idem.Record])

var queries = dbsql.New()

// Client is the database/sql form of idem.Client: the same configuration
// (idem.Config), the same calls, on *sql.DB and *sql.Tx. It holds no
// connections. A Client is safe for concurrent use.
type Client struct {
	c         *idem.Client
	cfg       idem.Config
	ttlMicros int64
	wait      string // Config.Wait as a lock_timeout value
	txOptions *sql.TxOptions
}

// New returns a Client for cfg, with zero fields replaced by their
// defaults (see idem.New). A field out of range gives an error wrapping
// idem.ErrInvalidConfig.
func New(cfg idem.Config) (*Client, error) {
	c, err := idem.New(cfg)
	if err != nil {
		return nil, err
	}
	cfg = c.Config()
	wait := max(cfg.Wait, time.Millisecond) // lock_timeout 0 would mean "wait forever"
	sc := &Client{c: c, cfg: cfg, ttlMicros: cfg.TTL.Microseconds(), wait: fmt.Sprintf("%dms", wait.Milliseconds())}
	if level, ok := isolationLevels[cfg.IsolationLevel]; ok {
		sc.txOptions = &sql.TxOptions{Isolation: level}
	}
	return sc, nil
}

// Config returns the client's configuration with defaults filled in.
func (c *Client) Config() idem.Config { return c.cfg }

// isolationLevels maps idem.Config.IsolationLevel to database/sql's levels
// ("" is the server's default: no level in BEGIN).
var isolationLevels = map[pgx.TxIsoLevel]sql.IsolationLevel{
	pgx.ReadUncommitted: sql.LevelReadUncommitted,
	pgx.ReadCommitted:   sql.LevelReadCommitted,
	pgx.RepeatableRead:  sql.LevelRepeatableRead,
	pgx.Serializable:    sql.LevelSerializable,
}

var defaultClient = func() *Client {
	c, err := New(idem.Config{})
	if err != nil {
		panic(err)
	}
	return c
}()

// InTx runs fn in a transaction begun on db and commits it when fn returns
// nil; when fn returns an error or panics the transaction is rolled back
// and the error (or panic) is passed on.
//
// After a serialization failure (40001) or a deadlock (40P01), anywhere in
// fn or at commit, the whole transaction is rolled back and run again, up
// to Config.MaxRetries times with jittered exponential backoff, so fn must
// be safe to run again. Both drivers' errors are recognized (pgx's
// *pgconn.PgError through its stdlib driver, lib/pq's *pq.Error).
//
// fn's errors are returned as they are, except when the store failed under
// them (the connection broke, or the server answered that it cannot serve:
// see idem.Unavailable): then InTx returns an error that wraps both
// idem.ErrUnavailable and fn's error. Failures to begin or commit because
// the server cannot be reached are idem.ErrUnavailable too.
//
// InTx uses the package defaults; see Client.InTx.
func InTx(ctx context.Context, db *sql.DB, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return defaultClient.InTx(ctx, db, fn)
}

// InTx is the package-level InTx with this client's isolation level and
// retry budget.
func (c *Client) InTx(ctx context.Context, db *sql.DB, fn func(ctx context.Context, tx *sql.Tx) error) error {
	if db == nil {
		return errNilDB
	}
	if fn == nil {
		return fmt.Errorf("%w: nil function", idem.ErrInvalidArgument)
	}
	return pooled(c.retry(ctx, func() error { return c.inTx(ctx, db, fn) }))
}

// retry runs once until it succeeds, fails with an error other than a
// serialization failure or a deadlock, or runs out of Config.MaxRetries.
func (c *Client) retry(ctx context.Context, once func() error) error {
	for attempt := 0; ; attempt++ {
		err := once()
		if err == nil || !core.Retryable(err) || attempt >= c.cfg.MaxRetries {
			return err
		}
		t := time.NewTimer(core.Backoff(attempt))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return err
		}
	}
}

// inTx is one transaction of InTx.
func (c *Client) inTx(ctx context.Context, db *sql.DB, fn func(ctx context.Context, tx *sql.Tx) error) error {
	tx, err := c.begin(ctx, db)
	if err != nil {
		return err
	}
	ended := false
	defer func() {
		if !ended { // fn panicked
			_ = rollback(ctx, tx)
		}
	}()
	err = fn(ctx, tx)
	ended = true
	if err != nil {
		// The store failed under fn when the server said it cannot serve,
		// or when the rollback finds the connection broken.
		return unavailableIf(serverSaidUnavailable(err) || connLost(rollback(ctx, tx)), err)
	}
	return commit(tx)
}

// begin begins a transaction on db at the configured isolation level.
func (c *Client) begin(ctx context.Context, db *sql.DB) (*sql.Tx, error) {
	tx, err := db.BeginTx(ctx, c.txOptions)
	if err != nil {
		return nil, unavailableIf(idem.Unavailable(err), fmt.Errorf("idem: begin: %w", err))
	}
	return tx, nil
}

// commit commits tx. database/sql ends the Tx whatever COMMIT answers.
func commit(tx *sql.Tx) error {
	if err := tx.Commit(); err != nil {
		return unavailableIf(idem.Unavailable(err), fmt.Errorf("idem: commit: %w", err))
	}
	return nil
}

// rollback rolls tx back, even when ctx is done: database/sql sends
// ROLLBACK whatever the context (a Tx whose context ended was rolled back
// already, and answers sql.ErrTxDone).
func rollback(_ context.Context, tx *sql.Tx) error {
	err := tx.Rollback()
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return err
}

// connLost reports whether err, the answer of a ROLLBACK, says the
// connection is gone.
func connLost(err error) bool { return err != nil && idem.Unavailable(err) }

// serverSaidUnavailable reports whether err holds a server error (of
// either driver) that says it cannot serve now: SQLSTATE class 08, 53, 57
// or 58.
func serverSaidUnavailable(err error) bool {
	var stateErr interface{ SQLState() string }
	return errors.As(err, &stateErr) && idem.Unavailable(err)
}

// sqlState returns the SQLSTATE of err if it is (or wraps) a server error
// of either driver.
func sqlState(err error) string {
	var stateErr interface{ SQLState() string }
	if errors.As(err, &stateErr) {
		return stateErr.SQLState()
	}
	return ""
}

// pooled names the fix when err is pgx's stdlib driver in its default exec
// mode losing its prepared statements behind a transaction pooler
// (idem.ErrPreparedStatements).
func pooled(err error) error {
	if lost := core.PreparedStatementsLost(err); lost != err {
		return fmt.Errorf("%w (on database/sql: default_query_exec_mode=exec, cache_describe or simple_protocol "+
			"in pgx's connection string)", lost)
	}
	return err
}

// txUnusable returns err wrapped with idem.ErrInvalidArgument when it says
// that the caller's transaction cannot be used (as package idem answers
// for a pgx.Tx): closed, committed or rolled back (sql.ErrTxDone), or
// aborted by a statement that failed in it (SQLSTATE 25P02).
func txUnusable(err error) error {
	switch {
	case err == nil || errors.Is(err, idem.ErrInvalidArgument):
		return err
	case errors.Is(err, sql.ErrTxDone):
		return fmt.Errorf("%w: the transaction is closed (committed or rolled back): %w", idem.ErrInvalidArgument, err)
	case sqlState(err) == pgerrcode.InFailedSQLTransaction:
		return fmt.Errorf("%w: the transaction is aborted (a statement failed in it; roll it back): %w", idem.ErrInvalidArgument, err)
	}
	return err
}

// unavailableIf wraps err with idem.ErrUnavailable when lost is true.
func unavailableIf(lost bool, err error) error {
	if !lost || errors.Is(err, idem.ErrUnavailable) {
		return err
	}
	return fmt.Errorf("%w: %w", idem.ErrUnavailable, err)
}

var (
	errNilDB = fmt.Errorf("%w: nil database handle", idem.ErrInvalidArgument)
	errNilTx = fmt.Errorf("%w: nil transaction", idem.ErrInvalidArgument)
)

// ValidateKey is idem.Client.ValidateKey: whether key is a valid
// idempotency key under this client's key length bounds (ErrInvalidKey).
func (c *Client) ValidateKey(key string) error { return c.c.ValidateKey(key) }

// ValidateScope is idem.ValidateScope (ErrInvalidScope): a scope's limits
// do not depend on the client's Config.
func (c *Client) ValidateScope(scope idem.Scope) error { return idem.ValidateScope(scope) }

// checkTarget validates the scope and key of a call.
func (c *Client) checkTarget(scope idem.Scope, key string) error {
	if err := c.c.ValidateKey(key); err != nil {
		return err
	}
	return idem.ValidateScope(scope)
}

// bridgeKey is the bridge's name of (scope, key).
func bridgeKey(scope idem.Scope, k string) bridge.Key {
	return bridge.Key{Actor: scope.Actor, Operation: scope.Operation, Key: k}
}
