package idem

import (
	"context"
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

// Status values of a key row.
const (
	statusProcessing = "processing"
	statusSucceeded  = "succeeded"
	statusRejected   = "rejected"
)

// maxClaimAttempts bounds the rounds of claim, look up and take over when
// rows keep changing under Do (expired rows taken over or pruned by others).
const maxClaimAttempts = 4

// Do runs fn at most once per key: it claims (scope, key) in tx, runs fn in
// tx, and stores fn's Response in tx. Everything commits or rolls back with
// tx; Do itself never commits or rolls back the caller's transaction.
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
//   - fn returns Reject(resp): fn's writes are undone (fn runs in a
//     savepoint), resp is stored as the final outcome and returned with a nil
//     error, so the caller commits. Retries replay the refusal.
//   - fn returns any other error, or panics: fn's writes are undone, the
//     claim is given up, nothing is stored, and the error (or panic) is
//     passed on. The transaction stays usable; the key is free again once it
//     ends. This undo runs even when ctx is done (bounded by 5 seconds), so
//     a transaction the caller commits anyway holds nothing of fn's.
//   - A key past its TTL counts as a new request.
//
// Invalid input (key, scope, nil tx or fn) is refused before any statement
// runs. A Response that cannot be stored (too large, bad status, header that
// is not valid text) undoes fn's writes and the claim, and returns
// ErrResponseTooLarge or ErrInvalidResponse.
//
// When the claim itself fails — ErrInProgress because the wait ran out, a
// serialization failure (SQLSTATE 40001) under REPEATABLE READ or
// SERIALIZABLE, a lost connection — tx is aborted and must be rolled back;
// run the transaction again (InTx and DoInTx do so for 40001 and 40P01) and
// the retry replays or runs. After any other outcome tx stays usable.
//
// fn runs in a savepoint, so a Do whose fn writes uses a subtransaction; keep
// the number of Do calls in one transaction well under 64, PostgreSQL's
// per-backend subtransaction cache.
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
	k := newRowKey(scope, key)
	takeOver := false
	for range maxClaimAttempts {
		claimed, row, found, err := c.claim(ctx, tx, k, fp, takeOver)
		switch {
		case err != nil:
			return Result{}, err
		case claimed:
			return c.run(ctx, tx, k, fn)
		case !found:
			takeOver = false // the row is gone (pruned): claim afresh
			reopen(tx)
		case row.Expired:
			takeOver = true // an expired key is a new request
			reopen(tx)
		case [32]byte(row.Fingerprint) != fp:
			return Result{}, ErrKeyReused
		case row.Status == statusSucceeded || row.Status == statusRejected:
			return replay(row)
		default:
			return Result{}, c.inProgressOn(k)
		}
	}
	return Result{}, c.inProgressOn(k)
}

// run executes fn for a claimed key and stores its outcome.
func (c *Client) run(ctx context.Context, tx pgx.Tx, k *rowKey,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	panicked := true
	defer func() {
		if panicked {
			// Undo fn's writes and give up the claim, then pass the panic on.
			_ = undo(ctx, tx, k)
		}
	}()
	resp, fnErr := callFn(ctx, tx, fn)
	panicked = false

	status := statusSucceeded
	if fnErr != nil {
		refusal, rejected := RejectedResponse(fnErr)
		if !rejected {
			return Result{}, withUndo(ctx, tx, k, fnErr)
		}
		status, resp = statusRejected, refusal
	}
	headers, err := c.encodeResponse(resp)
	if err != nil {
		return Result{}, withUndo(ctx, tx, k, err)
	}
	if status == statusRejected {
		if err := undoRejected(ctx, tx); err != nil {
			return Result{}, withUndo(ctx, tx, k, err)
		}
	}
	if err := complete(ctx, tx, k, status, resp, headers); err != nil {
		return Result{}, withUndo(ctx, tx, k, err)
	}
	if resp.Body == nil {
		resp.Body = []byte{} // as a replay of it reads back
	}
	return Result{Response: resp}, nil
}

// callFn runs fn. While it runs, DoInTx's transaction is not the own
// transaction of a Do nested in fn: that one must release its savepoint,
// not commit what the outer Do has not finished.
func callFn(ctx context.Context, tx pgx.Tx, fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Response, error) {
	if pt, ok := tx.(*pipeTx); ok {
		pt.fnDepth++
		defer func() { pt.fnDepth-- }()
	}
	return fn(ctx, tx)
}

func (c *Client) inProgress() error {
	return &InProgressError{RetryAfter: c.retryAfter}
}

// inProgressOn is inProgress for the claim of k, which a twin holds.
func (c *Client) inProgressOn(k *rowKey) error {
	e := &InProgressError{RetryAfter: c.retryAfter}
	e.held.actor, e.held.operation, e.held.key = k.actor, k.operation, k.key
	return e
}

var queries = db.New()
