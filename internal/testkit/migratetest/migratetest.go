// Package migratetest helps the tests of idem's migrations: UpTo brings a
// database to a version, and Online is the harness of the tests that
// migrate a populated idem_keys while the service runs (TestMigrateOnline
// on PostgreSQL and on Citus): it writes finished keys at version 8, keeps
// calls of the version-8 service going, runs idem.Migrate to the latest
// version (stopped if it is seen building an index, then run again), and
// checks that nothing was lost. docs/operations.md gives its figures.
package migratetest

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem"
)

// UpTo applies idem's migrations up to version to the database of pool.
func UpTo(t testing.TB, pool *pgxpool.Pool, version int64) {
	t.Helper()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, db, idem.Migrations(),
		goose.WithTableName(idem.MigrationTable), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := provider.UpTo(t.Context(), version); err != nil {
		t.Fatal(err)
	}
}

// From is the version the table is at when Online starts: the callers
// migrate it there (UpTo; and distribute it, on Citus).
const From = 8

// Rows is how many finished keys the test migrates: IDEM_MIGRATION_ROWS,
// or def.
func Rows(t testing.TB, def int) int {
	t.Helper()
	s := os.Getenv("IDEM_MIGRATION_ROWS")
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("IDEM_MIGRATION_ROWS=%q: want a positive number", s)
	}
	return n
}

