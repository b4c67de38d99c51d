package idemsql_test

// idemsql behind PgBouncer in transaction pooling mode (IDEM_PGBOUNCER_URL,
// started by .ci/pgbouncer; skipped with one line when unset), with
// prepared statements off as in most deployments: pgx's stdlib driver in
// the exec modes that work there, and lib/pq (which prepares an unnamed
// statement per call; idemsql sends every statement in a transaction, which
// keeps the server connection), also with binary_parameters=yes.

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

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/callertest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// pgx's stdlib driver in its default exec mode (named prepared statements)
// behind a pooler without prepared-statement support: the calls that fail
// say so, with idem.ErrPreparedStatements and the fix.
func TestPoolerDefaultModeNamesTheFix(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db := open(t, "pgx", pgtest.BehindPooler(t, idem.Migrate))
	db.SetMaxOpenConns(16)
	ok := func(context.Context, *sql.Tx) (idem.Response, error) { return idem.Response{Status: 200}, nil }
	callertest.Pooled(t, 96, func(i int, key string) (err error) {
		switch i % 6 {
		case 0:
			_, err = idemsql.DoInTx(ctx, db, scope, key, fpOf(key), ok)
		case 1:
			err = idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
				_, err := idemsql.Do(ctx, tx, scope, key, fpOf(key), ok)
				return err
			})
		case 2:
			_, err = idemsql.Reserve(ctx, db, scope, key, fpOf(key), time.Minute)
		case 3:
			// Complete in a transaction of the caller's.
			r, err := idemsql.Reserve(ctx, db, scope, key, fpOf(key), time.Minute)
			if err != nil {
				return err
			}
			return idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
				return idemsql.Complete(ctx, tx, r, idem.Response{Status: 200})
			})
		case 4:
			err = idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
				return idemsql.Publish(ctx, tx, idem.Event{ID: key, Topic: "t", Destination: "d"})
			})
		default:
			if _, err = idemsql.LookupEvent(ctx, db, key, "d"); errors.Is(err, idem.ErrEventNotFound) {
				err = idemsql.RetryEvent(ctx, db, key, "d", "again")
			}
			if errors.Is(err, idem.ErrEventNotFound) {
				err = nil
			}
		}
		return err
	}, func(key string, err error) {
		if !errors.Is(err, idem.ErrPreparedStatements) || !strings.Contains(err.Error(), "default_query_exec_mode") {
			t.Errorf("%s: %v; want ErrPreparedStatements naming default_query_exec_mode", key, err)
		}
	})
}

func TestBehindPooler(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, driver, params string }{
		{"pgx-exec", "pgx", "&default_query_exec_mode=exec"},
		{"pgx-cache_describe", "pgx", "&default_query_exec_mode=cache_describe"},
		{"pgx-simple_protocol", "pgx", "&default_query_exec_mode=simple_protocol"},
		{"pq", "postgres", ""},
		{"pq-binary", "postgres", "&binary_parameters=yes"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			db := open(t, c.driver, pgtest.BehindPooler(t, nil)+c.params)
			if err := idemsql.Migrate(ctx, db); err != nil {
				t.Fatalf("Migrate: %v", err)
			}
			if _, err := db.ExecContext(ctx, `CREATE TABLE effects (idem_key text)`); err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int64
			fn := func(key string) func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				return func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
					runs.Add(1)
					_, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ($1)`, key)
					return idem.Response{Status: 201, Header: map[string][]string{"X-Key": {key}}, Body: []byte(key)}, err
				}
			}
			// Concurrent duplicates of several keys, on many connections.
			var wg sync.WaitGroup
			for i := range 40 {
				key := fmt.Sprintf("k%d", i%8)
				wg.Go(func() {
					res, err := idemsql.DoInTx(ctx, db, scope, key, fpOf(key), fn(key))
					if err != nil && !errors.Is(err, idem.ErrInProgress) {
						t.Errorf("%s: %v", key, err)
					} else if err == nil && string(res.Body) != key {
						t.Errorf("%s: answered %q", key, res.Body)
					}
				})
			}
			wg.Wait()
			var effects int
			if err := db.QueryRowContext(ctx, `SELECT count(*) FROM effects`).Scan(&effects); err != nil || effects != 8 || runs.Load() != 8 {
				t.Fatalf("%d effects, fn ran %d times, want 8 (%v)", effects, runs.Load(), err)
			}
			// Do in the caller's transaction, a replay, a reservation.
			err := idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
				res, err := idemsql.Do(ctx, tx, scope, "k0", fpOf("k0"), fn("k0"))
				if err == nil && !res.Replayed {
					err = errors.New("not replayed")
				}
				return err
			})
			if err != nil {
				t.Fatalf("Do: %v", err)
			}
			r, err := idemsql.Reserve(ctx, db, scope, "r1", fpOf("r1"), time.Minute)
			if err != nil {
				t.Fatalf("Reserve: %v", err)
			}
			if err := idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
				return idemsql.Complete(ctx, tx, r, idem.Response{Status: 200})
			}); err != nil {
				t.Fatalf("Complete: %v", err)
			}
			if rec, err := idemsql.Lookup(ctx, db, scope, "r1"); err != nil || rec.Status != idem.StatusSucceeded {
				t.Fatalf("Lookup: %+v, %v", rec, err)
			}
		})
	}
}
