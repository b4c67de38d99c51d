package idem

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// PruneOptions configures Prune. The zero value means the defaults.
type PruneOptions struct {
	// BatchSize is the most rows one DELETE (one transaction) removes.
	// Default 1000. Small batches keep locks and WAL bursts short.
	BatchSize int

	// MaxBatches bounds the batches of one call; 0 means until no expired
	// finished row is left.
	MaxBatches int

	// DryRun counts the rows Prune would delete now, and deletes nothing.
	DryRun bool
}

// DefaultPruneBatchSize is PruneOptions.BatchSize's default.
const DefaultPruneBatchSize = 1000

// Prune deletes finished keys past their TTL (succeeded, rejected and
// failed_retryable rows whose expiry has passed), oldest first, in batches
// of one short transaction each, and returns how many it deleted. It never
// touches a key in flight: a claim not yet committed, a take-over in
// progress, or a reservation that is processing or unknown. Several pruners
// (processes, goroutines) may run at once: they skip each other's rows
// instead of waiting (SKIP LOCKED). On Citus, which has no SKIP LOCKED over
// a distributed table, they wait for each other's batches instead, and a
// pruner that finds its batch taken stops early.
//
// Each batch is an index walk of the expired rows in expiry order, at
// millions of rows and whatever the planner's statistics say: it is planned
// for the table as it is when it runs, in a transaction that rules out the
// sequential scan, the bitmap scan of every expired row and the sort a
// planner misled by statistics gathered on an empty table would choose.
// Give Prune a pool or a connection: on a pgx.Tx its batches run in
// savepoints of that transaction, without those planner settings. Expired keys that Prune has not reached yet are
// still treated as new requests: pruning only reclaims space.
//
// When ctx ends between batches Prune returns what it deleted so far with
// the context's error.
func Prune(ctx context.Context, db Beginner, opts PruneOptions) (int64, error) {
	return defaultClient.Prune(ctx, db, opts)
}

// Prune is the package-level Prune.
func (c *Client) Prune(ctx context.Context, db Beginner, opts PruneOptions) (int64, error) {
	switch {
	case isNil(db):
		return 0, fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	case opts.BatchSize < 0:
		return 0, fmt.Errorf("%w: PruneOptions.BatchSize %d must not be negative", ErrInvalidArgument, opts.BatchSize)
	case opts.MaxBatches < 0:
		return 0, fmt.Errorf("%w: PruneOptions.MaxBatches %d must not be negative", ErrInvalidArgument, opts.MaxBatches)
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = DefaultPruneBatchSize
	}
	if opts.DryRun {
		var n int64
		err := c.batchTx(ctx, db, func(ctx context.Context, tx pgx.Tx) (err error) {
			n, err = queries.KeyCountPrunable(ctx, planned{tx})
			return err
		})
		if err != nil {
			return 0, fmt.Errorf("idem: prune: %w", unsupportedIf(err))
		}
		return n, nil
	}
	var total int64
	for batch := 0; opts.MaxBatches == 0 || batch < opts.MaxBatches; batch++ {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		var n int64
		err := c.batchTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
			citus, err := c.isCitus(ctx, tx.Conn())
			if err != nil {
				return err
			}
			size := int32(min(opts.BatchSize, 1<<30))
			if citus {
				n, err = queries.KeyPruneCitus(ctx, planned{tx}, size)
			} else {
				n, err = queries.KeyPrune(ctx, planned{tx}, size)
			}
			return err
		})
		if err != nil {
			return total, fmt.Errorf("idem: prune: %w", unsupportedIf(err))
		}
		total += n
		c.obs.count(ctx, "ttl_pruned", "prune", "", n)
		if n < int64(opts.BatchSize) {
			break // none left that no other pruner holds
		}
	}
	return total, nil
}

// sqlIndexWalk makes the statements after it in its transaction walk an
// index in the index's order instead of reading every matching row and
// sorting them. With statistics gathered while idem_keys was empty (and
// autovacuum off or behind) the planner takes a batch's LIMIT over the
// expired rows for a small part of a small table, and would pick a bitmap
// scan of all of them and a sort, for every batch.
const sqlIndexWalk = "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off"

// batchTx runs fn in a short transaction of its own begun on db, with
// sqlIndexWalk set for it: the maintenance calls that write batches of rows
// (Prune, ExpireLeases). The settings end with the transaction. On a
// caller's pgx.Tx, fn runs in a savepoint without them (they would outlive
// the call in the caller's transaction), planned for the table as it is.
func (c *Client) batchTx(ctx context.Context, db Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	_, nested := db.(pgx.Tx)
	return c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		if !nested {
			if _, err := tx.Exec(ctx, sqlIndexWalk); err != nil {
				return err
			}
		}
		return fn(ctx, tx)
	})
}
