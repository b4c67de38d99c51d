package citustest_test

import (
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/citustest"
	"github.com/pgidem/idem/internal/testkit/migratetest"
)

// TestMigrateOnline on a distributed table: idem_keys distributed at
// version 8 and populated, then migrated to the latest through the
// coordinator while calls of the version-8 service go on, the first run
// stopped if it is seen building an index on the shards (CREATE INDEX
// CONCURRENTLY, which Citus runs shard by shard) and run again; nothing
// lost, and every shard's indexes valid. 50,000 keys; IDEM_MIGRATION_ROWS
// for more (docs/operations.md gives the figures).
func TestMigrateOnline(t *testing.T) {
	if testing.Short() {
		t.Skip("populates a table")
	}
	t.Parallel()
	ctx := t.Context()
	db := citustest.Empty(t)
	p := pool(t, db.URL)
	migratetest.UpTo(t, p, migratetest.From)
	if err := idem.Distribute(ctx, p); err != nil {
		t.Fatal(err)
	}
	// The coordinator's backend that runs the migration shows the
	// statement it sends to the shards (this database's: other tests build
	// indexes on the cluster too).
	migratetest.Online(t, p, migratetest.Rows(t, 50_000), `SELECT EXISTS (SELECT FROM pg_stat_activity
		WHERE datname = current_database() AND state = 'active'
		  AND query ILIKE 'CREATE INDEX CONCURRENTLY%' AND pid <> pg_backend_pid())`)
	shards := count(t, p, `SELECT count(*) FROM citus_shards WHERE table_name = 'idem_keys'::regclass`)
	// Five valid indexes on each: the primary key, expires_at's, the one of
	// open reservations (migration 12 dropped the other), migration 9's and
	// 10's.
	if n := count(t, p, `SELECT count(*) FROM run_command_on_shards('idem_keys',
		$$SELECT count(*) FROM pg_index WHERE indrelid = '%s'::regclass AND indisvalid AND indisready$$)
		WHERE success AND result = '5'`); n != shards {
		t.Fatalf("%d shards, %d of them with 5 valid indexes", shards, n)
	}
}
