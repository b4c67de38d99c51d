package idemhttp

import (
	"context"
	"errors"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// watchedTx is the pgx.Tx a handler gets from Tx: the request's
// transaction, remembering the first serialization failure (40001) or
// deadlock (40P01) any of the handler's statements met. Such a failure
// dooms the transaction whatever the handler answers; the middleware then
// runs the handler again in a new transaction instead of sending its 5xx,
// as it does when the failure surfaces at the claim or at COMMIT.
type watchedTx struct {
	pgx.Tx
	retryable error // the first 40001 or 40P01 seen, or nil
}

// see records err if it is a serialization failure or a deadlock.
func (t *watchedTx) see(err error) error {
	var pgErr *pgconn.PgError
	if t.retryable == nil && errors.As(err, &pgErr) &&
		(pgErr.Code == pgerrcode.SerializationFailure || pgErr.Code == pgerrcode.DeadlockDetected) {
		t.retryable = err
	}
	return err
}

func (t *watchedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := t.Tx.Exec(ctx, sql, args...)
	return tag, t.see(err)
}

func (t *watchedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	rows, err := t.Tx.Query(ctx, sql, args...)
	if err != nil {
		return rows, t.see(err)
	}
	return watchedRows{rows, t}, nil
}

func (t *watchedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return watchedRow{t.Tx.QueryRow(ctx, sql, args...), t}
}

func (t *watchedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return watchedBatch{t.Tx.SendBatch(ctx, b), t}
}

type watchedRows struct {
	pgx.Rows
	t *watchedTx
}

func (r watchedRows) Err() error { return r.t.see(r.Rows.Err()) }

type watchedRow struct {
	pgx.Row
	t *watchedTx
}

func (r watchedRow) Scan(dest ...any) error { return r.t.see(r.Row.Scan(dest...)) }

type watchedBatch struct {
	pgx.BatchResults
	t *watchedTx
}

func (b watchedBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	return tag, b.t.see(err)
}

func (b watchedBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	if err != nil {
		return rows, b.t.see(err)
	}
	return watchedRows{rows, b.t}, nil
}

func (b watchedBatch) QueryRow() pgx.Row { return watchedRow{b.BatchResults.QueryRow(), b.t} }

func (b watchedBatch) Close() error { return b.t.see(b.BatchResults.Close()) }
