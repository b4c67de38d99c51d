package pgxdriver_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/driver/pgxdriver"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// The statements Do and DoInTx run on every call find the key through the
// primary key even with statistics that say idem_keys is empty and a
// generic plan, as pgx's statement cache keeps one for the life of a
// connection.
func TestHotStatementsUseTheIndexWithStaleStatistics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	exec := func(sql string) {
		t.Helper()
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`ANALYZE idem_keys`) // while empty
	exec(`INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at)
		SELECT 'a', 'op', 'k' || i, '\x00', 'succeeded', 200, '\x', now() FROM generate_series(1, 20000) i`)
	exec(`SET plan_cache_mode = force_generic_plan`)
	plan := func(name, sql string, args string) string {
		t.Helper()
		exec(`PREPARE ` + name + ` AS ` + strings.SplitN(sql, "\n", 2)[1])
		rows, err := conn.Query(ctx, `EXPLAIN EXECUTE `+name+args)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(lines, "\n")
	}
	exec(`BEGIN`)
	exec(pgxdriver.SQLIndexLookup)
	if p := plan("get", db.KeyGet, `('a', 'op', 'k7')`); !strings.Contains(p, "idem_keys_pkey") || strings.Contains(p, "Seq Scan") {
		t.Errorf("KeyGet with %q:\n%s", pgxdriver.SQLIndexLookup, p)
	}
	exec(`COMMIT`)
	for name, sql := range map[string]string{"claim": db.KeyClaim, "takeover": db.KeyTakeOver} {
		if p := plan(name, sql, `('a', 'op', 'k7', '\x00', 1000, 0, '2s')`); strings.Contains(p, "Scan") {
			t.Errorf("%s:\n%s", name, p)
		}
	}
	if p := plan("complete", db.KeyComplete, `('a', 'op', 'k7', '\x00', 'succeeded', 1000, 200, NULL, '\x')`); strings.Contains(strings.ReplaceAll(p, "CTE Scan", ""), "Scan") {
		t.Errorf("KeyComplete:\n%s", p)
	}
}

// Prune's batches walk the expiry index (and the body expiry index) even when the statistics say the
// table is empty while it holds many expired rows: no bitmap scan of every
// expired row, no sort.
func TestPruneWalksTheIndexWithStaleStatistics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	exec := func(tx pgx.Tx, sql string) {
		t.Helper()
		if _, err := tx.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	if _, err := pool.Exec(ctx, `ANALYZE idem_keys`); err != nil { // while empty
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at)
		SELECT 'a', 'op', 'k' || i, '\x00', 'succeeded', 200, '\x', now() - interval '1 second' * i FROM generate_series(1, 60000) i`); err != nil {
		t.Fatal(err)
	}
	// Half of them keep bodies shorter than keys, past their time too.
	if _, err := pool.Exec(ctx, `UPDATE idem_keys SET body_expires_at = expires_at WHERE idem_key LIKE '%0'`); err != nil {
		t.Fatal(err)
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		exec(tx, pgxdriver.SQLIndexWalk)
		for sql, index := range map[string]string{db.KeyPrune: "idem_keys_expires_at_idx", db.KeyDropBodies: "idem_keys_body_expires_idx"} {
			rows, err := tx.Query(ctx, `EXPLAIN `+strings.Replace(strings.SplitN(sql, "\n", 2)[1], "$1::integer", "1000", 1))
			if err != nil {
				return err
			}
			lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return err
			}
			p := strings.Join(lines, "\n")
			if !strings.Contains(p, index) || strings.Contains(p, "Sort") || strings.Contains(p, "Bitmap") || strings.Contains(p, "Seq Scan") {
				t.Errorf("%s with %q:\n%s", strings.SplitN(sql, "\n", 2)[0], pgxdriver.SQLIndexWalk, p)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// ExpireLeases, ListUnknown and ListResumable find open reservations
// through their partial indexes, with statistics taken while idem_keys was
// empty and with fresh ones, while the table holds mostly Do rows and
// finished reservations, some with a window: no scan of the table (and for
// ExpireLeases, which runs with pgxdriver.SQLIndexWalk, no sort either).
func TestReservationScansUseTheirIndexWithStaleStatistics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	if _, err := pool.Exec(ctx, `ANALYZE idem_keys`); err != nil { // while empty
		t.Fatal(err)
	}
	for _, sql := range []string{`
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body,
		                       completed_at, expires_at)
		SELECT 'a', 'do', 'k' || i, '\x00', 'succeeded', 200, '\x', now(), now() + interval '1 day'
		FROM generate_series(1, 150000) i`, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at,
		                       response_status, response_body, completed_at, expires_at)
		SELECT 'a', 'res', 'done' || i, '\x00', 'succeeded', i, now() - interval '1 hour', 200, '\x', now(), now() + interval '1 day'
		FROM generate_series(1, 50000) i`, `
		UPDATE idem_keys SET resume_until = now() + interval '1 hour' WHERE idem_key LIKE 'done%' AND token % 2 = 0`, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at, expires_at, resume_until)
		SELECT 'a', 'res', 'open' || i, '\x00', 'processing', 100000 + i, now() - interval '1 second' * i, now() + interval '1 day',
		       CASE WHEN i % 2 = 0 THEN now() + interval '1 hour' END
		FROM generate_series(1, 100) i`, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at, last_error, expires_at, resume_until)
		SELECT 'a', 'res', 'unknown' || i, '\x00', 'unknown', 200000 + i, now() - interval '1 hour', 'x', now() + interval '1 day',
		       CASE WHEN i % 2 = 0 THEN now() + interval '1 hour' END
		FROM generate_series(1, 100) i`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	explain := func(settings, sql string, args ...string) string {
		t.Helper()
		sql = strings.SplitN(sql, "\n", 2)[1]
		for i := len(args); i > 0; i-- { // $10 before $1
			sql = strings.ReplaceAll(sql, fmt.Sprintf("$%d", i), args[i-1])
		}
		var p string
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if settings != "" {
				if _, err := tx.Exec(ctx, settings); err != nil {
					return err
				}
			}
			rows, err := tx.Query(ctx, `EXPLAIN `+sql)
			if err != nil {
				return err
			}
			lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
			p = strings.Join(lines, "\n")
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, stats := range []string{"stale", "fresh"} {
		if stats == "fresh" {
			if _, err := pool.Exec(ctx, `ANALYZE idem_keys`); err != nil {
				t.Fatal(err)
			}
		}
		p := explain(pgxdriver.SQLIndexWalk, db.ReserveExpireLeases, "'x'", "1000")
		if !strings.Contains(p, "idem_keys_open_created_idx") || strings.Contains(p, "Seq Scan") ||
			strings.Contains(p, "Sort") || strings.Contains(p, "Bitmap") {
			t.Errorf("ReserveExpireLeases, %s statistics:\n%s", stats, p)
		}
		// Either index of open reservations: a few rows, whatever the
		// size of the table.
		for name, sql := range map[string]string{"ReserveListUnknown": db.ReserveListUnknown, "ReserveListResumable": db.ReserveListResumable} {
			p = explain("", sql, "'-infinity'", "''", "''", "''", "100")
			if !strings.Contains(p, "idem_keys_open_") || strings.Contains(p, "Seq Scan") {
				t.Errorf("%s, %s statistics:\n%s", name, stats, p)
			}
		}
	}
}

