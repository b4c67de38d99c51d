package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// DoInTx with a context already done, on a Client that has not yet asked
// whether the database is Citus: the question fails before BEGIN, and the
// call returns the context's error (nothing to undo), never a panic.
func TestDoInTxCancelledBeforeCitusQuestion(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	conn, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for name, db := range map[string]idem.Beginner{"conn": conn.Conn(), "pool": pool} {
		c := waitingClient(t, 0)
		_, err := c.DoInTx(cancelled, db, scope, "cancelled-"+name, fpA, okFn)
		if !errors.Is(err, context.Canceled) {
			t.Errorf("%s: err = %v, want context.Canceled", name, err)
		}
	}
	if n := keyRows(t, pool); n != 0 {
		t.Fatalf("%d key rows", n)
	}
}

// Do on a pool's transaction that was already committed is
// ErrInvalidArgument, and touches nothing of the connection that
// transaction had: the pool has handed it to other calls, which run Do on
// it meanwhile (the race detector watches).
func TestDoOnCommittedPoolTxLeavesItsConnectionAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := newPool(t).Config().ConnConfig.ConnString()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	c := waitingClient(t, time.Second)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("busy-%d-%d", w, i)
				if _, err := c.DoInTx(ctx, pool, scope, key, fpA, okFn); err != nil {
					t.Errorf("%s: %v", key, err)
					return
				}
				_ = inCallerTx(ctx, pool, func(tx pgx.Tx) error {
					_, err := c.Do(ctx, tx, scope, key+"-do", fpA, okFn)
					return err
				})
			}
		})
	}
	for i := range 50 {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 { // a connection that ran Do before, and one that did not
			if _, err := c.Do(ctx, tx, scope, fmt.Sprintf("committed-%d", i), fpA, okFn); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Do(ctx, tx, scope, fmt.Sprintf("closed-%d", i), fpA, okFn); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("Do on a committed transaction: err = %v, want ErrInvalidArgument", err)
		}
	}
	close(stop)
	wg.Wait()
}

// A transaction that is closed (committed or rolled back) or aborted is
// ErrInvalidArgument for DoInTx and InTx on it, as for Do: nothing runs.
func TestCallsOnAClosedTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	closed := map[string]func() pgx.Tx{
		"committed": func() pgx.Tx {
			tx, err := pool.Begin(ctx)
			if err == nil {
				err = tx.Commit(ctx)
			}
			if err != nil {
				t.Fatal(err)
			}
			return tx
		},
		"rolled back": func() pgx.Tx {
			tx, err := pool.Begin(ctx)
			if err == nil {
				err = tx.Rollback(ctx)
			}
			if err != nil {
				t.Fatal(err)
			}
			return tx
		},
		"aborted": func() pgx.Tx {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tx.Rollback(ctx) })
			if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
				t.Fatal("1/0 did not fail")
			}
			return tx
		},
	}
	for state, newTx := range closed {
		calls := map[string]func(tx pgx.Tx) error{
			"Do": func(tx pgx.Tx) error {
				_, err := idem.Do(ctx, tx, scope, "closed", fpA, recordEffect(&calls, "closed"))
				return err
			},
			"DoInTx": func(tx pgx.Tx) error {
				_, err := idem.DoInTx(ctx, tx, scope, "closed", fpA, recordEffect(&calls, "closed"))
				return err
			},
			"InTx": func(tx pgx.Tx) error {
				return idem.InTx(ctx, tx, func(context.Context, pgx.Tx) error { calls.Add(1); return nil })
			},
		}
		for name, call := range calls {
			err := call(newTx())
			if !errors.Is(err, idem.ErrInvalidArgument) {
				t.Errorf("%s on the %s transaction: err = %v, want ErrInvalidArgument", name, state, err)
			}
		}
	}
	if n := calls.Load(); n != 0 || keyRows(t, pool) != 0 {
		t.Fatalf("fn ran %d times; %d key rows", n, keyRows(t, pool))
	}
}