// Online populates idem_keys (at version From) in the database of db with
// rows finished keys, then migrates it to the latest version while four
// workers keep sending what the version-8 service's calls send (the claim
// and completion of a fresh key in one transaction, and a replay's read by
// primary key). building is a query that answers true while the migration
// builds an index: the first run is stopped when it does, and run again.
// Online logs the longest call before the migration and during it (no time
// is asserted: the machine's load moves both; a call counts as during the
// migration when it began during it) and fails the test when a populated
// key or a call's key is lost or changed, or the migrated table does not
// replay a populated key.
func Online(t *testing.T, db *pgxpool.Pool, rows int, building string) {
	t.Helper()
	ctx := t.Context()
	// A pool of its own on db's database, large enough that no call waits
	// for a connection: four callers, the migration's two, the watcher's one.
	cfg := db.Config().Copy()
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	start := time.Now()
	if _, err := pool.Exec(ctx, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_headers,
		                       response_body, created_at, completed_at, expires_at)
		SELECT 'user_' || (i % 1000), 'draw', 'key-' || i, sha256(int8send(i)), 'succeeded', 201,
		       '{"Content-Type":["application/json"],"Location":["/draws/1"]}',
		       convert_to('{"draw_id":' || i || ',"prizes":["p1"],"points_left":1000}', 'UTF8'),
		       now(), now(), now() + interval '1 day'
		FROM generate_series(1, $1::bigint) AS i`, rows); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE idem_keys`); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d keys written at version %d in %s", rows, From, time.Since(start).Round(time.Millisecond))

	// The version-8 service: 4 workers, each a call after the other.
	var (
		stop      atomic.Bool
		migrating atomic.Bool
		mu        sync.Mutex
		longest   [2]time.Duration // before the migration, during it
		longestAt time.Time        // when the longest call during it began
		calls     [2]int
		fresh     atomic.Int64
		wg        sync.WaitGroup
		callErr   error
	)
	call := func() error {
		k := fresh.Add(1)
		key := "probe-" + strconv.FormatInt(k, 10)
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status,
				completed_at, expires_at) VALUES ('probe', 'draw', $1, sha256(convert_to($1, 'UTF8')), 'processing',
				now(), now() + interval '1 day') ON CONFLICT DO NOTHING`, key); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `UPDATE idem_keys SET status = 'succeeded', response_status = 201,
				response_body = '\x7b7d' WHERE actor = 'probe' AND operation = 'draw' AND idem_key = $1`, key); err != nil {
				return err
			}
			var body []byte
			i := k%int64(rows) + 1 // a populated key, read as a replay reads it
			return tx.QueryRow(ctx, `SELECT response_body FROM idem_keys
				WHERE actor = $1 AND operation = 'draw' AND idem_key = $2`,
				"user_"+strconv.FormatInt(i%1000, 10), "key-"+strconv.FormatInt(i, 10)).Scan(&body)
		})
	}
	for range 4 {
		wg.Go(func() {
			for !stop.Load() {
				during := migrating.Load()
				began := time.Now()
				err := call()
				took := time.Since(began)
				mu.Lock()
				i := 0
				if during {
					i = 1
				}
				if i == 1 && took > longest[1] {
					longestAt = began
				}
				longest[i] = max(longest[i], took)
				calls[i]++
				if err != nil && callErr == nil {
					callErr = err
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		})
	}
	time.Sleep(2 * time.Second) // the service before the migration

	// Stopped if it is seen building an index, then run again.
	migrating.Store(true)
	began := time.Now()
	cut, cancel := context.WithCancel(ctx)
	go func() {
		for cut.Err() == nil {
			var b bool
			_ = pool.QueryRow(ctx, building).Scan(&b)
			if b {
				cancel()
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	interrupted := idem.Migrate(cut, pool)
	cancel()
	rerun := time.Since(began)
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate after an interruption (%v): %v", interrupted, err)
	}
	took := time.Since(began)
	migrating.Store(false)
	stop.Store(true)
	wg.Wait()
	if callErr != nil {
		t.Fatalf("a call of the version-%d service failed: %v", From, callErr)
	}
	t.Logf("migrations %d and on, on %d keys, in %s (the first run stopped by its context: %v; the second began %s in)",
		From+1, rows, took.Round(time.Millisecond), interrupted != nil, rerun.Round(time.Millisecond))
	t.Logf("longest call before the migration %s (%d calls), during it %s (%d calls; it began %s into the migration)",
		longest[0].Round(time.Millisecond), calls[0], longest[1].Round(time.Millisecond), calls[1],
		longestAt.Sub(began).Round(time.Millisecond))

	// Every populated key is there, finished, with its body (a count of the
	// intact ones, which Citus plans as it plans any query of one table).
	var intact, stored int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM (
		SELECT k.*, substring(k.idem_key FROM '^key-([0-9]+)$')::bigint AS i FROM idem_keys k) AS k
		WHERE i BETWEEN 1 AND $1 AND operation = 'draw' AND status = 'succeeded' AND actor = 'user_' || (i % 1000)
		  AND response_body = convert_to('{"draw_id":' || i || ',"prizes":["p1"],"points_left":1000}', 'UTF8')
		  AND fingerprint = sha256(int8send(i))`, rows).Scan(&intact); err != nil || intact != rows {
		t.Fatalf("%d populated keys intact of %d (%v)", intact, rows, err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE actor = 'probe' AND status = 'succeeded'`).
		Scan(&stored); err != nil || int64(stored) < fresh.Load()-4 { // (a call cut by stop may not have committed)
		t.Fatalf("%d call keys stored of %d sent (%v)", stored, fresh.Load(), err)
	}
	var invalid int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_index WHERE indrelid = 'idem_keys'::regclass
		AND NOT (indisvalid AND indisready)`).Scan(&invalid); err != nil || invalid != 0 {
		t.Fatalf("%d invalid indexes on idem_keys (%v)", invalid, err)
	}
	// The migrated table serves today's calls: a populated key replays.
	fp := sha256.Sum256(binary.BigEndian.AppendUint64(nil, 1)) // PostgreSQL's sha256(int8send(1))
	res, err := idem.DoInTx(ctx, pool, idem.Scope{Actor: "user_1", Operation: "draw"}, "key-1",
		idem.Fingerprint(fp), func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{}, errors.New("fn ran for a finished key")
		})
	if err != nil || !res.Replayed || res.Status != 201 || string(res.Body) != `{"draw_id":1,"prizes":["p1"],"points_left":1000}` {
		t.Fatalf("replay after the migration: %+v %v", res, err)
	}
}
