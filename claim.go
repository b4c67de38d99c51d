package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/db"
)

// The claim protocol, all in the caller's transaction:
//
//  1. One round trip: KeyClaim claims the key (waiting at most Config.Wait
//     for an in-flight twin), then SAVEPOINT idem_fn.
//  2. fn runs inside idem_fn.
//  3. One round trip: KeyComplete stores the outcome, RELEASE idem_fn (or
//     COMMIT, in DoInTx's own transaction).
//
// When a committed row already holds the key, step 1 claims nothing and a
// second round trip reads the row (KeyGetAfterClaim) and releases idem_fn.
//
// Reject rolls back to idem_fn first: fn's writes are undone but the claim is
// kept, so a twin waiting on the claim never sees the key free. Any other
// failure rolls back to idem_fn and deletes the claim: the key is free again
// when the transaction ends.
//
// The claim itself is not in a savepoint: when it fails (the wait runs out,
// a serialization failure) the transaction is aborted and must be rolled
// back. Every other path leaves it usable.

// savepointFn is the savepoint fn runs in. Do releases or rolls it back
// before it returns, so nested and sequential calls in one transaction do
// not interfere.
const savepointFn = "idem_fn"

// undoFnSQL undoes fn's writes and drops its savepoint. It is sent as one
// simple-protocol message: a transaction that fn left aborted accepts
// ROLLBACK TO, but would refuse to prepare the statements of a batch.
const undoFnSQL = "ROLLBACK TO SAVEPOINT " + savepointFn + "; RELEASE SAVEPOINT " + savepointFn

// rowKey is the primary key of a key row, with its parts boxed once as
// statement arguments: the claim and the completion both send them.
type rowKey struct {
	actor, operation, key string
	args                  [3]any
}

func newRowKey(scope Scope, key string) *rowKey {
	return &rowKey{actor: scope.Actor, operation: scope.Operation, key: key,
		args: [3]any{scope.Actor, scope.Operation, key}}
}

// keyRow is the committed row that holds a key, as KeyGetAfterClaim reads it.
type keyRow = db.KeyGetAfterClaimRow

// The two statements of every fresh Do are queued with arguments built here,
// in the order of the generated methods (TestHotArgsMatchGenerated checks
// it), rather than through those methods, which would box the key's parts
// again for each statement.

func (c *Client) claimArgs(k *rowKey, fp []byte) []any {
	return []any{k.args[0], k.args[1], k.args[2], fp, c.ttlArg, c.lockTimeoutArg}
}

// headers is the stored headers' JSON as a string, or nil for none: text
// rather than bytes, because in pgx's exec and simple-protocol modes (which
// PgBouncer setups use) a []byte argument is sent as bytea and would not
// read as JSON.
func completeArgs(k *rowKey, status string, respStatus int, headers any, body []byte) []any {
	return []any{status, int32(respStatus), headers, body, k.args[0], k.args[1], k.args[2]}
}

