package idem

import (
	"errors"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// Errors returned by Do and its relatives. Check them with errors.Is; the
// returned error usually wraps one of these with a more specific message.
// Every message names idem once, however deep the chain.
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

	// ErrTxAborted means fn returned a response although a statement it ran
	// had failed and aborted its transaction (fn swallowed the error, such
	// as a unique violation, without a savepoint of its own): the outcome
	// could not be stored. The call failed as a whole: fn's writes and the
	// claim were undone (Do's caller's transaction stays usable), nothing
	// was stored, and a retry runs fn again. It is a bug in fn (HTTP 500).
	// The server's error (SQLSTATE 25P02) stays in the chain: errors.As
	// finds the driver's error (*pgconn.PgError, *pq.Error).
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
)

// InProgressError is returned when the key is held by a transaction that did
// not finish within the wait. errors.Is(err, ErrInProgress) reports true.
type InProgressError struct {
	// RetryAfter is a hint for how long the client should wait before it
	// retries (the HTTP Retry-After header).
	RetryAfter time.Duration
}

func (e *InProgressError) Error() string {
	return fmt.Sprintf("%s (retry after %s)", ErrInProgress.Error(), e.RetryAfter)
}

// Is makes errors.Is(err, ErrInProgress) true.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// RejectedResponse reports whether err is (or wraps) a refusal made with
// Reject, and returns the refusal's response.
func RejectedResponse(err error) (Response, bool) {
	resp, ok := core.RejectedResponse(err)
	return Response(resp), ok
}

// Reject is returned by fn to refuse a request deterministically, for example
// for insufficient funds. Do undoes fn's writes (they ran in a savepoint),
// stores resp as the final outcome of the key, and returns it as a Result
// with a nil error, so the caller commits. Later calls with the same key
// replay resp and do not run fn.
//
// Reject is for refusals that would come out the same on every retry. A
// transient failure should be returned as an ordinary error instead: then
// nothing is stored and the key is free again once the caller rolls back.
func Reject(resp Response) error { return core.Reject(core.Response(resp)) }

// Unavailable reports whether err means the database could not serve the
// request, through no fault of the request itself: err wraps
// ErrUnavailable; or the server could not be reached, or dropped the
// connection (also when pgx reports the broken connection later as "conn
// closed", to any call or to the caller's own Exec or Commit; database/sql
// reports it as driver.ErrBadConn or sql.ErrConnDone), or the pool is
// closed, or a deadline ran out on the way; or the server answered
// (through pgx, or another driver such as lib/pq under package idemsql)
// with SQLSTATE class 08 (connection exception), 53 (insufficient
// resources), 57 (operator intervention: a shutdown, a cancelled or
// timed-out statement) or 58 (system error). This holds for the error of
// every public call of idem and of Migrate. Fail closed (HTTP 503) and let
// the client retry with the same key: the retry replays if the first
// attempt committed, and runs otherwise (Lookup shows what committed). This
// is the one classification idem and idemhttp use.
//
// It reads the whole chain, so an error fn returns is classified by what it
// wraps: fn's own io.ErrUnexpectedEOF (a truncated request body, say) or a
// net.Error of another service's client is Unavailable too. Wrap such
// errors in an error of your own that does not unwrap to them when they
// are not the database's.
func Unavailable(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, core.ErrUnavailable) || dberr.Unavailable(err)
}
