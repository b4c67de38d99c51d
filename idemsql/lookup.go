package idemsql

import (
	"context"
	"database/sql"

	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/migrate"
)

// Migrate is idem.Migrate on a *sql.DB: it brings idem's table up to date
// with package idem's own migration run (the same migrations,
// idem.Migrations; the same version table, idem.MigrationTable; the same
// lock, idem.MigrationLockID in idem.MigrationLockTable), so a database
// migrated by either form is migrated for both, and concurrent runs of
// either serialize. It does nothing when everything is applied, and works
// through a transaction pooler. A run holds two of db's connections at once
// (goose's lock keeps one while the migrations run on another): on a handle
// limited to one (SetMaxOpenConns(1)) it raises the limit to two for the
// run and puts it back after, and this process's runs on one handle take
// turns. Like idem.Migrate, it refuses (idem.ErrInvalidArgument) to run a
// migration while another schema on the search_path holds idem's tables,
// or when the search_path names no schema that exists; behind a
// transaction pooler, pgx's default exec mode may fail, and then returns
// idem.ErrPreparedStatements, naming the fix; and on Citus it runs on the
// coordinator: a worker is refused with idem.ErrUnsupported.
func Migrate(ctx context.Context, db *sql.DB) error {
	if db == nil {
		return core.Errorf("idem: %w: nil database handle", idem.ErrInvalidArgument)
	}
	err := checkNotWorker(ctx, db)
	if err == nil {
		err = migrate.WithProvider(ctx, db, db, idem.Migrations(), false, func(p *goose.Provider, _ int64) error {
			_, err := p.Up(ctx)
			return err
		})
	}
	if err != nil {
		return core.Errorf("idem: migrate: %w", publicErr(defaultClient.c.PreparedStatementsLost(err)))
	}
	return nil
}

// checkNotWorker refuses (idem.ErrUnsupported) a db connected to a Citus
// worker, as idem.Migrate does: the migrations would build local tables
// there that the coordinator never sees. A database without Citus passes.
func checkNotWorker(ctx context.Context, db *sql.DB) error {
	var citus, coordinator bool
	err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')`).Scan(&citus)
	if err != nil || !citus {
		return err
	}
	if err := db.QueryRowContext(ctx, `SELECT citus_is_coordinator()`).Scan(&coordinator); err != nil || coordinator {
		return err
	}
	return core.Errorf("idem: %w: connected to a Citus worker; connect to the coordinator", idem.ErrUnsupported)
}

// Lookup is idem.Lookup on a *sql.DB: the committed record of (scope,
// key), or idem.ErrNotFound. It does not check who asks.
func Lookup(ctx context.Context, db *sql.DB, scope idem.Scope, key string) (idem.Record, error) {
	return defaultClient.Lookup(ctx, db, scope, key)
}

// Lookup is the package-level Lookup with this client's key limits.
func (c *Client) Lookup(ctx context.Context, db *sql.DB, scope idem.Scope, key string) (idem.Record, error) {
	r, err := c.c.Lookup(ctx, db, core.Scope(scope), key)
	return record(r), publicErr(err)
}

// Forget is idem.Forget on a *sql.DB: it deletes the record of a finished
// key so the next request with it runs as a new one. idem.ErrInProgress
// for a key in flight, idem.ErrOutcomeUnknown for an unknown one (Resolve
// it instead), idem.ErrNotFound when no record holds the key; nothing
// changes on an error.
func Forget(ctx context.Context, db *sql.DB, scope idem.Scope, key string) error {
	return defaultClient.Forget(ctx, db, scope, key)
}

// Forget is the package-level Forget with this client's key limits.
func (c *Client) Forget(ctx context.Context, db *sql.DB, scope idem.Scope, key string) error {
	return publicErr(c.c.Forget(ctx, db, core.Scope(scope), key))
}

// Prune is idem.Prune on a *sql.DB: it deletes finished keys past their
// TTL, oldest first, in batches of one short transaction each, and returns
// how many it deleted. It never touches a key in flight; several pruners
// skip each other's rows. When ctx ends between batches Prune returns what
// it deleted so far with the context's error.
func Prune(ctx context.Context, db *sql.DB, opts idem.PruneOptions) (int64, error) {
	return defaultClient.Prune(ctx, db, opts)
}

// Prune is the package-level Prune.
func (c *Client) Prune(ctx context.Context, db *sql.DB, opts idem.PruneOptions) (int64, error) {
	n, err := c.c.Prune(ctx, db, core.PruneOptions(opts))
	return n, publicErr(err)
}

// PruneReport is idem.PruneReport on db: Prune, also saying how many stored
// bodies it dropped.
func PruneReport(ctx context.Context, db *sql.DB, opts idem.PruneOptions) (idem.PruneResult, error) {
	return defaultClient.PruneReport(ctx, db, opts)
}

// PruneReport is the package-level PruneReport.
func (c *Client) PruneReport(ctx context.Context, db *sql.DB, opts idem.PruneOptions) (idem.PruneResult, error) {
	keys, bodies, err := c.c.PruneReport(ctx, db, core.PruneOptions(opts))
	return idem.PruneResult{KeysDeleted: keys, BodiesDropped: bodies}, publicErr(err)
}

// ReadStats is idem.ReadStats on a *sql.DB: the keys in each status, the
// oldest in flight and unknown, and the table's size. It counts every row:
// run it from operators' tools, not on a request path.
func ReadStats(ctx context.Context, db *sql.DB) (idem.Stats, error) {
	return defaultClient.ReadStats(ctx, db)
}

// ReadStats is the package-level ReadStats, in a transaction at this
// client's isolation level.
func (c *Client) ReadStats(ctx context.Context, db *sql.DB) (idem.Stats, error) {
	s, err := c.c.ReadStats(ctx, db)
	return stats(s), publicErr(err)
}
