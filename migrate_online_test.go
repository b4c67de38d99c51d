package idem_test

import (
	"testing"

	"github.com/pgidem/idem/internal/testkit/migratetest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// Migrating a populated table from version 8 to the latest (migrations 9
// and 10: a column each, added in place, and a partial index each, built
// CONCURRENTLY; 11: a storage setting) while the service runs: calls of
// the version-8 service go on throughout, the first run is stopped if it
// is seen building an index, and run again, and nothing is lost
// (migratetest.Online). 200,000 keys; IDEM_MIGRATION_ROWS for more
// (docs/operations.md gives the figures at 3,000,000).
func TestMigrateOnline(t *testing.T) {
	if testing.Short() {
		t.Skip("populates a table")
	}
	t.Parallel()
	pool := pgtest.Pool(t, noMigrate)
	migratetest.UpTo(t, pool, migratetest.From)
	migratetest.Online(t, pool, migratetest.Rows(t, 200_000), `SELECT EXISTS (SELECT FROM pg_stat_progress_create_index
		WHERE relid = 'idem_keys'::regclass AND datname = current_database())`)
}
