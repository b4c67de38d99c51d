package core

import (
	"context"
	"math/rand/v2"
	"time"
)

// InTx runs fn in a transaction begun on db and commits it when fn returns
// nil, running it again after a serialization failure or a deadlock (see
// idem.InTx).
func (c *Client[TTx, TDB]) InTx(ctx context.Context, db TDB, fn func(ctx context.Context, tx TTx) error) error {
	if err := c.checkDB(db, false); err != nil {
		return err
	}
	if fn == nil {
		return errNilFn
	}
	return c.preparedStatementsLost(c.retry(ctx, c.drv.Nested(db), func() error { return c.inTx(ctx, db, fn) }))
}

// inTx is one transaction of InTx. fn's errors come back as they are,
// unless the store failed under them: the connection is gone, or the
// server said it cannot serve.
func (c *Client[TTx, TDB]) inTx(ctx context.Context, db TDB, fn func(ctx context.Context, tx TTx) error) error {
	tx, err := c.drv.Begin(ctx, db)
	if err != nil {
		err = unavailableIf(c.isUnavailable(err), errorf("idem: begin: %w", err))
		if c.drv.Nested(db) { // a savepoint of the caller's transaction
			err = c.txUnusable(err)
		}
		return err
	}
	ended := false
	defer func() {
		if !ended { // fn panicked
			c.drv.Rollback(ctx, db, tx)
		}
	}()
	err = fn(ctx, tx)
	ended = true
	if err != nil {
		return unavailableIf(c.drv.Rollback(ctx, db, tx) || c.serverSaidUnavailable(err), err)
	}
	if err := c.drv.Commit(ctx, tx); err != nil {
		if ctx.Err() != nil && c.drv.CtxEndsTx() && c.drv.TxClosed(err) {
			// database/sql rolled the transaction back when ctx ended
			// (it was begun with it): its "already committed or rolled
			// back" alone would read as if fn's writes may have committed.
			return errorf("idem: commit: %w: the transaction had ended before its COMMIT (database/sql rolls it back "+
				"when the context it was begun with ends, unless fn had ended it itself): %w", ctxError(ctx), err)
		}
		switch {
		case c.drv.TxClosed(err) && c.drv.Nested(db):
			// A savepoint of the caller's transaction: fn released it (its
			// writes now belong to the caller's transaction) or rolled it
			// back.
			return errorf("idem: %w: fn released or rolled back the savepoint InTx runs it in (released, its writes "+
				"are part of your transaction, which commits them or not; InTx cannot tell which): %w", ErrInvalidArgument, err)
		case c.drv.TxClosed(err):
			// fn committed or rolled back the transaction itself: after a
			// COMMIT its writes are durable, which a bare "tx is closed"
			// would hide from a caller about to run them again.
			return errorf("idem: %w: fn committed or rolled back the transaction InTx runs it in (a COMMIT made its "+
				"writes durable; InTx cannot tell which): %w", ErrInvalidArgument, err)
		}
		return unavailableIf(c.isUnavailable(err), errorf("idem: commit: %w", err))
	}
	return nil
}

// backoff returns a jittered exponential delay for retry number attempt.
func backoff(attempt int) time.Duration {
	d := 5 * time.Millisecond << min(attempt, 6)
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctxError(ctx)
	}
}
