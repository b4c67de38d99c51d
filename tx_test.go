package idem_test

import (
	"bytes"
	"context"
	"errors"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// The transactions InTx begins behave like pgx's own, whichever statement
// comes first.
func TestInTxBehavesLikePgxTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	serializable, err := idem.New(idem.Config{IsolationLevel: pgx.Serializable})
	if err != nil {
		t.Fatal(err)
	}
	steps := map[string]func(ctx context.Context, tx pgx.Tx) error{
		"exec with args": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, "a")
			return err
		},
		"exec without args": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ('b'); INSERT INTO effects (key) VALUES ('b')`)
			return err
		},
		"query": func(ctx context.Context, tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `INSERT INTO effects (key) VALUES ($1) RETURNING id`, "c")
			if err != nil {
				return err
			}
			rows.Close()
			return rows.Err()
		},
		"query row": func(ctx context.Context, tx pgx.Tx) error {
			var id int64
			return tx.QueryRow(ctx, `INSERT INTO effects (key) VALUES ($1) RETURNING id`, "d").Scan(&id)
		},
		"batch": func(ctx context.Context, tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO effects (key) VALUES ($1)`, "e")
			return tx.SendBatch(ctx, b).Close()
		},
		"copy": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.CopyFrom(ctx, pgx.Identifier{"effects"}, []string{"key"}, pgx.CopyFromRows([][]any{{"f"}}))
			return err
		},
		"savepoint": func(ctx context.Context, tx pgx.Tx) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, `INSERT INTO effects (key) VALUES ('undone')`); err != nil {
				return err
			}
			if err := sp.Rollback(ctx); err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, "g")
			return err
		},
		"large object": func(ctx context.Context, tx pgx.Tx) error {
			lo := tx.LargeObjects()
			oid, err := lo.Create(ctx, 0)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ('h', $1::oid::text)`, uint32(oid))
			return err
		},
	}
	for name, step := range steps {
		for _, commit := range []bool{true, false} {
			before := effects(t, pool)
			boom := errors.New("roll back")
			err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				if err := step(ctx, tx); err != nil {
					return err
				}
				if !commit {
					return boom
				}
				return nil
			})
			switch {
			case commit && err != nil:
				t.Fatalf("%s: %v", name, err)
			case !commit && !errors.Is(err, boom):
				t.Fatalf("%s: err = %v, want the rollback error", name, err)
			}
			after := effects(t, pool)
			if commit && after == before || !commit && after != before {
				t.Fatalf("%s (commit %v): effects %d -> %d", name, commit, before, after)
			}
		}
		// The isolation level applies whichever statement is first.
		err := serializable.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			if err := step(ctx, tx); err != nil {
				return err
			}
			var level string
			if err := tx.QueryRow(ctx, `SHOW transaction_isolation`).Scan(&level); err != nil {
				return err
			}
			if level != "serializable" {
				t.Errorf("%s: isolation %q", name, level)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("%s serializable: %v", name, err)
		}
	}
	// A transaction that ran nothing commits and rolls back without a word.
	if err := idem.InTx(ctx, pool, func(context.Context, pgx.Tx) error { return nil }); err != nil {
		t.Fatal(err)
	}
}

// DoInTx works on every kind of Beginner: a pool, a connection, and a pgx
// transaction (where it runs in a savepoint).
func TestDoInTxOnEveryBeginner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	outer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer outer.Rollback(ctx)
	for name, db := range map[string]idem.Beginner{"pool": pool, "conn": conn.Conn(), "tx": outer} {
		for range 2 {
			res, err := idem.DoInTx(ctx, db, scope, "beginner-"+name, fpA, recordEffect(&calls, name))
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			_ = res
		}
		// A reused key ends the transaction cleanly: the handle still works.
		if _, err := idem.DoInTx(ctx, db, scope, "beginner-"+name, fpB, recordEffect(&calls, name)); !errors.Is(err, idem.ErrKeyReused) {
			t.Fatalf("%s: err = %v", name, err)
		}
		if err := idem.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		}); err != nil {
			t.Fatalf("%s unusable: %v", name, err)
		}
	}
	if err := outer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 3 || effects(t, pool) != 3 {
		t.Fatalf("calls %d, effects %d; want 3 and 3", calls.Load(), effects(t, pool))
	}
	if pool.Stat().AcquiredConns() != 1 {
		t.Fatalf("%d connections still acquired, want only the test's own", pool.Stat().AcquiredConns())
	}
}

// Every pgx query exec mode works, including the exec and simple-protocol
// modes that PgBouncer setups use; so does a Response without a status.
func TestQueryExecModes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	for _, mode := range []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgxpool.ParseConfig(url)
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			resp := idem.Response{Status: 201,
				Header: map[string][]string{"Content-Type": {"application/json"}, "X-Quote": {`a"b\c`}},
				Body:   []byte("{\"ok\":true}\x00\xff")}
			key := "mode-" + strings.ReplaceAll(mode.String(), " ", "-")
			for i, wantReplayed := range []bool{false, true} {
				res, err := idem.DoInTx(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
					return resp, nil
				})
				if err != nil || res.Replayed != wantReplayed || res.Status != 201 ||
					!bytes.Equal(res.Body, resp.Body) || !reflect.DeepEqual(res.Header, resp.Header) {
					t.Fatalf("call %d: %+v, %v", i, res, err)
				}
			}
			// A refusal without a status, in the caller's transaction.
			for i, wantReplayed := range []bool{false, true} {
				var res idem.Result
				err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
					var err error
					res, err = idem.Do(ctx, tx, scope, key+"-reject", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
						return idem.Response{}, idem.Reject(idem.Response{Body: []byte("no")})
					})
					return err
				})
				if err != nil || res.Replayed != wantReplayed || res.Status != 0 || string(res.Body) != "no" || res.Header != nil {
					t.Fatalf("reject %d: %+v, %v", i, res, err)
				}
			}
		})
	}
}

