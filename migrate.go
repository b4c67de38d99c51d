package idem

import (
	"context"
	"embed"
	"errors"
	"io/fs"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/migrate"
)

// MigrationTable is the goose version table that records idem's own
// migrations, kept apart from an application's goose_db_version table.
const MigrationTable = "idem_goose_db_version"

// MigrationLockTable is the table that serializes concurrent runs of Migrate
// and MigrateDown (goose's table-based lock: a row with a lease, renewed
// while the run lasts). A table rather than a session advisory lock, so
// that migrating works through a transaction pooler such as PgBouncer in
// transaction mode, which would run the lock and the unlock on different
// server connections.
const MigrationLockTable = "idem_goose_lock"

// MigrationLockID is the id of idem's row in MigrationLockTable. (Before
// the table lock it was the id of a PostgreSQL advisory lock.) It differs
// from goose's default lock id, so idem's migrations and the application's
// own goose migrations never block each other.
const MigrationLockID int64 = 0x6964656d // "idem"

// ErrDowngradeDeletesRecords means MigrateDown refused to revert a migration
// because its Down would delete records whose outcome may have happened
// (unknown, in flight or failed_retryable, or, for the first migration,
// every record): the keys would become free and their retries would run
// again. It also covers migration 5, whose Down drops the operators' audit
// trail (idem_audit): refused while the trail holds any row; and migration
// 6, whose Down drops the resume windows: refused while records in doubt or
// failed_retryable hold one that lasts (they would wait for a person
// instead of resuming); and migration 7, whose Down drops the outbox
// (idem_events): refused while events are pending or failed (published
// and never delivered); and migration 9, whose Down would make records
// whose body was dropped (Config.BodyTTL) replay as empty responses:
// refused while there are such records. The error says how many records or rows; nothing
// changed. MigrateDownOptions.Force reverts anyway.
var ErrDowngradeDeletesRecords = errors.New("idem: migrating down would delete records whose outcome may have happened")

// downRefusedCode is the SQLSTATE with which a Down migration refuses to
// delete records (see MigrateDown).
const downRefusedCode = "IDMDN"

// forceDownParam is the setting, sent when the connection starts, that lets
// a Down migration delete records (MigrateDownOptions.Force).
const forceDownParam = "idem.force_down"

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns idem's goose SQL migrations, for applying them with your
// own tooling. The same files work with the goose CLI when it is pointed at
// idem's version table:
//
//	goose -dir migrations -table idem_goose_db_version postgres "$DATABASE_URL" up
//
// A Down that would delete records whose outcome may have happened refuses
// (SQLSTATE IDMDN, with the number of records) unless the connection sets
// idem.force_down to on (see MigrateDown).
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err) // the embedded folder is fixed at build time
	}
	return sub
}

// Migrate brings idem's tables up to date in the database of pool. It is safe
// to run from many processes at once (they serialize on MigrationLockID in
// MigrationLockTable) and does nothing when everything is applied. It uses
// its own version table (MigrationTable), so an application's goose
// migrations are untouched. It works through a transaction pooler when the
// pool's exec mode does (see docs/poolers.md; in pgx's default mode a run
// that fails so returns ErrPreparedStatements, naming the fix). On
// Citus, run it on the coordinator (then Distribute): a worker is refused
// with ErrUnsupported. It migrates the current schema (the first on the
// search_path that exists); while another schema on the search_path holds
// idem's tables it refuses to run a migration (ErrInvalidArgument), since
// the migrations name tables and indexes unqualified and would reach
// theirs: migrate with the schema alone on the search_path. MigrateDown
// refuses likewise.
//
// A run holds two connections at once (goose's lock keeps one while the
// migrations run on another): on a pool of one connection it opens a pool
// of two of its own for the run, configured as pool is, and this process's
// runs on one pool take turns (as MigrateDown's do).
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return core.Errorf("idem: %w: nil pool", ErrInvalidArgument)
	}
	if err := checkNotWorker(ctx, pool); err != nil {
		return core.Errorf("idem: migrate: %w", err)
	}
	err := withProvider(ctx, pool, false, func(p *goose.Provider, _ int64) error {
		_, err := p.Up(ctx)
		return err
	})
	if err != nil {
		return core.Errorf("idem: migrate: %w", preparedStatementsLost(err))
	}
	return nil
}

// MigrateDownOptions configure MigrateDown.
type MigrateDownOptions struct {
	// Force reverts the migration even when its Down deletes records whose
	// outcome may have happened. Their keys become free: a retry runs the
	// work again. It is sent as a setting when the connection starts
	// (idem.force_down), which PgBouncer refuses: force a downgrade on a
	// direct connection (through one, MigrateDown returns
	// ErrInvalidArgument saying so).
	Force bool
}

