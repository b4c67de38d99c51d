package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

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
	Status int                 // replayed as stored (200, 201, 402, ...)
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

// Savepoint names. Do releases or rolls back both before it returns, so
// nested and sequential calls in one transaction do not interfere.
const (
	savepointClaim = "idem_claim"
	savepointFn    = "idem_fn"
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
//   - fn returns any other error, or panics: fn's writes and the claim are
//     undone, nothing is stored, and the error (or panic) is passed on. The
//     transaction stays usable; the key is free again.
//   - A key past its TTL counts as a new request.
//
// Invalid input (key, scope, nil tx or fn) is refused before any statement
// runs. A Response that cannot be stored (too large, bad status, header that
// is not valid text) undoes fn's writes and the claim, and returns
// ErrResponseTooLarge or ErrInvalidResponse.
//
// Under REPEATABLE READ or SERIALIZABLE a concurrent duplicate can end in a
// serialization failure (SQLSTATE 40001); run the transaction again (InTx and
// DoInTx do) and the retry replays.
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
	if tx == nil {
		return Result{}, fmt.Errorf("%w: nil transaction", ErrInvalidArgument)
	}
	k := rowKey{actor: scope.Actor, operation: scope.Operation, key: key}
	takeOver := false
	for range maxClaimAttempts {
		claimed, row, found, err := c.claim(ctx, tx, k, fp, takeOver)
		if err != nil {
			return Result{}, err
		}
		if claimed {
			return c.run(ctx, tx, k, fn)
		}
		var res Result
		switch {
		case !found:
			takeOver = false // the row is gone (pruned): claim afresh
			err = errRetryClaim
		case row.Expired:
			takeOver = true // an expired key is a new request
			err = errRetryClaim
		case [32]byte(row.Fingerprint) != fp:
			err = ErrKeyReused
		case row.Status == statusSucceeded || row.Status == statusRejected:
			res, err = replay(row)
		default:
			err = c.inProgress()
		}
		// The outcome is final unless the claim is retried: then DoInTx's
		// transaction can end in the same round trip.
		if relErr := releaseClaim(ctx, tx, err != errRetryClaim); relErr != nil {
			return Result{}, relErr
		}
		if err != errRetryClaim {
			return res, err
		}
	}
	return Result{}, c.inProgress()
}

// errRetryClaim marks a lookup after which Do claims again.
var errRetryClaim = errors.New("idem: claim again")

// rowKey is the primary key of a key row.
type rowKey struct{ actor, operation, key string }

// claim inserts a 'processing' row for k (or, with takeOver, takes over an
// expired one) inside a new savepoint, waiting at most Config.Wait for a
// concurrent claim of the same key, and reads the row that holds the key, all
// in one round trip. When claimed, the savepoint stays open with a second
// savepoint for fn inside it. When not, row is the committed row holding the
// key (found false if there is none) and the caller releases the savepoint.
func (c *Client) claim(ctx context.Context, tx pgx.Tx, k rowKey, fp Fingerprint, takeOver bool) (
	claimed bool, row db.KeyGetAfterClaimRow, found bool, err error) {
	b := &pgx.Batch{}
	q := queuer{b}
	b.Queue("SAVEPOINT " + savepointClaim)
	if takeOver {
		_, _ = queries.KeyTakeOver(ctx, q, db.KeyTakeOverParams{
			Fingerprint: fp[:], TtlMicros: c.ttlMicros, LockTimeout: c.lockTimeout,
			Actor: k.actor, Operation: k.operation, IdemKey: k.key,
		})
	} else {
		_, _ = queries.KeyClaim(ctx, q, db.KeyClaimParams{
			Actor: k.actor, Operation: k.operation, IdemKey: k.key,
			Fingerprint: fp[:], TtlMicros: c.ttlMicros, LockTimeout: c.lockTimeout,
		})
	}
	// Read in a statement of its own, after the claim: under READ COMMITTED
	// it sees a twin that committed while the claim waited. It also puts
	// lock_timeout back, before fn's savepoint, so that undoing fn's writes
	// does not undo that.
	_, _ = queries.KeyGetAfterClaim(ctx, q, db.KeyGetAfterClaimParams{Actor: k.actor, Operation: k.operation, IdemKey: k.key})
	b.Queue("SAVEPOINT " + savepointFn)

	br := tx.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return false, row, false, fmt.Errorf("idem: claim: %w", err)
	}
	var expires pgtype.Timestamptz
	err = br.QueryRow().Scan(&expires)
	claimed = err == nil
	if errors.Is(err, pgx.ErrNoRows) {
		err = nil
	}
	if err == nil {
		err = br.QueryRow().Scan(&row.Found, &row.Fingerprint, &row.Status, &row.ResponseStatus,
			&row.ResponseHeaders, &row.ResponseBody, &row.Expired)
		found = row.Found
	}
	if err == nil {
		_, err = br.Exec()
	}
	err = closeBatch(br, err)
	if err == nil && found && len(row.Fingerprint) != len(Fingerprint{}) {
		err = fmt.Errorf("stored fingerprint has %d bytes", len(row.Fingerprint))
	}
	if err != nil {
		rbErr := rollbackSavepoint(ctx, tx)
		if pgCode(err) == pgerrcode.LockNotAvailable && rbErr == nil {
			return false, row, false, c.inProgress()
		}
		return false, row, false, errors.Join(fmt.Errorf("idem: claim: %w", err), rbErr)
	}
	return claimed, row, found, nil
}

