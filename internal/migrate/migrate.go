// Package migrate runs idem's goose migrations on a *sql.DB for both fronts
// (idem.Migrate, idem.MigrateDown, idemsql.Migrate): one provider, one
// version table, one lock, so runs of either serialize.
package migrate

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"sync"
	"time"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/pgidem/idem/internal/core"
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
// db, holding idem's table lock for the whole of fn, after this process's
// other runs on handle (db, or the pool db was opened from) have ended.
// Under the lock, before fn, it finishes a Down of migration 9 that was cut
// after its change committed (see finishDown9): fn gets that version (9),
// or 0. A run that would reach another schema's tables (see
// checkSearchPath) is refused; down says the run reverts.
//
// A run holds two of the handle's connections at once: goose's lock keeps
// one while the migrations run on another. So two runs on a handle of two
// connections would each hold one and wait for the other forever: the runs
// of one process on one handle take turns (goose's lock serializes the
// rest, across handles and processes). A handle limited to one open
// connection (SetMaxOpenConns(1)) may open a second one for the run, and
// gets its limit of one back after it, unless it was changed meanwhile.
func WithProvider(ctx context.Context, handle any, db *sql.DB, fsys fs.FS, down bool,
	fn func(p *goose.Provider, finished int64) error) (err error) {
	done, err := takeTurn(ctx, handle)
	if err != nil {
		return err
	}
	defer done()
	if db.Stats().MaxOpenConnections == 1 {
		db.SetMaxOpenConns(2)
		defer func() {
			if db.Stats().MaxOpenConnections == 2 {
				db.SetMaxOpenConns(1)
			}
		}()
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
	// The provider has no locker of its own: the lock is held around fn,
	// so that finishDown9 and fn's run are one turn.
	provider, err := goose.NewProvider(goose.DialectPostgres, db, fsys,
		goose.WithTableName(Table),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return err
	}
	if err := locker.Lock(ctx, db); err != nil {
		return err
	}
	defer func() {
		// Unlock does not end with ctx (goose detaches it).
		if unlockErr := locker.Unlock(ctx, db); err == nil {
			err = unlockErr
		}
	}()
	if err := checkSearchPath(ctx, db, provider, down); err != nil {
		return err
	}
	finished, err := finishDown9(ctx, db)
	if err != nil {
		return err
	}
	return fn(provider, finished)
}

// checkSearchPath refuses (ErrInvalidArgument) a run that has something to
// do while a schema on the search_path other than the current one (where
// goose keeps the version table and CREATE puts tables) holds idem_keys.
// The migrations name tables and indexes unqualified, so they act on
// whatever the search_path finds first: a DROP INDEX IF EXISTS of an index
// the current schema lacks would drop the other schema's (migrating a new
// schema with public behind it dropped three of public's), and a first
// migration would create a second, empty idem_keys in front of the one the
// service used. Everything applied (or, down, nothing), it lets the run go.
func checkSearchPath(ctx context.Context, db *sql.DB, p *goose.Provider, down bool) error {
	var current, others string
	var versioned bool
	if err := db.QueryRowContext(ctx, `SELECT coalesce(current_schema(), ''),
		coalesce((SELECT string_agg(n.nspname, ', ' ORDER BY n.nspname)
		          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		          WHERE c.relname = 'idem_keys' AND c.relkind IN ('r', 'p')
		            AND n.nspname = ANY (current_schemas(false)) AND n.nspname IS DISTINCT FROM current_schema()), ''),
		EXISTS (SELECT FROM pg_tables WHERE schemaname = current_schema() AND tablename = '`+Table+`')`).
		Scan(&current, &others, &versioned); err != nil || others == "" {
		return err
	}
	var applied int64
	if versioned {
		if err := db.QueryRowContext(ctx, `SELECT coalesce(max(version_id), 0) FROM `+Table).Scan(&applied); err != nil {
			return err
		}
	}
	sources := p.ListSources()
	if down && applied == 0 || !down && len(sources) > 0 && applied >= sources[len(sources)-1].Version {
		return nil
	}
	return core.Errorf("idem: %w: the search_path reaches idem's tables in %s besides the schema migrated (%s): "+
		"idem's migrations name tables and indexes unqualified and would act on theirs (drop their indexes); "+
		"migrate with %s alone on the search_path", core.ErrInvalidArgument, others, current, quoteOrNone(current))
}

// quoteOrNone names schema for a message.
func quoteOrNone(schema string) string {
	if schema == "" {
		return "the schema to migrate"
	}
	return fmt.Sprintf("%q", schema)
}

// finishDown9 finishes a Down of migration 9 that was cut between its
// statement and goose's deletion of its version, and returns 9 if it did,
// or 0. That Down runs outside a transaction (its migration builds an
// index concurrently): its one statement, the check and the drop of
// body_expires_at, commits before goose deletes version 9, and cannot run
// again once the column is gone. So a run cut between the two (a lost
// connection, a context ending) would leave 9 recorded without its column:
// the next MigrateDown would fail on the missing column, and the next
// Migrate would record 10 and later over a table without it. Version 9
// recorded as the latest and the column missing is that state: the
// version is deleted, so that the revert is complete (a MigrateDown
// reports 9) and a Migrate applies 9 again. Run it under the lock.
func finishDown9(ctx context.Context, db *sql.DB) (int64, error) {
	var versions bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('`+Table+`') IS NOT NULL`).Scan(&versions); err != nil || !versions {
		return 0, err
	}
	res, err := db.ExecContext(ctx, `DELETE FROM `+Table+` WHERE version_id = 9
		AND (SELECT max(version_id) FROM `+Table+`) = 9
		AND to_regclass('idem_keys') IS NOT NULL
		AND NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('idem_keys')
			AND attname = 'body_expires_at' AND NOT attisdropped)`)
	if err != nil {
		return 0, err
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return 0, err
	}
	return 9, nil
}

// turns holds, for each handle a run of this process is on, the turn that
// run holds (a channel of one, full while a run holds it) and how many runs
// hold it or wait for it.
var turns struct {
	mu sync.Mutex
	m  map[any]*turn
}

type turn struct {
	held    chan struct{}
	waiting int
}

// takeTurn waits until no other run of this process is on handle, or ctx
// ends, and returns the function that ends the turn.
func takeTurn(ctx context.Context, handle any) (done func(), err error) {
	turns.mu.Lock()
	if turns.m == nil {
		turns.m = map[any]*turn{}
	}
	t := turns.m[handle]
	if t == nil {
		t = &turn{held: make(chan struct{}, 1)}
		turns.m[handle] = t
	}
	t.waiting++
	turns.mu.Unlock()
	leave := func() {
		turns.mu.Lock()
		if t.waiting--; t.waiting == 0 {
			delete(turns.m, handle)
		}
		turns.mu.Unlock()
	}
	select {
	case t.held <- struct{}{}:
		return func() { <-t.held; leave() }, nil
	case <-ctx.Done():
		leave()
		return nil, context.Cause(ctx)
	}
}