// MigrateDown reverts the latest applied migration of idem in the database
// of pool, in one transaction (00003, 00009, 00010 and 00012 excepted: they
// build or drop their indexes concurrently, outside a transaction, and can be
// run again after an interruption; 00009's Down is one statement), and
// returns its version (0 when none is applied). It serializes with Migrate like Migrate does.
// A Down cut after some of its statements committed leaves its version
// recorded: the next MigrateDown runs it again (and returns 9 at once for
// a Down of 9 whose column is gone), and the next Migrate runs that
// version's Up again before the later ones. A database at a version this
// release does not ship (a later release migrated it) is refused, naming
// both versions: revert it with that release. A search_path that names
// no schema that exists is refused (ErrInvalidArgument).
//
// Migrations never delete outcomes or the audit trail on their own: when
// the Down would delete records whose outcome may have happened (unknown, in
// flight or failed_retryable records; every record for the first migration,
// which drops the table) or, for migration 5, any row of the audit trail
// (idem_audit), or for migration 9 would replay a dropped body
// (Config.BodyTTL) as an empty response, MigrateDown returns ErrDowngradeDeletesRecords, saying how
// many, and changes nothing, unless opts.Force is set.
func MigrateDown(ctx context.Context, pool *pgxpool.Pool, opts MigrateDownOptions) (int64, error) {
	if pool == nil {
		return 0, core.Errorf("idem: %w: nil pool", ErrInvalidArgument)
	}
	// No version table (goose keeps it in the current schema): nothing was
	// ever applied, and nothing is created to say so.
	var schema, versioned bool
	if err := pool.QueryRow(ctx, `SELECT current_schema() IS NOT NULL,
		EXISTS (SELECT FROM pg_tables WHERE schemaname = current_schema() AND tablename = $1)`,
		pgx.QueryExecModeSimpleProtocol, MigrationTable).Scan(&schema, &versioned); err != nil {
		return 0, core.Errorf("idem: migrate down: %w", preparedStatementsLost(err))
	}
	switch {
	case !schema:
		return 0, publicErr(core.Errorf("idem: migrate down: %w", migrate.NoSchema()))
	case !versioned:
		return 0, nil
	}
	if opts.Force {
		cfg := pool.Config().Copy()
		cfg.ConnConfig.RuntimeParams[forceDownParam] = "on"
		cfg.MinConns, cfg.MaxConns = 0, 2
		forced, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return 0, core.Errorf("idem: migrate down: %w", err)
		}
		defer forced.Close()
		pool = forced
	}
	var version int64
	err := withProvider(ctx, pool, true, func(p *goose.Provider, finished int64) error {
		if finished != 0 { // a Down cut after its change committed: now complete
			version = finished
			return nil
		}
		res, err := p.Down(ctx)
		if res != nil && err == nil {
			version = res.Source.Version
		}
		if errors.Is(err, goose.ErrNoNextVersion) {
			return nil // nothing applied
		}
		if errors.Is(err, goose.ErrVersionNotFound) {
			// A later release of idem migrated the database: this one has
			// no Down for its migration.
			if current, latest, verr := p.GetVersions(ctx); verr == nil && current > latest {
				return core.Errorf("the database is at version %d, which this release of idem does not ship "+
					"(its latest is %d): revert it with the release that applied it: %w", current, latest, err)
			}
		}
		return err
	})
	var pgErr *pgconn.PgError
	switch {
	case opts.Force && errors.As(err, &pgErr) && strings.Contains(pgErr.Message, forceDownParam):
		// A pooler (PgBouncer) that refuses the setting: not an outage, so
		// the cause is kept as text, out of Unavailable's reach.
		return 0, core.Errorf("idem: %w: MigrateDownOptions.Force sends the setting %s when the connection starts, "+
			"which the server or pooler refused (%v); force the downgrade on a direct connection to PostgreSQL",
			ErrInvalidArgument, forceDownParam, err)
	case errors.As(err, &pgErr) && pgErr.Code == downRefusedCode:
		return 0, core.Errorf("idem: %w: %s; nothing changed (MigrateDownOptions.Force, or idem migrate down --force, reverts anyway)",
			ErrDowngradeDeletesRecords, pgErr.Message)
	case err != nil:
		return 0, core.Errorf("idem: migrate down: %w", preparedStatementsLost(err))
	}
	return version, nil
}

// preparedStatementsLost is err as ErrPreparedStatements, naming the fix,
// when it is pgx's cached prepared statement lost behind a transaction
// pooler (the pool in pgx's default exec mode), as the calls say it; err
// otherwise.
func preparedStatementsLost(err error) error {
	return publicErr(defaultClient.c.PreparedStatementsLost(err))
}

// withProvider runs fn with a goose provider for idem's migrations on pool,
// locked with the table lock, one run of this process on pool at a time
// (see migrate.WithProvider). goose's lock keeps a connection while the
// migrations run on another, so a pool of one connection lends the run a
// pool of its own of two, configured as pool is
// (TestMigrateOnAPoolOfOneConnection).
func withProvider(ctx context.Context, pool *pgxpool.Pool, down bool, fn func(p *goose.Provider, finished int64) error) error {
	handle := pool
	if pool.Config().MaxConns < 2 {
		cfg := pool.Config().Copy()
		cfg.MinConns, cfg.MaxConns = 0, 2
		two, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return err
		}
		defer two.Close()
		pool = two
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	return migrate.WithProvider(ctx, handle, db, Migrations(), down, fn)
}
