package idem

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/db"
)

// Scope is the namespace of a key: (Actor, Operation, key) is unique. The same
// key under another actor or operation is an independent request, and a
// stored response is never replayed across scopes.
type Scope struct {
	// Actor is the authenticated tenant or user. Take it from authentication,
	// never from the request body.
	Actor string
	// Operation separates kinds of request, such as "draw" or
	// "payment.create".
	Operation string
}

// Response is the outcome of a request as it is stored and replayed.
type Response struct {
	Status int                 // replayed as stored (200, 201, 402, ...; 0 or 100..999)
	Header map[string][]string // optional, replayed as stored
	Body   []byte              // replayed byte for byte
}

// Result is what Do returns: the response, and whether it was replayed.
type Result struct {
	Response
	// Replayed is true when fn did not run and Response is the stored outcome
	// of an earlier call with the same key.
	Replayed bool
}

// Do runs fn at most once per key: it claims (scope, key) in tx, runs fn in
// tx, and stores fn's Response in tx. Everything commits or rolls back with
// tx; Do itself never commits or rolls back the caller's transaction. The
// claim and fn run in a savepoint of tx that Do ends before it returns.
//
//   - First call: fn runs once, its Response is stored and returned with
//     Replayed false.
//   - A later call with the same scope, key and fingerprint, after the first
//     committed: fn does not run; the stored Response comes back exactly
//     (status, headers, body bytes) with Replayed true.
//   - The same scope and key with a different fingerprint: ErrKeyReused; fn
//     does not run.
//   - Concurrent calls with the same key: the primary key lets one claim win.
//     The others wait up to Config.Wait for the winner's transaction: if it
//     commits they replay its outcome, if it rolls back one of them runs fn,
//     and if the wait runs out they get ErrInProgress (an *InProgressError).
//   - fn returns Reject(resp): fn's writes are undone, resp is stored as the
//     final outcome of the key and returned with a nil error, so the caller
//     commits. Retries replay the refusal. (Undoing fn's writes gives the
//     key up for a moment: should a concurrent twin claim it then and run,
//     its outcome is the key's and Do returns it as a replay.)
//   - fn returns any other error, or panics: fn's writes and the claim are
//     undone, nothing is stored, and the error (or panic) is passed on. The
//     key is free again. This undo runs even when ctx is done (bounded by 5
//     seconds), so a transaction the caller commits anyway holds nothing of
//     fn's.
//   - A key past its TTL counts as a new request.
//   - A key held by a reservation (Reserve): ErrInProgress while its lease
//     lasts, ErrOutcomeUnknown once the lease ran out or its outcome is
//     unknown; a reservation that failed retryably runs as a new attempt.
//
// Invalid input (key, scope, nil tx or fn) is refused before any statement
// runs. A Response that cannot be stored (too large, bad status, header that
// is not valid text) undoes fn's writes and the claim, and returns
// ErrResponseTooLarge or ErrInvalidResponse.
//
// When Do returns ErrInProgress, ErrKeyReused, ErrOutcomeUnknown or a
// replay, tx is as it was before the call. After a serialization failure
// (SQLSTATE 40001, under REPEATABLE READ or SERIALIZABLE) or a deadlock the
// whole transaction must be run again (InTx and DoInTx do so); after a lost
// connection it is gone. Either way the retry replays or runs.
//
// Each Do uses a subtransaction; keep the number of Do calls in one
// transaction well under 64, PostgreSQL's per-backend subtransaction cache.
//
// Do uses the package defaults; see Config and New for the configurable form.
func Do(ctx context.Context, tx pgx.Tx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	return defaultClient.Do(ctx, tx, scope, key, fp, fn)
}

// Do is the package-level Do with this client's configuration.
func (c *Client) Do(ctx context.Context, tx pgx.Tx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	if err := c.checkCall(scope, key, fn); err != nil {
		return Result{}, err
	}
	if isNil(tx) {
		return Result{}, fmt.Errorf("%w: nil transaction", ErrInvalidArgument)
	}
	ctx, cl := c.obs.begin(ctx, "do", "idem.Do", scope, key)
	defer cl.endIfPanicking(ctx)
	res, err := c.do(ctx, tx, newRowKey(scope, key), fp, fn, &cl)
	err = preparedStatementsLost(err)
	cl.end(ctx, res, err)
	return res, err
}

// do is Do after its checks, observed by cl: the call loop in a savepoint
// of the caller's transaction.
func (c *Client) do(ctx context.Context, tx pgx.Tx, k rowKey, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error), cl *call) (Result, error) {
	return c.call(ctx, &span{tx: tx}, k, fp, fn, cl)
}

