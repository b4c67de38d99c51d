package idem_test

import (
	"context"
	"errors"
	"fmt"
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
