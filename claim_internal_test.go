package idem

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/pgtest"
)

// The statements Do and DoInTx run on every call find the key through the
// primary key even with statistics that say idem_keys is empty and a
// generic plan, as pgx's statement cache keeps one for the life of a
// connection.
func TestHotStatementsUseTheIndexWithStaleStatistics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, Migrate)
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
	exec(sqlIndexLookup)
	if p := plan("get", db.KeyGet, `('a', 'op', 'k7')`); !strings.Contains(p, "idem_keys_pkey") || strings.Contains(p, "Seq Scan") {
		t.Errorf("KeyGet with %q:\n%s", sqlIndexLookup, p)
	}
	exec(`COMMIT`)
	for name, sql := range map[string]string{"claim": db.KeyClaim, "takeover": db.KeyTakeOver} {
		if p := plan(name, sql, `('a', 'op', 'k7', '\x00', 1000)`); strings.Contains(p, "Scan") {
			t.Errorf("%s:\n%s", name, p)
		}
	}
	if p := plan("complete", db.KeyComplete, `('a', 'op', 'k7', '\x00', 'succeeded', 1000, 200, NULL, '\x')`); strings.Contains(p, "Scan") {
		t.Errorf("KeyComplete:\n%s", p)
	}
}

// Prune's batches walk the expiry index even when the statistics say the
// table is empty while it holds many expired rows: no bitmap scan of every
// expired row, no sort.
func TestPruneWalksTheIndexWithStaleStatistics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, Migrate)
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
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		exec(tx, sqlIndexWalk)
		rows, err := tx.Query(ctx, `EXPLAIN `+strings.Replace(strings.SplitN(db.KeyPrune, "\n", 2)[1], "$1::integer", "1000", 1))
		if err != nil {
			return err
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		p := strings.Join(lines, "\n")
		if !strings.Contains(p, "idem_keys_expires_at_idx") || strings.Contains(p, "Sort") || strings.Contains(p, "Bitmap") || strings.Contains(p, "Seq Scan") {
			t.Errorf("KeyPrune with %q:\n%s", sqlIndexWalk, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
