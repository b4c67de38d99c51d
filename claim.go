package idem

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/db"
)

// The claim protocol, all in the caller's transaction:
//
//  1. One round trip: KeyClaim claims the key or reads the committed row
//     that holds it (waiting at most Config.Wait for an in-flight twin),
//     then SAVEPOINT idem_fn.
//  2. fn runs inside idem_fn.
//  3. One round trip: KeyComplete stores the outcome, RELEASE idem_fn (and
//     COMMIT, in DoInTx's own transaction).
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

// errRetryClaim marks a lookup after which Do claims again.
var errRetryClaim = errors.New("idem: claim again")

// rowKey is the primary key of a key row.
type rowKey struct{ actor, operation, key string }

// keyRow is the committed row that holds a key, as claim reads it.
type keyRow struct {
	Fingerprint     []byte
	Status          string
	ResponseStatus  pgtype.Int4
	ResponseHeaders []byte
	ResponseBody    []byte
	Expired         bool
}

// claim claims k for tx, waiting at most Config.Wait for a concurrent claim
// of the same key, and otherwise reads the committed row that holds the key;
// then it opens fn's savepoint. One round trip in the common cases. With
// takeOver it takes over an expired row instead of inserting one. When not
// claimed, row is the row holding the key (found false if there is none) and
// the caller releases the savepoint.
func (c *Client) claim(ctx context.Context, tx pgx.Tx, k rowKey, fp Fingerprint, takeOver bool) (
	claimed bool, row keyRow, found bool, err error) {
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 3)}
	q := queuer{b}
	if takeOver {
		_, _ = queries.KeyTakeOver(ctx, q, db.KeyTakeOverParams{
			Fingerprint: fp[:], TtlMicros: c.ttlMicros, LockTimeout: c.lockTimeout,
			Actor: k.actor, Operation: k.operation, IdemKey: k.key,
		})
		_, _ = queries.KeyGetAfterClaim(ctx, q, db.KeyGetAfterClaimParams{Actor: k.actor, Operation: k.operation, IdemKey: k.key})
	} else {
		_, _ = queries.KeyClaim(ctx, q, db.KeyClaimParams{
			Actor: k.actor, Operation: k.operation, IdemKey: k.key,
			Fingerprint: fp[:], TtlMicros: c.ttlMicros, LockTimeout: c.lockTimeout,
		})
	}
	// fn's savepoint comes after lock_timeout is restored, so that undoing
	// fn's writes does not undo that.
	b.Queue("SAVEPOINT " + savepointFn)

	br := tx.SendBatch(ctx, b)
	raced := false
	if takeOver {
		var expires pgtype.Timestamptz
		err = br.QueryRow().Scan(&expires)
		claimed = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
		if err == nil {
			err = br.QueryRow().Scan(&found, &row.Fingerprint, &row.Status, &row.ResponseStatus,
				&row.ResponseHeaders, &row.ResponseBody, &row.Expired)
		}
	} else {
		var status pgtype.Text
		var restored string
		err = br.QueryRow().Scan(&claimed, &row.Fingerprint, &status, &row.ResponseStatus,
			&row.ResponseHeaders, &row.ResponseBody, &row.Expired, &restored)
		row.Status, found = status.String, err == nil && !claimed
		if errors.Is(err, pgx.ErrNoRows) {
			// The twin it waited for committed during the wait: read its
			// row in a statement of its own, which can see it.
			err, raced = nil, true
		}
	}
	if err == nil {
		_, err = br.Exec()
	}
	err = closeBatch(br, err)
	if err == nil && raced {
		var got db.KeyGetAfterClaimRow
		got, err = queries.KeyGetAfterClaim(ctx, tx, db.KeyGetAfterClaimParams{Actor: k.actor, Operation: k.operation, IdemKey: k.key})
		row, found = keyRow{got.Fingerprint, got.Status, got.ResponseStatus, got.ResponseHeaders, got.ResponseBody, got.Expired}, got.Found
	}
	if err == nil && found && len(row.Fingerprint) != len(Fingerprint{}) {
		err = fmt.Errorf("stored fingerprint has %d bytes", len(row.Fingerprint))
	}
	switch {
	case err == nil:
		return claimed, row, found, nil
	case pgCode(err) == pgerrcode.LockNotAvailable:
		return false, row, false, c.inProgress()
	}
	return false, row, false, fmt.Errorf("idem: claim: %w", err)
}

// releaseClaim drops fn's savepoint after a claim that did not win. With
// final set, a transaction of DoInTx's own is committed in the same round
// trip: the claim wrote nothing, so there is nothing else to run.
func releaseClaim(ctx context.Context, tx pgx.Tx, final bool) error {
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 2)}
	b.Queue("RELEASE SAVEPOINT " + savepointFn)
	own := ownTx(tx, final)
	if own != nil {
		b.Queue("COMMIT")
	}
	br := tx.SendBatch(ctx, b)
	_, err := br.Exec()
	if err == nil && own != nil {
		err = own.commitResult(br.Exec())
	}
	if err = closeBatch(br, err); err != nil {
		return fmt.Errorf("idem: release claim: %w", err)
	}
	return nil
}

// complete stores the outcome of a claimed key and drops fn's savepoint. In
// DoInTx's own transaction Do is the last thing to run, so it also commits
// in the same round trip.
func complete(ctx context.Context, tx pgx.Tx, k rowKey, status string, resp Response, headers []byte) error {
	body := resp.Body
	if body == nil {
		body = []byte{}
	}
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 2)}
	_, _ = queries.KeyComplete(ctx, queuer{b}, db.KeyCompleteParams{
		Status:          status,
		ResponseStatus:  pgtype.Int4{Int32: int32(resp.Status), Valid: true},
		ResponseHeaders: headers,
		ResponseBody:    body,
		Actor:           k.actor, Operation: k.operation, IdemKey: k.key,
	})
	own := ownTx(tx, true)
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

// undoRejected undoes fn's writes and keeps fn's savepoint and the claim.
func undoRejected(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepointFn); err != nil {
		return fmt.Errorf("idem: undo rejected writes: %w", err)
	}
	return nil
}

// undo undoes fn's writes and gives up the claim after fn failed, leaving
// the caller's transaction as it was before Do. In DoInTx's own
// transaction there is nothing to do: it is rolled back whole.
func undo(ctx context.Context, tx pgx.Tx, k rowKey) error {
	if ownTx(tx, true) != nil {
		return nil
	}
	if _, err := tx.Exec(ctx, undoFnSQL); err != nil {
		return fmt.Errorf("idem: undo: %w", err)
	}
	if err := queries.KeyRelease(ctx, tx, db.KeyReleaseParams{Actor: k.actor, Operation: k.operation, IdemKey: k.key}); err != nil {
		return fmt.Errorf("idem: release key: %w", err)
	}
	return nil
}

// withUndo returns err, joined with the error of undo if that failed.
func withUndo(ctx context.Context, tx pgx.Tx, k rowKey, err error) error {
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
