package idem

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// queuer is a db.DBTX that queues each statement of a generated sqlc method
// in a pgx.Batch instead of running it, so Do can send several statements in
// one round trip while sqlc stays the single source of the SQL and of the
// order of its arguments. Results are read from the batch afterwards.
type queuer struct{ b *pgx.Batch }

var errQueued = errors.New("idem: statement queued in a batch")

func (q queuer) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.b.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

func (q queuer) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	q.b.Queue(sql, args...)
	return nil, errQueued
}

func (q queuer) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	q.b.Queue(sql, args...)
	return queuedRow{}
}

type queuedRow struct{}

func (queuedRow) Scan(...any) error { return errQueued }