// The take-over has two forms (the wait bounded inside the statement on
// PostgreSQL, around it on Citus); what they do to the row that holds the
// key must stay the same.
func TestTakeOverFormsUpdateAlike(t *testing.T) {
	src, err := os.ReadFile("../../../queries/keys.sql")
	if err != nil {
		t.Fatal(err)
	}
	update := func(name string) string {
		_, query, found := strings.Cut(string(src), "-- name: "+name+" ")
		start := strings.Index(query, "ON CONFLICT")
		end := strings.Index(query, "RETURNING")
		if !found || start < 0 || end < start {
			t.Fatalf("no ON CONFLICT ... RETURNING in %s", name)
		}
		return query[start:end]
	}
	if plain, citus := update("KeyTakeOver"), update("KeyTakeOverCitus"); plain != citus {
		t.Fatalf("KeyTakeOver and KeyTakeOverCitus update differently:\n%s\n%s", plain, citus)
	}
}

// KeyDropBodies and its Citus form (run here on PostgreSQL) drop the body
// and headers of finished rows past their body_expires_at, at most a batch,
// oldest first, and nothing else: not a row whose body's time has not come,
// not a row in flight, not a row without one; the rows stay.
func TestDropBodies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, sql := range map[string]string{"KeyDropBodies": db.KeyDropBodies, "KeyDropBodiesCitus": db.KeyDropBodiesCitus} {
		pool := pgtest.Pool(t, idem.Migrate)
		if _, err := pool.Exec(ctx, `
			INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_headers, response_body,
			                       expires_at, body_expires_at)
			SELECT 'a', 'op', 'k' || i, '\x00',
			       CASE WHEN i <= 5 THEN 'processing' ELSE 'succeeded' END,
			       CASE WHEN i <= 5 THEN NULL ELSE 201 END, '{"A":["b"]}', '\x01',
			       now() + interval '1 day',
			       CASE WHEN i <= 30 THEN now() - interval '1 second' * i
			            WHEN i <= 40 THEN now() + interval '1 hour' END
			FROM generate_series(1, 50) i`); err != nil {
			t.Fatal(err)
		}
		drop := func() int64 {
			t.Helper()
			tag, err := pool.Exec(ctx, sql, 20)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			return tag.RowsAffected()
		}
		if n := drop(); n != 20 {
			t.Errorf("%s: %d rows in the first batch, want 20", name, n)
		}
		var oldestLeft int
		if err := pool.QueryRow(ctx, `SELECT min(substr(idem_key, 2)::int) FROM idem_keys
			WHERE response_body IS NOT NULL AND body_expires_at <= now() AND status = 'succeeded'`).Scan(&oldestLeft); err != nil {
			t.Fatal(err)
		}
		if oldestLeft != 6 { // k11..k30, the oldest, went first
			t.Errorf("%s: the oldest body left is k%d's, want k6's", name, oldestLeft)
		}
		if n := drop(); n != 5 {
			t.Errorf("%s: %d rows in the second batch, want 5", name, n)
		}
		var dropped, rows int
		if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE response_body IS NULL AND response_headers IS NULL
			AND body_expires_at IS NULL AND response_status = 201), count(*) FROM idem_keys`).Scan(&dropped, &rows); err != nil {
			t.Fatal(err)
		}
		if dropped != 25 || rows != 50 {
			t.Errorf("%s: %d bodies dropped of %d rows, want 25 of 50", name, dropped, rows)
		}
	}
}
