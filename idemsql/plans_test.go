package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// The operator and reservation calls find rows through an index whatever
// the statistics say: pgx's stdlib driver caches a prepared statement per
// connection, and PostgreSQL may keep a generic plan made while idem_keys
// was small (a sequential scan) for the life of the connection. Here the
// plans are made on an empty, analyzed table, the table then grows, and the
// calls must not scan it.
func TestOperatorCallsUseTheIndex(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, pool := migrated(t, "pgx")
	db.SetMaxOpenConns(1) // one connection: one statement cache
	if _, err := pool.Exec(ctx, `ANALYZE idem_keys`); err != nil {
		t.Fatal(err)
	}
	r := idem.Reservation{Scope: scope, Key: "nobody", Token: 1}
	calls := func() {
		t.Helper()
		for range 8 { // past the five custom plans PostgreSQL makes before a generic one
			if _, err := idemsql.Lookup(ctx, db, scope, "nobody"); !errors.Is(err, idem.ErrNotFound) {
				t.Fatalf("Lookup: %v", err)
			}
			if err := idemsql.Forget(ctx, db, scope, "nobody"); !errors.Is(err, idem.ErrNotFound) {
				t.Fatalf("Forget: %v", err)
			}
			if err := idemsql.Resolve(ctx, db, scope, "nobody", idem.Resolution{Token: 1, Retryable: true}); !errors.Is(err, idem.ErrNotFound) {
				t.Fatalf("Resolve: %v", err)
			}
			if err := idemsql.FailRetryable(ctx, db, r, ""); !errors.Is(err, idem.ErrFenced) {
				t.Fatalf("FailRetryable: %v", err)
			}
			if _, err := idemsql.Heartbeat(ctx, db, r, time.Minute); !errors.Is(err, idem.ErrFenced) {
				t.Fatalf("Heartbeat: %v", err)
			}
		}
	}
	calls()
	bulk := fpOf("bulk")
	if _, err := pool.Exec(ctx, `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
		SELECT 'bulk', 'op', 'k' || g, $1, 'succeeded', now() + interval '1 day' FROM generate_series(1, 5000) g`,
		bulk[:]); err != nil {
		t.Fatal(err)
	}
	before := seqScans(t, ctx, db)
	calls()
	if after := seqScans(t, ctx, db); after != before {
		t.Fatalf("the calls scanned idem_keys %d times", after-before)
	}
}

// seqScans is how many sequential scans of idem_keys the statistics count,
// after the one connection of db flushed its own.
func seqScans(t *testing.T, ctx context.Context, db *sql.DB) int64 {
	t.Helper()
	if _, err := db.ExecContext(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		t.Fatal(err)
	}
	var n int64
	if err := db.QueryRowContext(ctx, `SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'idem_keys'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