// The first statement of an InTx transaction may carry pgx's per-query
// options, which cannot ride in a batch with BEGIN.
func TestInTxFirstStatementWithQueryOptions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			var n int
			return tx.QueryRow(ctx, `SELECT $1::int`, mode, 7).Scan(&n)
		})
		if err != nil {
			t.Fatalf("QueryRow with %v: %v", mode, err)
		}
		err = idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, mode, "opt")
			return err
		})
		if err != nil {
			t.Fatalf("Exec with %v: %v", mode, err)
		}
	}
	if effects(t, pool) != 2 {
		t.Fatalf("%d effects, want 2", effects(t, pool))
	}
}

// On a pgx.Tx, InTx and DoInTx run in a savepoint at the caller's
// isolation level, whatever the Client's, and leave retrying to the caller.
func TestInTxOnTxIgnoresIsolationLevel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c, err := idem.New(idem.Config{IsolationLevel: pgx.Serializable})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var calls atomic.Int64
	if _, err := c.DoInTx(ctx, tx, scope, "on-tx", fpA, recordEffect(&calls, "on-tx")); err != nil {
		t.Fatal(err)
	}
	attempts := 0
	serializationFailure := &pgconn.PgError{Code: "40001"}
	err = c.InTx(ctx, tx, func(context.Context, pgx.Tx) error {
		attempts++
		return serializationFailure
	})
	if !errors.Is(err, serializationFailure) || attempts != 1 {
		t.Fatalf("InTx on a tx: err %v after %d attempts, want the failure after one", err, attempts)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if effects(t, pool) != 1 {
		t.Fatalf("%d effects", effects(t, pool))
	}
}

// wrappedPool is a Beginner that InTx does not know: its transactions give
// their connection back to the pool when they end.
type wrappedPool struct{ *pgxpool.Pool }

func (w wrappedPool) Begin(ctx context.Context) (pgx.Tx, error) { return w.Pool.Begin(ctx) }

