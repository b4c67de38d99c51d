package citustest_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
	"github.com/pgidem/idem/internal/testkit/citustest"
	"github.com/pgidem/idem/internal/testkit/migratetest"
)

// ReadStats reports the size of idem_keys' shards on the workers, not the
// coordinator's empty shell.
func TestReadStatsSizes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	if _, err := p.Exec(ctx, `INSERT INTO idem_keys
		(actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at)
		SELECT 'bulk-' || (i % 50), 'op', 'k' || i, '\x00', 'succeeded', 200, repeat('x', 200)::bytea, now() + interval '1 hour'
		FROM generate_series(1, 5000) i`); err != nil {
		t.Fatal(err)
	}
	st, err := idem.ReadStats(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	var shell, table, total int64
	if err := p.QueryRow(ctx, `SELECT pg_table_size('idem_keys'), citus_table_size('idem_keys'),
		citus_total_relation_size('idem_keys')`).Scan(&shell, &table, &total); err != nil {
		t.Fatal(err)
	}
	if st.Keys[idem.StatusSucceeded] != 5000 {
		t.Fatalf("ReadStats counts %+v, want 5000 succeeded", st.Keys)
	}
	if st.TableBytes != table || st.IndexBytes != total-table || st.TableBytes <= shell || st.TableBytes < 5000*200 {
		t.Fatalf("ReadStats sizes: table %d, indexes %d; shards: table %d, with indexes %d; the coordinator's shell %d",
			st.TableBytes, st.IndexBytes, table, total, shell)
	}
}

// A pool on a worker instead of the coordinator: Migrate, Distribute and
// the reservation calls (whose token sequence lives on the coordinator)
// are refused with ErrUnsupported, and nothing is written.
func TestWorkerConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, p := newDB(t)
	w := pool(t, db.Workers[0])
	scope := idem.Scope{Actor: "heidi", Operation: "charge"}
	isErr(t, "Migrate on a worker", idem.Migrate(ctx, w), idem.ErrUnsupported)
	isErr(t, "Distribute on a worker", idem.Distribute(ctx, w), idem.ErrUnsupported)
	_, err := idem.Reserve(ctx, w, scope, "r", fp("x"), time.Minute)
	isErr(t, "Reserve on a worker", err, idem.ErrUnsupported)
	if n := count(t, p, `SELECT count(*) FROM idem_keys`); n != 0 {
		t.Fatalf("%d keys written through the worker", n)
	}
	// Resolve draws a new token too.
	r, err := idem.Reserve(ctx, p, scope, "u", fp("x"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, p, r, "lost"); err != nil {
		t.Fatal(err)
	}
	err = idem.Resolve(ctx, w, scope, "u", idem.Resolution{Token: r.Token, Retryable: true, Reason: "checked"})
	isErr(t, "Resolve on a worker", err, idem.ErrUnsupported)
	if rec, err := idem.Lookup(ctx, p, scope, "u"); err != nil || rec.Status != idem.StatusUnknown || rec.Token != r.Token {
		t.Fatalf("after Resolve on a worker: %+v, %v", rec, err)
	}
}

// Distribute refuses a session whose SET LOCAL statements do not reach the
// workers: Config.Wait would bound nothing there.
func TestDistributeNeedsSetPropagation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := newDB(t)
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["citus.propagate_set_commands"] = "none"
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	isErr(t, "Distribute with citus.propagate_set_commands none", idem.Distribute(ctx, p), idem.ErrUnsupported)
}