// An fn that commits or rolls back the transaction DoInTx runs it in
// (itself, instead of leaving it to DoInTx) gets an error wrapping
// ErrInvalidArgument that says which, whatever fn returns after. When fn
// committed, its writes and the claim are durable without an outcome: the
// record is turned unknown, so retries get ErrOutcomeUnknown (never run fn
// again), ListUnknown lists it and Resolve settles it. When fn rolled back,
// nothing remains and the key runs again.
func TestFnEndingDoInTxTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var calls atomic.Int64
	// fn writes an effect, ends its transaction with end, and returns what
	// then says.
	fn := func(key, end, then string) func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			resp, err := recordEffect(&calls, key)(ctx, tx)
			if err != nil {
				return resp, err
			}
			if end == "commit" {
				err = tx.Commit(ctx)
			} else {
				err = tx.Rollback(ctx)
			}
			if err != nil {
				t.Errorf("%s: %s: %v", key, end, err)
			}
			switch then {
			case "error":
				return idem.Response{}, errors.New("fn failed after " + end)
			case "reject":
				return idem.Response{}, idem.Reject(idem.Response{Status: 409})
			}
			return resp, nil
		}
	}
	for _, handle := range []string{"pool", "conn"} {
		for _, end := range []string{"commit", "rollback"} {
			for _, then := range []string{"response", "error", "reject"} {
				var db idem.Beginner = pool
				if handle == "conn" {
					db = conn.Conn()
				}
				key := handle + "-" + end + "-" + then
				before := calls.Load()
				_, err := idem.DoInTx(ctx, db, scope, key, fpA, fn(key, end, then))
				said := map[string]string{"commit": "fn committed", "rollback": "fn rolled back"}[end]
				if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), said) {
					t.Errorf("%s: err = %v, want ErrInvalidArgument saying %s", key, err, said)
					continue
				}
				effects := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key)
				row := readRow(t, pool, scope, key)
				if end == "rollback" {
					if effects != 0 || row.Found {
						t.Errorf("%s: %d effects, row %+v; want none", key, effects, row)
					}
					if res, err := idem.DoInTx(ctx, db, scope, key, fpA, recordEffect(&calls, key)); err != nil || res.Replayed {
						t.Errorf("%s: retry after the rollback: %+v, %v; want fn to run", key, res, err)
					}
					continue
				}
				if effects != 1 || row.Status != "unknown" || row.Token <= 0 || row.Lease == nil || row.Completed != nil ||
					row.LastError == nil || !strings.Contains(*row.LastError, "fn committed") {
					t.Errorf("%s: %d effects, row %+v; want fn's effect and an unknown record", key, effects, row)
					continue
				}
				if _, err := idem.DoInTx(ctx, db, scope, key, fpA, recordEffect(&calls, key)); !errors.Is(err, idem.ErrOutcomeUnknown) {
					t.Errorf("%s: retry: err = %v, want ErrOutcomeUnknown", key, err)
				}
				if err := inCallerTx(ctx, pool, func(tx pgx.Tx) error {
					_, err := idem.Do(ctx, tx, scope, key, fpA, recordEffect(&calls, key))
					return err
				}); !errors.Is(err, idem.ErrOutcomeUnknown) {
					t.Errorf("%s: retry with Do: err = %v, want ErrOutcomeUnknown", key, err)
				}
				if err := idem.Forget(ctx, pool, scope, key); !errors.Is(err, idem.ErrOutcomeUnknown) {
					t.Errorf("%s: Forget: err = %v, want ErrOutcomeUnknown", key, err)
				}
				if n := calls.Load() - before; n != 1 {
					t.Errorf("%s: fn ran %d times, want once", key, n)
				}
			}
		}
	}

	// The operator's path: ListUnknown lists each such record, and Resolve
	// settles it; a retryable verdict lets the key run again.
	var listed []idem.Record
	for after := (*idem.Record)(nil); ; {
		page, err := idem.ListUnknown(ctx, pool, 2, after)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			break
		}
		listed = append(listed, page...)
		after = &page[len(page)-1]
	}
	if len(listed) != 6 {
		t.Fatalf("ListUnknown: %d records, want 6: %+v", len(listed), listed)
	}
	for i, rec := range listed {
		res := idem.Resolution{Token: rec.Token, Retryable: true, Reason: "fn's writes checked: none to keep"}
		if i%2 == 1 {
			res = idem.Resolution{Token: rec.Token, Succeeded: &idem.Response{Status: 200, Body: []byte("settled")}, Reason: "fn's writes stand"}
		}
		if err := idem.Resolve(ctx, pool, rec.Scope, rec.Key, res); err != nil {
			t.Fatalf("Resolve %s: %v", rec.Key, err)
		}
		got, err := idem.DoInTx(ctx, pool, rec.Scope, rec.Key, fpA, recordEffect(&calls, rec.Key))
		switch {
		case err != nil:
			t.Errorf("%s after Resolve: %v", rec.Key, err)
		case res.Retryable && got.Replayed, !res.Retryable && (!got.Replayed || string(got.Body) != "settled"):
			t.Errorf("%s after Resolve (%+v): %+v", rec.Key, res, got)
		}
	}
}

