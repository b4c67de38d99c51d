package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/callertest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// handles are the ways these tests open a *sql.DB on a fresh connection:
// pgx's stdlib driver in every exec mode, and lib/pq.
var handles = []string{"pgx-cache_statement", "pgx-cache_describe", "pgx-describe_exec", "pgx-exec", "pgx-simple_protocol", "pq"}

// freshDB opens a *sql.DB of one connection on url as handle names it; with
// cancelRequest, pgx's stdlib driver cancels a statement whose context is
// done with a cancel request (lib/pq always does).
func freshDB(t *testing.T, url, handle string, cancelRequest bool) *sql.DB {
	t.Helper()
	var db *sql.DB
	if handle == "pq" {
		var err error
		if db, err = sql.Open("postgres", url); err != nil {
			t.Fatal(err)
		}
	} else {
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		mode := map[string]pgx.QueryExecMode{
			"pgx-cache_statement": pgx.QueryExecModeCacheStatement, "pgx-cache_describe": pgx.QueryExecModeCacheDescribe,
			"pgx-describe_exec": pgx.QueryExecModeDescribeExec, "pgx-exec": pgx.QueryExecModeExec,
			"pgx-simple_protocol": pgx.QueryExecModeSimpleProtocol,
		}[handle]
		cfg.DefaultQueryExecMode = mode
		if cancelRequest {
			callertest.CancelRequests(cfg)
		}
		db = stdlib.OpenDB(*cfg)
	}
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// aborted reports whether tx is aborted: a statement in it fails with
// 25P02.
func aborted(tx *sql.Tx) bool {
	_, err := tx.ExecContext(context.Background(), `SELECT 1`)
	return callertest.Aborted(err)
}

// refusalSetup stores "stored" (fingerprint a) and marks "unknown"
// unknown.
func refusalSetup(t *testing.T) (url string, setup *sql.DB) {
	t.Helper()
	ctx := context.Background()
	url = pgtest.URL(t, idem.Migrate)
	setup = open(t, "pgx", url)
	if _, err := setup.ExecContext(ctx, `CREATE TABLE effects (key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := idemsql.DoInTx(ctx, setup, scope, "stored", fpOf("a"), okFn); err != nil {
		t.Fatal(err)
	}
	r, err := idemsql.Reserve(ctx, setup, scope, "unknown", fpOf("a"), time.Minute)
	if err == nil {
		err = idemsql.MarkUnknown(ctx, setup, r, "timeout")
	}
	if err != nil {
		t.Fatal(err)
	}
	return url, setup
}

// other runs sql in a transaction of another session, kept open until the
// returned function runs.
func other(t *testing.T, db *sql.DB, sql string, args ...any) func() {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), nil)
	if err == nil {
		_, err = tx.ExecContext(context.Background(), sql, args...)
	}
	if err != nil {
		t.Fatal(err)
	}
	return func() { _ = tx.Rollback() }
}

func okFn(context.Context, *sql.Tx) (idem.Response, error) { return created, nil }

// A refusal of idemsql.Do on a fresh connection, with pgx's stdlib driver
// in every exec mode and with lib/pq, leaves the caller's transaction
// usable: its own write commits. Among the refusals: idem_keys locked by
// another session past the caller's own lock_timeout.
func TestRefusalOnFreshConnectionLeavesTxUsable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, setup := refusalSetup(t)
	for _, handle := range handles {
		for _, c := range callertest.Refusals {
			db := freshDB(t, url, handle, false)
			client, err := idemsql.New(idem.Config{Wait: 20 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.ExecContext(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
				t.Fatal(err)
			}
			mark := handle + " " + c.Name
			if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ($1)`, mark); err != nil {
				t.Fatal(err)
			}
			release := func() {}
			switch c.Other {
			case callertest.HoldKey:
				held := fpOf("a")
				release = other(t, setup, c.Other, scope.Actor, scope.Operation, held[:])
			case callertest.LockTable:
				release = other(t, setup, c.Other)
			}
			fn, fp := okFn, fpOf("a")
			if c.NilFn {
				fn = nil
			}
			if c.Reused {
				fp = fpOf("b")
			}
			_, err = client.Do(ctx, tx, scope, c.Key, fp, fn)
			release()
			if !errors.Is(err, c.Want) {
				t.Errorf("%s: err = %v, want %v", mark, err, c.Want)
			}
			if aborted(tx) {
				t.Errorf("%s: Do refused (%v) and left the caller's transaction aborted", mark, err)
				_ = tx.Rollback()
				continue
			}
			if err := tx.Commit(); err != nil {
				t.Errorf("%s: commit after the refusal: %v", mark, err)
			}
			var n int
			if err := setup.QueryRowContext(ctx, `SELECT count(*) FROM effects WHERE key = $1`, mark).Scan(&n); err != nil || n != 1 {
				t.Errorf("%s: the caller's write did not commit (%d, %v)", mark, n, err)
			}
		}
	}
}

