package citustest_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

var errFnPanic = errors.New("fn's panic")

// recovered runs f and returns the value it panicked with (nil: none).
func recovered(f func()) (v any) {
	defer func() { v = recover() }()
	f()
	return nil
}

// fn commits its transaction and panics, through the coordinator: DoInTx
// (pgx, and idemsql's NewCitus on both drivers) marks the claim fn's
// COMMIT made durable unknown before the panic goes on (ListUnknown lists
// it after one call alone, before any retry could mark it), and under
// concurrent duplicates fn runs once and its panic goes on once; Do, and
// DoInTx, on a savepoint of the caller's transaction abort that
// transaction, so the caller's COMMIT commits nothing of fn's and no
// claim.
func TestFnCommittingThenPanicking(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	scope := idem.Scope{Actor: "alice", Operation: "order"}
	// storm runs call n times at once and returns how many times fn's
	// panic went on.
	storm := func(n int, call func()) int {
		var wg sync.WaitGroup
		var panics atomic.Int64
		for range n {
			wg.Go(func() {
				switch v := recovered(call); v {
				case nil:
				case errFnPanic:
					panics.Add(1)
				default:
					t.Errorf("panicked with %v", v)
				}
			})
		}
		wg.Wait()
		return int(panics.Load())
	}
	doInTx := func(key string) func() {
		return func() {
			_, err := idem.DoInTx(ctx, p, scope, key, fp("book"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				if _, err := order("alice", key, "book")(ctx, tx); err != nil {
					return idem.Response{}, err
				}
				_ = tx.Commit(ctx)
				panic(errFnPanic)
			})
			if !errors.Is(err, idem.ErrOutcomeUnknown) && !errors.Is(err, idem.ErrInProgress) {
				t.Errorf("%s, a duplicate: %v", key, err)
			}
		}
	}
	if n := storm(1, doInTx("p0")); n != 1 {
		t.Errorf("p0: the panic went on %d times, want 1", n)
	}
	settle(t, p, 1, func(rec idem.Record, res idem.Resolution) error {
		return idem.Resolve(ctx, p, rec.Scope, rec.Key, res)
	})
	if n := storm(4, doInTx("p1")); n != 1 {
		t.Errorf("p1: the panic went on %d times, want 1 (fn ran once)", n)
	}
	if n := ordersOf(t, p, "alice", "p1"); n != 1 {
		t.Errorf("%d orders, want 1", n)
	}
	for _, call := range []string{"Do", "DoInTx"} {
		key := "p2-" + call
		panics := storm(4, func() {
			tx, err := p.Begin(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			defer func() { _ = tx.Rollback(ctx) }()
			defer func() { _ = tx.Commit(ctx) }() // the caller recovers, and commits
			fn := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				if _, err := order("alice", key, "book")(ctx, tx); err != nil {
					return idem.Response{}, err
				}
				_ = tx.Commit(ctx)
				panic(errFnPanic)
			}
			if call == "DoInTx" {
				_, _ = idem.DoInTx(ctx, tx, scope, key, fp("book"), fn)
				return
			}
			nested, err := tx.Begin(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = idem.Do(ctx, nested, scope, key, fp("book"), fn)
		})
		if panics < 1 {
			t.Errorf("%s: fn's panic never went on", call)
		}
		if n := ordersOf(t, p, "alice", key); n != 0 {
			t.Errorf("%s: %d orders committed", call, n)
		}
		if n := count(t, p, `SELECT count(*) FROM idem_keys WHERE idem_key = $1`, key); n != 0 {
			t.Errorf("%s: %d key rows committed", call, n)
		}
	}
	settle(t, p, 1, func(rec idem.Record, res idem.Resolution) error {
		return idem.Resolve(ctx, p, rec.Scope, rec.Key, res)
	})

	eachSQLDriver(t, func(t *testing.T, p *pgxpool.Pool, db *sql.DB) {
		c, err := idemsql.NewCitus(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		doInTx := func(key string) func() {
			return func() {
				_, err := c.DoInTx(ctx, db, scope, key, fp("pen"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
					if _, err := sqlOrder("alice", key, "pen")(ctx, tx); err != nil {
						return idem.Response{}, err
					}
					_ = tx.Commit()
					panic(errFnPanic)
				})
				if !errors.Is(err, idem.ErrOutcomeUnknown) && !errors.Is(err, idem.ErrInProgress) {
					t.Errorf("%s, a duplicate: %v", key, err)
				}
			}
		}
		if n := storm(1, doInTx("s0")); n != 1 {
			t.Errorf("s0: the panic went on %d times, want 1", n)
		}
		settle(t, p, 1, func(rec idem.Record, res idem.Resolution) error {
			return c.Resolve(ctx, db, rec.Scope, rec.Key, res)
		})
		if n := storm(4, doInTx("s1")); n != 1 {
			t.Errorf("s1: the panic went on %d times, want 1 (fn ran once)", n)
		}
		settle(t, p, 1, func(rec idem.Record, res idem.Resolution) error {
			return c.Resolve(ctx, db, rec.Scope, rec.Key, res)
		})
	})
}

// fn swallows a failed statement and returns a response, through the
// coordinator: ErrTxAborted (SQLSTATE 25P02 kept), nothing stored.
func TestFnHidingAFailedStatement(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	scope := idem.Scope{Actor: "alice", Operation: "order"}
	_, err := idem.DoInTx(ctx, p, scope, "h1", fp("book"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		_, _ = tx.Exec(ctx, `SELECT 1/0`)
		return idem.Response{Status: 201}, nil
	})
	isErr(t, "DoInTx", err, idem.ErrTxAborted)
	eachSQLDriver(t, func(t *testing.T, p *pgxpool.Pool, db *sql.DB) {
		c, err := idemsql.NewCitus(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.DoInTx(ctx, db, scope, "h2", fp("pen"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			_, _ = tx.ExecContext(ctx, `SELECT 1/0`)
			return idem.Response{Status: 201}, nil
		})
		isErr(t, "idemsql DoInTx", err, idem.ErrTxAborted)
	})
	if n := count(t, p, `SELECT count(*) FROM idem_keys`); n != 0 {
		t.Errorf("%d key rows", n)
	}
}