// releaseClaim releases the claim savepoint after a claim that did not win.
// With final set, a transaction of DoInTx's own is committed in the same
// round trip: the claim wrote nothing, so there is nothing else to run.
func releaseClaim(ctx context.Context, tx pgx.Tx, final bool) error {
	b := &pgx.Batch{}
	b.Queue("RELEASE SAVEPOINT " + savepointClaim)
	own := ownTx(tx, final)
	if own != nil {
		b.Queue("COMMIT")
	}
	br := tx.SendBatch(ctx, b)
	_, err := br.Exec()
	if err == nil && own != nil {
		err = own.commitResult(br.Exec())
	}
	err = closeBatch(br, err)
	if err != nil {
		return fmt.Errorf("idem: release claim: %w", err)
	}
	return nil
}

// run executes fn for a claimed key and stores its outcome.
func (c *Client) run(ctx context.Context, tx pgx.Tx, k rowKey,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (res Result, err error) {
	done := false
	defer func() {
		if !done {
			// fn panicked: undo fn's writes and the claim, then pass it on.
			_ = rollbackSavepoint(ctx, tx)
		}
	}()
	resp, fnErr := fn(ctx, tx)
	done = true

	status := statusSucceeded
	if fnErr != nil {
		refusal, rejected := RejectedResponse(fnErr)
		if !rejected {
			if rbErr := rollbackSavepoint(ctx, tx); rbErr != nil {
				return Result{}, errors.Join(fnErr, rbErr)
			}
			return Result{}, fnErr
		}
		status, resp = statusRejected, refusal
	}
	headers, err := c.encodeResponse(resp)
	if err != nil {
		return Result{}, errors.Join(err, rollbackSavepoint(ctx, tx))
	}
	body := resp.Body
	if body == nil {
		body = []byte{}
	}

	if status == statusRejected {
		// Undo fn's writes. A separate simple-protocol statement, because fn
		// may have left its savepoint aborted by a failed statement.
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepointFn); err != nil {
			return Result{}, errors.Join(fmt.Errorf("idem: undo rejected writes: %w", err), rollbackSavepoint(ctx, tx))
		}
	}
	b := &pgx.Batch{}
	_, _ = queries.KeyComplete(ctx, queuer{b}, db.KeyCompleteParams{
		Status:          status,
		ResponseStatus:  pgtype.Int4{Int32: int32(resp.Status), Valid: true},
		ResponseHeaders: headers,
		ResponseBody:    body,
		Actor:           k.actor, Operation: k.operation, IdemKey: k.key,
	})
	b.Queue("RELEASE SAVEPOINT " + savepointClaim)
	// In DoInTx's own transaction Do is the last thing to run: commit in
	// the same round trip.
	own := ownTx(tx, true)
	if own != nil {
		b.Queue("COMMIT")
	}
	br := tx.SendBatch(ctx, b)
	tag, err := br.Exec()
	if err == nil && tag.RowsAffected() != 1 {
		err = fmt.Errorf("claimed row not found (%d rows)", tag.RowsAffected())
	}
	if err == nil {
		_, err = br.Exec()
	}
	if err == nil && own != nil {
		err = own.commitResult(br.Exec())
	}
	err = closeBatch(br, err)
	if err != nil {
		if own != nil && own.done {
			return Result{}, fmt.Errorf("idem: commit: %w", err)
		}
		return Result{}, errors.Join(fmt.Errorf("idem: store response: %w", err), rollbackSavepoint(ctx, tx))
	}
	return Result{Response: resp}, nil
}

// encodeResponse checks that resp can be stored and replayed exactly, and
// returns its header encoded for the response_headers column (nil when resp
// has no header map).
func (c *Client) encodeResponse(resp Response) ([]byte, error) {
	if resp.Status < 100 || resp.Status > 999 {
		return nil, fmt.Errorf("%w: status %d is not a 3-digit HTTP status", ErrInvalidResponse, resp.Status)
	}
	size := len(resp.Body)
	for name, values := range resp.Header {
		if err := checkHeaderText(name); err != nil {
			return nil, fmt.Errorf("%w: header name %q: %v", ErrInvalidResponse, name, err)
		}
		size += len(name)
		for _, v := range values {
			if err := checkHeaderText(v); err != nil {
				return nil, fmt.Errorf("%w: header %q value %q: %v", ErrInvalidResponse, name, v, err)
			}
			size += len(v)
		}
	}
	if size > c.cfg.MaxResponseBytes {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrResponseTooLarge, size, c.cfg.MaxResponseBytes)
	}
	if resp.Header == nil {
		return nil, nil
	}
	return json.Marshal(resp.Header)
}

