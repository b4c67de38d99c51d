package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/callertest"
)

// changeKeyRow is an fn that writes an effects row and then changes its own
// key row with change.
func changeKeyRow(key, change string) func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
	return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ($1, 'fn')`, key); err != nil {
			return idem.Response{}, err
		}
		if _, err := tx.Exec(ctx, change, scope.Actor, scope.Operation, key); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: 201, Body: []byte("fn's")}, nil
	}
}

// An fn that changes (or deletes) idem's own row of its key makes the call
// fail with ErrKeyRowChanged, for Do and DoInTx: nothing of fn's commits,
// no outcome is stored, Do leaves the caller's transaction usable (its own
// writes commit), and the retry runs fn as a new request.
func TestFnChangingItsKeyRowStoresNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	calls := map[string]func(key, change string) error{
		"DoInTx": func(key, change string) error {
			_, err := idem.DoInTx(ctx, pool, scope, key, fpA, changeKeyRow(key, change))
			return err
		},
		"Do": func(key, change string) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ($1, 'caller')`, key); err != nil {
				return err
			}
			_, doErr := idem.Do(ctx, tx, scope, key, fpA, changeKeyRow(key, change))
			if err := tx.Commit(ctx); err != nil {
				t.Errorf("%s: the caller's transaction is unusable after Do (%v): %v", key, doErr, err)
			}
			return doErr
		},
	}
	for callName, call := range calls {
		for column, change := range callertest.KeyRowChanges {
			key := "row-" + callName + "-" + column
			err := call(key, change)
			if !errors.Is(err, idem.ErrKeyRowChanged) {
				t.Errorf("%s, fn changes %s: err = %v, want ErrKeyRowChanged", callName, column, err)
			}
			checkKeyRowChangeUndone(t, pool, key, callName == "Do")
		}
	}
}

// checkKeyRowChangeUndone checks that nothing of fn's committed for key (the
// caller's own row did, when callerRow), and that a retry runs normally.
func checkKeyRowChangeUndone(t *testing.T, pool *pgxpool.Pool, key string, callerRow bool) {
	t.Helper()
	ctx := context.Background()
	if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1 AND note = 'fn'`, key); n != 0 {
		t.Errorf("%s: %d of fn's writes committed", key, n)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE idem_key = $1`, key); n != 0 {
		t.Errorf("%s: %d key rows committed", key, n)
	}
	if callerRow {
		if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = $1 AND note = 'caller'`, key); n != 1 {
			t.Errorf("%s: the caller's own write did not commit (%d rows)", key, n)
		}
	}
	var calls atomic.Int64
	res, err := idem.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key))
	if err != nil || res.Replayed || calls.Load() != 1 || res.Status != 201 {
		t.Errorf("%s: retry: %+v, %v, fn ran %d times; want a new request", key, res, err, calls.Load())
	}
	res, err = idem.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key))
	if err != nil || !res.Replayed || calls.Load() != 1 {
		t.Errorf("%s: second retry: %+v, %v; want the retry's outcome replayed", key, res, err)
	}
}
