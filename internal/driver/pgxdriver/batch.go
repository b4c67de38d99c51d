package pgxdriver

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem/internal/db"
)

// queuer is a db.DBTX that queues each statement of a generated sqlc method
// in a pgx.Batch instead of running it, so a call can send several statements in
// one round trip while sqlc stays the single source of the SQL and of the
// order of its arguments. Once the batch is sent, the same generated methods
// called on a batchRead scan the results. (The arguments given on that
// second call are not used: zero values do.)
type queuer struct{ b *pgx.Batch }

var errQueued = errors.New("statement queued in a batch")

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

// batchRead is a db.DBTX that reads the next result of a batch already sent
// instead of running a statement, so that the generated method of a
// statement queued with queuer scans its own result.
type batchRead struct{ br pgx.BatchResults }

func (r batchRead) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return r.br.Exec()
}
func (r batchRead) Query(context.Context, string, ...any) (pgx.Rows, error) { return r.br.Query() }
func (r batchRead) QueryRow(context.Context, string, ...any) pgx.Row        { return r.br.QueryRow() }

// planned is a db.DBTX that runs each statement with a plan made for its
// arguments and the table as it is at that moment (pgx's
// QueryExecModeExec: the unnamed statement, planned on every execution),
// never a cached generic plan. Statements that find rows by a WHERE clause
// run through it when they are off the hot path: a generic plan cached
// while idem_keys was small, or while its statistics said it was empty, can
// scan the whole table on every call for the life of the connection. The
// price is the planning, about 60-90 us of server CPU per statement.
type planned struct{ db db.DBTX }

func (p planned) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return p.db.Exec(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (p planned) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return p.db.Query(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (p planned) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return p.db.QueryRow(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}
