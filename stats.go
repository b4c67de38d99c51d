package idem

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
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
	if isNil(db) {
		return Stats{}, fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	st := Stats{Keys: make(map[Status]int64)}
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		rows, err := queries.KeyStats(ctx, planned{tx})
		if err != nil {
			return err
		}
		for _, r := range rows {
			st.Keys[Status(r.Status)] = r.Keys
			switch r.Status {
			case string(StatusProcessing):
				st.OldestProcessing = r.Oldest.Time
			case string(StatusUnknown):
				st.OldestUnknown = r.Oldest.Time
			}
		}
		// On Citus the coordinator's idem_keys is an empty shell: the rows
		// live in its shards, which citus_table_size adds up (a question
		// asked on every call: ReadStats is not on a request path).
		citus, err := isCitusTable(ctx, tx)
		if err != nil {
			return err
		}
		if citus {
			return tx.QueryRow(ctx, sqlCitusTableSize).Scan(&st.TableBytes, &st.IndexBytes)
		}
		size, err := queries.KeyTableSize(ctx, planned{tx})
		st.TableBytes, st.IndexBytes = size.TableBytes, size.IndexBytes
		return err
	})
	if err != nil {
		return Stats{}, fmt.Errorf("idem: stats: %w", unsupportedIf(err))
	}
	return st, nil
}
