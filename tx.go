package idem

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Beginner starts transactions. *pgxpool.Pool, *pgx.Conn and pgx.Tx (which
// begins a savepoint) satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// InTx runs fn in a transaction begun on db and commits it when fn returns
// nil; when fn returns an error or panics the transaction is rolled back and
// the error (or panic) is passed on.
//
// After a serialization failure (40001) or a deadlock (40P01), anywhere in
// fn or at commit, the whole transaction is rolled back and run again, up to
// Config.MaxRetries times with jittered exponential backoff, so fn must be
// safe to run again: everything it did in the rolled-back transaction is
// gone. On a pgx.Tx, InTx runs fn in a savepoint and does not retry: such a
// failure dooms the caller's whole transaction, which only the caller can
// run again.
//
// fn's errors are returned as they are, except when the store failed under
// them (the connection broke, or the server answered that it cannot serve:
// see Unavailable): then InTx returns an error that wraps both
// ErrUnavailable and fn's error. Failures to begin or commit because the
// server cannot be reached are ErrUnavailable too. fn must not commit or
// roll back tx: InTx then returns ErrInvalidArgument (after a COMMIT, fn's
// writes are durable; on a pgx.Tx, whose tx is a savepoint, they are then
// part of the caller's transaction).
//
// InTx uses the package defaults; see Client.InTx.
func InTx(ctx context.Context, db Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return defaultClient.InTx(ctx, db, fn)
}

// InTx is the package-level InTx with this client's isolation level and
// retry budget.
func (c *Client) InTx(ctx context.Context, db Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return publicErr(c.c.InTx(ctx, db, fn))
}
