package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/db"
)

// The statements of the protocol that Do and DoInTx send (their one loop,
// call, is in idem.go), and what the row that holds a key means for a call.
//
// Every statement is a generated sqlc method. The ones Do and DoInTx send
// together in one round trip are queued in a pgx.Batch by calling the
// method on a queuer, and their results read by calling it again on a
// batchRead (batch.go); all others are called directly.
//
// None of them depends on the planner's statistics for its access path:
//   - The claim, the take-over and the completion are INSERT ... ON CONFLICT:
//     the key is found through the primary key (the arbiter index), whatever
//     the statistics say. The completion of a key Do claimed changes no
//     indexed column and no column an index predicate reads, so it is a HOT
//     update (migration 00003).
//
// Their ON CONFLICT DO UPDATE clauses call no function: the clock is read
// from the proposed row (excluded), which a distributed planner (Citus)
// accepts too. The claim's bounded wait is a subquery of its INSERT, which
// such a planner refuses: a variant for it replaces KeyClaim and
// KeyTakeOver in queueClaim alone.
//   - KeyGet runs only after "SET LOCAL enable_seqscan = off", undone with
//     the savepoint (Do) or the transaction (DoInTx) it runs in, so every
//     plan of it, and the generic plan pgx's statement cache keeps for the
//     life of the connection, is the primary key index even when idem_keys
//     was analyzed while empty.
//   - Statements off the hot path (Prune, the reservation calls) go through
//     planned (batch.go): planned anew on every execution.
//
// The wait for a concurrent claim of the same key is bounded by
// lock_timeout = Config.Wait, set and restored by the claim statement itself
// (KeyClaim, KeyTakeOver): no statement of its own. When nothing is claimed,
// the savepoint (Do) or transaction (DoInTx) ends before any code of the
// caller runs, and that restores the caller's value. On Citus, where the
// wait happens on a worker that set_config never reaches, SET LOCAL
// statements around the claim bound it instead (queueClaim).

// Statements that are not table queries. savepoint is the savepoint that Do
// runs the claim and fn in.
const (
	sqlSavepoint = "SAVEPOINT idem_do"
	sqlRelease   = "RELEASE SAVEPOINT idem_do"
	// sqlUndo undoes the claim and fn's writes and drops the savepoint. It
	// is sent as one simple-protocol message: a transaction that fn left
	// aborted accepts ROLLBACK TO, but would refuse to prepare the next
	// statement of a pipeline.
	sqlUndo        = "ROLLBACK TO SAVEPOINT idem_do; RELEASE SAVEPOINT idem_do"
	sqlRollbackTo  = "ROLLBACK TO SAVEPOINT idem_do"
	sqlIndexLookup = "SET LOCAL enable_seqscan = off"
	// sqlWaitDefault ends the Citus claim's bound on waiting (see
	// queueClaim).
	sqlWaitDefault = "SET LOCAL lock_timeout TO DEFAULT"
)

// maxClaimAttempts bounds the rounds of claim, read and take-over when the
// row that holds the key keeps changing under a call (taken over or pruned
// by others, or given up by a twin after Reject).
const maxClaimAttempts = 4

// maxRetryAfter caps the retry hint of a key held by a long lease.
const maxRetryAfter = time.Minute

// rowKey is the primary key of a key row.
type rowKey struct{ actor, operation, key string }

func newRowKey(scope Scope, key string) rowKey {
	return rowKey{actor: scope.Actor, operation: scope.Operation, key: key}
}

