package core

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// Errors returned by Do and its relatives. Check them with errors.Is; the
// returned error usually wraps one of these with a more specific message.
var (
	// ErrKeyReused means the key was already used under the same scope for a
	// request with a different fingerprint: a client bug (HTTP 422). fn did not
	// run and nothing changed.
	ErrKeyReused = errors.New("idem: idempotency key reused with a different request")

	// ErrInProgress means another transaction holds the key and did not finish
	// within the configured wait, or a reservation's lease still holds it
	// (HTTP 409 with Retry-After). fn did not run, and the caller's
	// transaction is as it was before Do. The error is an *InProgressError
	// carrying a retry hint.
	ErrInProgress = errors.New("idem: a request with this idempotency key is in progress")

	// ErrInvalidKey means the idempotency key is empty, too long, or holds a
	// character outside visible ASCII (0x21-0x7E). Nothing was touched.
	ErrInvalidKey = errors.New("idem: invalid idempotency key")

	// ErrInvalidScope means the scope's Actor or Operation is empty, too long
	// or not valid text. Nothing was touched.
	ErrInvalidScope = errors.New("idem: invalid scope")

	// ErrInvalidResponse means fn returned a Response that cannot be stored
	// and replayed exactly (a status outside 0 and 100..999, a header name
	// that is not an RFC 9110 token, a header value that is not valid text
	// or holds CR, LF or NUL).
	// fn's writes and the claim were undone; nothing was stored.
	ErrInvalidResponse = errors.New("idem: invalid response")

	// ErrResponseTooLarge means fn returned a Response over the configured
	// size limit. fn's writes and the claim were undone; nothing was stored.
	ErrResponseTooLarge = errors.New("idem: response too large to store")

	// ErrInvalidJSON means FingerprintJSON was given something that is not
	// valid JSON (or could not be marshalled to JSON).
	ErrInvalidJSON = errors.New("idem: invalid JSON")

	// ErrInvalidConfig means a Config field is out of range.
	ErrInvalidConfig = errors.New("idem: invalid config")

	// ErrUnavailable means the database could not be reached, or dropped
	// the connection before the transaction's outcome was known. Fail closed
	// (HTTP 503) and let the client retry with the same key: the retry
	// replays if the first attempt did commit, and runs otherwise. InTx and
	// DoInTx wrap such failures with it; the underlying error stays in the
	// chain.
	ErrUnavailable = errors.New("idem: store unavailable")

	// ErrInvalidArgument means a required argument (transaction, function,
	// database handle) is nil, or a value such as a lease, a window
	// (ReserveOptions), a limit or a ListUnknown cursor is out of range, or
	// the caller's transaction given to Do or Complete (or to DoInTx or
	// InTx as the handle) is closed or aborted: nothing was touched. Do and
	// DoInTx also return it when fn committed or rolled back the
	// transaction it runs in, which fn must leave to them: the error says
	// which, and what became of fn's writes (see DoInTx).
	ErrInvalidArgument = errors.New("idem: invalid argument")

	// ErrOutcomeUnknown means the key belongs to a reservation whose work
	// outside the database may or may not have happened: its owner marked it
	// unknown, or its lease ran out before it completed. Nothing runs again
	// automatically; reconcile it (Resolve) first (HTTP 409). (Inside the
	// window of a key reserved with ReserveOptions.ResumeWithin, Reserve
	// resumes such an attempt instead; Do still answers ErrOutcomeUnknown.)
	// It is also what idem's clients (idemhttp.Transport, the gRPC and
	// Connect client interceptors) return, as an *idem.CallError, for an
	// outgoing call that got no answer after an attempt that may have
	// reached the receiver.
	ErrOutcomeUnknown = errors.New("idem: the outcome of the request with this idempotency key is unknown")

	// ErrResponseGone means the key holds a finished outcome whose
	// response body was dropped (Config.BodyTTL) while the key is still
	// remembered: the operation happened and nothing ran again, but its
	// response cannot be replayed. The Result carries the stored Status
	// (Replayed true, no body or header). HTTP 410
	// IDEMPOTENCY_RESPONSE_EXPIRED in idemhttp.
	ErrResponseGone = errors.New("idem: the stored response of this idempotency key is gone")

	// ErrNotFound means no record holds the key (it was never used, it was
	// pruned or forgotten). Nothing changed.
	ErrNotFound = errors.New("idem: no record for this idempotency key")

	// ErrFenced means a Reservation is no longer the owner of its key: its
	// token is stale, or the record is no longer this reservation's
	// 'processing' (the lease ran out and the key was taken over, or an
	// operator resolved it). Whatever the caller was about to record must be
	// rolled back.
	ErrFenced = errors.New("idem: reservation fenced: no longer the owner of the key")

	// ErrKeyRowChanged means fn changed or deleted idem's own row of the key
	// it ran under (the idem_keys row: its status, fingerprint, token, lease
	// or expiry), so the outcome could not be stored. The call failed as a
	// whole: fn's writes and the claim were undone (DoInTx rolled its
	// transaction back; Do rolled back to its savepoint, and the caller's
	// transaction stays usable), nothing was stored, and the key is free: a
	// retry runs fn again. fn must not write idem_keys; this is a bug in fn,
	// not in the request (HTTP 500).
	ErrKeyRowChanged = errors.New("idem: fn changed or deleted the idem_keys row of its own key; nothing was stored")

	// ErrTxAborted means fn returned a response although one of its
	// statements had failed and aborted its transaction (SQLSTATE 25P02
	// when the outcome was stored): nothing was stored.
	ErrTxAborted = errors.New("idem: fn's transaction was aborted by a statement it did not report; nothing was stored")

	// ErrPreparedStatements means the server lost or mixed up pgx's cached
	// prepared statements (SQLSTATE 26000 or 42P05 on a statement named
	// stmtcache_…): the connection goes through a transaction pooler, such
	// as PgBouncer in transaction mode, that hands each transaction another
	// server connection and does not carry prepared statements across. The
	// fix is a configuration: give the pool a DefaultQueryExecMode that does
	// not prepare named statements (pgx.QueryExecModeExec,
	// QueryExecModeCacheDescribe or QueryExecModeSimpleProtocol), or run
	// PgBouncer 1.21 or newer with max_prepared_statements > 0. Nothing was
	// stored (HTTP 500).
	ErrPreparedStatements = errors.New("idem: prepared statements lost behind a connection pooler")

	// ErrNotResolvable means Resolve was asked to reconcile a record whose
	// outcome is not in doubt: a live lease still holds it, or it is finished
	// (succeeded, rejected, failed_retryable). Nothing changed.
	ErrNotResolvable = errors.New("idem: the record with this idempotency key is not awaiting reconciliation")

	// ErrUnsupported means the database refused one of idem's statements as a
	// feature it does not support (SQLSTATE 0A000, as Citus answers statements
	// it cannot distribute), or the database is not set up the way the call
	// needs: Distribute on a database without the citus extension, or a
	// connection to a Citus worker instead of the coordinator. Nothing was
	// stored. It is a deployment error, not a request's (HTTP 500).
	ErrUnsupported = errors.New("idem: not supported by this database")

	// ErrStoredValue means a stored outcome does not decode into the type asked
	// for: the type changed since the outcome was stored (a field that was a
	// string is now a number), or the scope's operation was also used with Do
	// and holds bytes that are not the JSON of a T. Nothing ran and nothing
	// changed; the error wraps the encoding/json error.
	ErrStoredValue = errors.New("idem: stored value does not decode into the requested type")
)

