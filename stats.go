package idem

import (
	"context"
	"time"
)

// Stats describes the idem_keys table for operators.
type Stats struct {
	// Keys counts the keys in each status ("processing", "succeeded",
	// "rejected", "failed_retryable", "unknown"); statuses without keys are
	// left out. Claims of transactions still open are not counted.
	Keys map[Status]int64
	// OldestProcessing is when the oldest committed 'processing' key (a
	// reservation in flight) was claimed; zero when there is none.
	OldestProcessing time.Time
	// OldestUnknown is when the oldest 'unknown' key was claimed; zero when
	// there is none.
	OldestUnknown time.Time
	// TableBytes and IndexBytes are the table's size on disk (with its
	// TOAST data) and its indexes'. For a Citus distributed idem_keys they
	// are the sums over its shards on the workers.
	TableBytes, IndexBytes int64
}

// ReadStats reads Stats in one transaction on db. It counts every row, so
// it takes time in proportion to the table: run it from operators' tools,
// not on a request path.
func ReadStats(ctx context.Context, db Beginner) (Stats, error) {
	return defaultClient.ReadStats(ctx, db)
}

// ReadStats is the package-level ReadStats, in a transaction of this
// client (its isolation level and retry budget).
func (c *Client) ReadStats(ctx context.Context, db Beginner) (Stats, error) {
	s, err := c.c.ReadStats(ctx, db)
	return stats(s), publicErr(err)
}
