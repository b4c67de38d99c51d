package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

// errFnPanic is what the panicking fns of these tests panic with.
var errFnPanic = errors.New("fn's panic")

// recovered runs f and returns the value it panicked with (nil: none).
func recovered(f func()) (v any) {
	defer func() { v = recover() }()
	f()
	return nil
}

// An fn that commits DoInTx's own transaction and then panics gets what
// its return gets: the claim fn's COMMIT made durable is marked unknown,
// so ListUnknown lists it at once and retries get ErrOutcomeUnknown; and
// the panic goes on, unchanged. Concurrent duplicates (coalesced on one
// pool, or not: another Client) never run fn again.
func TestFnCommittingThenPanickingInDoInTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	fn := func(key string) func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			if _, err := recordEffect(&calls, key)(ctx, tx); err != nil {
				return idem.Response{}, err
			}
			if err := tx.Commit(ctx); err != nil {
				t.Errorf("%s: commit: %v", key, err)
			}
			panic(errFnPanic)
		}
	}
	// One call alone: the call itself marks the record unknown (no
	// duplicate or retry does it for it), before the panic goes on.
	if v := recovered(func() { _, _ = idem.DoInTx(ctx, pool, scope, "panic-alone", fpA, fn("panic-alone")) }); v != errFnPanic {
		t.Fatalf("panic-alone: panicked with %v, want fn's panic", v)
	}
	if row := readRow(t, pool, scope, "panic-alone"); row.Status != "unknown" || row.LastError == nil || !strings.Contains(*row.LastError, "fn committed") {
		t.Errorf("panic-alone: row %+v, want an unknown record", row)
	}
	if page, err := idem.ListUnknown(ctx, pool, 10, nil); err != nil || len(page) != 1 || page[0].Key != "panic-alone" {
		t.Errorf("ListUnknown after one call: %+v, %v; want panic-alone", page, err)
	}

	other := waitingClient(t, 0)
	const dups = 8
	for _, key := range []string{"panic-a", "panic-b", "panic-c"} {
		var wg sync.WaitGroup
		for i := range dups {
			wg.Go(func() {
				var err error
				v := recovered(func() {
					if i%2 == 0 {
						_, err = idem.DoInTx(ctx, pool, scope, key, fpA, fn(key))
					} else {
						_, err = other.DoInTx(ctx, pool, scope, key, fpA, fn(key))
					}
				})
				switch {
				case v != nil && v != errFnPanic:
					t.Errorf("%s: panicked with %v, want fn's panic", key, v)
				case v == nil && !errors.Is(err, idem.ErrOutcomeUnknown) && !errors.Is(err, idem.ErrInProgress):
					t.Errorf("%s: a duplicate: err = %v, want ErrOutcomeUnknown or ErrInProgress", key, err)
				}
			})
		}
		wg.Wait()
		if row := readRow(t, pool, scope, key); row.Status != "unknown" || row.LastError == nil || !strings.Contains(*row.LastError, "fn committed") {
			t.Errorf("%s: row %+v, want an unknown record", key, row)
		}
		if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key); n != 1 {
			t.Errorf("%s: %d effects, want 1", key, n)
		}
	}
	if n := calls.Load(); n != 4 {
		t.Errorf("fn ran %d times, want 4 (once per key)", n)
	}
	page, err := idem.ListUnknown(ctx, pool, 10, nil)
	if err != nil || len(page) != 4 {
		t.Fatalf("ListUnknown: %d records, %v; want 4", len(page), err)
	}

	// fn that panics without ending its transaction: nothing remains, and
	// the key runs again.
	v := recovered(func() {
		_, _ = idem.DoInTx(ctx, pool, scope, "panic-open", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			_, _ = recordEffect(&calls, "panic-open")(ctx, tx)
			panic(errFnPanic)
		})
	})
	if v != errFnPanic {
		t.Fatalf("panic-open: panicked with %v", v)
	}
	if row := readRow(t, pool, scope, "panic-open"); row.Found {
		t.Errorf("panic-open: row %+v", row)
	}
	if res, err := idem.DoInTx(ctx, pool, scope, "panic-open", fpA, recordEffect(&calls, "panic-open")); err != nil || res.Replayed {
		t.Errorf("panic-open again: %+v, %v", res, err)
	}
}