// errorf is fmt.Errorf for idem's own errors: format begins with "idem: ",
// and the errors it wraps are written without theirs, so that a message
// names idem once however deep the chain ("idem: heartbeat: store
// unavailable: commit: conn closed"). errors.Is and errors.As see through.
func errorf(format string, args ...any) error {
	for i, a := range args {
		if err, ok := a.(error); ok && err != nil {
			args[i] = quiet{err}
		}
	}
	return fmt.Errorf(format, args...)
}

// quiet is err written without its leading "idem: ".
type quiet struct{ err error }

func (q quiet) Error() string { return strings.TrimPrefix(q.err.Error(), "idem: ") }
func (q quiet) Unwrap() error { return q.err }

// InProgressError is returned when the key is held by a transaction that did
// not finish within the wait. errors.Is(err, ErrInProgress) reports true.
type InProgressError struct {
	// RetryAfter is a hint for how long the client should wait before it
	// retries (the HTTP Retry-After header).
	RetryAfter time.Duration

	// held names the key whose claim waited in vain, when known (its Key
	// is "" when not).
	held driver.Key
}

func (e *InProgressError) Error() string {
	return fmt.Sprintf("%s (retry after %s)", ErrInProgress.Error(), e.RetryAfter)
}

// Is makes errors.Is(err, ErrInProgress) true.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// rejection is the error fn returns through Reject.
type rejection struct{ resp Response }

