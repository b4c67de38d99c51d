package idem

import (
	"context"

	"github.com/pgidem/idem/internal/core"
)

// PruneOptions configures Prune. The zero value means the defaults.
type PruneOptions struct {
	// BatchSize is the most rows one DELETE (one transaction) removes.
	// Default 1000. Small batches keep locks and WAL bursts short.
	BatchSize int

	// MaxBatches bounds the batches of one call, of key deletes and then of
	// body drops each; 0 means until no expired finished row (and no body
	// past its Config.BodyTTL) is left.
	MaxBatches int

	// DryRun counts the rows Prune would delete now (at most MaxBatches
	// batches of BatchSize, when MaxBatches is set), and deletes (and drops)
	// nothing.
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
// Then it drops the stored body and headers of finished keys whose body's
// life has passed (Config.BodyTTL) in the same way, oldest first through
// their own index, in batches of BatchSize: those keys stay, with their
// status, until their TTL (a replay answers ErrResponseGone). The result
// counts deleted keys only; the drops are counted by the metric
// idem.bodies_dropped, and PruneReport returns both.
//
// When ctx ends between batches Prune returns what it deleted so far with
// the context's error.
func Prune(ctx context.Context, db Beginner, opts PruneOptions) (int64, error) {
	return defaultClient.Prune(ctx, db, opts)
}

// Prune is the package-level Prune.
func (c *Client) Prune(ctx context.Context, db Beginner, opts PruneOptions) (int64, error) {
	n, err := c.c.Prune(ctx, db, core.PruneOptions(opts))
	return n, publicErr(err)
}

// PruneResult is what PruneReport did.
type PruneResult struct {
	// KeysDeleted is what Prune returns: the expired keys deleted (with
	// DryRun, those it would delete).
	KeysDeleted int64
	// BodiesDropped is the stored bodies dropped after their life
	// (Config.BodyTTL); none with DryRun.
	BodiesDropped int64
}

// PruneReport is Prune, also saying how many stored bodies it dropped
// (which Prune counts only in the metric idem.bodies_dropped). On an error
// it returns what it did so far.
func PruneReport(ctx context.Context, db Beginner, opts PruneOptions) (PruneResult, error) {
	return defaultClient.PruneReport(ctx, db, opts)
}

// PruneReport is the package-level PruneReport.
func (c *Client) PruneReport(ctx context.Context, db Beginner, opts PruneOptions) (PruneResult, error) {
	keys, bodies, err := c.c.PruneReport(ctx, db, core.PruneOptions(opts))
	return PruneResult{KeysDeleted: keys, BodiesDropped: bodies}, publicErr(err)
}
