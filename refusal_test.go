package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/callertest"
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
		callertest.CancelRequests(cfg)
	}
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// waitingClient is a new Client (which has not asked whether the database is
// Citus yet) that waits for a twin at most wait.
func waitingClient(t *testing.T, wait time.Duration) *idem.Client {
	t.Helper()
	c, err := idem.New(idem.Config{Wait: wait})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// refusalPool returns a pool on a fresh database where "stored" holds the
// outcome of a call with fpA, its URL, and the counter of fn's runs.
func refusalPool(t *testing.T) (pool *pgxpool.Pool, url string, calls *atomic.Int64) {
	t.Helper()
	pool, calls = newPool(t), &atomic.Int64{}
	if _, err := idem.DoInTx(context.Background(), pool, scope, "stored", fpA, recordEffect(calls, "stored")); err != nil {
		t.Fatal(err)
	}
	return pool, pool.Config().ConnConfig.ConnString(), calls
}

// aborted reports whether tx is aborted: a statement in it fails with
// 25P02.
func aborted(tx pgx.Tx) bool {
	_, err := tx.Exec(context.Background(), `SELECT 1`)
	return callertest.Aborted(err)
}

// A refusal of Do on a fresh connection (pgx's caches empty, a new Client
// that has not yet asked whether the database is Citus), in every exec
// mode, leaves the caller's transaction usable: its own write commits.
// Among the refusals: idem_keys locked by another session past the
// caller's own lock_timeout.
func TestRefusalOnFreshConnectionLeavesTxUsable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url, calls := refusalPool(t)
	r, err := idem.Reserve(ctx, pool, scope, "unknown", fpA, time.Minute)
	if err == nil {
		err = idem.MarkUnknown(ctx, pool, r, "timeout")
	}
	if err != nil {
		t.Fatal(err)
	}
	// Another session holds LOCK TABLE idem_keys, or a claim of "held",
	// while the call runs.
	other := func(c callertest.Refusal) func() {
		switch c.Other {
		case "":
			return func() {}
		case callertest.HoldKey:
			return hold(t, pool, c.Other, scope.Actor, scope.Operation, fpA[:])
		}
		return hold(t, pool, c.Other)
	}
	for _, mode := range execModes {
		for _, c := range callertest.Refusals {
			client, conn := waitingClient(t, 20*time.Millisecond), freshConn(t, url, mode, false)
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ($1, 'caller')`, mode.String()+c.Name); err != nil {
				t.Fatal(err)
			}
			release := other(c)
			fn, fp := recordEffect(calls, c.Key), fpA
			if c.NilFn {
				fn = nil
			}
			if c.Reused {
				fp = fpB
			}
			_, err = client.Do(ctx, tx, scope, c.Key, fp, fn)
			release()
			if !errors.Is(err, c.Want) {
				t.Errorf("%s, %s: err = %v, want %v", mode, c.Name, err, c.Want)
			}
			if aborted(tx) {
				t.Errorf("%s, %s: Do refused (%v) and left the caller's transaction aborted", mode, c.Name, err)
				_ = tx.Rollback(ctx)
				continue
			}
			if err := tx.Commit(ctx); err != nil {
				t.Errorf("%s, %s: commit after the refusal: %v", mode, c.Name, err)
			}
			if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1 AND note = 'caller'`, mode.String()+c.Name); n != 1 {
				t.Errorf("%s, %s: the caller's write did not commit", mode, c.Name)
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
	pool, url, calls := refusalPool(t)
	twin, err := pool.Begin(ctx) // holds "held" claimed for the whole test
	if err != nil {
		t.Fatal(err)
	}
	defer twin.Rollback(ctx)
	if _, err := idem.Do(ctx, twin, scope, "held", fpA, recordEffect(calls, "held")); err != nil {
		t.Fatal(err)
	}
	trials := callertest.Trials(40)
	for _, mode := range execModes {
		tally := callertest.Cancelled(t, trials, func(begin func() context.Context, i int) (bool, bool, error) {
			client, conn := waitingClient(t, time.Millisecond), freshConn(t, url, mode, true)
			defer conn.Close(context.Background())
			tx, err := conn.Begin(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			key, fp := "held", fpA
			if i%2 == 1 {
				key, fp = "stored", fpB
			}
			_, err = client.Do(begin(), tx, scope, key, fp, recordEffect(calls, key))
			return !conn.IsClosed() && aborted(tx), conn.IsClosed(), err
		})
		t.Logf("%s: %d trials: %v", mode, trials, tally)
	}
}

// A connection whose statement cache evicted the claim's statements after
// Do ran there (a cache smaller than the statements the service runs
// between two calls): pgx prepares them again before the batch, in the
// caller's transaction, where a lock wait fails outside Do's savepoint. Do
// then never answers with a refusal: its error says what failed, and the
// caller's transaction is aborted as that error implies.
func TestEvictedStatementsNeverGiveARefusal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	cfg := pool.Config().ConnConfig.Copy()
	cfg.StatementCacheCapacity = 3
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var calls atomic.Int64
	for _, key := range []string{"warm-1", "warm-2"} { // the claim's statements cached, and known so
		if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, key, fpA, recordEffect(&calls, key))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, sql := range []string{`SET LOCAL lock_timeout = '100ms'`, `SELECT 1`, `SELECT 2`, `SELECT 3`} { // evicts them
		if _, err := tx.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := locker.Exec(ctx, callertest.LockTable); err != nil {
		t.Fatal(err)
	}
	_, err = idem.Do(ctx, tx, scope, "evicted", fpA, recordEffect(&calls, "evicted"))
	_ = locker.Rollback(ctx)
	if err == nil || callertest.IsRefusal(err) {
		t.Fatalf("Do with its statements evicted and the table locked: %v; want an error that is no refusal", err)
	}
	t.Logf("Do: %v", err)
}

// A claim that fails on a warm connection (one whose earlier calls left the
// claim's statements in pgx's cache) makes pgx drop every statement of its
// batch from its caches. The next Do there must prepare the claim inside its
// savepoint again: with another session holding idem_keys locked past the
// caller's lock_timeout, it refuses (ErrInProgress) and the caller's
// transaction stays usable. Each kind of failed claim, in both exec modes
// that cache statements.
func TestFailedClaimOnWarmConnectionKeepsNextDoInItsSavepoint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url, calls := refusalPool(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe} {
		for _, f := range callertest.FailedClaims {
			name, prefix := mode.String()+", "+f.Name, strings.ReplaceAll(mode.String()+"-"+f.Name, " ", "-")
			conn := freshConn(t, url, mode, true)
			for i := range 2 { // warm: the claim's statements cached
				key := fmt.Sprintf("%s-warm-%d", prefix, i)
				if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
					_, err := idem.Do(ctx, tx, scope, key, fpA, recordEffect(calls, key))
					return err
				}); err != nil {
					t.Fatal(err)
				}
			}
			release := hold(t, pool, callertest.HoldKey, scope.Actor, scope.Operation, fpA[:])
			client, err := idem.New(f.Config())
			if err != nil {
				t.Fatal(err)
			}
			fp, fn := fpA, recordEffect(calls, f.Key)
			if f.Key == "stored" {
				fp = fpB
			}
			callCtx, cancel := f.Context()
			if f.InTx {
				_, err = client.DoInTx(callCtx, conn, scope, f.Key, fp, fn)
			} else {
				err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
					_, err := client.Do(callCtx, tx, scope, f.Key, fp, fn)
					return err
				})
			}
			cancel()
			release()
			if err == nil || conn.IsClosed() {
				t.Fatalf("%s: %v (connection closed: %v)", name, err, conn.IsClosed())
			}

			release = hold(t, pool, callertest.LockTable)
			tx, err := conn.Begin(ctx)
			if err == nil {
				_, err = tx.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`)
			}
			if err != nil {
				t.Fatal(err)
			}
			_, err = idem.Do(ctx, tx, scope, prefix+"-new", fpA, recordEffect(calls, "new"))
			release()
			if !errors.Is(err, idem.ErrInProgress) {
				t.Errorf("%s, then Do with idem_keys locked: err = %v, want ErrInProgress", name, err)
			}
			if aborted(tx) {
				t.Errorf("%s, then Do with idem_keys locked (%v): the caller's transaction is aborted", name, err)
			}
			_ = tx.Rollback(ctx)
		}
	}
}

// hold runs sql with args in a transaction of another session on pool, and
// keeps it open until the returned function runs.
func hold(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, sql, args...)
	}
	if err != nil {
		t.Fatal(err)
	}
	return func() { _ = tx.Rollback(ctx) }
}

// cutAtUndo is a pgx tracer that closes the connection's socket when Do
// starts undoing its savepoint.
type cutAtUndo struct{}

func (cutAtUndo) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(data.SQL, "ROLLBACK TO SAVEPOINT idem_do") {
		_ = conn.PgConn().Conn().Close()
	}
	return ctx
}

func (cutAtUndo) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A refusal whose savepoint cannot be undone (the connection broke at the
// rollback) is no refusal: the caller's transaction is gone, so the error
// is the undo's (ErrUnavailable) and does not wrap ErrInProgress, which
// promises a transaction as it was. The same holds for fn's error, when fn
// passes on a refusal of its own (a nested call's ErrInProgress): it is
// named in words only, while on a connection that survives the undo it is
// returned as it is.
func TestRefusalWhoseUndoFailsIsNoRefusal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url, calls := refusalPool(t)
	release := hold(t, pool, callertest.HoldKey, scope.Actor, scope.Operation, fpA[:])
	defer release()
	nestedRefusal := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		if _, err := recordEffect(calls, "nested")(ctx, tx); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{}, fmt.Errorf("a nested call: %w", &idem.InProgressError{RetryAfter: time.Second})
	}
	for _, c := range []struct {
		name, key string
		fn        func(ctx context.Context, tx pgx.Tx) (idem.Response, error)
		cut       bool
	}{
		{"the claim's refusal", "held", recordEffect(calls, "held"), true},
		{"fn's refusal", "free", nestedRefusal, true},
		{"fn's refusal, undone", "free", nestedRefusal, false},
	} {
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		if c.cut {
			cfg.Tracer = cutAtUndo{}
		}
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = waitingClient(t, 20*time.Millisecond).Do(ctx, tx, scope, c.key, fpA, c.fn)
		switch {
		case !c.cut && (!errors.Is(err, idem.ErrInProgress) || idem.Unavailable(err) || aborted(tx)):
			t.Errorf("%s: err = %v (transaction aborted: %v); want fn's ErrInProgress, the transaction usable", c.name, err, aborted(tx))
		case c.cut && (err == nil || errors.Is(err, idem.ErrInProgress) || !errors.Is(err, idem.ErrUnavailable)):
			t.Errorf("%s: err = %v; want ErrUnavailable, not ErrInProgress", c.name, err)
		case c.cut && !strings.Contains(err.Error(), "in progress"):
			t.Errorf("%s: err = %v; want the refusal named in words", c.name, err)
		case c.cut && !conn.IsClosed():
			t.Errorf("%s: the connection survived", c.name)
		}
		_ = conn.Close(ctx)
	}
}