// call is the one loop of Do and DoInTx: claim the key, run fn, store the
// outcome. s says where that happens (Do's savepoint in the caller's
// transaction, or a transaction of DoInTx's own) and how it begins and ends;
// everything else is the same for both.
//
//  1. One round trip: the savepoint (or BEGIN) and the claim, waiting at
//     most Config.Wait for a twin.
//  2. fn runs in the savepoint (or transaction).
//  3. One round trip: the outcome is stored and the savepoint released (or
//     the transaction committed).
//
// When a committed row already holds the key, step 1 claims nothing and a
// second round trip reads the row and ends the savepoint (or transaction),
// which also undoes the read's planner setting and the claim's lock_timeout;
// then the call replays, fails, or claims again (judge). When fn fails, its
// writes and the claim are undone; a refusal (Reject) is then stored by a
// claim of its own that runs nothing.
func (c *Client) call(ctx context.Context, s *span, k rowKey, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error), cl *call) (Result, error) {
	var decided outcome // a refusal, stored once the key is claimed again (none: status "")
	takeOver := false
	// Citus bounds the claim's wait otherwise (see queueClaim); asked once
	// per Client and database.
	citus, err := c.isCitus(ctx, s.connection())
	if err != nil {
		err = unavailableIf(isUnavailable(err), fmt.Errorf("idem: claim: %w", err))
		if s.conn == nil {
			err = txUnusable(err) // Do on a closed or aborted transaction
		}
		return Result{}, err
	}
	s.fp = fp
	fpBytes := s.fp[:]
	b := &s.batch
	b.QueuedQueries = s.queue[:0]
	for range maxClaimAttempts {
		// Round trip 1: begin, and claim.
		reset(b)
		br := s.begin(ctx, b, func() { c.queueClaim(b, k, fpBytes, takeOver, citus) })
		_, err := br.Exec()
		if err != nil { // not begun: nothing to undo
			return Result{}, s.notBegun(ctx, c.claimError(closeBatch(br, err), k))
		}
		claimed, err := readClaim(br, citus)
		if err = closeBatch(br, err); err != nil {
			return Result{}, s.fail(ctx, c.claimError(err, k))
		}

		if claimed {
			out := decided
			if out.status == "" {
				out, err = c.runFn(ctx, s, fn, cl)
				if err != nil {
					return Result{}, s.failFn(ctx, err)
				}
				if out.status == StatusRejected {
					// Undo fn's writes (and the claim), then store the
					// refusal in a claim of its own.
					if err := s.undo(ctx); err != nil {
						return Result{}, err
					}
					decided = out
					continue
				}
			}
			cl.rejected = out.status == StatusRejected
			// Round trip 2: store the outcome, and end.
			reset(b)
			c.queueComplete(b, k, fpBytes, out)
			s.queueEnd(b)
			br := s.tx.SendBatch(ctx, b)
			err := readComplete(br)
			if err == nil {
				err = s.ended(br)
			}
			if err = closeBatch(br, err); err != nil {
				return Result{}, s.fail(ctx, err)
			}
			return out.result(), nil
		}

		// Round trip 2: read the row that holds the key, and end: that
		// undoes the read's planner setting and the claim's lock_timeout.
		reset(b)
		queueRead(b, k)
		s.queueLeave(b)
		br = s.tx.SendBatch(ctx, b)
		row, found, err := readRow(br)
		if err == nil {
			err = s.left(br)
		}
		if err = closeBatch(br, err); err != nil {
			return Result{}, s.fail(ctx, fmt.Errorf("idem: read key: %w", err))
		}
		res, then, err := c.judge(row, found, fp, k)
		if then == nextDone {
			return res, err
		}
		takeOver = then == nextTakeOver
	}
	return Result{}, c.inProgressOn(k)
}

// span is where one call claims its key, runs fn and stores the outcome:
// Do's savepoint in the caller's transaction (conn nil), or DoInTx's own
// transactions on conn, one per round of call's loop, each begun with
// txOptions by the claim's batch.
type span struct {
	tx        pgx.Tx // Do: the caller's; DoInTx: the current own transaction
	conn      *pgx.Conn
	txOptions pgx.TxOptions
	// The batch of every round trip in turn, with room for the longest,
	// and the fingerprint the statements take: kept here, a call allocates
	// them with the span, once.
	batch pgx.Batch
	queue [4]*pgx.QueuedQuery
	fp    Fingerprint
}

// connection is the connection the span runs on.
func (s *span) connection() *pgx.Conn {
	if s.conn != nil {
		return s.conn
	}
	return s.tx.Conn()
}

