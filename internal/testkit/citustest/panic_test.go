package citustest_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
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

// fn commits its transaction and panics, through the coordinator, under
// concurrent duplicates: DoInTx (pgx, and idemsql's NewCitus on both
// drivers) marks the claim fn's COMMIT made durable unknown before the
// panic goes on (ListUnknown lists it); Do on a savepoint of the caller's
// transaction aborts that transaction, so the caller's COMMIT commits
// nothing of fn's and no claim.
func TestFnCommittingThenPanicking(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	scope := idem.Scope{Actor: "alice", Operation: "order"}
	storm := func(call func()) {
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				if v := recovered(call); v != nil && v != errFnPanic {
					t.Errorf("panicked with %v", v)
				}
			})
		}
		wg.Wait()
	}
	storm(func() {
		_, err := idem.DoInTx(ctx, p, scope, "p1", fp("book"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			if _, err := order("alice", "p1", "book")(ctx, tx); err != nil {
				return idem.Response{}, err
			}
			_ = tx.Commit(ctx)
			panic(errFnPanic)
		})
		if !errors.Is(err, idem.ErrOutcomeUnknown) && !errors.Is(err, idem.ErrInProgress) {
			t.Errorf("a duplicate: %v", err)
		}
	})
	if n := ordersOf(t, p, "alice", "p1"); n != 1 {
		t.Errorf("%d orders, want 1", n)
	}
	storm(func() {
		tx, err := p.Begin(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		defer func() { _ = tx.Rollback(ctx) }()
		nested, err := tx.Begin(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		defer func() { _ = tx.Commit(ctx) }() // the caller recovers, and commits
		_, _ = idem.Do(ctx, nested, scope, "p2", fp("book"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			if _, err := order("alice", "p2", "book")(ctx, tx); err != nil {
				return idem.Response{}, err
			}
			_ = tx.Commit(ctx)
			panic(errFnPanic)
		})
	})
	if n := ordersOf(t, p, "alice", "p2"); n != 0 {
		t.Errorf("Do: %d orders committed", n)
	}
	if n := count(t, p, `SELECT count(*) FROM idem_keys WHERE idem_key = 'p2'`); n != 0 {
		t.Errorf("Do: %d key rows committed", n)
	}
	settle(t, p, 1, func(rec idem.Record, res idem.Resolution) error {
		return idem.Resolve(ctx, p, rec.Scope, rec.Key, res)
	})

	eachSQLDriver(t, func(t *testing.T, p *pgxpool.Pool, db *sql.DB) {
		c, err := idemsql.NewCitus(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		storm(func() {
			_, err := c.DoInTx(ctx, db, scope, "s1", fp("pen"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				if _, err := sqlOrder("alice", "s1", "pen")(ctx, tx); err != nil {
					return idem.Response{}, err
				}
				_ = tx.Commit()
				panic(errFnPanic)
			})
			if !errors.Is(err, idem.ErrOutcomeUnknown) && !errors.Is(err, idem.ErrInProgress) {
				t.Errorf("a duplicate: %v", err)
			}
		})
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