// An fn that commits the caller's transaction Do runs it in gets an error
// wrapping ErrInvalidArgument. Do has no connection of its own to mark the
// record with: it stays 'processing' without a lease, which Do cannot tell
// from its own caller's claim (ErrInProgress); DoInTx and Reserve, in
// transactions of their own, can, and turn it unknown (ErrOutcomeUnknown),
// as they do for a record whose DoInTx stopped before it marked it (a
// crash between fn's COMMIT and the mark).
func TestFnEndingDoTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	commit := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		resp, err := recordEffect(&calls, "do")(ctx, tx)
		if err == nil {
			err = tx.Commit(ctx)
		}
		return resp, err
	}
	for _, retry := range []string{"DoInTx", "Reserve"} {
		key := "do-then-" + retry
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = idem.Do(ctx, tx, scope, key, fpA, commit)
		if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "fn committed or rolled back") {
			t.Errorf("Do: err = %v, want ErrInvalidArgument saying fn ended the transaction", err)
		}
		if row := readRow(t, pool, scope, key); row.Status != "processing" || row.Token != 0 || row.Lease != nil {
			t.Fatalf("after Do: row %+v", row)
		}
		if err := inCallerTx(ctx, pool, func(tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, key, fpA, recordEffect(&calls, key))
			return err
		}); !errors.Is(err, idem.ErrInProgress) {
			t.Errorf("Do again: err = %v, want ErrInProgress", err)
		}
		if retry == "DoInTx" {
			_, err = idem.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key))
		} else {
			_, err = idem.Reserve(ctx, pool, scope, key, fpA, time.Minute)
		}
		if !errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Errorf("%s: err = %v, want ErrOutcomeUnknown", retry, err)
		}
		if row := readRow(t, pool, scope, key); row.Status != "unknown" || row.Token <= 0 || row.Lease == nil {
			t.Errorf("after %s: row %+v, want an unknown record", retry, row)
		}
	}
	if n := calls.Load(); n != 2 || effects(t, pool) != 2 {
		t.Fatalf("fn ran %d times, %d effects; want 2", n, effects(t, pool))
	}
}

// When a retry of the key meets the claim fn committed before DoInTx could
// mark it, the retry marks it; DoInTx still says fn committed.
func TestFnCommittingWhileARetryMarksTheRecord(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	other := waitingClient(t, time.Second) // not coalesced with the package's calls
	var calls atomic.Int64
	_, err := idem.DoInTx(ctx, pool, scope, "raced", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		resp, err := recordEffect(&calls, "raced")(ctx, tx)
		if err == nil {
			err = tx.Commit(ctx)
		}
		if _, retryErr := other.DoInTx(ctx, pool, scope, "raced", fpA, recordEffect(&calls, "raced")); !errors.Is(retryErr, idem.ErrOutcomeUnknown) {
			t.Errorf("retry: err = %v, want ErrOutcomeUnknown", retryErr)
		}
		return resp, err
	})
	if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "fn committed") {
		t.Fatalf("err = %v, want ErrInvalidArgument saying fn committed", err)
	}
	if row := readRow(t, pool, scope, "raced"); row.Status != "unknown" || calls.Load() != 1 {
		t.Fatalf("row %+v, fn ran %d times", row, calls.Load())
	}
}

