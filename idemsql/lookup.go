package idemsql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgerrcode"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/dbsql"
)

// Migrate is idem.Migrate on a *sql.DB: it brings idem's table up to date
// with package idem's own migration run (the same migrations,
// idem.Migrations; the same version table, idem.MigrationTable; the same
// lock, idem.MigrationLockID in idem.MigrationLockTable), so a database
// migrated by either form is migrated for both, and concurrent runs of
// either serialize. It does nothing when everything is applied, and works
// through a transaction pooler.
func Migrate(ctx context.Context, db *sql.DB) error {
	if db == nil {
		return errNilDB
	}
	if err := core.Migrate(ctx, db); err != nil {
		return fmt.Errorf("idem: migrate: %w", err)
	}
	return nil
}

// Lookup is idem.Lookup on a *sql.DB: the committed record of (scope,
// key), or idem.ErrNotFound. It does not check who asks.
func Lookup(ctx context.Context, db *sql.DB, scope idem.Scope, key string) (idem.Record, error) {
	return defaultClient.Lookup(ctx, db, scope, key)
}

// Lookup is the package-level Lookup with this client's key limits.
func (c *Client) Lookup(ctx context.Context, db *sql.DB, scope idem.Scope, key string) (idem.Record, error) {
	if err := c.checkTarget(scope, key); err != nil {
		return idem.Record{}, err
	}
	if db == nil {
		return idem.Record{}, errNilDB
	}
	var rec idem.Record
	err := c.indexTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		row, err := queries.KeyLookup(ctx, tx, dbsql.KeyLookupParams{Actor: scope.Actor, Operation: scope.Operation, IdemKey: key})
		if errors.Is(err, sql.ErrNoRows) {
			return idem.ErrNotFound
		}
		if err != nil {
			return err
		}
		rec, err = record(row.IdemKey)
		return err
	})
	switch {
	case errors.Is(err, idem.ErrNotFound):
		return idem.Record{}, err
	case err != nil:
		return idem.Record{}, fmt.Errorf("idem: lookup: %w", err)
	}
	return rec, nil
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
	if err := c.checkTarget(scope, key); err != nil {
		return err
	}
	if db == nil {
		return errNilDB
	}
	k := dbsql.KeyLockForForgetParams{Actor: scope.Actor, Operation: scope.Operation, IdemKey: key}
	err := c.indexTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		row, err := queries.KeyLockForForget(ctx, tx, k)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			return idem.ErrNotFound
		case sqlState(err) == pgerrcode.LockNotAvailable:
			return core.InProgress(c.c, bridgeKey(idem.Scope{}, ""))
		case err != nil:
			return err
		}
		if err := core.Forgettable(c.c, row.Status, row.LeaseRanOut); err != nil {
			return err
		}
		_, err = queries.KeyForget(ctx, tx, dbsql.KeyForgetParams(k))
		return err
	})
	switch {
	case errors.Is(err, idem.ErrNotFound), errors.Is(err, idem.ErrInProgress), errors.Is(err, idem.ErrOutcomeUnknown):
		return err
	case err != nil:
		return fmt.Errorf("idem: forget: %w", err)
	}
	return nil
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
	switch {
	case db == nil:
		return 0, errNilDB
	case opts.BatchSize < 0:
		return 0, fmt.Errorf("%w: PruneOptions.BatchSize %d must not be negative", idem.ErrInvalidArgument, opts.BatchSize)
	case opts.MaxBatches < 0:
		return 0, fmt.Errorf("%w: PruneOptions.MaxBatches %d must not be negative", idem.ErrInvalidArgument, opts.MaxBatches)
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = idem.DefaultPruneBatchSize
	}
	if opts.DryRun {
		var n int64
		err := c.batchTx(ctx, db, func(ctx context.Context, tx *sql.Tx) (err error) {
			n, err = queries.KeyCountPrunable(ctx, tx)
			return err
		})
		if err != nil {
			return 0, fmt.Errorf("idem: prune: %w", err)
		}
		return n, nil
	}
	var total int64
	for batch := 0; opts.MaxBatches == 0 || batch < opts.MaxBatches; batch++ {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		var n int64
		err := c.batchTx(ctx, db, func(ctx context.Context, tx *sql.Tx) (err error) {
			n, err = queries.KeyPrune(ctx, tx, int32(min(opts.BatchSize, 1<<30)))
			return err
		})
		if err != nil {
			return total, fmt.Errorf("idem: prune: %w", err)
		}
		total += n
		core.Count(c.c, ctx, "ttl_pruned", "prune", "", n)
		if n < int64(opts.BatchSize) {
			break // none left that no other pruner holds
		}
	}
	return total, nil
}

// indexTx runs fn, an operator or reservation call's statements, in a
// transaction of its own begun on db, with sqlIndexLookup set for it: every
// plan of those statements, also the generic plan that pgx's stdlib driver
// caches for the life of a connection, finds rows through an index, even
// when idem_keys was analyzed while empty. (Package idem plans them anew on
// every execution instead, which database/sql cannot ask of a driver.) The
// setting ends with the transaction.
func (c *Client) indexTx(ctx context.Context, db *sql.DB, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, sqlIndexLookup); err != nil {
			return err
		}
		return fn(ctx, tx)
	})
}

// sqlIndexWalk makes the statements after it in its transaction walk an
// index in the index's order (see idem.Prune).
const sqlIndexWalk = "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off"

// batchTx runs fn in a short transaction of its own begun on db, with
// sqlIndexWalk set for it (the settings end with the transaction).
func (c *Client) batchTx(ctx context.Context, db *sql.DB, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, sqlIndexWalk); err != nil {
			return err
		}
		return fn(ctx, tx)
	})
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
	if db == nil {
		return idem.Stats{}, errNilDB
	}
	st := idem.Stats{Keys: make(map[idem.Status]int64)}
	err := c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		rows, err := queries.KeyStats(ctx, tx)
		if err != nil {
			return err
		}
		for _, r := range rows {
			st.Keys[idem.Status(r.Status)] = r.Keys
			switch r.Status {
			case string(idem.StatusProcessing):
				st.OldestProcessing = r.Oldest
			case string(idem.StatusUnknown):
				st.OldestUnknown = r.Oldest
			}
		}
		size, err := queries.KeyTableSize(ctx, tx)
		st.TableBytes, st.IndexBytes = size.TableBytes, size.IndexBytes
		return err
	})
	if err != nil {
		return idem.Stats{}, fmt.Errorf("idem: stats: %w", err)
	}
	return st, nil
}
