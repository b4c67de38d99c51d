package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/callertest"
)

// execModes are every query exec mode of pgx.
var execModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// freshConn opens a connection to url in mode, whose statement caches are
// empty; with cancelRequest, a done context sends the server a cancel
// request (pgconn.CancelRequestContextWatcherHandler) instead of closing
// the connection.
func freshConn(t *testing.T, url string, mode pgx.QueryExecMode, cancelRequest bool) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.DefaultQueryExecMode = mode
	if cancelRequest {
		cfg.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: 5 * time.Second}
		}
	}
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// aborted reports whether tx is aborted: a statement in it fails with
// 25P02.
func aborted(tx pgx.Tx) bool {
	_, err := tx.Exec(context.Background(), `SELECT 1`)
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InFailedSQLTransaction
}

// A refusal of Do on a fresh connection (pgx's caches empty, a new Client
// that has not yet asked whether the database is Citus), in every exec
// mode, leaves the caller's transaction usable: its own write commits.
// Among the refusals: idem_keys locked by another session past the
// caller's own lock_timeout.
func TestRefusalOnFreshConnectionLeavesTxUsable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	url := pool.Config().ConnConfig.ConnString()
	var calls atomic.Int64
	if _, err := idem.DoInTx(ctx, pool, scope, "stored", fpA, recordEffect(&calls, "stored")); err != nil {
		t.Fatal(err)
	}
	r, err := idem.Reserve(ctx, pool, scope, "unknown", fpA, time.Minute)
	if err == nil {
		err = idem.MarkUnknown(ctx, pool, r, "timeout")
	}
	if err != nil {
		t.Fatal(err)
	}
	// Another session holds LOCK TABLE idem_keys, or a claim of "held",
	// while the call runs.
	other := func(sql string, args ...any) func() {
		o, err := pool.Begin(ctx)
		if err == nil {
			_, err = o.Exec(ctx, sql, args...)
		}
		if err != nil {
			t.Fatal(err)
		}
		return func() { _ = o.Rollback(ctx) }
	}
	cases := []struct {
		name  string
		key   string
		fp    idem.Fingerprint
		other func() func()
		want  error
	}{
		{"table locked", "new", fpA, func() func() { return other(callertest.LockTable) }, idem.ErrInProgress},
		{"held by a twin", "held", fpA, func() func() { return other(callertest.HoldKey, scope.Actor, scope.Operation, fpA[:]) }, idem.ErrInProgress},
		{"key reused", "stored", fpB, nil, idem.ErrKeyReused},
		{"outcome unknown", "unknown", fpA, nil, idem.ErrOutcomeUnknown},
		{"nil fn", "new", fpA, nil, idem.ErrInvalidArgument},
	}
	for _, mode := range execModes {
		for _, c := range cases {
			conn := freshConn(t, url, mode, false)
			client, err := idem.New(idem.Config{Wait: 20 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ($1, 'caller')`, mode.String()+c.name); err != nil {
				t.Fatal(err)
			}
			release := func() {}
			if c.other != nil {
				release = c.other()
			}
			fn := recordEffect(&calls, c.key)
			if c.name == "nil fn" {
				fn = nil
			}
			_, err = client.Do(ctx, tx, scope, c.key, c.fp, fn)
			release()
			if !errors.Is(err, c.want) {
				t.Errorf("%s, %s: err = %v, want %v", mode, c.name, err, c.want)
			}
			if aborted(tx) {
				t.Errorf("%s, %s: Do refused (%v) and left the caller's transaction aborted", mode, c.name, err)
				_ = tx.Rollback(ctx)
				continue
			}
			if err := tx.Commit(ctx); err != nil {
				t.Errorf("%s, %s: commit after the refusal: %v", mode, c.name, err)
			}
			if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1 AND note = 'caller'`, mode.String()+c.name); n != 1 {
				t.Errorf("%s, %s: the caller's write did not commit", mode, c.name)
			}
		}
	}
}

// Contexts cancelled at random small delays while Do runs on fresh
// connections, in every exec mode, with pgx's cancel-request handler (the
// server cancels the statement in flight; the connection lives on): when Do
// returns a refusal, the caller's transaction is never aborted.
func TestCancelledDoNeverAbortsAfterARefusal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	url := pool.Config().ConnConfig.ConnString()
	var calls atomic.Int64
	if _, err := idem.DoInTx(ctx, pool, scope, "stored", fpA, recordEffect(&calls, "stored")); err != nil {
		t.Fatal(err)
	}
	twin, err := pool.Begin(ctx) // holds "held" claimed for the whole test
	if err != nil {
		t.Fatal(err)
	}
	defer twin.Rollback(ctx)
	if _, err := idem.Do(ctx, twin, scope, "held", fpA, recordEffect(&calls, "held")); err != nil {
		t.Fatal(err)
	}
	trials := 40
	if testing.Short() {
		trials = 8
	}
	for _, mode := range execModes {
		tally := callertest.Cancelled(t, trials, func(begin func() context.Context, i int) (bool, bool, error) {
			conn := freshConn(t, url, mode, true)
			defer conn.Close(context.Background())
			client, err := idem.New(idem.Config{Wait: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			tx, err := conn.Begin(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			key, fp := "held", fpA
			if i%2 == 1 {
				key, fp = "stored", fpB
			}
			_, err = client.Do(begin(), tx, scope, key, fp, recordEffect(&calls, key))
			return !conn.IsClosed() && aborted(tx), conn.IsClosed(), err
		})
		t.Logf("%s: %d trials: %v", mode, trials, tally)
	}
}
