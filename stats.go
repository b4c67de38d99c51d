package idem

import (
	"context"

	"github.com/pgidem/idem/internal/core"
)

// Stats describes the idem_keys table for operators. Keys counts the keys
// in each status ("processing", "succeeded", "rejected",
// "failed_retryable", "unknown"; statuses without keys are left out; claims
// of transactions still open are not counted). OldestProcessing is when the
// oldest committed 'processing' key (a reservation in flight) was claimed,
// OldestUnknown when the oldest 'unknown' key was (zero when there is
// none). TableBytes and IndexBytes are the table's size on disk (with its
// TOAST data) and its indexes'; for a Citus distributed idem_keys, the sums
// over its shards on the workers.
type Stats = core.Stats

// ReadStats reads Stats in one transaction on db. It counts every row, so
// it takes time in proportion to the table: run it from operators' tools,
// not on a request path.
func ReadStats(ctx context.Context, db Beginner) (Stats, error) {
	return defaultClient.c.ReadStats(ctx, db)
}

// ReadStats is the package-level ReadStats, in a transaction of this
// client (its isolation level and retry budget).
func (c *Client) ReadStats(ctx context.Context, db Beginner) (Stats, error) {
	return c.c.ReadStats(ctx, db)
}