// begin queues the savepoint (or BEGIN) in b, then what queue queues, and
// sends b.
func (s *span) begin(ctx context.Context, b *pgx.Batch, queue func()) pgx.BatchResults {
	if s.conn == nil {
		b.Queue(sqlSavepoint)
		queue()
		return s.tx.SendBatch(ctx, b)
	}
	b.BeginTx(s.txOptions)
	queue()
	br := s.conn.SendBatch(ctx, b)
	s.tx = br.Tx()
	return br
}

// queueEnd queues the end of a span that keeps its writes: RELEASE (or
// COMMIT).
func (s *span) queueEnd(b *pgx.Batch) {
	if s.conn == nil {
		b.Queue(sqlRelease)
		return
	}
	b.Queue("COMMIT")
}

// ended reads the result of what queueEnd queued.
func (s *span) ended(br pgx.BatchResults) error {
	if s.conn == nil {
		_, err := br.Exec()
		return err
	}
	return commitResult(br.Exec())
}

// queueLeave queues the end of a span that wrote nothing and keeps none of
// its settings: ROLLBACK TO and RELEASE (or COMMIT).
func (s *span) queueLeave(b *pgx.Batch) {
	if s.conn == nil {
		b.Queue(sqlRollbackTo)
		b.Queue(sqlRelease)
		return
	}
	b.Queue("COMMIT")
}

// left reads the results of what queueLeave queued.
func (s *span) left(br pgx.BatchResults) error {
	if s.conn == nil {
		_, err := br.Exec()
		if err == nil {
			_, err = br.Exec()
		}
		return err
	}
	return commitResult(br.Exec())
}

// undo undoes the span: the claim and fn's writes are gone, and so are the
// settings made in it. It runs even when ctx is done.
func (s *span) undo(ctx context.Context) error {
	if s.conn == nil {
		return undo(ctx, s.tx)
	}
	rollback(ctx, s.tx)
	return nil
}

// notBegun returns the error of a span that failed to begin; a transaction
// that did begin (the error came later in the batch) is rolled back.
func (s *span) notBegun(ctx context.Context, err error) error {
	if s.conn == nil { // Do: the savepoint did not begin in the caller's transaction
		return txUnusable(err)
	}
	return s.fail(ctx, err)
}

// fail undoes the span after a statement of the call failed with err, and
// returns err: for DoInTx, an ErrUnavailable when the connection was lost
// or the server cannot serve.
func (s *span) fail(ctx context.Context, err error) error {
	if s.conn == nil {
		return undone(ctx, s.tx, err)
	}
	rollback(ctx, s.tx)
	return unavailableIf(connLost(s.conn) || isUnavailable(err), err)
}

// failFn undoes the span after fn failed with err (or its response cannot
// be stored), and returns err: for DoInTx, an ErrUnavailable when the
// connection was lost or the server said it cannot serve.
func (s *span) failFn(ctx context.Context, err error) error {
	if s.conn == nil {
		return undone(ctx, s.tx, err)
	}
	rollback(ctx, s.tx)
	return unavailableIf(connLost(s.conn) || serverSaidUnavailable(err), err)
}

// runFn runs fn in the span and decides the outcome to store. If fn panics,
// its writes and the claim are undone before the panic goes on.
func (c *Client) runFn(ctx context.Context, s *span,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error), cl *call) (outcome, error) {
	panicked := true
	defer func() {
		if panicked {
			_ = s.undo(ctx)
		}
	}()
	var resp Response
	var err error
	cl.timeFn(func() { resp, err = fn(ctx, s.tx) })
	panicked = false
	return c.decide(resp, err)
}

// undone undoes Do's savepoint and returns err, joined with the error of the
// undo if that failed too.
func undone(ctx context.Context, tx pgx.Tx, err error) error {
	if undoErr := undo(ctx, tx); undoErr != nil {
		return errors.Join(err, undoErr)
	}
	return err
}

// undo rolls the caller's transaction back to Do's savepoint and drops it:
// the claim and fn's writes are gone and the key is free again. It runs even
// when ctx is done.
func undo(ctx context.Context, tx pgx.Tx) error {
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	if _, err := tx.Exec(ctx, sqlUndo); err != nil {
		return fmt.Errorf("idem: undo: %w", err)
	}
	return nil
}

func (c *Client) inProgress() error {
	return &InProgressError{RetryAfter: c.retryAfter}
}

// inProgressOn is inProgress for the claim of k, which a twin holds.
func (c *Client) inProgressOn(k rowKey) error {
	e := &InProgressError{RetryAfter: c.retryAfter}
	e.held.actor, e.held.operation, e.held.key = k.actor, k.operation, k.key
	return e
}

var queries = db.New()