func (r *rejection) Error() string {
	return fmt.Sprintf("idem: request rejected with status %d", r.resp.Status)
}

// RejectedResponse reports whether err is (or wraps) a refusal made with
// Reject, and returns the refusal's response.
func RejectedResponse(err error) (Response, bool) {
	var rej *rejection
	if errors.As(err, &rej) {
		return rej.resp, true
	}
	return Response{}, false
}

// Reject is returned by fn to refuse a request deterministically (see
// idem.Reject).
func Reject(resp Response) error { return &rejection{resp: resp} }

// ctxError is ctx's error, joined by its cause when it was given one
// (context.WithCancelCause, WithDeadlineCause): errors.Is matches both.
func ctxError(ctx context.Context) error {
	err, cause := ctx.Err(), context.Cause(ctx)
	if cause == nil || cause == err {
		return err
	}
	return fmt.Errorf("%w: %w", err, cause)
}

// fault reports whether err shows f, in the driver's terms: the driver
// translates the database's error (Driver.Interpret), and the core reads
// nothing of it but the driver package's faults.
func (c *Client[TTx, TDB]) fault(err error, f driver.Fault) bool {
	return err != nil && errors.Is(c.drv.Interpret(err), f)
}

// isUnavailable reports whether err says the database could not serve
// (driver.ErrUnavailable: the connection, the pool, the server).
func (c *Client[TTx, TDB]) isUnavailable(err error) bool { return c.fault(err, driver.ErrUnavailable) }

// serverSaidUnavailable reports whether err holds a server error that says
// it cannot serve now.
func (c *Client[TTx, TDB]) serverSaidUnavailable(err error) bool {
	return c.fault(err, driver.ErrServerUnavailable)
}

// unavailableIf wraps err with ErrUnavailable when lost is true.
func unavailableIf(lost bool, err error) error {
	if !lost || errors.Is(err, ErrUnavailable) {
		return err
	}
	return errorf("idem: %w: %w", ErrUnavailable, err)
}

// isRetryable reports whether err is a serialization failure or a deadlock,
// after which the whole transaction may be run again.
func (c *Client[TTx, TDB]) isRetryable(err error) bool { return c.fault(err, driver.ErrRetryable) }

// lockNotAvailable reports whether err is a wait for a lock that ran out.
func (c *Client[TTx, TDB]) lockNotAvailable(err error) bool {
	return c.fault(err, driver.ErrLockNotAvailable)
}

// PreparedStatementsLost is preparedStatementsLost, for the fronts'
// statements that run outside the core (the outbox's Publish, LookupEvent,
// RetryEvent).
func (c *Client[TTx, TDB]) PreparedStatementsLost(err error) error {
	return c.preparedStatementsLost(err)
}

// preparedStatementsLost returns err wrapped with ErrPreparedStatements and
// the fix (the driver adds its words for it) when it is pgx's cached
// prepared statement missing or already there on the server connection:
// what a transaction pooler without prepared-statement support does to
// pgx's default exec mode.
func (c *Client[TTx, TDB]) preparedStatementsLost(err error) error {
	if err == nil || errors.Is(err, ErrPreparedStatements) || !c.fault(err, driver.ErrPreparedStatementsLost) {
		return err
	}
	return errorf("idem: %w (a transaction pooler such as PgBouncer in transaction mode?): "+
		"set the pool's DefaultQueryExecMode to pgx.QueryExecModeExec, QueryExecModeCacheDescribe or "+
		"QueryExecModeSimpleProtocol, or run PgBouncer 1.21 or newer with max_prepared_statements > 0"+
		c.drv.PreparedStatementsFix()+": %w", ErrPreparedStatements, err)
}

