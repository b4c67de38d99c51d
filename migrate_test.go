package idem_test

import (
	"context"
	"errors"
	"io/fs"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgtest"
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
