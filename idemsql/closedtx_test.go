package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// DoInTx with a context already done fails to begin its transaction and
// returns the context's error: nothing to undo, nothing stored.
func TestDoInTxCancelledBeforeBegin(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, pool := migrated(t, driver)
		cancelled, cancel := context.WithCancel(context.Background())
		cancel()
		c, err := idemsql.New(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.DoInTx(cancelled, db, scope, "cancelled", fpOf("a"), okFn); !errors.Is(err, context.Canceled) {
			t.Errorf("err = %v, want context.Canceled", err)
		}
		if n := keyCount(t, pool); n != 0 {
			t.Errorf("%d key rows", n)
		}
	})
}

// Do on a transaction that is closed (committed or rolled back) or aborted
// is idem.ErrInvalidArgument, as in idem.Do: nothing runs.
func TestDoOnAClosedTransaction(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, pool := migrated(t, driver)
		ran := false
		fn := func(context.Context, *sql.Tx) (idem.Response, error) { ran = true; return created, nil }
		for _, state := range []string{"committed", "rolled back", "aborted"} {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			switch state {
			case "committed":
				err = tx.Commit()
			case "rolled back":
				err = tx.Rollback()
			case "aborted":
				if _, err = tx.ExecContext(ctx, `SELECT 1/0`); err != nil {
					err = nil
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			if _, err := idemsql.Do(ctx, tx, scope, "closed", fpOf("a"), fn); !errors.Is(err, idem.ErrInvalidArgument) {
				t.Errorf("Do on the %s transaction: err = %v, want ErrInvalidArgument", state, err)
			}
			_ = tx.Rollback()
		}
		if ran || keyCount(t, pool) != 0 {
			t.Fatalf("fn ran: %v; %d key rows", ran, keyCount(t, pool))
		}
	})
}

// An fn that commits or rolls back the transaction DoInTx runs it in gets
// an error wrapping idem.ErrInvalidArgument that says which, with both
// drivers, as in idem.DoInTx. When fn committed, the record is unknown:
// retries get idem.ErrOutcomeUnknown, ListUnknown lists it and Resolve
// settles it. When it rolled back, the key runs again. Do, whose fn commits
// the caller's transaction, says so too, and DoInTx then marks the record.
func TestFnEndingItsTransaction(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, pool := migrated(t, driver)
		if _, err := db.ExecContext(ctx, `CREATE TABLE effects (key text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		runs := 0
		fn := func(key, end string) func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			return func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				runs++
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ($1)`, key); err != nil {
					return idem.Response{}, err
				}
				var err error
				switch end {
				case "commit":
					err = tx.Commit()
				case "rollback":
					err = tx.Rollback()
				}
				return created, err
			}
		}
		effects := func(key string) int {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE key = $1`, key).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		status := func(key string) string {
			var s string
			if err := pool.QueryRow(ctx, `SELECT status FROM idem_keys WHERE idem_key = $1`, key).Scan(&s); err != nil {
				return err.Error()
			}
			return s
		}

		_, err := idemsql.DoInTx(ctx, db, scope, "rollback", fpOf("a"), fn("rollback", "rollback"))
		if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "fn rolled back") {
			t.Errorf("rollback: err = %v", err)
		}
		if effects("rollback") != 0 || keyCount(t, pool) != 0 {
			t.Errorf("rollback: %d effects, %d keys", effects("rollback"), keyCount(t, pool))
		}
		if res, err := idemsql.DoInTx(ctx, db, scope, "rollback", fpOf("a"), fn("rollback", "")); err != nil || res.Replayed {
			t.Errorf("rollback, again: %+v, %v", res, err)
		}

		_, err = idemsql.DoInTx(ctx, db, scope, "commit", fpOf("a"), fn("commit", "commit"))
		if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "fn committed") {
			t.Errorf("commit: err = %v", err)
		}
		if effects("commit") != 1 || status("commit") != "unknown" {
			t.Errorf("commit: %d effects, status %s", effects("commit"), status("commit"))
		}
		if _, err := idemsql.DoInTx(ctx, db, scope, "commit", fpOf("a"), fn("commit", "")); !errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Errorf("commit, again: err = %v, want ErrOutcomeUnknown", err)
		}

		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, err = idemsql.Do(ctx, tx, scope, "do", fpOf("a"), fn("do", "commit"))
		if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "fn committed or rolled back") {
			t.Errorf("Do: err = %v", err)
		}
		if _, err := idemsql.DoInTx(ctx, db, scope, "do", fpOf("a"), fn("do", "")); !errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Errorf("Do, then DoInTx: err = %v, want ErrOutcomeUnknown", err)
		}

		recs, err := idemsql.ListUnknown(ctx, db, 10, nil)
		if err != nil || len(recs) != 2 {
			t.Fatalf("ListUnknown: %+v, %v", recs, err)
		}
		for _, rec := range recs {
			if err := idemsql.Resolve(ctx, db, rec.Scope, rec.Key, idem.Resolution{Token: rec.Token, Retryable: true, Reason: "undone by hand"}); err != nil {
				t.Fatalf("Resolve %s: %v", rec.Key, err)
			}
		}
		if res, err := idemsql.DoInTx(ctx, db, scope, "commit", fpOf("a"), fn("commit", "")); err != nil || res.Replayed {
			t.Errorf("commit, resolved: %+v, %v", res, err)
		}
		if runs != 5 {
			t.Errorf("fn ran %d times, want 5", runs)
		}
	})
}

// cancelAfterCompletion is a pgx tracer that cancels a call's context once
// its completion (KeyComplete) succeeded, before DoInTx commits; database/sql
// then rolls the transaction back. It records the statements sent after
// that.
type cancelAfterCompletion struct {
	cancel context.CancelFunc
	mu     sync.Mutex
	ran    bool     // the completion ran
	after  []string // statements sent after it
}

type tracedSQL struct{}

func (c *cancelAfterCompletion) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ran {
		c.after = append(c.after, data.SQL)
	}
	return context.WithValue(ctx, tracedSQL{}, data.SQL)
}

func (c *cancelAfterCompletion) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	sql, _ := ctx.Value(tracedSQL{}).(string)
	if data.Err != nil || !strings.Contains(sql, "name: KeyComplete ") {
		return
	}
	c.mu.Lock()
	c.ran = true
	c.mu.Unlock()
	c.cancel()
	// database/sql marks the transaction done as soon as its context ends
	// (its ROLLBACK then waits for this statement to end); give it that
	// moment, so that DoInTx's Commit finds the transaction done, not only
	// the context.
	time.Sleep(200 * time.Millisecond)
}

// DoInTx whose context ends after the completion, before its COMMIT:
// database/sql has rolled the transaction back, and Commit answers
// sql.ErrTxDone. The call returns the context's error (nothing was stored,
// nothing of fn's committed) and does not blame fn; all it sends after is
// the check whether fn had committed the claim without an outcome
// (KeyMarkUnknown, which finds no such row, then KeyLookup).
func TestDoInTxCancelledBeforeCommit(t *testing.T) {
	t.Parallel()
	url, setup := refusalSetup(t)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tracer := &cancelAfterCompletion{cancel: cancel}
	cfg.Tracer = tracer
	db := stdlib.OpenDB(*cfg)
	defer func() { _ = db.Close() }()
	ran := false
	_, err = idemsql.DoInTx(ctx, db, scope, "cancelled", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		ran = true
		_, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('cancelled')`)
		return created, err
	})
	if !ran || !tracer.ran {
		t.Fatalf("fn ran: %v, the completion ran: %v (err %v)", ran, tracer.ran, err)
	}
	if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrInvalidArgument) || strings.Contains(err.Error(), "fn ") {
		t.Errorf("err = %v; want the context's error, not fn blamed", err)
	}
	tracer.mu.Lock()
	after := tracer.after
	tracer.mu.Unlock()
	for _, sql := range after {
		if !strings.EqualFold(sql, "rollback") && // database/sql's own
			!strings.Contains(sql, "name: KeyMarkUnknown ") && !strings.Contains(sql, "name: KeyLookup ") {
			t.Errorf("sent after the completion: %s", sql)
		}
	}
	var keys, effects int
	if err := setup.QueryRowContext(context.Background(),
		`SELECT (SELECT count(*) FROM idem_keys WHERE idem_key = 'cancelled'), (SELECT count(*) FROM effects WHERE key = 'cancelled')`).
		Scan(&keys, &effects); err != nil {
		t.Fatal(err)
	}
	if keys != 0 || effects != 0 {
		t.Errorf("%d key rows, %d effects committed", keys, effects)
	}
}