// An fn that commits the savepoint of a caller's transaction it runs in
// (Do on a pgx.Tx begun on a pgx.Tx; DoInTx on a pgx.Tx) and then panics:
// the enclosing transaction is aborted, so a caller that recovers the
// panic and commits commits nothing of fn's and no claim. Concurrent
// duplicates, each in a transaction of its own.
func TestFnCommittingThenPanickingInCallersTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	for _, call := range []string{"Do", "DoInTx"} {
		key := "panic-tx-" + call
		var wg sync.WaitGroup
		var committed atomic.Int64
		for range 6 {
			wg.Go(func() {
				tx, err := pool.Begin(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				defer func() { _ = tx.Rollback(ctx) }()
				fn := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
					if _, err := recordEffect(&calls, key)(ctx, tx); err != nil {
						return idem.Response{}, err
					}
					if err := tx.Commit(ctx); err != nil {
						t.Errorf("%s: commit: %v", key, err)
					}
					panic(errFnPanic)
				}
				var callErr error
				v := recovered(func() {
					if call == "Do" {
						nested, err := tx.Begin(ctx)
						if err != nil {
							t.Error(err)
							return
						}
						_, callErr = idem.Do(ctx, nested, scope, key, fpA, fn)
					} else {
						_, callErr = idem.DoInTx(ctx, tx, scope, key, fpA, fn)
					}
				})
				if v != errFnPanic {
					t.Errorf("%s: panicked with %v (err %v), want fn's panic", key, v, callErr)
				}
				// The caller recovers, and commits.
				if err := tx.Commit(ctx); err == nil {
					committed.Add(1)
				}
			})
		}
		wg.Wait()
		if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key); n != 0 {
			t.Errorf("%s: %d of fn's effects committed", key, n)
		}
		if row := readRow(t, pool, scope, key); row.Found {
			t.Errorf("%s: key row %+v committed (%d callers' COMMITs succeeded)", key, row, committed.Load())
		}
	}
}