// unsupportedIf is UnsupportedIf for an error of one of idem's statements
// as the driver gave it.
func (c *Client[TTx, TDB]) unsupportedIf(err error) error {
	if err == nil {
		return nil
	}
	return unsupportedIf(c.drv.Interpret(err))
}

// unsupportedIf wraps err, an error in the driver's terms
// (Driver.Interpret), with ErrUnsupported when the server refused one of
// idem's statements as a feature it does not support (Citus refuses
// statements it cannot distribute that way), or when the token sequence is
// missing: the connection is to a Citus worker, where idem's sequence does
// not exist (only the coordinator's tables are distributed). Use it only
// on errors of idem's own statements, never on fn's.
func unsupportedIf(err error) error {
	switch {
	case err == nil || errors.Is(err, ErrUnsupported):
		return err
	case errors.Is(err, driver.ErrFeatureNotSupported):
		return errorf("idem: %w: %w", ErrUnsupported, err)
	case errors.Is(err, driver.ErrNoTokenSequence):
		return errorf("idem: %w (on Citus, connect to the coordinator; otherwise run idem.Migrate): %w", ErrUnsupported, err)
	case errors.Is(err, driver.ErrNoBodyExpiry):
		return errorf("idem: %w (the key table lacks body_expires_at, migration 9: run idem.Migrate): %w", ErrUnsupported, err)
	case errors.Is(err, driver.ErrNoUnknownAt):
		return errorf("idem: %w (the key table lacks unknown_at, migration 10: run idem.Migrate): %w", ErrUnsupported, err)
	case errors.Is(err, driver.ErrNoRefusal):
		return errorf("idem: %w (idem's function idem_refuse is missing: run idem.Migrate; on Citus, run Distribute "+
			"again, which creates it on the workers): %w", ErrUnsupported, err)
	case errors.Is(err, driver.ErrNoLockTimeoutSetting):
		// PostgreSQL's claim run on Citus's worker, where the setting it
		// saves the caller's lock_timeout in is not known: package idemsql
		// cannot tell a Citus coordinator by itself.
		return errorf("idem: %w (a Citus coordinator: use a Client of idemsql.NewCitus, or Options.Citus of idemhttp, idemgrpc or idemconnect): %w", ErrUnsupported, err)
	}
	return err
}

// UnsupportedIf is unsupportedIf, for the Citus setup calls of package idem
// (Distribute, Migrate), on an error in the driver's terms.
func UnsupportedIf(err error) error { return unsupportedIf(err) }

// Errorf is errorf, for the calls of the fronts that are not the protocol's
// (migrations, Distribute).
func Errorf(format string, args ...any) error { return errorf(format, args...) }

// keyRowChanged reports whether err is the completion's refusal to store an
// outcome because fn changed the claimed row.
func (c *Client[TTx, TDB]) keyRowChanged(err error) bool {
	return c.fault(err, driver.ErrKeyRowChanged)
}

// txUnusable returns err wrapped with ErrInvalidArgument when it says that
// the caller's transaction could not run the call: it was closed
// (committed or rolled back) or is aborted (a statement failed in it).
func (c *Client[TTx, TDB]) txUnusable(err error) error {
	switch {
	case err == nil || errors.Is(err, ErrInvalidArgument):
		return err
	case c.drv.TxClosed(err):
		return errorf("idem: %w: the transaction is closed (committed or rolled back): %w", ErrInvalidArgument, err)
	case c.fault(err, driver.ErrTxAborted):
		return errorf("idem: %w: the transaction is aborted (a statement failed in it; roll it back): %w", ErrInvalidArgument, err)
	}
	return err
}

// Refusals of arguments, before anything runs.
var (
	errNilTx = errorf("idem: %w: nil transaction", ErrInvalidArgument)
	errNilFn = errorf("idem: %w: nil function", ErrInvalidArgument)
)
