package idem_test

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
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// onlineRows is how many finished keys TestMigrateOnline migrates:
// IDEM_MIGRATION_ROWS, or 200,000 (docs/operations.md gives the figures at
// 3,000,000).
func onlineRows(t *testing.T) int {
	s := os.Getenv("IDEM_MIGRATION_ROWS")
	if s == "" {
		return 200_000
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("IDEM_MIGRATION_ROWS=%q: want a positive number", s)
	}
	return n
}

// Migrating a populated table from version 8 to the latest (migrations 9
// and 10: a column each, added in place, and a partial index each, built
// CONCURRENTLY) while the service runs: calls of the version-8 service
// (probes that send its statements' locks and writes: the claim and
// completion of a fresh key in one transaction, and a replay's read by
// primary key) go on throughout. The test logs the longest probe during the
// migration beside the longest before it (no time is asserted: the
// machine's load moves both), and checks that nothing is lost: every
// populated key and every probe's key is there, finished, with its body. A
// migration interrupted while it builds an index is run again and
// finishes, its index valid.
func TestMigrateOnline(t *testing.T) {
	if testing.Short() {
		t.Skip("populates a table")
	}
	t.Parallel()
	ctx := t.Context()
	rows := onlineRows(t)
	pool := pgtest.Pool(t, noMigrate)
	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, idem.Migrations(),
		goose.WithTableName(idem.MigrationTable), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := provider.UpTo(ctx, 8); err != nil {
		t.Fatal(err)
	}
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
	t.Logf("%d keys written at version 8 in %s", rows, time.Since(start).Round(time.Millisecond))

	// The version-8 service: 4 workers, each a probe after the other.
	var (
		stop      atomic.Bool
		migrating atomic.Bool
		mu        sync.Mutex
		longest   [2]time.Duration // before the migration, during it
		longestAt time.Time        // when the longest probe during it began
		probes    [2]int
		fresh     atomic.Int64
		wg        sync.WaitGroup
		probeErr  error
	)
	probe := func() error {
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
				err := probe()
				took := time.Since(began)
				mu.Lock()
				i := 0
				if during || migrating.Load() {
					i = 1
				}
				if i == 1 && took > longest[1] {
					longestAt = began
				}
				longest[i] = max(longest[i], took)
				probes[i]++
				if err != nil && probeErr == nil {
					probeErr = err
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		})
	}
	time.Sleep(time.Second) // the service before the migration

	// Interrupted while it builds migration 9's index, then run again.
	migrating.Store(true)
	began := time.Now()
	cut, cancel := context.WithCancel(ctx)
	go func() {
		for cut.Err() == nil {
			var building bool
			_ = pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_progress_create_index
				WHERE relid = 'idem_keys'::regclass)`).Scan(&building)
			if building {
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
	if probeErr != nil {
		t.Fatalf("a probe of the version-8 service failed: %v", probeErr)
	}
	t.Logf("migrations 9 and 10 on %d keys in %s (the first run stopped by its context: %v; the second began %s in)",
		rows, took.Round(time.Millisecond), interrupted != nil, rerun.Round(time.Millisecond))
	t.Logf("longest probe before the migration %s (%d probes), during it %s (%d probes; it began %s into the migration)",
		longest[0].Round(time.Millisecond), probes[0], longest[1].Round(time.Millisecond), probes[1],
		longestAt.Sub(began).Round(time.Millisecond))

	var invalid, missing, probed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_index WHERE indrelid = 'idem_keys'::regclass
		AND NOT (indisvalid AND indisready)`).Scan(&invalid); err != nil || invalid != 0 {
		t.Fatalf("%d invalid indexes on idem_keys (%v)", invalid, err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM generate_series(1, $1::bigint) AS i
		WHERE NOT EXISTS (SELECT FROM idem_keys WHERE actor = 'user_' || (i % 1000) AND operation = 'draw'
		  AND idem_key = 'key-' || i AND status = 'succeeded'
		  AND response_body = convert_to('{"draw_id":' || i || ',"prizes":["p1"],"points_left":1000}', 'UTF8'))`,
		rows).Scan(&missing); err != nil || missing != 0 {
		t.Fatalf("%d populated keys lost or changed (%v)", missing, err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE actor = 'probe' AND status = 'succeeded'`).
		Scan(&probed); err != nil || int64(probed) < fresh.Load()-4 { // (a probe cut by stop may not have committed)
		t.Fatalf("%d probe keys stored of %d sent (%v)", probed, fresh.Load(), err)
	}
	// The migrated table serves today's calls: a populated key replays.
	res, err := idem.DoInTx(ctx, pool, idem.Scope{Actor: "user_1", Operation: "draw"}, "key-1",
		idem.Fingerprint(sha256Of8(1)), func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{}, errors.New("fn ran for a finished key")
		})
	if err != nil || !res.Replayed || res.Status != 201 || string(res.Body) != `{"draw_id":1,"prizes":["p1"],"points_left":1000}` {
		t.Fatalf("replay after the migration: %+v %v", res, err)
	}
}

// sha256Of8 is PostgreSQL's sha256(int8send(i)): the fingerprint of a key
// TestMigrateOnline writes.
func sha256Of8(i uint64) [32]byte {
	return sha256.Sum256(binary.BigEndian.AppendUint64(nil, i))
}