// An fn that commits or rolls back the transaction it was given, when that
// is a savepoint of an enclosing transaction (a pgx.Tx begun on a pgx.Tx,
// given to Do; or DoInTx on a pgx.Tx, which runs Do in such a savepoint):
// pgx's Commit is RELEASE SAVEPOINT, which keeps fn's writes and the claim
// in the enclosing transaction. The call gets ErrInvalidArgument, naming
// itself and saying which. After a COMMIT the enclosing transaction is
// aborted, so it cannot commit the claim without an outcome: its COMMIT
// rolls back, and nothing of fn's or of the key remains. After a ROLLBACK
// the enclosing transaction is usable, and the key is free. A COMMIT that
// failed (fn left the transaction aborted) leaves it aborted, and the call
// cannot tell which.
func TestFnEndingASavepointOfTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var calls atomic.Int64
	fn := func(key, end string) func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			resp, err := recordEffect(&calls, key)(ctx, tx)
			if err != nil {
				return resp, err
			}
			switch end {
			case "commit":
				err = tx.Commit(ctx)
			case "rollback":
				err = tx.Rollback(ctx)
			case "failed commit":
				if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
					t.Errorf("%s: 1/0 did not fail", key)
				}
				if err = tx.Commit(ctx); err == nil {
					t.Errorf("%s: the COMMIT of an aborted transaction succeeded", key)
				}
				err = nil
			}
			if err != nil {
				t.Errorf("%s: %s: %v", key, end, err)
			}
			return resp, nil
		}
	}
	said := map[string]string{"commit": "fn committed the", "rollback": "fn rolled back the", "failed commit": "fn committed or rolled back the"}
	for _, outer := range []string{"pool", "conn"} {
		for _, call := range []string{"Do", "DoInTx"} {
			for _, end := range []string{"commit", "rollback", "failed commit"} {
				key := strings.ReplaceAll(outer+"-"+call+"-"+end, " ", "-")
				var db idem.Beginner = pool
				if outer == "conn" {
					db = conn.Conn()
				}
				tx, err := db.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ($1, 'before')`, key); err != nil {
					t.Fatal(err)
				}
				if call == "Do" {
					var nested pgx.Tx
					if nested, err = tx.Begin(ctx); err != nil {
						t.Fatal(err)
					}
					_, err = idem.Do(ctx, nested, scope, key, fpA, fn(key, end))
				} else {
					_, err = idem.DoInTx(ctx, tx, scope, key, fpA, fn(key, end))
				}
				usable := end == "rollback"
				if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), said[end]+" transaction that "+call+" runs in") {
					t.Errorf("%s: err = %v, want ErrInvalidArgument naming %s, saying %q", key, err, call, said[end])
				}
				if !usable && (!strings.Contains(err.Error(), "aborted") || strings.Contains(err.Error(), "durable")) {
					t.Errorf("%s: err = %v, want it to say the enclosing transaction is aborted", key, err)
				}
				if got := aborted(tx); got == usable {
					t.Errorf("%s: the enclosing transaction aborted: %v, want %v", key, got, !usable)
				}
				if commitErr := tx.Commit(ctx); (commitErr == nil) != usable {
					t.Errorf("%s: the enclosing transaction's COMMIT: %v", key, commitErr)
				}
				if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1 AND note IS NULL`, key); n != 0 {
					t.Errorf("%s: %d of fn's effects committed", key, n)
				}
				if n, want := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1 AND note = 'before'`, key), map[bool]int{true: 1}[usable]; n != want {
					t.Errorf("%s: %d of the caller's own writes committed, want %d", key, n, want)
				}
				if row := readRow(t, pool, scope, key); row.Found {
					t.Errorf("%s: key row %+v committed", key, row)
				}
				if res, err := idem.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key)); err != nil || res.Replayed {
					t.Errorf("%s: the key again: %+v, %v; want fn to run", key, res, err)
				}
			}
		}
	}

	// Do on the connection's own transaction: fn's COMMIT is a COMMIT, the
	// connection is idle after it, and nothing is sent on it.
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = idem.Do(ctx, tx, scope, "top", fpA, fn("top", "commit"))
	if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "fn committed or rolled back the caller's transaction that Do runs in") {
		t.Errorf("top: err = %v", err)
	}
	if row := readRow(t, pool, scope, "top"); row.Status != "processing" {
		t.Errorf("top: row %+v, want the claim fn committed", row)
	}
	if strings.Contains(err.Error(), "a type idem does not look into") {
		t.Errorf("top: err = %v, names a transaction of another making", err)
	}

	// A pgx.Tx of another making, a savepoint: idem does not look into it
	// (documented), and the error says what to do.
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	nested, err := tx.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = idem.Do(ctx, wrappedTx{nested}, scope, "wrapped", fpA, fn("wrapped", "commit"))
	if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "a type idem does not look into") ||
		!strings.Contains(err.Error(), "roll it back") {
		t.Errorf("wrapped: err = %v, want ErrInvalidArgument saying to roll the enclosing transaction back", err)
	}
}

// wrappedTx is a pgx.Tx of another making.
type wrappedTx struct{ pgx.Tx }
