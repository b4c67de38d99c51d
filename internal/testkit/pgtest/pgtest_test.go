package pgtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestMain(m *testing.M) { Main(m) }

// widgetMigrations counts runs of migrateWidgets.
var widgetMigrations atomic.Int32

func migrateWidgets(ctx context.Context, pool *pgxpool.Pool) error {
	widgetMigrations.Add(1)
	_, err := pool.Exec(ctx, `create table widgets (id bigserial primary key, name text not null)`)
	return err
}

// gadgetMigrations counts runs of migrateGadgets.
var gadgetMigrations atomic.Int32

func migrateGadgets(ctx context.Context, pool *pgxpool.Pool) error {
	gadgetMigrations.Add(1)
	_, err := pool.Exec(ctx, `create table gadgets (id bigserial primary key)`)
	return err
}

func migrateBroken(ctx context.Context, pool *pgxpool.Pool) error {
	return errors.New("broken migration")
}

func currentDatabase(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var name string
	if err := pool.QueryRow(t.Context(), "select current_database()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}

func tableExists(t *testing.T, pool *pgxpool.Pool, table string) bool {
	t.Helper()
	var exists bool
	if err := pool.QueryRow(t.Context(), "select to_regclass($1) is not null", table).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	return exists
}

// adminQuery runs a query returning one value on the server's admin
// database.
func adminQuery[T any](t *testing.T, sql string, args ...any) T {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), Server(t).URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var v T
	if err := conn.QueryRow(t.Context(), sql, args...).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

func TestServer(t *testing.T) {
	srv := Server(t)
	if srv.URL == "" || srv.Source == "" {
		t.Fatalf("server = %+v", srv)
	}
	t.Logf("server from %s", srv.Source)
}

func TestParallelTestsGetOwnDatabases(t *testing.T) {
	var (
		mu    sync.Mutex
		names = map[string]string{}
	)
	t.Run("group", func(t *testing.T) {
		for _, sub := range []string{"a", "b", "c", "d"} {
			t.Run(sub, func(t *testing.T) {
				t.Parallel()
				pool := Pool(t, migrateWidgets)

				name := currentDatabase(t, pool)
				if !strings.HasPrefix(name, "idemtest_") {
					t.Errorf("database name %q", name)
				}
				mu.Lock()
				names[sub] = name
				mu.Unlock()

				// Migrated from the template, and private: the same table
				// name can be created in every test, and rows do not mix.
				if !tableExists(t, pool, "widgets") {
					t.Fatal("widgets table missing: database not migrated")
				}
				if _, err := pool.Exec(t.Context(), "create table mine (sub text)"); err != nil {
					t.Fatal(err)
				}
				if _, err := pool.Exec(t.Context(), "insert into widgets (name) values ($1)", sub); err != nil {
					t.Fatal(err)
				}
				var count int
				if err := pool.QueryRow(t.Context(), "select count(*) from widgets").Scan(&count); err != nil {
					t.Fatal(err)
				}
				if count != 1 {
					t.Errorf("widgets has %d rows, want 1", count)
				}
			})
		}
	})

	seen := map[string]bool{}
	for sub, name := range names {
		if seen[name] {
			t.Errorf("database %s handed out twice (again to %s)", name, sub)
		}
		seen[name] = true
		// Cleanup dropped it.
		if n := adminQuery[int64](t, "select count(*) from pg_database where datname = $1", name); n != 0 {
			t.Errorf("database %s of subtest %s not dropped", name, sub)
		}
	}
	if n := widgetMigrations.Load(); n != 1 {
		t.Errorf("migrateWidgets ran %d times, want 1", n)
	}
}

func TestTableNotVisibleInOtherDatabase(t *testing.T) {
	t.Parallel()
	p1 := Pool(t, migrateWidgets)
	p2 := Pool(t, migrateWidgets)

	if _, err := p1.Exec(t.Context(), "create table only_in_first (x int)"); err != nil {
		t.Fatal(err)
	}
	if _, err := p1.Exec(t.Context(), "insert into widgets (name) values ('first')"); err != nil {
		t.Fatal(err)
	}
	if !tableExists(t, p1, "only_in_first") {
		t.Fatal("table missing where it was created")
	}
	if tableExists(t, p2, "only_in_first") {
		t.Error("table created in one database is visible in another")
	}
	var count int
	if err := p2.QueryRow(t.Context(), "select count(*) from widgets").Scan(&count); err != nil {
		t.Fatal(err)
	}
	if count != 0 {
		t.Errorf("second database sees %d widgets, want 0", count)
	}
}

func TestConcurrentNewDatabase(t *testing.T) {
	t.Parallel()
	const n = 8
	urls := make([]string, n)
	drops := make([]func(), n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			urls[i], drops[i], errs[i] = NewDatabase(t.Context(), migrateGadgets)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if n := gadgetMigrations.Load(); n != 1 {
		t.Errorf("migrateGadgets ran %d times for %d databases, want 1", n, len(urls))
	}

	seen := map[string]bool{}
	for i, url := range urls {
		if seen[url] {
			t.Errorf("URL %s handed out twice", url)
		}
		seen[url] = true
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		conn, err := pgx.ConnectConfig(t.Context(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		var exists bool
		err = conn.QueryRow(t.Context(), "select to_regclass('gadgets') is not null").Scan(&exists)
		conn.Close(context.Background())
		if err != nil || !exists {
			t.Errorf("database %s: gadgets table exists = %v, %v", cfg.Database, exists, err)
		}

		drops[i]()
		drops[i]() // a second call is harmless
		if n := adminQuery[int64](t, "select count(*) from pg_database where datname = $1", cfg.Database); n != 0 {
			t.Errorf("database %s still exists after drop", cfg.Database)
		}
	}
}

func TestTemplateRefusesConnections(t *testing.T) {
	t.Parallel()
	_ = URL(t, migrateWidgets)
	tpl := templateFor(migrateWidgets)
	tpl.mu.Lock()
	name := tpl.name
	tpl.mu.Unlock()
	if !strings.HasPrefix(name, "idemtest_tpl_") {
		t.Fatalf("template name %q", name)
	}
	if adminQuery[bool](t, "select datallowconn from pg_database where datname = $1", name) {
		t.Errorf("template %s accepts connections", name)
	}
}

func TestEmptyDatabaseWithoutMigrate(t *testing.T) {
	t.Parallel()
	pool := Pool(t, nil)
	var tables int
	err := pool.QueryRow(t.Context(),
		"select count(*) from pg_tables where schemaname = 'public'").Scan(&tables)
	if err != nil {
		t.Fatal(err)
	}
	if tables != 0 {
		t.Errorf("fresh database has %d tables", tables)
	}
}

// Not parallel, so that no other template is being created meanwhile.
func TestMigrateErrorIsReported(t *testing.T) {
	url, drop, err := NewDatabase(t.Context(), migrateBroken)
	if err == nil {
		drop()
		t.Fatalf("NewDatabase succeeded (%s) with a failing migration", url)
	}
	if !strings.Contains(err.Error(), "broken migration") {
		t.Errorf("error does not carry the migration's: %v", err)
	}

	// The half-made template was dropped: every template this process
	// still has is the one recorded for some migration.
	recorded := map[string]bool{}
	mu.Lock()
	for _, tpl := range templates {
		recorded[tpl.name] = true
	}
	broken := templates[templateKey(migrateBroken)].name
	var leaked []string
	for name := range live {
		if strings.HasPrefix(name, "idemtest_tpl_") && !recorded[name] {
			leaked = append(leaked, name)
		}
	}
	mu.Unlock()
	if len(leaked) > 0 {
		t.Errorf("templates left behind: %v", leaked)
	}
	if broken != "" {
		t.Errorf("the failed template is recorded as created: %s", broken)
	}
}

// recordingTB is a testing.TB whose cleanups and errors are captured
// instead of acting on the real test.
type recordingTB struct {
	*testing.T
	cleanups []func()
	errors   []string
}

func (r *recordingTB) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }

func (r *recordingTB) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

// runCleanups runs the captured cleanups last-in first-out, as testing does.
func (r *recordingTB) runCleanups() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

// Not parallel: it shortens poolCloseTimeout for its duration.
func TestLeakedConnectionFailsInsteadOfHanging(t *testing.T) {
	defer func(d time.Duration) { poolCloseTimeout = d }(poolCloseTimeout)
	poolCloseTimeout = 200 * time.Millisecond

	rec := &recordingTB{T: t}
	pool := Pool(rec, migrateWidgets)
	name := currentDatabase(t, pool)
	leaked, err := pool.Acquire(t.Context()) // never released before cleanup
	if err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	rec.runCleanups()
	t.Logf("cleanup returned after %v", time.Since(start)) // a hang would hit the test timeout
	if len(rec.errors) != 1 || !strings.Contains(rec.errors[0], "still acquired") {
		t.Errorf("cleanup errors = %q, want one about a connection still acquired", rec.errors)
	}
	if n := adminQuery[int64](t, "select count(*) from pg_database where datname = $1", name); n != 0 {
		t.Errorf("database %s not dropped", name)
	}
	leaked.Release() // lets the background Close finish
}