// checkHeaderText reports whether s can be stored in a jsonb column and read
// back unchanged.
func checkHeaderText(s string) error {
	if !utf8.ValidString(s) {
		return errors.New("not valid UTF-8")
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return errors.New("holds a NUL byte")
		}
	}
	return nil
}

// replay turns a stored row into a replayed Result.
func replay(row db.KeyGetAfterClaimRow) (Result, error) {
	res := Result{Replayed: true}
	res.Status = int(row.ResponseStatus.Int32)
	res.Body = row.ResponseBody
	if row.ResponseHeaders != nil {
		if err := json.Unmarshal(row.ResponseHeaders, &res.Header); err != nil {
			return Result{}, fmt.Errorf("idem: stored response headers: %w", err)
		}
	}
	return res, nil
}

const rollbackClaimSQL = "ROLLBACK TO SAVEPOINT " + savepointClaim + "; RELEASE SAVEPOINT " + savepointClaim

// closeBatch closes br and returns err, or the error of closing when err is
// nil: the first error of the batch.
func closeBatch(br pgx.BatchResults, err error) error {
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	return err
}

// rollbackSavepoint undoes everything since the claim savepoint (the claim
// and fn's writes) and releases it, leaving the caller's transaction as it
// was before Do.
func rollbackSavepoint(ctx context.Context, tx pgx.Tx) error {
	// One simple-protocol message: an aborted transaction accepts ROLLBACK
	// TO, but would refuse to prepare a statement first, as a batch would.
	if _, err := tx.Exec(ctx, rollbackClaimSQL); err != nil {
		return fmt.Errorf("idem: roll back to savepoint: %w", err)
	}
	return nil
}

func (c *Client) inProgress() error {
	return &InProgressError{RetryAfter: c.retryAfter}
}

// checkCall validates the arguments every entry point shares.
func (c *Client) checkCall(scope Scope, key string, fn func(ctx context.Context, tx pgx.Tx) (Response, error)) error {
	if err := c.ValidateKey(key); err != nil {
		return err
	}
	if err := ValidateScope(scope); err != nil {
		return err
	}
	if fn == nil {
		return fmt.Errorf("%w: nil function", ErrInvalidArgument)
	}
	return nil
}

// MaxScopeLength is the longest Actor or Operation, in bytes.
const MaxScopeLength = 255

// ValidateScope reports whether scope can be used: Actor and Operation must be
// non-empty valid UTF-8 of at most MaxScopeLength bytes without NUL bytes.
// The error wraps ErrInvalidScope.
func ValidateScope(scope Scope) error {
	for _, f := range [...]struct{ name, v string }{{"actor", scope.Actor}, {"operation", scope.Operation}} {
		switch {
		case f.v == "":
			return fmt.Errorf("%w: empty %s", ErrInvalidScope, f.name)
		case len(f.v) > MaxScopeLength:
			return fmt.Errorf("%w: %s is %d bytes, limit %d", ErrInvalidScope, f.name, len(f.v), MaxScopeLength)
		case checkHeaderText(f.v) != nil:
			return fmt.Errorf("%w: %s: %v", ErrInvalidScope, f.name, checkHeaderText(f.v))
		}
	}
	return nil
}

// ValidateKey reports whether key is a valid idempotency key under the
// package defaults: 1 to 255 bytes of visible ASCII (0x21-0x7E), so no
// spaces, control characters or non-ASCII. The error wraps ErrInvalidKey.
func ValidateKey(key string) error { return defaultClient.ValidateKey(key) }

// ValidateKey is the package-level ValidateKey with this client's key length
// bounds.
func (c *Client) ValidateKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty key", ErrInvalidKey)
	case len(key) < c.cfg.MinKeyLength:
		return fmt.Errorf("%w: key is %d bytes, at least %d required", ErrInvalidKey, len(key), c.cfg.MinKeyLength)
	case len(key) > c.cfg.MaxKeyLength:
		return fmt.Errorf("%w: key is %d bytes, limit %d", ErrInvalidKey, len(key), c.cfg.MaxKeyLength)
	}
	for i := 0; i < len(key); i++ {
		if b := key[i]; b < 0x21 || b > 0x7e {
			return fmt.Errorf("%w: byte %d is 0x%02x; keys hold visible ASCII (0x21-0x7E) only", ErrInvalidKey, i, b)
		}
	}
	return nil
}

var queries = db.New()
