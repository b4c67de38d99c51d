// Package migrate runs idem's goose migrations on a *sql.DB for both fronts
// (idem.Migrate, idem.MigrateDown, idemsql.Migrate): one provider, one
// version table, one lock, so runs of either serialize.
package migrate

import (
	"database/sql"
	"io/fs"
	"time"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/pgidem/idem/internal/driver/dberr"
)

// The names idem's migrations run under (see idem.MigrationTable,
// idem.MigrationLockTable and idem.MigrationLockID).
const (
	Table     = "idem_goose_db_version"
	LockTable = "idem_goose_lock"
	LockID    = int64(0x6964656d) // "idem"
)

// WithProvider runs fn with a goose provider for the migrations in fsys on
// db, locked with idem's table lock.
//
// goose's lock keeps a connection while the migrations run on another: a
// handle limited to one open connection (SetMaxOpenConns(1)) may open a
// second one for the run, and gets its limit of one back after it.
func WithProvider(db *sql.DB, fsys fs.FS, fn func(*goose.Provider) error) error {
	if db.Stats().MaxOpenConnections == 1 {
		db.SetMaxOpenConns(2)
		defer db.SetMaxOpenConns(1)
	}
	locker, err := lock.NewPostgresTableLocker(
		lock.WithTableName(LockTable),
		lock.WithTableLockID(LockID),
		// Poll often (runs are short) for at most five minutes, while
		// another run holds the lock; a store failure ends the wait at
		// once (idem.Unavailable is true for it).
		lock.WithTableLockTimeout(200*time.Millisecond, 1500),
		lock.WithTableRetryPolicy(func(err error) bool { return !dberr.Unavailable(err) }),
	)
	if err != nil {
		return err
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, fsys,
		goose.WithTableName(Table),
		goose.WithLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return err
	}
	return fn(provider)
}
