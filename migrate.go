package idem

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// MigrationTable is the goose version table that records idem's own
// migrations, kept apart from an application's goose_db_version table.
const MigrationTable = "idem_goose_db_version"

// MigrationLockID is the PostgreSQL advisory lock id that serializes
// concurrent runs of Migrate. It differs from goose's default lock id, so
// idem's migrations and the application's own goose migrations never block
// each other.
const MigrationLockID int64 = 0x6964656d // "idem"

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns idem's goose SQL migrations, for applying them with your
// own tooling. The same files work with the goose CLI when it is pointed at
// idem's version table:
//
//	goose -dir migrations -table idem_goose_db_version postgres "$DATABASE_URL" up
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err) // the embedded folder is fixed at build time
	}
	return sub
}

// Migrate brings idem's tables up to date in the database of pool. It is safe
// to run from many processes at once (they serialize on MigrationLockID) and
// does nothing when everything is applied. It uses its own version table
// (MigrationTable), so an application's goose migrations are untouched. On
// Citus, run it on the coordinator (then Distribute): a worker is refused
// with ErrUnsupported.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return fmt.Errorf("%w: nil pool", ErrInvalidArgument)
	}
	if err := checkNotWorker(ctx, pool); err != nil {
		return fmt.Errorf("idem: migrate: %w", err)
	}
	locker, err := lock.NewPostgresSessionLocker(
		lock.WithLockID(MigrationLockID),
		lock.WithLockTimeout(1, 300),
	)
	if err != nil {
		return fmt.Errorf("idem: migrate: %w", err)
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, db, Migrations(),
		goose.WithTableName(MigrationTable),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return fmt.Errorf("idem: migrate: %w", err)
	}
	if _, err := provider.Up(ctx); err != nil {
		return fmt.Errorf("idem: migrate: %w", err)
	}
	return nil
}