// claim claims k for tx, waiting at most Config.Wait for a concurrent claim
// of the same key, and opens fn's savepoint: one round trip. With takeOver it
// takes over an expired row instead of inserting one. When not claimed, it
// reads the committed row that holds the key (found false if there is none)
// and drops the savepoint again.
func (c *Client) claim(ctx context.Context, tx pgx.Tx, k *rowKey, fp Fingerprint, takeOver bool) (
	claimed bool, row keyRow, found bool, err error) {
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 2)}
	if takeOver {
		_, _ = queries.KeyTakeOver(ctx, queuer{b}, db.KeyTakeOverParams{
			Fingerprint: fp[:], TtlMicros: c.ttlMicros, LockTimeout: c.lockTimeout,
			Actor: k.actor, Operation: k.operation, IdemKey: k.key,
		})
	} else {
		b.Queue(db.KeyClaim, c.claimArgs(k, fp[:])...)
	}
	b.Queue("SAVEPOINT " + savepointFn)
	br := tx.SendBatch(ctx, b)
	err = br.QueryRow().Scan(&claimed)
	if errors.Is(err, pgx.ErrNoRows) {
		err = nil
	}
	if err == nil {
		_, err = br.Exec()
	}
	if err = closeBatch(br, err); err != nil {
		if pgCode(err) == pgerrcode.LockNotAvailable {
			return false, row, false, c.inProgressOn(k)
		}
		return false, row, false, fmt.Errorf("idem: claim: %w", err)
	}
	if claimed {
		return true, row, false, nil
	}

	// A committed row holds the key. Read it in a statement of its own:
	// under READ COMMITTED that one sees a twin that committed while the
	// claim waited. DoInTx's own transaction has written nothing, so it
	// commits in the same round trip; Do reopens it if it has to claim
	// again.
	b = &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 2)}
	_, _ = queries.KeyGetAfterClaim(ctx, queuer{b}, db.KeyGetAfterClaimParams{Actor: k.actor, Operation: k.operation, IdemKey: k.key})
	own := ownTx(tx)
	if own != nil {
		b.Queue("COMMIT")
	} else {
		b.Queue("RELEASE SAVEPOINT " + savepointFn)
	}
	br = tx.SendBatch(ctx, b)
	err = br.QueryRow().Scan(&row.Found, &row.Fingerprint, &row.Status, &row.ResponseStatus,
		&row.ResponseHeaders, &row.ResponseBody, &row.Expired)
	if err == nil && own != nil {
		err = own.commitResult(br.Exec())
	} else if err == nil {
		_, err = br.Exec()
	}
	if err == nil && row.Found && len(row.Fingerprint) != len(Fingerprint{}) {
		err = fmt.Errorf("stored fingerprint has %d bytes", len(row.Fingerprint))
	}
	if err = closeBatch(br, err); err != nil {
		return false, row, false, fmt.Errorf("idem: read key: %w", err)
	}
	return false, row, row.Found, nil
}

// complete stores the outcome of a claimed key and drops fn's savepoint. In
// DoInTx's own transaction Do is the last thing to run, so it commits
// instead, in the same round trip.
func complete(ctx context.Context, tx pgx.Tx, k *rowKey, status string, resp Response, headers any) error {
	body := resp.Body
	if body == nil {
		body = []byte{}
	}
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 2)}
	b.Queue(db.KeyComplete, completeArgs(k, status, resp.Status, headers, body)...)
	own := ownTx(tx)
	if own != nil {
		b.Queue("COMMIT") // the savepoint ends with the transaction
	} else {
		b.Queue("RELEASE SAVEPOINT " + savepointFn)
	}
	br := tx.SendBatch(ctx, b)
	tag, err := br.Exec()
	if err == nil && tag.RowsAffected() != 1 {
		err = fmt.Errorf("claimed row not found (%d rows)", tag.RowsAffected())
	}
	if err == nil && own != nil {
		err = own.commitResult(br.Exec())
	}
	if err = closeBatch(br, err); err != nil {
		if own != nil && own.done {
			return fmt.Errorf("idem: commit: %w", err)
		}
		return fmt.Errorf("idem: store response: %w", err)
	}
	return nil
}

// cleanupTimeout bounds the statements that undo fn's work, which run even
// when the caller's context is done: leaving the claim and fn's writes in a
// transaction the caller may still commit would block the key for its TTL.
const cleanupTimeout = 5 * time.Second

// undoRejected undoes fn's writes and keeps fn's savepoint and the claim.
func undoRejected(ctx context.Context, tx pgx.Tx) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepointFn); err != nil {
		return fmt.Errorf("idem: undo rejected writes: %w", err)
	}
	return nil
}

// undo undoes fn's writes and gives up the claim after fn failed, leaving
// the caller's transaction as it was before Do. In DoInTx's own
// transaction there is nothing to do: it is rolled back whole (or its
// COMMIT already failed).
func undo(ctx context.Context, tx pgx.Tx, k *rowKey) error {
	if isOwnTx(tx) {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if _, err := tx.Exec(ctx, undoFnSQL); err != nil {
		return fmt.Errorf("idem: undo: %w", err)
	}
	if err := queries.KeyRelease(ctx, tx, db.KeyReleaseParams{Actor: k.actor, Operation: k.operation, IdemKey: k.key}); err != nil {
		return fmt.Errorf("idem: release key: %w", err)
	}
	return nil
}

// withUndo returns err, joined with the error of undo if that failed.
func withUndo(ctx context.Context, tx pgx.Tx, k *rowKey, err error) error {
	if undoErr := undo(ctx, tx, k); undoErr != nil {
		return errors.Join(err, undoErr)
	}
	return err
}

// closeBatch closes br and returns err, or the error of closing when err is
// nil: the first error of the batch.
func closeBatch(br pgx.BatchResults, err error) error {
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	return err
}