// An fn that commits the transaction it runs in while the call's context
// ends (a deadline passing, a client gone), then panics or returns: the
// call does what it does with the context live, as pgx never ends a
// transaction for its context and a COMMIT cannot be undone. DoInTx on a
// pool marks the claim unknown (ListUnknown lists it); Do in a savepoint
// of the caller's transaction and DoInTx on a caller's pgx.Tx abort it, so
// the caller's COMMIT commits nothing.
func TestFnCommittingAsTheContextEnds(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	var calls atomic.Int64
	// fn records its effect, commits, and the call's context ends; then it
	// panics, or returns a response.
	fn := func(key string, cancel context.CancelFunc, panics bool) func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			if _, err := recordEffect(&calls, key)(ctx, tx); err != nil {
				return idem.Response{}, err
			}
			if err := tx.Commit(ctx); err != nil {
				t.Errorf("%s: commit: %v", key, err)
			}
			cancel()
			if panics {
				panic(errFnPanic)
			}
			return idem.Response{Status: 201, Body: []byte(`{}`)}, nil
		}
	}
	// run runs call, which panics with fn's panic or, when fn returned,
	// fails with ErrInvalidArgument: fn ended its transaction (pgx never
	// ends one for its context).
	run := func(panics bool, call func() error) {
		var err error
		v := recovered(func() { err = call() })
		if panics && v != errFnPanic || !panics && (v != nil || !errors.Is(err, idem.ErrInvalidArgument)) {
			t.Errorf("panicked with %v, err %v; want fn's panic, or ErrInvalidArgument when fn returned", v, err)
		}
	}
	for _, panics := range []bool{true, false} {
		key := fmt.Sprintf("ctx-pool-%t", panics)
		ctx, cancel := context.WithCancel(t.Context())
		run(panics, func() error {
			_, err := idem.DoInTx(ctx, pool, scope, key, fpA, fn(key, cancel, panics))
			return err
		})
		if row := readRow(t, pool, scope, key); row.Status != "unknown" || row.LastError == nil || !strings.Contains(*row.LastError, "fn committed") {
			t.Errorf("%s: row %+v, want an unknown record", key, row)
		}
		if _, err := idem.DoInTx(t.Context(), pool, scope, key, fpA, recordEffect(&calls, key)); !errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Errorf("%s: a retry: %v, want ErrOutcomeUnknown", key, err)
		}

		// DoItself: Do on the caller's transaction itself, which fn commits.
		for _, form := range []string{"Do", "DoInTx", "DoItself"} {
			key := fmt.Sprintf("ctx-tx-%s-%t", form, panics)
			tx, err := pool.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(t.Context())
			run(panics, func() error {
				switch form {
				case "DoInTx":
					_, err := idem.DoInTx(ctx, tx, scope, key, fpA, fn(key, cancel, panics))
					return err
				case "DoItself":
					_, err := idem.Do(ctx, tx, scope, key, fpA, fn(key, cancel, panics))
					return err
				}
				nested, err := tx.Begin(ctx)
				if err != nil {
					return err
				}
				_, err = idem.Do(ctx, nested, scope, key, fpA, fn(key, cancel, panics))
				return err
			})
			if err := tx.Commit(t.Context()); err == nil {
				t.Errorf("%s: the caller's COMMIT succeeded", key)
			}
			if form == "DoItself" {
				// fn's own COMMIT committed its writes and the claim
				// (documented): the row stays processing for the next
				// DoInTx or Reserve of the key to mark unknown.
				if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key); n != 1 {
					t.Errorf("%s: %d of fn's effects committed, want fn's one", key, n)
				}
				if row := readRow(t, pool, scope, key); row.Status != "processing" {
					t.Errorf("%s: key row %+v, want the claim fn committed", key, row)
				}
				continue
			}
			if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key); n != 0 {
				t.Errorf("%s: %d of fn's effects committed", key, n)
			}
			if row := readRow(t, pool, scope, key); row.Found {
				t.Errorf("%s: key row %+v committed", key, row)
			}
		}
	}
	page, err := idem.ListUnknown(t.Context(), pool, 10, nil)
	if err != nil || len(page) != 2 {
		t.Errorf("ListUnknown: %d records, %v; want the two pool keys", len(page), err)
	}
}

// An fn that swallows a failed statement and returns a response: nothing
// is stored, the call returns ErrTxAborted with the server's SQLSTATE
// 25P02 in the chain, Do's caller's transaction stays usable, and the key
// runs again. Concurrent duplicates get the same, or wait.
func TestFnHidingAFailedStatement(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	hiding := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		_, _ = tx.Exec(ctx, `SELECT 1/0`) // swallowed
		return idem.Response{Status: 200}, nil
	}
	check := func(name string, err error) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.Is(err, idem.ErrTxAborted) || !errors.As(err, &pgErr) || pgErr.Code != "25P02" || idem.Unavailable(err) {
			t.Errorf("%s: err = %v, want ErrTxAborted with SQLSTATE 25P02", name, err)
		}
	}
	var wg sync.WaitGroup
	for i := range 6 {
		wg.Go(func() {
			key := fmt.Sprintf("hidden-%d", i%2)
			_, err := idem.DoInTx(ctx, pool, scope, key, fpA, hiding)
			check("DoInTx "+key, err)
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = idem.Do(ctx, tx, scope, key+"-do", fpA, hiding)
			if errors.Is(err, idem.ErrInProgress) {
				return
			}
			check("Do "+key, err)
			if aborted(tx) {
				t.Errorf("Do %s: the caller's transaction is aborted", key)
			}
		})
	}
	wg.Wait()
	if n := keyRows(t, pool); n != 0 {
		t.Errorf("%d key rows", n)
	}
	var calls atomic.Int64
	if res, err := idem.DoInTx(ctx, pool, scope, "hidden-0", fpA, recordEffect(&calls, "hidden-0")); err != nil || res.Replayed {
		t.Errorf("hidden-0 again: %+v, %v", res, err)
	}
}