// Concurrent pruners and lease sweepers on Citus (no SKIP LOCKED there):
// every expired finished key goes, every live one stays, each lease that
// ran out turns unknown once.
func TestConcurrentMaintenance(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	if _, err := p.Exec(ctx, `INSERT INTO idem_keys
		(actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at, token, lease_expires_at)
		SELECT 'm-' || (i % 40), 'op', 'k' || i, '\x00',
		       CASE WHEN i % 4 = 0 THEN 'processing' ELSE 'succeeded' END,
		       200, '\x', now() + CASE WHEN i % 4 = 1 THEN interval '1 hour' ELSE - interval '1 second' * i END,
		       i, CASE WHEN i % 4 = 0 THEN now() - interval '1 second' END
		FROM generate_series(1, 4000) i`); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var pruned, expired [3]int64
	for i := range 3 {
		wg.Go(func() {
			n, err := idem.Prune(ctx, p, idem.PruneOptions{BatchSize: 200})
			if err != nil {
				t.Errorf("Prune: %v", err)
			}
			pruned[i] = n
		})
		wg.Go(func() {
			for {
				n, err := idem.ExpireLeases(ctx, p, 100)
				if err != nil {
					t.Errorf("ExpireLeases: %v", err)
					return
				}
				expired[i] += n
				if n == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
	// Pruners that stopped early leave the rest to a last one.
	rest, err := idem.Prune(ctx, p, idem.PruneOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sweep, err := idem.ExpireLeases(ctx, p, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if got := pruned[0] + pruned[1] + pruned[2] + rest; got != 2000 {
		t.Fatalf("pruned %v + %d, want 2000 in all", pruned, rest)
	}
	if got := expired[0] + expired[1] + expired[2] + sweep; got != 1000 {
		t.Fatalf("expired %v + %d, want 1000 in all", expired, sweep)
	}
	if n := count(t, p, `SELECT count(*) FROM idem_keys WHERE status = 'succeeded'`); n != 1000 {
		t.Fatalf("%d live keys left, want 1000", n)
	}
	if n := count(t, p, `SELECT count(*) FROM idem_keys WHERE status = 'unknown'`); n != 1000 {
		t.Fatalf("%d unknown, want 1000", n)
	}
}

// Two actors in one transaction (a request that also writes for another
// tenant): Citus commits it on both workers with two-phase commit, and
// both keys replay.
func TestTwoActorsOneTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	a, b := actorsOnTwoWorkers(t, p)
	res, err := idem.DoInTx(ctx, p, idem.Scope{Actor: a, Operation: "transfer"}, "x1", fp("x"),
		func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			if _, err := order(a, "x1", "out")(ctx, tx); err != nil {
				return idem.Response{}, err
			}
			inner, err := idem.Do(ctx, tx, idem.Scope{Actor: b, Operation: "receive"}, "x1", fp("x"), order(b, "x1", "in"))
			if err != nil {
				return idem.Response{}, err
			}
			return idem.Response{Status: 201, Body: inner.Body}, nil
		})
	if err != nil || res.Replayed {
		t.Fatalf("two actors: %+v, %v", res, err)
	}
	if ordersOf(t, p, a, "x1") != 1 || ordersOf(t, p, b, "x1") != 1 {
		t.Fatal("the orders of the two actors did not both commit")
	}
	for _, s := range []idem.Scope{{Actor: a, Operation: "transfer"}, {Actor: b, Operation: "receive"}} {
		if rec, err := idem.Lookup(ctx, p, s, "x1"); err != nil || rec.Status != idem.StatusSucceeded {
			t.Fatalf("%v: %+v, %v", s, rec, err)
		}
	}
}

// What a request costs on Citus: DoInTx for one actor (one key, one
// order), the same transaction with a second key and order (Do inside fn)
// for the same actor, and for an actor on the other worker (two-phase
// commit). The three run in turn, so each gets the machine's same mood;
// each reports its mean as ms/<name>. The figures are in docs/citus.md:
//
//	go test -run '^$' -bench Citus -benchtime 600x ./internal/testkit/citustest
func BenchmarkCitus(b *testing.B) {
	ctx := context.Background()
	_, p := newDB(b)
	a, c := actorsOnTwoWorkers(b, p)
	request := func(key, second string) error {
		if second == "" {
			_, err := idem.DoInTx(ctx, p, idem.Scope{Actor: a, Operation: "order"}, key, fp("x"), order(a, key, "x"))
			return err
		}
		_, err := idem.DoInTx(ctx, p, idem.Scope{Actor: a, Operation: "transfer"}, key, fp("x"),
			func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				if _, err := order(a, key, "out")(ctx, tx); err != nil {
					return idem.Response{}, err
				}
				inner, err := idem.Do(ctx, tx, idem.Scope{Actor: second, Operation: "receive"}, key, fp("x"),
					order(second, key, "in"))
				return inner.Response, err
			})
		return err
	}
	kinds := []struct{ name, second string }{{"one-actor", ""}, {"two-keys-one-actor", a}, {"two-actors-two-workers", c}}
	spent := make([]time.Duration, len(kinds))
	n := 0
	for b.Loop() {
		k := n % len(kinds)
		start := time.Now()
		if err := request(fmt.Sprintf("%s-%d", kinds[k].name, n), kinds[k].second); err != nil {
			b.Fatal(err)
		}
		spent[k] += time.Since(start)
		n++
	}
	for k, kind := range kinds {
		if runs := (n - k + len(kinds) - 1) / len(kinds); runs > 0 {
			b.ReportMetric(float64(spent[k].Microseconds())/1000/float64(runs), "ms/"+kind.name)
		}
	}
}

// idem_keys distributed at an earlier version: Migrate brings it up to date
// on the coordinator, Citus applies the later migrations (indexes built
// concurrently, a new column) to every shard, and every call works. The
// audit trail, which Migrate adds as a local table (an audited change
// commits there meanwhile), is distributed by Distribute run again,
// co-located with idem_keys, its row copied.
func TestMigrateAfterDistribute(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := citustest.Empty(t)
	p := pool(t, db.URL)
	migratetest.UpTo(t, p, 2)
	if err := idem.Distribute(ctx, p); err != nil {
		t.Fatal(err)
	}
	if err := idem.Migrate(ctx, p); err != nil {
		t.Fatalf("Migrate on the distributed table: %v", err)
	}
	if column, _ := distribution(t, p, "idem_audit"); column != "" {
		t.Fatalf("idem_audit, new, is distributed by %q", column)
	}
	// Meanwhile the trail is a local table on the coordinator, written in
	// one transaction with the distributed idem_keys.
	early := idem.Scope{Actor: "ivan", Operation: "order"}
	if _, err := idem.DoInTx(ctx, p, early, "m0", fp("x"), func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201}, nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := audit.Forget(ctx, p, nil, "sam", early, "m0", nil, "reused"); err != nil {
		t.Fatalf("a forget with its audit row, the trail local: %v", err)
	}
	if err := idem.Distribute(ctx, p); err != nil {
		t.Fatalf("Distribute after Migrate added idem_audit: %v", err)
	}
	if column, colocated := distribution(t, p, "idem_audit"); column != idem.DistributionColumn || !colocated {
		t.Fatalf("idem_audit is distributed by %q, co-located with idem_keys: %v", column, colocated)
	}
	if n := count(t, p, `SELECT count(*) FROM idem_audit WHERE actor = 'ivan'`); n != 1 {
		t.Fatalf("%d audit rows after Distribute, want 1", n)
	}
	if err := orders(ctx, p); err != nil {
		t.Fatal(err)
	}
	// 00003's index of open reservations is on every shard, and the
	// other one, which 00012 dropped, on none.
	var shards, indexed, dropped int64
	if err := p.QueryRow(ctx, `SELECT count(*) FROM citus_shards WHERE table_name = 'idem_keys'::regclass`).Scan(&shards); err != nil {
		t.Fatal(err)
	}
	indexed = count(t, p, `SELECT count(*) FROM run_command_on_shards('idem_keys',
		$$SELECT count(*) FROM pg_indexes WHERE tablename = '%s' AND indexname LIKE 'idem_keys_open_created_idx%%'$$)
		WHERE success AND result = '1'`)
	dropped = count(t, p, `SELECT count(*) FROM run_command_on_shards('idem_keys',
		$$SELECT count(*) FROM pg_indexes WHERE tablename = '%s' AND indexname LIKE 'idem_keys_open_lease_idx%%'$$)
		WHERE success AND result <> '0'`)
	if shards == 0 || indexed != shards || dropped != 0 {
		t.Fatalf("%d shards, %d of them with idem_keys_open_created_idx, %d with idem_keys_open_lease_idx", shards, indexed, dropped)
	}
	scope := idem.Scope{Actor: "judy", Operation: "order"}
	if _, err := idem.DoInTx(ctx, p, scope, "m1", fp("x"), order("judy", "m1", "x")); err != nil {
		t.Fatal(err)
	}
	r, err := idem.Reserve(ctx, p, scope, "m2", fp("x"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, p, r, "lost"); err != nil {
		t.Fatal(err)
	}
	if err := idem.Resolve(ctx, p, scope, "m2", idem.Resolution{Token: r.Token, Retryable: true, Reason: "checked"}); err != nil {
		t.Fatal(err)
	}
}

// Distribute refuses a database without idem_keys, and an idem_audit
// distributed otherwise than by actor co-located with idem_keys, and
// changes nothing: idem_keys is not distributed either (both are
// distributed in one transaction). The fix the refusal of a trail not
// co-located names works.
func TestDistributeAuditOtherwise(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := citustest.Empty(t)
	p := pool(t, db.URL)
	err := idem.Distribute(ctx, p)
	isErr(t, "Distribute before Migrate", err, idem.ErrUnsupported)
	if !strings.Contains(err.Error(), "run Migrate first") {
		t.Fatalf("Distribute before Migrate: %v", err)
	}
	if err := idem.Migrate(ctx, p); err != nil {
		t.Fatal(err)
	}
	exec := func(sql string) {
		t.Helper()
		if _, err := p.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	for _, c := range []struct{ name, sql string }{
		{"distributed by id", `SELECT create_distributed_table('idem_audit', 'id')`},
		{"a reference table", `SELECT create_reference_table('idem_audit')`},
	} {
		exec(c.sql)
		isErr(t, "Distribute with idem_audit "+c.name, idem.Distribute(ctx, p), idem.ErrUnsupported)
		if column, _ := distribution(t, p, "idem_keys"); column != "" {
			t.Fatalf("idem_audit %s: Distribute refused, yet idem_keys is distributed by %q", c.name, column)
		}
		exec(`SELECT undistribute_table('idem_audit')`)
	}

	exec(`SELECT create_distributed_table('idem_keys', 'actor')`)
	exec(`SELECT create_distributed_table('idem_audit', 'actor', colocate_with => 'none')`)
	err = idem.Distribute(ctx, p)
	isErr(t, "Distribute with idem_audit not co-located", err, idem.ErrUnsupported)
	fix := "SELECT update_distributed_table_colocation('idem_audit', colocate_with => 'idem_keys')"
	if !strings.Contains(err.Error(), fix) {
		t.Fatalf("the refusal does not name the fix: %v", err)
	}
	if column, colocated := distribution(t, p, "idem_audit"); column != idem.DistributionColumn || colocated {
		t.Fatalf("after the refusal idem_audit is distributed by %q, co-located: %v", column, colocated)
	}
	exec(fix)
	if err := idem.Distribute(ctx, p); err != nil {
		t.Fatalf("Distribute after the fix: %v", err)
	}
	if _, colocated := distribution(t, p, "idem_audit"); !colocated {
		t.Fatal("idem_audit is not co-located with idem_keys after the fix")
	}
}

// Distribute creates idem_refuse (migration 00008) on the workers when the
// database was migrated before Citus could propagate it (simulated: the
// workers' copies dropped), so that a completion that must refuse raises
// idem's SQLSTATE there: fn that changes its key row gets ErrKeyRowChanged,
// and nothing is stored.
func TestDistributeCreatesRefuseOnWorkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	if _, err := p.Exec(ctx, `SELECT run_command_on_workers($$DROP FUNCTION idem_refuse(text, text)$$)`); err != nil {
		t.Fatal(err)
	}
	if err := idem.Distribute(ctx, p); err != nil {
		t.Fatal(err)
	}
	var onWorkers int
	if err := p.QueryRow(ctx, `SELECT count(*) FROM run_command_on_workers(
		$$SELECT count(*) FROM pg_proc WHERE proname = 'idem_refuse'$$) WHERE success AND result = '1'`).Scan(&onWorkers); err != nil || onWorkers != 2 {
		t.Fatalf("idem_refuse on %d workers, %v; want 2", onWorkers, err)
	}
	scope := idem.Scope{Actor: "alice", Operation: "order"}
	_, err := idem.DoInTx(ctx, p, scope, "k", fp("book"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		_, err := tx.Exec(ctx, `UPDATE idem_keys SET fingerprint = '\x00' WHERE actor = 'alice' AND idem_key = 'k'`)
		return idem.Response{Status: 200}, err
	})
	isErr(t, "fn changed its key row", err, idem.ErrKeyRowChanged)
	var n int
	if err := p.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE actor = 'alice'`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows after ErrKeyRowChanged, %v", n, err)
	}
}

// Migrations 00009 to 00012 on a table Distribute distributed at version
// 8: their columns, the partial indexes built concurrently, 00011's
// autovacuum setting and 00012's dropped index reach every shard, calls
// with Config.BodyTTL work, and their Downs (00012's index built again
// concurrently; 00009's one DO statement, the table locked; 00011's reset)
// revert them on the distributed table.
func TestMigrate9AfterDistribute(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := citustest.Empty(t)
	p := pool(t, db.URL)
	migratetest.UpTo(t, p, 8)
	if err := idem.Distribute(ctx, p); err != nil {
		t.Fatal(err)
	}
	if err := idem.Migrate(ctx, p); err != nil {
		t.Fatalf("Migrate to the latest on the distributed table: %v", err)
	}
	shards := count(t, p, `SELECT count(*) FROM citus_shards WHERE table_name = 'idem_keys'::regclass`)
	indexed := count(t, p, `SELECT count(*) FROM run_command_on_shards('idem_keys',
		$$SELECT count(*) FROM pg_indexes WHERE tablename = '%s' AND indexname LIKE 'idem_keys_body_expires_idx%%'$$)
		WHERE success AND result = '1'`)
	if shards == 0 || indexed != shards {
		t.Fatalf("%d shards, %d of them with idem_keys_body_expires_idx", shards, indexed)
	}
	if n := count(t, p, `SELECT count(*) FROM run_command_on_shards('idem_keys',
		$$SELECT count(*) FROM pg_indexes WHERE tablename = '%s' AND indexname LIKE 'idem_keys_failed_idx%%'$$)
		WHERE success AND result = '1'`); n != shards {
		t.Fatalf("%d shards, %d of them with idem_keys_failed_idx", shards, n)
	}
	c, err := idem.New(idem.Config{BodyTTL: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := orders(ctx, p); err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "kate", Operation: "order"}
	if _, err := c.DoInTx(ctx, p, scope, "b1", fp("x"), order("kate", "b1", "x")); err != nil {
		t.Fatal(err)
	}
	if n := count(t, p, `SELECT count(*) FROM idem_keys WHERE body_expires_at IS NOT NULL`); n != 1 {
		t.Fatalf("%d rows with body_expires_at, want 1", n)
	}
	if n := count(t, p, `SELECT count(*) FROM run_command_on_shards('idem_keys',
		$$SELECT count(*) FROM information_schema.columns WHERE table_name = '%s' AND column_name = 'unknown_at'$$)
		WHERE success AND result = '1'`); n != shards {
		t.Fatalf("%d shards, %d of them with unknown_at", shards, n)
	}
	// Migration 12's Down builds the lease index again, valid, on every
	// shard.
	leaseIndexes := `SELECT count(*) FROM run_command_on_shards('idem_keys',
		$$SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		  WHERE i.indrelid = '%s'::regclass AND c.relname LIKE 'idem_keys_open_lease_idx%%' AND i.indisvalid$$)
		WHERE success AND result = '1'`
	if n := count(t, p, leaseIndexes); n != 0 {
		t.Fatalf("%d shards with idem_keys_open_lease_idx at the latest version", n)
	}
	if v, err := idem.MigrateDown(ctx, p, idem.MigrateDownOptions{}); err != nil || v != 12 {
		t.Fatalf("MigrateDown from 12 on the distributed table: %d, %v", v, err)
	}
	if n := count(t, p, leaseIndexes); n != shards {
		t.Fatalf("%d shards, %d of them with a valid idem_keys_open_lease_idx after 12's Down", shards, n)
	}
	// Migration 11's autovacuum setting reaches every shard, where
	// autovacuum runs, and its Down takes it back from them.
	if n := count(t, p, scaledShards); n != shards {
		t.Fatalf("%d shards, %d of them with autovacuum_vacuum_scale_factor 0.050", shards, n)
	}
	if v, err := idem.MigrateDown(ctx, p, idem.MigrateDownOptions{}); err != nil || v != 11 {
		t.Fatalf("MigrateDown from 11 on the distributed table: %d, %v", v, err)
	}
	if n := count(t, p, scaledShards); n != 0 {
		t.Fatalf("%d shards keep autovacuum_vacuum_scale_factor 0.050 after the Down", n)
	}
	if v, err := idem.MigrateDown(ctx, p, idem.MigrateDownOptions{}); err != nil || v != 10 {
		t.Fatalf("MigrateDown from 10 on the distributed table: %d, %v", v, err)
	}
	if n := count(t, p, `SELECT count(*) FROM information_schema.columns WHERE table_name = 'idem_keys' AND column_name = 'unknown_at'`); n != 0 {
		t.Fatalf("unknown_at still there after the Down")
	}
	if v, err := idem.MigrateDown(ctx, p, idem.MigrateDownOptions{}); err != nil || v != 9 {
		t.Fatalf("MigrateDown from 9 on the distributed table: %d, %v", v, err)
	}
	if n := count(t, p, `SELECT count(*) FROM information_schema.columns WHERE table_name = 'idem_keys' AND column_name = 'body_expires_at'`); n != 0 {
		t.Fatalf("body_expires_at still there after the Down")
	}
}

// Migrate, then Distribute (the order docs/citus.md gives): the shards that
// create_distributed_table makes carry migration 00011's autovacuum
// setting, where autovacuum runs.
func TestAutovacuumSettingOnShards(t *testing.T) {
	t.Parallel()
	_, p := newDB(t)
	shards := count(t, p, `SELECT count(*) FROM citus_shards WHERE table_name = 'idem_keys'::regclass`)
	if n := count(t, p, scaledShards); shards == 0 || n != shards {
		t.Fatalf("%d shards, %d of them with autovacuum_vacuum_scale_factor 0.050", shards, n)
	}
}

// scaledShards counts the shards of idem_keys that carry migration 00011's
// autovacuum setting.
const scaledShards = `SELECT count(*) FROM run_command_on_shards('idem_keys',
	$$SELECT count(*) FROM pg_class c, pg_options_to_table(c.reloptions)
	  WHERE c.oid = '%s'::regclass AND option_name = 'autovacuum_vacuum_scale_factor' AND option_value = '0.050'$$)
	WHERE success AND result = '1'`