// Contexts cancelled at random small delays while idemsql.Do runs on fresh
// connections: when Do returns a refusal, the caller's transaction is never
// aborted.
func TestCancelledDoNeverAbortsAfterARefusal(t *testing.T) {
	t.Parallel()
	url, setup := refusalSetup(t)
	held := fpOf("a")
	defer other(t, setup, callertest.HoldKey, scope.Actor, scope.Operation, held[:])()
	trials := callertest.Trials(30)
	for _, handle := range handles {
		tally := callertest.Cancelled(t, trials, func(begin func() context.Context, i int) (bool, bool, error) {
			db := freshDB(t, url, handle, true)
			defer db.Close()
			client, err := idemsql.New(idem.Config{Wait: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			tx, err := db.BeginTx(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			key, fp := "held", fpOf("a")
			if i%2 == 1 {
				key, fp = "stored", fpOf("b")
			}
			_, err = client.Do(begin(), tx, scope, key, fp, okFn)
			_, pingErr := tx.ExecContext(context.Background(), `SELECT 1`)
			isAborted := aborted(tx)
			return isAborted, pingErr != nil && !isAborted && idem.Unavailable(pingErr), err
		})
		t.Logf("%s: %d trials: %v", handle, trials, tally)
	}
}

// After a failed claim on a warm connection (pgx's stdlib driver in both
// exec modes that cache statements, and lib/pq), the next idemsql.Do there
// still claims inside its savepoint: with idem_keys locked by another
// session past the caller's lock_timeout, it refuses and the caller's
// transaction stays usable.
func TestFailedClaimOnWarmConnectionKeepsNextDoInItsSavepoint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, setup := refusalSetup(t)
	held := fpOf("a")
	for _, handle := range []string{"pgx-cache_statement", "pgx-cache_describe", "pq"} {
		for _, f := range callertest.FailedClaims {
			name, prefix := handle+", "+f.Name, strings.ReplaceAll(handle+"-"+f.Name, " ", "-")
			db := freshDB(t, url, handle, true)
			for i := range 2 { // warm: the claim's statements cached
				tx, err := db.BeginTx(ctx, nil)
				if err == nil {
					_, err = idemsql.Do(ctx, tx, scope, fmt.Sprintf("%s-warm-%d", prefix, i), held, okFn)
				}
				if err == nil {
					err = tx.Commit()
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			release := other(t, setup, callertest.HoldKey, scope.Actor, scope.Operation, held[:])
			client, err := idemsql.New(f.Config())
			if err != nil {
				t.Fatal(err)
			}
			fp := held
			if f.Key == "stored" {
				fp = fpOf("b")
			}
			callCtx, cancel := f.Context()
			if f.InTx {
				_, err = client.DoInTx(callCtx, db, scope, f.Key, fp, okFn)
			} else {
				tx, beginErr := db.BeginTx(ctx, nil)
				if beginErr != nil {
					t.Fatal(beginErr)
				}
				_, err = client.Do(callCtx, tx, scope, f.Key, fp, okFn)
				_ = tx.Rollback()
			}
			cancel()
			release()
			if err == nil {
				t.Fatalf("%s: no error", name)
			}

			release = other(t, setup, callertest.LockTable)
			tx, err := db.BeginTx(ctx, nil)
			if err == nil {
				_, err = tx.ExecContext(ctx, `SET LOCAL lock_timeout = '100ms'`)
			}
			if err != nil {
				t.Fatal(err)
			}
			_, err = idemsql.Do(ctx, tx, scope, prefix+"-new", held, okFn)
			release()
			if !errors.Is(err, idem.ErrInProgress) {
				t.Errorf("%s, then Do with idem_keys locked: err = %v, want ErrInProgress", name, err)
			}
			if aborted(tx) {
				t.Errorf("%s, then Do with idem_keys locked (%v): the caller's transaction is aborted", name, err)
			}
			_ = tx.Rollback()
		}
	}
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
// rollback) is no refusal: the error is the undo's (idem.ErrUnavailable)
// and does not wrap idem.ErrInProgress. The same holds for fn's error when
// fn passes on a refusal of its own (a nested call's ErrInProgress): named
// in words only, while on a connection that survives the undo it is
// returned as it is.
func TestRefusalWhoseUndoFailsIsNoRefusal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, setup := refusalSetup(t)
	fp := fpOf("a")
	release := other(t, setup, callertest.HoldKey, scope.Actor, scope.Operation, fp[:])
	defer release()
	nestedRefusal := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('nested')`); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{}, fmt.Errorf("a nested call: %w", &idem.InProgressError{RetryAfter: time.Second})
	}
	c, err := idemsql.New(idem.Config{Wait: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, key string
		fn        func(ctx context.Context, tx *sql.Tx) (idem.Response, error)
		cut       bool
	}{
		{"the claim's refusal", "held", okFn, true},
		{"fn's refusal", "free", nestedRefusal, true},
		{"fn's refusal, undone", "free", nestedRefusal, false},
	} {
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		if tc.cut {
			cfg.Tracer = cutAtUndo{}
		}
		db := stdlib.OpenDB(*cfg)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Do(ctx, tx, scope, tc.key, fp, tc.fn)
		switch {
		case !tc.cut && (!errors.Is(err, idem.ErrInProgress) || idem.Unavailable(err)):
			t.Errorf("%s: err = %v; want fn's ErrInProgress", tc.name, err)
		case !tc.cut:
			if _, err := tx.ExecContext(ctx, `SELECT 1`); err != nil {
				t.Errorf("%s: the transaction is not usable: %v", tc.name, err)
			}
		case err == nil || errors.Is(err, idem.ErrInProgress) || !errors.Is(err, idem.ErrUnavailable):
			t.Errorf("%s: err = %v; want ErrUnavailable, not ErrInProgress", tc.name, err)
		case !strings.Contains(err.Error(), "in progress"):
			t.Errorf("%s: err = %v; want the refusal named in words", tc.name, err)
		}
		_ = tx.Rollback()
		_ = db.Close()
	}
}