// InTx whose context ends after fn returned nil, once database/sql has
// rolled the transaction back: Commit answers sql.ErrTxDone ("already
// committed or rolled back"), which alone reads as if the work might have
// committed. The error names the context's (errors.Is finds it), and
// nothing of fn's committed.
func TestInTxCancelledBeforeCommit(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, pool := migrated(t, driver)
		if _, err := pool.Exec(context.Background(), `CREATE TABLE effects (key text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		err := idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('cancelled')`); err != nil {
				return err
			}
			// The client hangs up as fn returns; wait until database/sql
			// has rolled tx back.
			cancel()
			for range 200 {
				if _, err := tx.ExecContext(context.Background(), `SELECT 1`); errors.Is(err, sql.ErrTxDone) {
					return nil
				}
				time.Sleep(5 * time.Millisecond)
			}
			t.Error("database/sql never rolled the transaction back")
			return nil
		})
		if !errors.Is(err, context.Canceled) {
			t.Errorf("err = %v, want the context's error", err)
		}
		var effects int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM effects`).Scan(&effects); err != nil {
			t.Fatal(err)
		}
		if effects != 0 {
			t.Errorf("%d effects committed", effects)
		}
	})
}

// A closed *sql.DB is database/sql's closed pool: like a closed pgxpool
// for package idem, the calls fail closed with idem.ErrUnavailable (HTTP
// 503), not an error of no kind (500).
func TestCallsOnAClosedDB(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, _ := migrated(t, driver)
		if err := db.Close(); err != nil {
			t.Fatal(err)
		}
		_, doErr := idemsql.DoInTx(ctx, db, scope, "closed-db", fpOf("a"), func(context.Context, *sql.Tx) (idem.Response, error) {
			t.Error("fn ran")
			return created, nil
		})
		inTxErr := idemsql.InTx(ctx, db, func(context.Context, *sql.Tx) error { t.Error("fn ran"); return nil })
		for name, err := range map[string]error{"DoInTx": doErr, "InTx": inTxErr} {
			if !errors.Is(err, idem.ErrUnavailable) || !idem.Unavailable(err) {
				t.Errorf("%s on a closed *sql.DB: err = %v, want ErrUnavailable", name, err)
			}
		}
	})
}

// fn that ends the transaction InTx runs it in: ErrInvalidArgument, as in
// package idem (TestFnEndingInTxTransaction).
func TestFnEndingInTxTransaction(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, _ := migrated(t, driver)
		for _, end := range []string{"commit", "rollback"} {
			err := idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
				if end == "commit" {
					return tx.Commit()
				}
				return tx.Rollback()
			})
			if !errors.Is(err, idem.ErrInvalidArgument) {
				t.Errorf("fn's %s: err = %v, want ErrInvalidArgument", end, err)
			}
		}
	})
}
