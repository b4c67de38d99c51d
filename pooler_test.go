package idem_test

// idem behind PgBouncer in transaction pooling mode (IDEM_PGBOUNCER_URL,
// started by .ci/pgbouncer): every public call, concurrent duplicates and
// Migrate, in each exec mode pgx documents as working through such a
// pooler; and, in pgx's default mode on a pooler without prepared-statement
// support, an error that names the cause and the fix.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/callertest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// poolerModes are the exec modes that work through a transaction pooler
// without prepared-statement support (QueryExecModeDescribeExec does not:
// it prepares an unnamed statement in one round trip and runs it in the
// next, which may reach another server connection).
var poolerModes = []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeSimpleProtocol}

// poolerPool returns a pool on a fresh database behind the pooler, in mode,
// with every notice of severity WARNING counted in warnings.
func poolerPool(t *testing.T, migrate pgtest.MigrateFunc, mode pgx.QueryExecMode, warnings *atomic.Int64) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.BehindPooler(t, migrate))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.MaxConns = 8
	if warnings != nil {
		cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			if n.Severity == "WARNING" {
				warnings.Add(1)
				t.Logf("warning: %s", n.Message)
			}
		}
	}
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func TestBehindPooler(t *testing.T) {
	t.Parallel()
	for _, mode := range poolerModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			pool := poolerPool(t, idem.Migrate, mode, nil)
			c := mustClient(t, idem.Config{})
			if _, err := pool.Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, note text)`); err != nil {
				t.Fatal(err)
			}

			// Every public call.
			for _, tc := range lostCases() {
				key := "pooler-" + tc.name
				var r idem.Reservation
				if tc.set != nil {
					r = tc.set(ctx, t, c, pool, key)
				}
				if err := tc.act(ctx, c, pool, key, r); err != nil {
					t.Fatalf("%s: %v", tc.name, err)
				}
				if tc.check != nil {
					tc.check(ctx, t, c, pool, key, r, true)
				}
			}

			// Concurrent duplicates, through DoInTx and through Do in InTx:
			// each key's fn commits once, and every answer is its response.
			const keys, copies = 20, 4
			var calls atomic.Int64
			var wg sync.WaitGroup
			for i := range keys * copies {
				wg.Go(func() {
					key := fmt.Sprintf("dup-%d", i%keys)
					for {
						var res idem.Result
						var err error
						if i%2 == 0 {
							res, err = c.DoInTx(ctx, pool, lostScope, key, fpA, recordEffect(&calls, key))
						} else {
							err = c.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) (err error) {
								res, err = c.Do(ctx, tx, lostScope, key, fpA, recordEffect(&calls, key))
								return err
							})
						}
						if errors.Is(err, idem.ErrInProgress) {
							time.Sleep(10 * time.Millisecond)
							continue
						}
						if err != nil || res.Status != 201 {
							t.Errorf("%s: %+v, %v", key, res, err)
						}
						return
					}
				})
			}
			wg.Wait()
			var effects, distinct int
			if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key) FROM effects WHERE key LIKE 'dup-%'`).Scan(&effects, &distinct); err != nil {
				t.Fatal(err)
			}
			if effects != keys || distinct != keys {
				t.Fatalf("%d effects for %d keys (%d distinct); want one each", effects, keys, distinct)
			}
		})
	}
}

