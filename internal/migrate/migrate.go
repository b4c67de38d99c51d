// Package migrate runs idem's goose migrations on a *sql.DB for both fronts
// (idem.Migrate, idem.MigrateDown, idemsql.Migrate): one provider, one
// version table, one lock, so runs of either serialize.
package migrate

import (
	"context"
	"database/sql"
	"io/fs"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
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
// Under the lock, before fn, it mends what a cut run of a migration that
// runs outside a transaction left (see repair): fn gets the version whose
// Down that finished (9), or 0. A run that would reach another schema's
// tables, or that has no schema to migrate (see checkSearchPath), is
// refused before anything is written; down says the run reverts.
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
	// so that repair and fn's run are one turn.
	provider, err := goose.NewProvider(goose.DialectPostgres, db, fsys,
		goose.WithTableName(Table),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return err
	}
	// Before the lock, whose table the lock creates, so that a refused run
	// writes nothing; and again under it, as another run may have changed
	// the versions meanwhile.
	if err := checkSearchPath(ctx, db, provider, down); err != nil {
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
	finished, err := repair(ctx, db, down)
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
		Scan(&current, &others, &versioned); err != nil {
		return err
	}
	if current == "" {
		return NoSchema()
	}
	if others == "" {
		return nil
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
		"migrate with %s alone on the search_path", core.ErrInvalidArgument, others, current, pgx.Identifier{current}.Sanitize())
}

// NoSchema is the refusal of a run whose search_path names no schema that
// exists (empty, or mistyped): there is nothing to migrate, nor anywhere
// to record a migration.
func NoSchema() error {
	return core.Errorf("idem: %w: the search_path names no schema that exists: nothing to migrate", core.ErrInvalidArgument)
}

// complete holds, for each migration that runs outside a transaction
// (whose statements commit one by one, before goose records or deletes its
// version), a query that is true when its Up's effects are all there.
// Checked on the latest version recorded, and false there, it says that a
// Down was cut after some of its statements committed (or that an index
// was dropped by hand).
var complete = map[int64]string{
	3: `SELECT ` + hasIndex("idem_keys_open_created_idx") + ` AND ` + hasIndex("idem_keys_open_lease_idx") +
		` AND NOT ` + hasIndex("idem_keys_lease_idx") + ` AND NOT ` + hasIndex("idem_keys_unknown_idx"),
	9:  `SELECT ` + hasColumn("body_expires_at") + ` AND ` + hasIndex("idem_keys_body_expires_idx"),
	10: `SELECT ` + hasColumn("unknown_at") + ` AND ` + hasIndex("idem_keys_failed_idx"),
	12: `SELECT NOT ` + hasIndex("idem_keys_open_lease_idx"),
}

// hasIndex and hasColumn are SQL that is true when the current schema (the
// one migrated; not another on the search_path) has the index, or when its
// idem_keys has the column.
func hasIndex(name string) string {
	return `EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = current_schema() AND c.relname = '` + name + `')`
}

func hasColumn(name string) string {
	return `EXISTS (SELECT FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = current_schema() AND c.relname = 'idem_keys' AND a.attname = '` + name + `' AND NOT a.attisdropped)`
}

// repair mends what a cut Down of a migration that runs outside a
// transaction left: its version recorded, some of its statements
// committed. Such a version, the latest recorded and its Up's effects not
// all there (see complete), is deleted for a run up, so that goose applies
// its Up again (every one of them can run again) rather than the versions
// after it over a table that lacks what they expect. For a run down,
// goose runs the Down again (each can run again), except 9's once its
// column is gone (its one statement reads the column): then the version
// is deleted, and repair returns 9, the version whose Down is now
// complete. It returns 0 otherwise. Run it under the lock.
func repair(ctx context.Context, db *sql.DB, down bool) (int64, error) {
	var versioned bool
	if err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT FROM pg_tables
		WHERE schemaname = current_schema() AND tablename = '`+Table+`')`).Scan(&versioned); err != nil || !versioned {
		return 0, err
	}
	var latest int64
	if err := db.QueryRowContext(ctx, `SELECT coalesce(max(version_id), 0) FROM `+Table).Scan(&latest); err != nil {
		return 0, err
	}
	check, ok := complete[latest]
	switch {
	case !ok || down && latest != 9:
		return 0, nil
	case down:
		check = `SELECT ` + hasColumn("body_expires_at") // 9's Down runs again while it is there
	}
	var there bool
	if err := db.QueryRowContext(ctx, check).Scan(&there); err != nil || there {
		return 0, err
	}
	if _, err := db.ExecContext(ctx, `DELETE FROM `+Table+` WHERE version_id = $1`, latest); err != nil {
		return 0, err
	}
	if down {
		return latest, nil
	}
	return 0, nil
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
