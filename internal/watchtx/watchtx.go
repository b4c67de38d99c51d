// Package watchtx gives handlers a pgx.Tx that remembers the first
// serialization failure (40001) or deadlock (40P01) one of their statements
// met. Such a failure dooms the transaction whatever the handler answers;
// idemhttp, idemgrpc and idemconnect then run the handler again in a new
// transaction (idem.InTx and idem.DoInTx retry when fn returns that error),
// as they do when the failure surfaces at the claim or at COMMIT.
package watchtx

import (
	"context"
	"errors"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Tx is the pgx.Tx a handler gets: the request's transaction, remembering
// the first serialization failure or deadlock any of the handler's
// statements met.
type Tx struct {
	pgx.Tx
	retryable error // the first 40001 or 40P01 seen, or nil
}

// New returns tx, watched.
func New(tx pgx.Tx) *Tx { return &Tx{Tx: tx} }

// Retryable returns the first serialization failure or deadlock that a
// statement through t met, or nil. When it is not nil, the transaction is
// lost whatever the handler answered: return it to idem.InTx or
// idem.DoInTx, which run the handler again in a new transaction.
func (t *Tx) Retryable() error { return t.retryable }

// see records err if it is a serialization failure or a deadlock.
func (t *Tx) see(err error) error {
	var pgErr *pgconn.PgError
	if t.retryable == nil && errors.As(err, &pgErr) &&
		(pgErr.Code == pgerrcode.SerializationFailure || pgErr.Code == pgerrcode.DeadlockDetected) {
		t.retryable = err
	}
	return err
}

func (t *Tx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := t.Tx.Exec(ctx, sql, args...)
	return tag, t.see(err)
}

func (t *Tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	rows, err := t.Tx.Query(ctx, sql, args...)
	if err != nil {
		return rows, t.see(err)
	}
	return watchedRows{rows, t}, nil
}

func (t *Tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return watchedRow{t.Tx.QueryRow(ctx, sql, args...), t}
}

func (t *Tx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return watchedBatch{t.Tx.SendBatch(ctx, b), t}
}

type watchedRows struct {
	pgx.Rows
	t *Tx
}

func (r watchedRows) Err() error { return r.t.see(r.Rows.Err()) }

type watchedRow struct {
	pgx.Row
	t *Tx
}

func (r watchedRow) Scan(dest ...any) error { return r.t.see(r.Row.Scan(dest...)) }

type watchedBatch struct {
	pgx.BatchResults
	t *Tx
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