// queueClaim queues the claim of k for fp in b, bounded by Config.Wait: a
// fresh claim, or with takeOver the take-over of a row that is over. On
// PostgreSQL the bound is set and the caller's lock_timeout restored by the
// statement itself (see KeyClaim). On Citus (citus true, see
// Client.isCitus) the wait happens on the worker, which only SET LOCAL
// statements reach: lock_timeout is set to Config.Wait before the claim and
// back to its default after it: the server's, role's, database's or
// startup parameters' value. A session-level SET or an earlier SET LOCAL of
// the caller's is not known there and not restored (docs/citus.md).
func (c *Client) queueClaim(b *pgx.Batch, k rowKey, fp []byte, takeOver, citus bool) {
	ctx, q := context.Background(), queuer{b}
	switch {
	case citus && takeOver:
		b.Queue(c.sqlSetWait)
		_, _ = queries.KeyTakeOverCitus(ctx, q, db.KeyTakeOverCitusParams{Actor: k.actor, Operation: k.operation,
			IdemKey: k.key, Fingerprint: fp, TtlMicros: c.ttlMicros})
		b.Queue(sqlWaitDefault)
	case citus:
		b.Queue(c.sqlSetWait)
		_, _ = queries.KeyClaimCitus(ctx, q, db.KeyClaimCitusParams{Actor: k.actor, Operation: k.operation,
			IdemKey: k.key, Fingerprint: fp, TtlMicros: c.ttlMicros})
		b.Queue(sqlWaitDefault)
	case takeOver:
		_, _ = queries.KeyTakeOver(ctx, q, db.KeyTakeOverParams{Actor: k.actor, Operation: k.operation,
			IdemKey: k.key, Fingerprint: fp, TtlMicros: c.ttlMicros, LockTimeout: c.lockTimeout})
	default:
		_, _ = queries.KeyClaim(ctx, q, db.KeyClaimParams{Actor: k.actor, Operation: k.operation,
			IdemKey: k.key, Fingerprint: fp, TtlMicros: c.ttlMicros, LockTimeout: c.lockTimeout})
	}
}

// readClaim reads the results of what queueClaim queued: whether the key is
// now claimed by this transaction. (All four claims return the same single
// column.)
func readClaim(br pgx.BatchResults, citus bool) (claimed bool, err error) {
	if citus {
		if _, err = br.Exec(); err != nil {
			return false, err
		}
	}
	claimed, err = queries.KeyClaim(context.Background(), batchRead{br}, db.KeyClaimParams{})
	if errors.Is(err, pgx.ErrNoRows) {
		claimed, err = false, nil
	}
	if err == nil && citus {
		_, err = br.Exec()
	}
	return claimed, err
}

// claimError turns the failure of a claim round trip into the error a
// call returns: a wait for a twin that ran out is ErrInProgress.
func (c *Client) claimError(err error, k rowKey) error {
	if pgCode(err) == pgerrcode.LockNotAvailable {
		return c.inProgressOn(k)
	}
	return fmt.Errorf("idem: claim: %w", unsupportedIf(err))
}

// queueRead queues the read of the committed row that holds k, preceded by
// the planner setting that makes it an index lookup; end (a statement
// without arguments) follows it and must undo that setting: the end of the
// savepoint or of the transaction.
func queueRead(b *pgx.Batch, k rowKey) {
	b.Queue(sqlIndexLookup)
	_, _ = queries.KeyGet(context.Background(), queuer{b},
		db.KeyGetParams{Actor: k.actor, Operation: k.operation, IdemKey: k.key})
}

// readRow reads the results of what queueRead queued. found is false when
// no row holds the key any more.
func readRow(br pgx.BatchResults) (row keyRow, found bool, err error) {
	if _, err = br.Exec(); err != nil {
		return row, false, err
	}
	row, err = queries.KeyGet(context.Background(), batchRead{br}, db.KeyGetParams{})
	if errors.Is(err, pgx.ErrNoRows) {
		return row, false, nil
	}
	if err == nil && len(row.Fingerprint) != len(Fingerprint{}) {
		err = fmt.Errorf("stored fingerprint has %d bytes", len(row.Fingerprint))
	}
	return row, err == nil, err
}

// keyRow is the committed row that holds a key, as KeyGet reads it.
type keyRow = db.KeyGetRow

// next is what a call does after reading the row that holds its key.
type next int

const (
	nextDone     next = iota // return the result or the error
	nextClaim                // the row is gone: claim the key afresh
	nextTakeOver             // the row is over: take it over
)