// A failed COMMIT on such a transaction is classified by its error alone:
// the connection, back in the pool, may already serve someone else (-race).
func TestInTxOnForeignBeginner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	withDeferredConflict(t, pool)
	stop := make(chan struct{})
	var busy sync.WaitGroup
	for range 4 {
		busy.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				var n int
				_ = pool.QueryRow(ctx, `SELECT 1`).Scan(&n)
			}
		})
	}
	defer func() { close(stop); busy.Wait() }()
	for range 20 {
		err := idem.InTx(ctx, wrappedPool{pool}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO deferred VALUES (1)`)
			return err
		})
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23505" || errors.Is(err, idem.ErrUnavailable) {
			t.Fatalf("err = %v, want the unique violation at commit", err)
		}
	}
}

// DoInTx and InTx on a *pgx.Conn that is in a transaction refuse: their
// BEGIN would only warn and their COMMIT would end the caller's transaction.
func TestDoInTxOnConnInTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ('caller')`); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	if _, err := idem.DoInTx(ctx, conn.Conn(), scope, "in-tx", fpA, recordEffect(&calls, "in-tx")); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("DoInTx: err = %v, want ErrInvalidArgument", err)
	}
	if err := idem.InTx(ctx, conn.Conn(), func(context.Context, pgx.Tx) error { return nil }); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("InTx: err = %v, want ErrInvalidArgument", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 0 || effects(t, pool) != 0 || keyRows(t, pool) != 0 {
		t.Fatal("the caller's transaction was committed or fn ran")
	}
	// Idle again, the connection works.
	if _, err := idem.DoInTx(ctx, conn.Conn(), scope, "in-tx", fpA, recordEffect(&calls, "in-tx")); err != nil {
		t.Fatal(err)
	}
}

// The same for the *pgxpool.Conn the caller began its transaction on
// (pool.Acquire, then conn.Begin): it is a Beginner too, and a BEGIN on it
// would only warn, then a COMMIT would commit the caller's transaction.
func TestDoInTxOnPooledConnInTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var calls atomic.Int64
	for name, call := range map[string]func() error{
		"DoInTx": func() error {
			_, err := idem.DoInTx(ctx, conn, scope, "pooled-in-tx", fpA, recordEffect(&calls, "pooled-in-tx"))
			return err
		},
		"InTx": func() error {
			return idem.InTx(ctx, conn, func(context.Context, pgx.Tx) error { calls.Add(1); return nil })
		},
	} {
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ('caller')`); err != nil {
			t.Fatal(err)
		}
		if err := call(); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("%s: err = %v, want ErrInvalidArgument", name, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if n, e, k := calls.Load(), effects(t, pool), keyRows(t, pool); n != 0 || e != 0 || k != 0 {
			t.Fatalf("%s: the caller's transaction was committed or fn ran: %d runs, %d effects, %d key rows", name, n, e, k)
		}
	}
	// Idle again, the connection works.
	if _, err := idem.DoInTx(ctx, conn, scope, "pooled-in-tx", fpA, recordEffect(&calls, "pooled-in-tx")); err != nil {
		t.Fatal(err)
	}
}

// InTx rolling back after fn failed, on a pool of one connection that
// another goroutine uses as soon as InTx gives it back: InTx looks at its
// connection only while it holds it (under -race, a data race otherwise).
func TestInTxRollbackLeavesThePooledConnectionAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t, idem.Migrate))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	failed := errors.New("fn failed")
	var wg sync.WaitGroup
	wg.Go(func() {
		for range 200 {
			err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error { return failed })
			if !errors.Is(err, failed) {
				t.Errorf("InTx: %v, want fn's error", err)
				return
			}
		}
	})
	wg.Go(func() {
		for range 200 {
			if _, err := pool.Exec(ctx, `SELECT 1`); err != nil {
				t.Errorf("pool.Exec: %v", err)
				return
			}
		}
	})
	wg.Wait()
}

// fn that commits or rolls back the transaction InTx runs it in is
// ErrInvalidArgument, as for DoInTx's fn (docs/using.md), not a bare
// "commit: tx is closed" that reads as a failed transaction: after fn's
// COMMIT its writes are durable, and a caller that retried on that error
// would write them twice.
func TestFnEndingInTxTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	for _, end := range []string{"commit", "rollback"} {
		err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, end); err != nil {
				return err
			}
			if end == "commit" {
				return tx.Commit(ctx)
			}
			return tx.Rollback(ctx)
		})
		if !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("fn's %s: err = %v, want ErrInvalidArgument", end, err)
		}
	}
	if n := effects(t, pool); n != 1 {
		t.Fatalf("%d effects, want fn's committed one", n)
	}
	// On a caller's transaction, InTx's transaction is a savepoint: fn's
	// Commit releases it, and the error says its writes are the caller's.
	outer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer outer.Rollback(ctx)
	err = idem.InTx(ctx, outer, func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) })
	if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "savepoint") || strings.Contains(err.Error(), "durable") {
		t.Errorf("fn's commit of InTx's savepoint: %v; want ErrInvalidArgument naming the savepoint", err)
	}
}
