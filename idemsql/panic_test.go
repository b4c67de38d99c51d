package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/lib/pq"

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

// An fn that commits DoInTx's transaction and then panics, on both
// drivers, under concurrent duplicates: the claim its COMMIT made durable
// is marked unknown at once (ListUnknown lists it, retries get
// ErrOutcomeUnknown), fn ran once, and the panic goes on. An fn that
// panics in Do without ending the caller's transaction leaves it usable,
// and nothing of fn's or of the key in it.
func TestFnPanicking(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, pool := migrated(t, driver)
		if _, err := db.ExecContext(ctx, `CREATE TABLE effects (key text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int64
		commitThenPanic := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			runs.Add(1)
			if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('p')`); err != nil {
				return idem.Response{}, err
			}
			if err := tx.Commit(); err != nil {
				t.Errorf("commit: %v", err)
			}
			panic(errFnPanic)
		}
		var wg sync.WaitGroup
		for range 6 {
			wg.Go(func() {
				var err error
				v := recovered(func() { _, err = idemsql.DoInTx(ctx, db, scope, "p", fpOf("a"), commitThenPanic) })
				switch {
				case v != nil && v != errFnPanic:
					t.Errorf("panicked with %v", v)
				case v == nil && !errors.Is(err, idem.ErrOutcomeUnknown) && !errors.Is(err, idem.ErrInProgress):
					t.Errorf("a duplicate: err = %v, want ErrOutcomeUnknown or ErrInProgress", err)
				}
			})
		}
		wg.Wait()
		if n := runs.Load(); n != 1 {
			t.Errorf("fn ran %d times, want once", n)
		}
		page, err := idemsql.ListUnknown(ctx, db, 10, nil)
		if err != nil || len(page) != 1 || page[0].Key != "p" {
			t.Errorf("ListUnknown: %+v, %v; want the key", page, err)
		}

		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		v := recovered(func() {
			_, _ = idemsql.Do(ctx, tx, scope, "q", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				_, _ = tx.ExecContext(ctx, `INSERT INTO effects VALUES ('q')`)
				panic(errFnPanic)
			})
		})
		if v != errFnPanic {
			t.Fatalf("Do: panicked with %v", v)
		}
		if err := tx.Commit(); err != nil {
			t.Fatalf("the caller's COMMIT after the panic: %v", err)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE key = 'q'`).Scan(&n); err != nil || n != 0 {
			t.Errorf("%d of fn's effects committed (%v)", n, err)
		}
		if keyCount(t, pool) != 1 {
			t.Errorf("%d key rows, want only the unknown one", keyCount(t, pool))
		}
	})
}

// An fn that commits DoInTx's transaction while the call's context ends,
// then panics or returns, on both drivers: database/sql cannot undo the
// COMMIT, so the claim it made durable is marked unknown as it would be
// with the context live, by the call itself (ListUnknown lists it, a retry
// gets ErrOutcomeUnknown).
func TestFnCommittingAsTheContextEnds(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, _ := migrated(t, driver)
		if _, err := db.ExecContext(t.Context(), `CREATE TABLE effects (key text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		for _, panics := range []bool{true, false} {
			key := fmt.Sprintf("ctx-%t", panics)
			ctx, cancel := context.WithCancel(t.Context())
			var err error
			v := recovered(func() {
				_, err = idemsql.DoInTx(ctx, db, scope, key, fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
					if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ($1)`, key); err != nil {
						return idem.Response{}, err
					}
					if err := tx.Commit(); err != nil {
						t.Errorf("%s: commit: %v", key, err)
					}
					cancel()
					if panics {
						panic(errFnPanic)
					}
					return created, nil
				})
			})
			if panics && v != errFnPanic || !panics && (v != nil || !errors.Is(err, idem.ErrInvalidArgument)) {
				t.Errorf("%s: panicked with %v, err %v; want fn's panic, or ErrInvalidArgument when fn returned", key, v, err)
			}
			// Marked by the call itself, not by the retry below.
			if rec, err := idemsql.Lookup(t.Context(), db, scope, key); err != nil || rec.Status != idem.StatusUnknown || rec.UnknownAt.IsZero() {
				t.Errorf("%s: record %+v, %v; want it unknown", key, rec, err)
			}
			again := func(context.Context, *sql.Tx) (idem.Response, error) {
				t.Errorf("%s: fn ran again", key)
				return created, nil
			}
			if _, err := idemsql.DoInTx(t.Context(), db, scope, key, fpOf("a"), again); !errors.Is(err, idem.ErrOutcomeUnknown) {
				t.Errorf("%s: a retry: %v, want ErrOutcomeUnknown", key, err)
			}
		}
		page, err := idemsql.ListUnknown(t.Context(), db, 10, nil)
		if err != nil || len(page) != 2 {
			t.Errorf("ListUnknown: %+v, %v; want the two keys", page, err)
		}

		// fn that does not end its transaction, whose context ends while it
		// runs: database/sql rolls the transaction back; the call says so
		// with the context's error, and does not blame fn.
		ctx, cancel := context.WithCancel(t.Context())
		_, err = idemsql.DoInTx(ctx, db, scope, "ctx-innocent", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('ctx-innocent')`); err != nil {
				return idem.Response{}, err
			}
			cancel()
			return created, nil
		})
		if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("an innocent fn: err = %v, want the context's error only", err)
		}
		if _, err := idemsql.Lookup(t.Context(), db, scope, "ctx-innocent"); !errors.Is(err, idem.ErrNotFound) {
			t.Errorf("an innocent fn: Lookup: %v, want ErrNotFound", err)
		}
	})
}

// An fn that swallows a failed statement and returns a response, on both
// drivers, under concurrent duplicates: ErrTxAborted, with the driver's
// own error of SQLSTATE 25P02 in the chain, not Unavailable; nothing is
// stored, and Do's caller's transaction stays usable.
func TestFnHidingAFailedStatement(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, pool := migrated(t, driver)
		hiding := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			_, _ = tx.ExecContext(ctx, `SELECT 1/0`)
			return created, nil
		}
		check := func(name string, err error) {
			t.Helper()
			code := ""
			var pgErr *pgconn.PgError
			var pqErr *pq.Error
			switch {
			case errors.As(err, &pgErr):
				code = pgErr.Code
			case errors.As(err, &pqErr):
				code = string(pqErr.Code)
			}
			if !errors.Is(err, idem.ErrTxAborted) || code != "25P02" || idem.Unavailable(err) {
				t.Errorf("%s: err = %v (SQLSTATE %q), want ErrTxAborted with 25P02", name, err, code)
			}
		}
		var wg sync.WaitGroup
		for i := range 6 {
			wg.Go(func() {
				key := fmt.Sprintf("h%d", i%2)
				_, err := idemsql.DoInTx(ctx, db, scope, key, fpOf("a"), hiding)
				if !errors.Is(err, idem.ErrInProgress) {
					check("DoInTx", err)
				}
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Error(err)
					return
				}
				defer func() { _ = tx.Rollback() }()
				_, err = idemsql.Do(ctx, tx, scope, key+"-do", fpOf("a"), hiding)
				if errors.Is(err, idem.ErrInProgress) {
					return
				}
				check("Do", err)
				if _, err := tx.ExecContext(ctx, `SELECT 1`); err != nil {
					t.Errorf("Do: the caller's transaction: %v", err)
				}
			})
		}
		wg.Wait()
		if n := keyCount(t, pool); n != 0 {
			t.Errorf("%d key rows", n)
		}
	})
}