// judge tells what the committed row that holds a key means for a call with
// fingerprint fp: a replay, an error, or another claim. Every state of the
// key is decided here, for Do and DoInTx alike.
func (c *Client) judge(row keyRow, found bool, fp Fingerprint, k rowKey) (Result, next, error) {
	status := Status(row.Status)
	switch {
	case !found:
		return Result{}, nextClaim, nil
	case status.finished() && row.Expired:
		return Result{}, nextTakeOver, nil // an expired key is a new request
	case [32]byte(row.Fingerprint) != fp:
		return Result{}, nextDone, ErrKeyReused
	case status == StatusSucceeded || status == StatusRejected:
		res, err := replay(row)
		return res, nextDone, err
	case status == StatusFailedRetryable:
		return Result{}, nextTakeOver, nil // certainly not executed: it may run
	case status == StatusUnknown:
		return Result{}, nextDone, ErrOutcomeUnknown
	case status == StatusProcessing && row.Leased && row.LeaseLeftMs <= 0:
		return Result{}, nextDone, ErrOutcomeUnknown // the owner's lease ran out
	case status == StatusProcessing && row.Leased:
		left := time.Duration(row.LeaseLeftMs) * time.Millisecond
		return Result{}, nextDone, &InProgressError{RetryAfter: min(max(left.Round(time.Second), time.Second), maxRetryAfter)}
	default:
		return Result{}, nextDone, c.inProgressOn(k)
	}
}

// queueComplete queues the statement that stores the outcome of a claimed
// key.
func (c *Client) queueComplete(b *pgx.Batch, k rowKey, fp []byte, out outcome) {
	body := out.resp.Body
	if body == nil {
		body = []byte{}
	}
	_, _ = queries.KeyComplete(context.Background(), queuer{b}, db.KeyCompleteParams{
		Actor: k.actor, Operation: k.operation, IdemKey: k.key, Fingerprint: fp,
		Status: string(out.status), TtlMicros: c.ttlMicros, ResponseStatus: int32(out.resp.Status),
		ResponseHeaders: out.headers, ResponseBody: body,
	})
}

// readComplete reads the result of what queueComplete queued.
func readComplete(br pgx.BatchResults) error {
	n, err := queries.KeyComplete(context.Background(), batchRead{br}, db.KeyCompleteParams{})
	if err == nil && n != 1 {
		err = errors.New("the claimed row changed under fn")
	}
	if err != nil {
		return fmt.Errorf("idem: store response: %w", unsupportedIf(err))
	}
	return nil
}

// outcome is what a claimed key ends with: fn's response, or a refusal.
type outcome struct {
	status  Status // StatusSucceeded or StatusRejected
	resp    Response
	headers pgtype.Text // resp.Header as stored
}

// decide checks fn's result and turns it into the outcome to store. A
// rejection is a valid outcome; any other error of fn is returned as is.
func (c *Client) decide(resp Response, fnErr error) (outcome, error) {
	out := outcome{status: StatusSucceeded, resp: resp}
	if fnErr != nil {
		refusal, rejected := RejectedResponse(fnErr)
		if !rejected {
			return outcome{}, fnErr
		}
		out = outcome{status: StatusRejected, resp: refusal}
	}
	headers, err := c.encodeResponse(out.resp)
	if err != nil {
		return outcome{}, err
	}
	out.headers = headers
	return out, nil
}

// result is what a call that stored out returns.
func (out outcome) result() Result {
	res := Result{Response: out.resp}
	if res.Body == nil {
		res.Body = []byte{} // as a replay of it reads back
	}
	return res
}

// closeBatch closes br and returns err, or the error of closing when err is
// nil: the first error of the batch.
func closeBatch(br pgx.BatchResults, err error) error {
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	return err
}

// cleanupTimeout bounds the statements that undo a call's work, which run
// even when the caller's context is done.
const cleanupTimeout = 5 * time.Second

// cleanupContext is ctx without its cancellation, bounded by cleanupTimeout.
func cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
}