// Migrate from several processes at once through the pooler, beside other
// traffic: every run succeeds, the migrations are applied once, and the
// server warns about nothing (a session advisory lock taken on one server
// connection and released on another did: "you don't own a lock").
func TestMigrateBehindPooler(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	var warnings atomic.Int64
	pool := poolerPool(t, noMigrate, pgx.QueryExecModeExec, &warnings)
	stop := make(chan struct{})
	var load sync.WaitGroup
	for range 3 {
		load.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := pool.Exec(ctx, `SELECT pg_sleep(0.005)`); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for range 6 {
		wg.Go(func() { errs <- idem.Migrate(ctx, pool) })
	}
	wg.Wait()
	close(stop)
	load.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	files, _ := fs.Glob(idem.Migrations(), "*.sql")
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+idem.MigrationTable+` WHERE version_id > 0`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if applied != len(files) {
		t.Fatalf("%d migrations recorded, %d files", applied, len(files))
	}
	if n := warnings.Load(); n != 0 {
		t.Fatalf("%d warnings from the server", n)
	}
}

// pgx's default exec mode (a cache of named prepared statements) through a
// pooler without prepared-statement support: the calls that fail say why
// and what to do, as ErrPreparedStatements, never a bare 26000 or 42P05.
func TestPoolerDefaultModeNamesTheFix(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := poolerPool(t, idem.Migrate, pgx.QueryExecModeCacheStatement, nil)
	c := mustClient(t, idem.Config{})
	callertest.Pooled(t, 96, func(i int, key string) (err error) {
		switch i % 6 {
		case 0:
			_, err = c.DoInTx(ctx, pool, lostScope, key, fpA, okFn)
		case 1:
			err = c.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				_, err := c.Do(ctx, tx, lostScope, key, fpA, okFn)
				return err
			})
		case 2:
			_, err = c.Reserve(ctx, pool, lostScope, key, fpA, time.Minute)
		case 3:
			// Complete in a transaction of the caller's.
			r, err := c.Reserve(ctx, pool, lostScope, key, fpA, time.Minute)
			if err != nil {
				return err
			}
			return c.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				return c.Complete(ctx, tx, r, idem.Response{Status: 200})
			})
		case 4:
			err = c.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				return idem.Publish(ctx, tx, idem.Event{ID: key, Topic: "t", Destination: "d"})
			})
		default:
			if _, err = idem.LookupEvent(ctx, pool, key, "d"); errors.Is(err, idem.ErrEventNotFound) {
				err = idem.RetryEvent(ctx, pool, key, "d", "again")
			}
			if errors.Is(err, idem.ErrEventNotFound) {
				err = nil
			}
		}
		return err
	}, func(key string, err error) {
		msg := err.Error()
		if !errors.Is(err, idem.ErrPreparedStatements) || !strings.Contains(msg, "QueryExecMode") ||
			!strings.Contains(msg, "max_prepared_statements") || idem.Unavailable(err) {
			t.Errorf("%s: %v; want ErrPreparedStatements naming the exec mode and max_prepared_statements", key, err)
		}
	})
}

// A forced downgrade through the pooler, which refuses the startup setting
// that forces it: ErrInvalidArgument saying to use a direct connection,
// not an outage; nothing changed.
func TestMigrateDownForceBehindPooler(t *testing.T) {
	t.Parallel()
	pool := poolerPool(t, idem.Migrate, pgx.QueryExecModeExec, nil)
	before := appliedVersion(t, pool)
	_, err := idem.MigrateDown(t.Context(), pool, idem.MigrateDownOptions{Force: true})
	if !errors.Is(err, idem.ErrInvalidArgument) || idem.Unavailable(err) || !strings.Contains(err.Error(), "direct connection") {
		t.Fatalf("forced MigrateDown through the pooler: %v", err)
	}
	if after := appliedVersion(t, pool); after != before {
		t.Fatalf("version %d, was %d", after, before)
	}
}

// Migrate and MigrateDown in pgx's default exec mode through a pooler
// without prepared-statement support: a run that fails says why and what
// to do (ErrPreparedStatements, naming the exec mode), as the calls do,
// never a bare 26000 or 42P05.
func TestMigratePoolerDefaultModeNamesTheFix(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := pgtest.BehindPooler(t, noMigrate)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() {
			pool, err := pgxpool.New(ctx, url) // pgx's default exec mode
			if err != nil {
				errs[i] = err
				return
			}
			defer pool.Close()
			if i%2 == 0 {
				errs[i] = idem.Migrate(ctx, pool)
			} else {
				_, errs[i] = idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{})
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil && (!errors.Is(err, idem.ErrPreparedStatements) || !strings.Contains(err.Error(), "QueryExecMode") || idem.Unavailable(err)) {
			t.Errorf("%v; want ErrPreparedStatements naming the exec mode", err)
		}
	}
}
