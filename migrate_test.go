package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/migratetest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// noMigrate leaves a fresh database empty.
func noMigrate(context.Context, *pgxpool.Pool) error { return nil }

func TestMigrateIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, noMigrate)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() { errs <- idem.Migrate(ctx, pool) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+idem.MigrationTable+` WHERE version_id > 0 AND is_applied`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	files, _ := fs.Glob(idem.Migrations(), "*.sql")
	if applied != len(files) || len(files) == 0 {
		t.Fatalf("%d migrations recorded, %d files", applied, len(files))
	}
}

func TestMigrateCoexistsWithApplicationGoose(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, noMigrate)

	// The application's own goose migrations, in goose's default table.
	app := memFS(map[string]string{
		"00001_app.sql": "-- +goose Up\nCREATE TABLE app_things (id int);\n-- +goose Down\nDROP TABLE app_things;\n",
	})
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, db, app, goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := provider.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	// Both histories are intact and separate.
	version, err := provider.GetDBVersion(ctx)
	if err != nil || version != 1 {
		t.Fatalf("application goose version %d, %v", version, err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM goose_db_version WHERE version_id > 0`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("application history has %d rows, %v", n, err)
	}
	if _, err := pool.Exec(ctx, `SELECT 1 FROM idem_keys, app_things LIMIT 0`); err != nil {
		t.Fatal(err)
	}
}

func TestMigrateNilPool(t *testing.T) {
	t.Parallel()
	if err := idem.Migrate(context.Background(), nil); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("err = %v", err)
	}
}

func memFS(files map[string]string) fs.FS {
	m := fstest.MapFS{}
	for name, body := range files {
		m[name] = &fstest.MapFile{Data: []byte(body)}
	}
	return m
}

// appliedVersion is the latest migration of idem applied in pool's database.
func appliedVersion(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var v int64
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(max(version_id), 0) FROM `+idem.MigrationTable).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// idemRows is every row of idem_keys as text, or "" once the table is gone.
func idemRows(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var rows string
	err := pool.QueryRow(context.Background(), `SELECT CASE WHEN to_regclass('idem_keys') IS NULL THEN ''
		ELSE (SELECT coalesce(string_agg(k::text, E'\n' ORDER BY k::text), 'empty') FROM idem_keys AS k) END`).Scan(&rows)
	if err != nil {
		// to_regclass is checked first, but the subquery is planned anyway.
		return ""
	}
	return rows
}

// Migrating down never deletes an outcome unless forced: a Down that would
// delete unknown, in-flight or failed_retryable records (2), or any record
// (1, which drops the table), refuses with the count and changes nothing.
// The Down of 4 keeps the operator's reason in last_error.
func TestMigrateDownKeepsOutcomes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	c := mustClient(t, idem.Config{})
	reserve := func(key string) idem.Reservation {
		r, err := c.Reserve(ctx, pool, payScope, key, fpA, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	if err := c.MarkUnknown(ctx, pool, reserve("unknown"), "timeout"); err != nil {
		t.Fatal(err)
	}
	reserve("in-flight")
	f := reserve("resolved")
	if err := c.MarkUnknown(ctx, pool, f, "timeout"); err != nil {
		t.Fatal(err)
	}
	if err := c.Resolve(ctx, pool, payScope, "resolved", idem.Resolution{Token: f.Token, Retryable: true, Reason: "no charge"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DoInTx(ctx, pool, payScope, "done", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 200}, nil
	}); err != nil {
		t.Fatal(err)
	}

	// Down to 2, which keeps everything.
	for appliedVersion(t, pool) > 2 {
		v := appliedVersion(t, pool)
		if got, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || got != v {
			t.Fatalf("MigrateDown from %d: %d, %v", v, got, err)
		}
	}
	var lastError string
	if err := pool.QueryRow(ctx, `SELECT last_error FROM idem_keys WHERE idem_key = 'resolved'`).Scan(&lastError); err != nil ||
		lastError != "timeout; resolved: no charge" {
		t.Fatalf("last_error after the Down of 4: %q, %v", lastError, err)
	}

	refused := func(wantCount string) {
		t.Helper()
		before, version := idemRows(t, pool), appliedVersion(t, pool)
		_, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{})
		if !errors.Is(err, idem.ErrDowngradeDeletesRecords) || !strings.Contains(err.Error(), wantCount) {
			t.Fatalf("MigrateDown from %d: %v; want ErrDowngradeDeletesRecords about %s", version, err, wantCount)
		}
		if after := idemRows(t, pool); after != before || appliedVersion(t, pool) != version {
			t.Fatalf("a refused MigrateDown changed something:\nbefore %s\nafter  %s", before, after)
		}
	}
	refused("3 records") // unknown, in-flight, failed_retryable
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{Force: true}); err != nil || v != 2 {
		t.Fatalf("forced MigrateDown: %d, %v", v, err)
	}
	refused("1 records") // the one Do stored
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{Force: true}); err != nil || v != 1 {
		t.Fatalf("forced MigrateDown: %d, %v", v, err)
	}
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != 0 {
		t.Fatalf("MigrateDown with nothing applied: %d, %v", v, err)
	}
	// Empty, version 1 goes without force; and up again.
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	for appliedVersion(t, pool) > 0 {
		if _, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil {
			t.Fatalf("MigrateDown of an empty table: %v", err)
		}
	}
	if _, err := idem.MigrateDown(ctx, nil, idem.MigrateDownOptions{}); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("MigrateDown(nil): %v", err)
	}
}

