package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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
		// One call alone: the call itself marks the record unknown, before
		// any duplicate or retry of the key could.
		if v := recovered(func() { _, _ = idemsql.DoInTx(ctx, db, scope, "alone", fpOf("a"), commitThenPanic) }); v != errFnPanic {
			t.Fatalf("alone: panicked with %v, want fn's panic", v)
		}
		if page, err := idemsql.ListUnknown(ctx, db, 10, nil); err != nil || len(page) != 1 || page[0].Key != "alone" {
			t.Errorf("ListUnknown after one call: %+v, %v; want the key", page, err)
		}
		runs.Store(0)

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
		if err != nil || len(page) != 2 || page[1].Key != "p" {
			t.Errorf("ListUnknown: %+v, %v; want the two keys", page, err)
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
		if keyCount(t, pool) != 2 {
			t.Errorf("%d key rows, want only the two unknown ones", keyCount(t, pool))
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
		// runs (or as it returns, in the race below): database/sql rolls the
		// transaction back; the call says so with the context's error, does
		// not blame fn, and says nothing committed, which holds.
		for i := range 20 {
			key := fmt.Sprintf("ctx-innocent-%d", i)
			ctx, cancel := context.WithCancelCause(t.Context())
			_, err = idemsql.DoInTx(ctx, db, scope, key, fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ($1)`, key); err != nil {
					return idem.Response{}, err
				}
				if i%2 == 0 {
					cancel(errClientGone)
				} else {
					go cancel(errClientGone) // as the call goes on to store the outcome
				}
				return created, nil
			})
			if err == nil {
				// The cancel came after the COMMIT.
				if rec, err := idemsql.Lookup(t.Context(), db, scope, key); err != nil || rec.Status != idem.StatusSucceeded {
					t.Errorf("%s: the call succeeded, but the record is %+v, %v", key, rec, err)
				}
				continue
			}
			if errors.Is(err, context.Canceled) && strings.Contains(err.Error(), "outcome was being committed") {
				// The cancel came during the COMMIT (the race above, rarely):
				// the call cannot know whether it committed, and says so; the
				// claim and fn's effect committed together or not at all.
				rec, lerr := idemsql.Lookup(t.Context(), db, scope, key)
				var n int
				if err := db.QueryRowContext(t.Context(), `SELECT count(*) FROM effects WHERE key = $1`, key).Scan(&n); err != nil ||
					lerr == nil && (rec.Status != idem.StatusSucceeded || n != 1) ||
					lerr != nil && (!errors.Is(lerr, idem.ErrNotFound) || n != 0) {
					t.Errorf("%s: the COMMIT in doubt: Lookup %+v, %v, %d effects (%v); want the outcome and the effect, or neither",
						key, rec, lerr, n, err)
				}
				continue
			}
			// The context's error, from the statement database/sql refused
			// or, when the transaction was found ended, with its cause.
			if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrInvalidArgument) ||
				strings.Contains(err.Error(), "fn ") || strings.Contains(err.Error(), "may have committed") ||
				strings.Contains(err.Error(), "transaction had ended") && !errors.Is(err, errClientGone) {
				t.Errorf("%s: an innocent fn: err = %v, want the context's error, no blame for fn, nothing said committed", key, err)
			}
			if _, err := idemsql.Lookup(t.Context(), db, scope, key); !errors.Is(err, idem.ErrNotFound) {
				t.Errorf("%s: an innocent fn: Lookup: %v, want ErrNotFound", key, err)
			}
			var n int
			if err := db.QueryRowContext(t.Context(), `SELECT count(*) FROM effects WHERE key = $1`, key).Scan(&n); err != nil || n != 0 {
				t.Errorf("%s: an innocent fn: %d of its effects committed (%v)", key, n, err)
			}
		}
	})
}

var errClientGone = errors.New("the client went away")

// The call's context ends while DoInTx's COMMIT is under way (held back by
// a deferred trigger waiting for a lock the test holds), on both drivers:
// pgx's stdlib stops waiting for the answer, and the call says the outcome
// may have committed; lib/pq has the server cancel the COMMIT, and the call
// says nothing committed; either with the context's error, no blame for
// fn. The key then holds what the COMMIT did (the outcome, or nothing),
// never a claim without one, and a retry replays the outcome or runs once.
func TestCommitUnderWayAsTheContextEnds(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, pool := migrated(t, driver)
		if _, err := db.ExecContext(t.Context(), `
			CREATE TABLE effects (key text NOT NULL);
			CREATE FUNCTION wait_for_test() RETURNS trigger LANGUAGE plpgsql AS
				$$ BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$;
			CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
				FOR EACH ROW EXECUTE FUNCTION wait_for_test();`); err != nil {
			t.Fatal(err)
		}
		lock, err := pool.Acquire(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer lock.Release()
		if _, err := lock.Exec(t.Context(), `SELECT pg_advisory_lock(4242)`); err != nil {
			t.Fatal(err)
		}
		released := make(chan struct{})
		defer func() { <-released }() // before lock.Release
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel() // before the wait for released
		go func() {
			// Once the COMMIT waits for the lock, end the call's context,
			// give the driver a moment to give up, and let the COMMIT go.
			defer close(released)
			defer func() { _, _ = lock.Exec(context.Background(), `SELECT pg_advisory_unlock(4242)`) }()
			for ctx.Err() == nil {
				var waiting bool
				if err := pool.QueryRow(ctx, `SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database()
					AND wait_event_type = 'Lock' AND wait_event = 'advisory' AND query ILIKE 'commit%'`).Scan(&waiting); err != nil {
					return
				}
				if waiting {
					cancel()
					time.Sleep(200 * time.Millisecond)
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
		var runs atomic.Int64
		fn := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			runs.Add(1)
			_, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ('c')`)
			return created, err
		}
		_, err = idemsql.DoInTx(ctx, db, scope, "c", fpOf("a"), fn)
		// pgx's stdlib stops reading (the COMMIT is in doubt); lib/pq has
		// the server cancel it (57014: it rolled back).
		want := "may have committed"
		if driver == "postgres" {
			want = "nothing was stored, nothing of fn's committed"
		}
		if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), want) {
			t.Errorf("err = %v, want the context's error saying %q", err, want)
		}
		// Wait for the COMMIT, given up on or not, to finish on the server.
		for {
			var n int
			if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
				AND query ILIKE 'commit%' AND state = 'active'`).Scan(&n); err != nil || n == 0 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		rec, lookupErr := idemsql.Lookup(t.Context(), db, scope, "c")
		var effects int
		if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM effects`).Scan(&effects); err != nil {
			t.Fatal(err)
		}
		switch {
		case lookupErr == nil && rec.Status == idem.StatusSucceeded && effects == 1:
		case errors.Is(lookupErr, idem.ErrNotFound) && effects == 0:
		default:
			t.Errorf("after the COMMIT: record %+v (%v), %d effects; want the outcome with fn's effect, or nothing", rec, lookupErr, effects)
		}
		if _, err := idemsql.DoInTx(t.Context(), db, scope, "c", fpOf("a"), fn); err != nil {
			t.Errorf("a retry: %v", err)
		}
		if n := runs.Load(); n > 2 || n == 2 && lookupErr == nil {
			t.Errorf("fn ran %d times; want once more only when nothing had committed", n)
		}
	})
}

// Do on a caller's transaction whose own context ends while fn runs, the
// call's context live: database/sql rolls the caller's transaction back,
// so the call cannot tell fn's doing from the context's and says both.
func TestCallersTransactionEndedByItsContext(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, pool := migrated(t, driver)
		txCtx, cancel := context.WithCancel(t.Context())
		tx, err := db.BeginTx(txCtx, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, err = idemsql.Do(t.Context(), tx, scope, "d", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			cancel()
			for { // until database/sql has rolled the transaction back
				if _, err := tx.ExecContext(ctx, `SELECT 1`); errors.Is(err, sql.ErrTxDone) {
					return created, nil
				}
				time.Sleep(time.Millisecond)
			}
		})
		if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "the context it was begun with ended") {
			t.Errorf("err = %v, want ErrInvalidArgument naming the transaction's context", err)
		}
		if keyCount(t, pool) != 0 {
			t.Errorf("%d key rows", keyCount(t, pool))
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
