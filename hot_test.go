package idem_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// The completion of a key claimed by DoInTx or Do is a HOT update: it
// changes no indexed column and no column an index predicate reads, so it
// adds no index entries. The statistics are read from the backend that ran
// the calls, after it flushed them.
func TestCompletionIsHOT(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	const calls = 200
	ok := func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201, Body: []byte(`{"id":1}`)}, nil
	}
	// Half of the calls keep bodies shorter than keys: the claim writes
	// body_expires_at (indexed), the completion never does.
	plain, err := idem.New(idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	short, err := idem.New(idem.Config{BodyTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	for i := range calls {
		c := plain
		if i%2 == 1 {
			c = short
		}
		if _, err := c.DoInTx(ctx, conn, scope, fmt.Sprintf("hot-%d", i), fpA, ok); err != nil {
			t.Fatal(err)
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			_, err := c.Do(ctx, tx, scope, fmt.Sprintf("hot-do-%d", i), fpA, ok)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	var upd, hot int64
	if _, err := conn.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		t.Fatal(err)
	}
	err = conn.QueryRow(ctx, `SELECT pg_stat_clear_snapshot(), n_tup_upd, n_tup_hot_upd
		FROM pg_stat_user_tables WHERE relname = 'idem_keys'`).Scan(nil, &upd, &hot)
	if err != nil {
		t.Fatal(err)
	}
	// A few completions may find no room left on their page.
	if upd != 2*calls || hot < upd*9/10 {
		t.Fatalf("%d updates, %d of them HOT; want %d, nearly all HOT", upd, hot, 2*calls)
	}
	t.Logf("%d updates, %d HOT", upd, hot)
}

// Migration 00003 upgrades a populated table of version 2 without changing
// a row, its indexes serve ListUnknown and ExpireLeases at once, and its
// Down (back to version 2) changes no row either.
func TestMigrationHOTUpgradesAPopulatedTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, noMigrate)
	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, idem.Migrations(),
		goose.WithTableName(idem.MigrationTable), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := provider.UpTo(ctx, 2); err != nil {
		t.Fatal(err)
	}
	// Rows as version 2 leaves them: Do's, and reservations in every state.
	for _, sql := range []string{`
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body,
		                       created_at, completed_at, expires_at)
		SELECT 'up', 'do', 'do-' || g, $1, 'succeeded', 200, '\x', now(), now(), now() + interval '1 day'
		FROM generate_series(1, 2000) AS g`, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at, expires_at)
		SELECT 'up', 'res', 'expired-' || g, $1, 'processing', nextval('idem_keys_token_seq'),
		       now() - interval '1 minute' + g * interval '1 ms', now() + interval '1 day'
		FROM generate_series(1, 40) AS g`, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at, expires_at)
		SELECT 'up', 'res', 'live-' || g, $1, 'processing', nextval('idem_keys_token_seq'),
		       now() + interval '1 hour', now() + interval '1 day'
		FROM generate_series(1, 30) AS g`, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at, last_error, expires_at)
		SELECT 'up', 'res', 'unknown-' || g, $1, 'unknown', nextval('idem_keys_token_seq'),
		       now() - interval '1 hour', 'timeout', now() + interval '1 day'
		FROM generate_series(1, 20) AS g`, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at,
		                       response_status, response_body, completed_at, expires_at)
		SELECT 'up', 'res', 'done-' || g, $1, 'succeeded', nextval('idem_keys_token_seq'),
		       now() - interval '1 hour', 200, '\x', now(), now() + interval '1 day'
		FROM generate_series(1, 50) AS g`, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at,
		                       last_error, completed_at, expires_at)
		SELECT 'up', 'res', 'retry-' || g, $1, 'failed_retryable', nextval('idem_keys_token_seq'),
		       now() - interval '1 hour', 'declined', now(), now() + interval '1 day'
		FROM generate_series(1, 10) AS g`,
	} {
		if _, err := pool.Exec(ctx, sql, fpA[:]); err != nil {
			t.Fatal(err)
		}
	}
	indexes := func() string {
		t.Helper()
		var s string
		err := pool.QueryRow(ctx, `SELECT string_agg(c.relname || ':' || i.indisvalid, ',' ORDER BY c.relname)
			FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
			WHERE i.indrelid = 'idem_keys'::regclass`).Scan(&s)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := tableState(t, pool)
	if _, err := provider.UpTo(ctx, 3); err != nil {
		t.Fatal(err)
	}
	if after := tableState(t, pool); after != before {
		t.Fatal("the upgrade changed rows")
	}
	const v3 = "idem_keys_expires_at_idx:true,idem_keys_open_created_idx:true,idem_keys_open_lease_idx:true,idem_keys_pkey:true"
	if got := indexes(); got != v3 {
		t.Fatalf("indexes after the upgrade: %s", got)
	}
	if err := idem.Migrate(ctx, pool); err != nil { // the later versions, for the calls below
		t.Fatal(err)
	}
	// ListUnknown shows the 20 unknown records and, at once, the 40 whose
	// lease ran out (no resume window); ExpireLeases then marks those.
	unknown, err := idem.ListUnknown(ctx, pool, 1000, nil)
	if err != nil || len(unknown) != 60 {
		t.Fatalf("ListUnknown = %d records, %v", len(unknown), err)
	}
	if n, err := idem.ExpireLeases(ctx, pool, 1000); err != nil || n != 40 {
		t.Fatalf("ExpireLeases = %d, %v", n, err)
	}
	if unknown, err = idem.ListUnknown(ctx, pool, 1000, nil); err != nil || len(unknown) != 60 {
		t.Fatalf("ListUnknown after ExpireLeases = %d records, %v", len(unknown), err)
	}

	if _, err := provider.DownTo(ctx, 3); err != nil {
		t.Fatal(err)
	}
	before = tableState(t, pool)
	if _, err := provider.DownTo(ctx, 2); err != nil {
		t.Fatal(err)
	}
	if after := tableState(t, pool); after != before {
		t.Fatal("the down changed rows")
	}
	const v2 = "idem_keys_expires_at_idx:true,idem_keys_lease_idx:true,idem_keys_pkey:true,idem_keys_unknown_idx:true"
	if got := indexes(); got != v2 {
		t.Fatalf("indexes after the down: %s", got)
	}
	if err := idem.Migrate(ctx, pool); err != nil { // and up again
		t.Fatal(err)
	}
	// and those of migrations 9 and 10, without the one 12 dropped
	if got, want := indexes(), "idem_keys_body_expires_idx:true,idem_keys_expires_at_idx:true,idem_keys_failed_idx:true,"+
		"idem_keys_open_created_idx:true,idem_keys_pkey:true"; got != want {
		t.Fatalf("indexes after the second upgrade: %s", got)
	}
}