// The Down of 6 drops the resume windows: refused while a record in doubt
// or failed_retryable holds one that lasts, unless forced; forced, it
// deletes and changes no record but the window, and the attempt in doubt
// becomes a person's (ListUnknown, once up again).
func TestMigrateDownKeepsWindows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	c := mustClient(t, idem.Config{})
	window := idem.ReserveOptions{Lease: time.Hour, ResumeWithin: 2 * time.Hour}
	r, err := c.ReserveWith(ctx, pool, payScope, "in-doubt", fpA, window)
	if err == nil {
		err = c.MarkUnknown(ctx, pool, r, "timeout")
	}
	if err != nil {
		t.Fatal(err)
	}
	done, err := c.ReserveWith(ctx, pool, payScope, "done", fpA, window)
	if err == nil {
		err = completeTx(ctx, c, pool, done, charged)
	}
	if err != nil {
		t.Fatal(err)
	}
	for appliedVersion(t, pool) > 6 { // the later migrations revert without a refusal
		if _, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if v := appliedVersion(t, pool); v != 6 {
		t.Fatalf("applied version %d, want 6", v)
	}
	before := idemRows(t, pool)
	_, err = idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{})
	if !errors.Is(err, idem.ErrDowngradeDeletesRecords) || !strings.Contains(err.Error(), "resume windows of 1 records") {
		t.Fatalf("MigrateDown from 6: %v; want a refusal about 1 record", err)
	}
	if after := idemRows(t, pool); after != before || appliedVersion(t, pool) != 6 {
		t.Fatalf("a refused MigrateDown changed something:\nbefore %s\nafter  %s", before, after)
	}
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{Force: true}); err != nil || v != 6 {
		t.Fatalf("forced MigrateDown: %d, %v", v, err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE status = 'unknown' AND token = $1`, r.Token).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the record in doubt after the Down: %d, %v", n, err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	recs, err := c.ListUnknown(ctx, pool, 10, nil)
	if err != nil || len(recs) != 1 || recs[0].Key != "in-doubt" || !recs[0].ResumeUntil.IsZero() {
		t.Fatalf("up again, the attempt in doubt is a person's: %+v, %v", recs, err)
	}
	if rec, err := c.Lookup(ctx, pool, payScope, "done"); err != nil || rec.Status != idem.StatusSucceeded {
		t.Fatalf("the finished record: %+v, %v", rec, err)
	}
}

// Migration 00008 adds idem_refuse, through which the completion refuses
// with idem's own SQLSTATE, 00009 the column body_expires_at and 00010 the
// column unknown_at. Reverted, each is gone: a call fails with
// ErrUnsupported naming what is missing at the claim, before fn runs, and
// stores nothing (DoInTx, and Do in each exec mode, whose caller's
// transaction goes on; without unknown_at, Reserve too); migrated again
// (00009 and 00010 find their columns there and run anyway), the same call
// runs.
func TestMigrateDownFrom8(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	if _, err := pool.Exec(ctx, `CREATE TABLE charges (id text)`); err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int64
	charge := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		ran.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO charges VALUES ('c1')`)
		return idem.Response{Status: 201}, err
	}
	// Migrations 12 and 11 change no statement's needs: the lease index
	// comes back, then only the table's autovacuum setting goes.
	for _, want := range []int64{12, 11} {
		if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != want {
			t.Fatalf("MigrateDown: %d, %v; want %d", v, err, want)
		}
	}
	for _, down := range []struct {
		version int64
		fix     string // what makes the version's missing part the only one
		missing string
	}{
		{10, "", "unknown_at"},
		{9, `ALTER TABLE idem_keys ADD COLUMN unknown_at timestamptz`, "body_expires_at"},
		{8, `ALTER TABLE idem_keys ADD COLUMN body_expires_at timestamptz`, "idem_refuse"},
	} {
		if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != down.version {
			t.Fatalf("MigrateDown: %d, %v; want %d", v, err, down.version)
		}
		if down.fix != "" {
			if _, err := pool.Exec(ctx, down.fix); err != nil {
				t.Fatal(err)
			}
		}
		_, err := idem.DoInTx(ctx, pool, payScope, "k8", fpA, charge)
		if !errors.Is(err, idem.ErrUnsupported) || !strings.Contains(err.Error(), down.missing) {
			t.Fatalf("DoInTx at version %d: %v, want ErrUnsupported naming %s", down.version-1, err, down.missing)
		}
		if down.version == 10 {
			_, err := idem.Reserve(ctx, pool, payScope, "r9", fpA, time.Minute)
			if !errors.Is(err, idem.ErrUnsupported) || !strings.Contains(err.Error(), "unknown_at") {
				t.Fatalf("Reserve at version 9: %v, want ErrUnsupported naming unknown_at", err)
			}
		}
		// Do in a caller's transaction, in each of pgx's exec modes (the
		// completion prepared before its batch, or not): the same refusal,
		// and the caller's transaction goes on and commits its own writes.
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
			cfg := pool.Config().Copy()
			cfg.ConnConfig.DefaultQueryExecMode = mode
			p, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			tx, err := p.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := idem.Do(ctx, tx, payScope, "k8", fpA, charge); !errors.Is(err, idem.ErrUnsupported) {
				t.Errorf("%v: Do at version %d: %v, want ErrUnsupported", mode, down.version-1, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO charges VALUES ('mine')`); err != nil {
				t.Errorf("%v: the caller's transaction after Do: %v", mode, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			p.Close()
		}
		var keys, charges int
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM idem_keys), (SELECT count(*) FROM charges WHERE id = 'c1')`).Scan(&keys, &charges); err != nil ||
			keys != 0 || charges != 0 {
			t.Fatalf("after the refusals: %d keys, %d charges, %v", keys, charges, err)
		}
		// The claim refuses, before fn: fn's effects outside the database
		// (a message sent, a call made) do not happen on every retry of a
		// service deployed before its migration.
		if n := ran.Load(); n != 0 {
			t.Errorf("fn ran %d times on a database without %s", n, down.missing)
		}
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if res, err := idem.DoInTx(ctx, pool, payScope, "k8", fpA, charge); err != nil || res.Status != 201 {
		t.Fatalf("DoInTx at the latest version: %+v, %v", res, err)
	}
}

// The Down of 9 is refused while a finished record's body was dropped
// (Config.BodyTTL): version 8 would replay it as an empty response.
// Forced, it keeps every row; records whose body is still there revert
// freely, keeping it for the key's life.
func TestMigrateDownFrom9KeepsDroppedBodies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	c := mustClient(t, idem.Config{BodyTTL: time.Millisecond})
	for _, key := range []string{"dropped", "kept"} {
		if _, err := c.DoInTx(ctx, pool, payScope, key, fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Body: []byte(`{"id":1}`)}, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_keys SET body_expires_at = NULL WHERE idem_key = 'kept'`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	if _, err := c.Prune(ctx, pool, idem.PruneOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []int64{12, 11, 10} {
		if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != want {
			t.Fatalf("MigrateDown from %d: %d, %v", want, v, err)
		}
	}
	before := idemRows(t, pool)
	_, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{})
	if !errors.Is(err, idem.ErrDowngradeDeletesRecords) || !strings.Contains(err.Error(), "replay 1 records") {
		t.Fatalf("MigrateDown from 9: %v; want a refusal about 1 record", err)
	}
	if after := idemRows(t, pool); after != before || appliedVersion(t, pool) != 9 {
		t.Fatalf("a refused MigrateDown changed something:\nbefore %s\nafter  %s", before, after)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM idem_keys WHERE idem_key = 'dropped'`); err != nil {
		t.Fatal(err)
	}
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != 9 {
		t.Fatalf("MigrateDown from 9 with every body kept: %d, %v", v, err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if res, err := c.DoInTx(ctx, pool, payScope, "kept", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{}, errors.New("ran again")
	}); err != nil || string(res.Body) != `{"id":1}` {
		t.Fatalf("the kept body after down and up: %+v, %v", res, err)
	}
}

// The Down of 7 drops the outbox: refused while events are pending or
// failed (published, not delivered), changing nothing; delivered events
// alone do not hold it; forced, it drops them.
func TestMigrateDownKeepsEvents(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	downTo7 := func() {
		t.Helper()
		for appliedVersion(t, pool) > 7 { // the later migrations revert without a refusal
			if _, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	downTo7()
	publish(t, pool, idem.Event{ID: "a", Topic: "t", Destination: "d"}, idem.Event{ID: "b", Topic: "t", Destination: "d"})
	if _, err := pool.Exec(ctx, `UPDATE idem_events SET status = 'failed' WHERE id = 'b'`); err != nil {
		t.Fatal(err)
	}
	events := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT string_agg(e::text, ',' ORDER BY id) FROM idem_events e`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := events()
	_, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{})
	if !errors.Is(err, idem.ErrDowngradeDeletesRecords) || !strings.Contains(err.Error(), "2 undelivered events") {
		t.Fatalf("MigrateDown from 7: %v; want a refusal about 2 events", err)
	}
	if events() != before || appliedVersion(t, pool) != 7 {
		t.Fatal("a refused MigrateDown changed something")
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_events SET status = 'delivered'`); err != nil {
		t.Fatal(err)
	}
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != 7 {
		t.Fatalf("MigrateDown with delivered events only: %d, %v", v, err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	publish(t, pool, idem.Event{ID: "c", Topic: "t", Destination: "d"})
	downTo7()
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{Force: true}); err != nil || v != 7 {
		t.Fatalf("forced MigrateDown: %d, %v", v, err)
	}
}

// A pool of one or two connections migrates, with concurrent runs too: a
// run holds two connections at once (goose's lock keeps one while the
// migrations run on another), so Migrate and MigrateDown lend a pool of one
// a second connection, and the runs of one process on one pool take turns.
func TestMigrateOnAPoolOfOneConnection(t *testing.T) {
	t.Parallel()
	for _, conns := range []int32{1, 2} {
		t.Run(fmt.Sprint(conns), func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			cfg, err := pgxpool.ParseConfig(pgtest.URL(t, noMigrate))
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = conns
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			var wg sync.WaitGroup
			errs := make([]error, 3)
			for i := range errs {
				wg.Go(func() { errs[i] = idem.Migrate(ctx, pool) })
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v == 0 {
				t.Fatalf("MigrateDown: %d %v", v, err)
			}
			if err := idem.Migrate(ctx, pool); err != nil {
				t.Fatal(err)
			}
			if _, err := idem.DoInTx(ctx, pool, idem.Scope{Actor: "a", Operation: "op"}, "k", idem.Fingerprint{1},
				func(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{Status: 200}, nil }); err != nil {
				t.Fatal(err)
			}
			if n := pool.Stat().MaxConns(); n != conns {
				t.Fatalf("the pool's MaxConns is %d after Migrate, want %d", n, conns)
			}
		})
	}
}

// Migration 11 sets idem_keys' autovacuum_vacuum_scale_factor to 0.05
// (written 0.050), but keeps a value an operator set before it; its Down
// puts back the server's default, but not an operator's value, even 0.05.
func TestMigration11Autovacuum(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	scale := func() string {
		t.Helper()
		var v string
		if err := pool.QueryRow(ctx, `SELECT coalesce((SELECT option_value FROM pg_class c, pg_options_to_table(c.reloptions)
			WHERE c.oid = 'idem_keys'::regclass AND option_name = 'autovacuum_vacuum_scale_factor'), 'unset')`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	down := func() { // 12 (an index), then 11
		t.Helper()
		for _, want := range []int64{12, 11} {
			if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != want {
				t.Fatalf("MigrateDown: %d, %v; want %d", v, err, want)
			}
		}
	}
	if got := scale(); got != "0.050" {
		t.Fatalf("after Migrate: autovacuum_vacuum_scale_factor %s, want 0.050", got)
	}
	down()
	if got := scale(); got != "unset" {
		t.Fatalf("after MigrateDown: autovacuum_vacuum_scale_factor %s, want the server's (unset)", got)
	}
	for _, mine := range []string{"0.01", "0.05"} {
		if _, err := pool.Exec(ctx, `ALTER TABLE idem_keys SET (autovacuum_vacuum_scale_factor = `+mine+`)`); err != nil {
			t.Fatal(err)
		}
		if err := idem.Migrate(ctx, pool); err != nil {
			t.Fatal(err)
		}
		if got := scale(); got != mine {
			t.Fatalf("after Migrate over an operator's %s: %s", mine, got)
		}
		down()
		if got := scale(); got != mine {
			t.Fatalf("after MigrateDown over an operator's %s: %s", mine, got)
		}
	}
}

// The Down of 9 runs outside a transaction: its one statement (the check
// and the drop of body_expires_at) commits before goose deletes the
// version, and cannot run again once the column is gone. A run cut between
// the two (its connection terminated) leaves 9 recorded without the
// column: the next MigrateDown finishes that revert (it returns 9), and
// the next Migrate puts the column back, instead of recording 10 to 12
// over a table without it.
func TestMigrateDownFrom9Interrupted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	interrupt := func() {
		t.Helper()
		for appliedVersion(t, pool) > 9 {
			if _, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		// Goose's delete of version 9 waits for this row lock; its
		// connection is terminated while it waits.
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, `SELECT FROM `+idem.MigrationTable+` WHERE version_id = 9 FOR UPDATE`); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		defer close(done)
		go func() {
			for {
				select {
				case <-done:
					return
				case <-time.After(10 * time.Millisecond):
				}
				_, _ = pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock'
					  AND query LIKE 'DELETE FROM `+idem.MigrationTable+`%'`)
			}
		}()
		if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err == nil {
			t.Fatalf("MigrateDown from 9 whose version delete was cut: %d, no error", v)
		}
		var column bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_attribute
			WHERE attrelid = 'idem_keys'::regclass AND attname = 'body_expires_at' AND NOT attisdropped)`).Scan(&column); err != nil {
			t.Fatal(err)
		}
		if column || appliedVersion(t, pool) != 9 {
			t.Fatalf("after the cut: column body_expires_at %v, version %d; want the column gone at 9", column, appliedVersion(t, pool))
		}
	}
	works := func() {
		t.Helper()
		if _, err := idem.DoInTx(ctx, pool, payScope, "after", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201}, nil
		}); err != nil {
			t.Fatalf("DoInTx at version %d: %v", appliedVersion(t, pool), err)
		}
	}

	interrupt()
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != 9 || appliedVersion(t, pool) != 8 {
		t.Fatalf("MigrateDown after the cut: %d, %v, at version %d; want 9 reverted, at 8", v, err, appliedVersion(t, pool))
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	works()

	interrupt()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	works()
}

// idem's migrations name their tables and indexes unqualified, so they act
// on whatever the search_path finds: migrating a schema whose search_path
// has another schema holding idem's tables behind it would drop that
// schema's indexes (DROP INDEX IF EXISTS of one the migrated schema does
// not have yet). Migrate and MigrateDown refuse that, changing nothing,
// while there is something to run; with the schema alone on the
// search_path it migrates; a search_path with both, everything applied,
// is no reason to refuse.
func TestMigrateSearchPathReachingAnotherSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate) // idem's tables in public
	public, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer public.Close()
	indexes := func() string {
		t.Helper()
		var s string
		if err := public.QueryRow(ctx, `SELECT string_agg(schemaname || '.' || indexname, ' ' ORDER BY 1)
			FROM pg_indexes WHERE tablename = 'idem_keys'`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	if _, err := public.Exec(ctx, `CREATE SCHEMA tenant`); err != nil {
		t.Fatal(err)
	}
	poolOn := func(searchPath string) *pgxpool.Pool { return poolOnSearchPath(t, url, searchPath) }
	both := poolOn("tenant, public")
	before := indexes()
	if err := idem.Migrate(ctx, both); !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "public") {
		t.Fatalf("Migrate of tenant with public behind it: %v; want ErrInvalidArgument naming public", err)
	}
	if after := indexes(); after != before {
		t.Fatalf("a refused Migrate changed the indexes:\nbefore %s\nafter  %s", before, after)
	}
	var inTenant int
	if err := public.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = 'tenant'`).Scan(&inTenant); err != nil || inTenant != 0 {
		t.Fatalf("a refused Migrate left %d tables in tenant (%v)", inTenant, err)
	}
	// A search_path that names no schema that exists: nothing to migrate,
	// refused, not taken for a database never migrated.
	for _, path := range []string{`""`, "tenantx"} {
		if err := idem.Migrate(ctx, poolOn(path)); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("Migrate with search_path %s: %v; want ErrInvalidArgument", path, err)
		}
		if v, err := idem.MigrateDown(ctx, poolOn(path), idem.MigrateDownOptions{}); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("MigrateDown with search_path %s: %d, %v; want ErrInvalidArgument", path, v, err)
		}
	}
	if err := idem.Migrate(ctx, poolOn("tenant")); err != nil {
		t.Fatal(err)
	}
	if err := idem.Migrate(ctx, both); err != nil {
		t.Fatalf("Migrate with everything applied: %v", err)
	}
	before = indexes()
	if _, err := idem.MigrateDown(ctx, both, idem.MigrateDownOptions{}); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("MigrateDown of tenant with public behind it: %v; want ErrInvalidArgument", err)
	}
	if after := indexes(); after != before {
		t.Fatalf("a refused MigrateDown changed the indexes:\nbefore %s\nafter  %s", before, after)
	}
	if !strings.Contains(before, "public.idem_keys_body_expires_idx") || !strings.Contains(before, "public.idem_keys_failed_idx") ||
		!strings.Contains(before, "public.idem_keys_open_created_idx") {
		t.Fatalf("public's indexes: %s", before)
	}
}

// A database migrated by a later release of idem (a version this one does
// not ship): Migrate leaves it as it is (code of an earlier release runs on
// a later schema), and MigrateDown refuses, changing nothing, with an error
// that names the database's version and this release's latest, not goose's
// bare "version not found".
func TestMigrateDownOfAnUnknownVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	files, _ := fs.Glob(idem.Migrations(), "*.sql")
	later := int64(len(files) + 1)
	if _, err := pool.Exec(ctx, `INSERT INTO `+idem.MigrationTable+` (version_id, is_applied) VALUES ($1, true)`, later); err != nil {
		t.Fatal(err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate of a database at a later version: %v", err)
	}
	_, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{})
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("version %d", later)) ||
		!strings.Contains(err.Error(), fmt.Sprintf("%d", len(files))) {
		t.Fatalf("MigrateDown of a database at version %d: %v; want an error naming %d and this release's latest, %d", later, err, later, len(files))
	}
	if v := appliedVersion(t, pool); v != later {
		t.Fatalf("version %d after the refusal, want %d", v, later)
	}
}

// MigrateDown of a database where idem's migrations never ran has nothing
// to revert: it returns 0 and creates nothing (not goose's version table,
// nor the lock's).
func TestMigrateDownOfAnEmptyDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, noMigrate)
	for _, force := range []bool{false, true} {
		if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{Force: force}); err != nil || v != 0 {
			t.Fatalf("MigrateDown (force %v) of an empty database: %d, %v", force, v, err)
		}
	}
	var tables string
	if err := pool.QueryRow(ctx, `SELECT coalesce(string_agg(tablename, ' '), '') FROM pg_tables WHERE tablename LIKE 'idem%'`).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if tables != "" {
		t.Fatalf("MigrateDown of an empty database created %s", tables)
	}
}

// A Down of a migration that runs outside a transaction (3, 10, 12), cut
// after some of its statements committed, leaves its version recorded over
// a table without all of its Up's effects. The next Migrate runs that
// version's Up again before the later ones, instead of recording them over
// it (without unknown_at, every call failed ErrUnsupported at "version
// 12"), and the table ends as a migrated one: every column, and the same
// indexes.
func TestMigrateAfterACutDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct {
		version int64
		cut     string // what the Down committed before it was cut
	}{
		{3, `CREATE INDEX idem_keys_lease_idx ON idem_keys (lease_expires_at) WHERE status = 'processing' AND lease_expires_at IS NOT NULL;
			CREATE INDEX idem_keys_unknown_idx ON idem_keys (created_at, actor, operation, idem_key) WHERE status = 'unknown'`},
		{10, `DROP INDEX idem_keys_failed_idx; ALTER TABLE idem_keys DROP COLUMN unknown_at`},
		{12, `CREATE INDEX idem_keys_open_lease_idx ON idem_keys (lease_expires_at) WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL`},
	} {
		t.Run(strconv.FormatInt(c.version, 10), func(t *testing.T) {
			t.Parallel()
			pool := pgtest.Pool(t, noMigrate)
			migratetest.UpTo(t, pool, c.version)
			if _, err := pool.Exec(ctx, c.cut); err != nil {
				t.Fatal(err)
			}
			if err := idem.Migrate(ctx, pool); err != nil {
				t.Fatal(err)
			}
			want := pgtest.Pool(t, idem.Migrate)
			if got, want := schemaOf(t, pool), schemaOf(t, want); got != want {
				t.Errorf("after the cut Down of %d and Migrate:\n%s\nwant, as migrated:\n%s", c.version, got, want)
			}
			if _, err := idem.DoInTx(ctx, pool, payScope, "after", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
				return idem.Response{Status: 201}, nil
			}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// schemaOf lists idem_keys' columns and index definitions.
func schemaOf(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), `SELECT
		(SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attname)
		 FROM pg_attribute WHERE attrelid = 'idem_keys'::regclass AND attnum > 0 AND NOT attisdropped)
		|| E'\n' ||
		(SELECT string_agg(indexdef, E'\n' ORDER BY indexname) FROM pg_indexes WHERE tablename = 'idem_keys')`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// The check of a cut Down (Migrate's repair) looks at the schema migrated
// only: with everything applied to tenant, a Migrate whose search_path
// also reaches public's idem tables, at an older version that still has
// an index tenant's version 12 dropped, changes nothing in either.
func TestMigrateRepairLooksAtItsOwnSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, noMigrate)
	public, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer public.Close()
	migratetest.UpTo(t, public, 11)
	if _, err := public.Exec(ctx, `CREATE SCHEMA tenant`); err != nil {
		t.Fatal(err)
	}
	poolOn := func(searchPath string) *pgxpool.Pool { return poolOnSearchPath(t, url, searchPath) }
	if err := idem.Migrate(ctx, poolOn("tenant")); err != nil {
		t.Fatal(err)
	}
	state := func() string {
		var s string
		if err := public.QueryRow(ctx, `SELECT string_agg(schemaname || '.' || indexname, ' ' ORDER BY 1) FROM pg_indexes
			WHERE tablename = 'idem_keys'`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s + fmt.Sprintf(" tenant at %d", appliedVersion(t, poolOn("tenant")))
	}
	before := state()
	if err := idem.Migrate(ctx, poolOn("tenant, public")); err != nil {
		t.Fatalf("Migrate with everything applied: %v", err)
	}
	if after := state(); after != before {
		t.Errorf("Migrate with everything applied changed:\nbefore %s\nafter  %s", before, after)
	}
}

// poolOnSearchPath is a pool on the database of url whose connections have
// searchPath as their search_path, closed with the test.
func poolOnSearchPath(t *testing.T, url, searchPath string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = searchPath
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}
