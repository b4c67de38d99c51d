package idem

import (
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
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
	// database handle) is nil, or a value such as a lease, a limit or a
	// ListUnknown cursor is out of range, or the caller's transaction given
	// to Do or Complete is closed or aborted. Nothing was touched.
	ErrInvalidArgument = errors.New("idem: invalid argument")

	// ErrOutcomeUnknown means the key belongs to a reservation whose work
	// outside the database may or may not have happened: its owner marked it
	// unknown, or its lease ran out before it completed. Nothing runs again
	// automatically; reconcile it (Resolve) first (HTTP 409).
	ErrOutcomeUnknown = errors.New("idem: the outcome of the request with this idempotency key is unknown")

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

// preparedStatementsLost returns err wrapped with ErrPreparedStatements and
// the fix when it is pgx's cached prepared statement missing (26000) or
// already there (42P05) on the server connection: what a transaction pooler
// without prepared-statement support does to pgx's default exec mode.
func preparedStatementsLost(err error) error {
	if err == nil { // first: pgErr below escapes to the heap
		return nil
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || errors.Is(err, ErrPreparedStatements) ||
		(pgErr.Code != pgerrcode.InvalidSQLStatementName && pgErr.Code != pgerrcode.DuplicatePreparedStatement) ||
		!strings.Contains(pgErr.Message, "stmtcache_") {
		return err
	}
	return fmt.Errorf("%w (a transaction pooler such as PgBouncer in transaction mode?): "+
		"set the pool's DefaultQueryExecMode to pgx.QueryExecModeExec, QueryExecModeCacheDescribe or "+
		"QueryExecModeSimpleProtocol, or run PgBouncer 1.21 or newer with max_prepared_statements > 0: %w",
		ErrPreparedStatements, err)
}

// keyRowChanged reports whether err is the completion's refusal to store
// an outcome because fn changed the claimed row (KeyComplete raises it as a
// failed cast of its message to integer, SQLSTATE 22P02).
func keyRowChanged(err error) bool {
	return err != nil && pgCode(err) == pgerrcode.InvalidTextRepresentation &&
		strings.Contains(err.Error(), keyRowChangedMessage)
}

// keyRowChangedMessage is in the message of KeyComplete's failure.
const keyRowChangedMessage = "idem_keys row changed under fn"

// txUnusable returns err wrapped with ErrInvalidArgument when it says that
// the caller's transaction could not run the call: it was closed
// (committed or rolled back) or is aborted (a statement failed in it).
func txUnusable(err error) error {
	switch {
	case err == nil || errors.Is(err, ErrInvalidArgument):
		return err
	case errors.Is(err, pgx.ErrTxClosed):
		return fmt.Errorf("%w: the transaction is closed (committed or rolled back): %w", ErrInvalidArgument, err)
	case pgCode(err) == pgerrcode.InFailedSQLTransaction:
		return fmt.Errorf("%w: the transaction is aborted (a statement failed in it; roll it back): %w", ErrInvalidArgument, err)
	}
	return err
}

// InProgressError is returned when the key is held by a transaction that did
// not finish within the wait. errors.Is(err, ErrInProgress) reports true.
type InProgressError struct {
	// RetryAfter is a hint for how long the client should wait before it
	// retries (the HTTP Retry-After header).
	RetryAfter time.Duration

	// held names the key whose claim waited in vain, when known. (A copy,
	// not the *rowKey: keeping that would move every call's key to the heap.)
	held struct{ actor, operation, key string }
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

// Reject is returned by fn to refuse a request deterministically, for example
// for insufficient funds. Do undoes fn's writes (they ran in a savepoint),
// stores resp as the final outcome of the key, and returns it as a Result
// with a nil error, so the caller commits. Later calls with the same key
// replay resp and do not run fn.
//
// Reject is for refusals that would come out the same on every retry. A
// transient failure should be returned as an ordinary error instead: then
// nothing is stored and the key is free again once the caller rolls back.
func Reject(resp Response) error { return &rejection{resp: resp} }

// pgCode returns the SQLSTATE of err if it is (or wraps) a PostgreSQL error:
// pgx's *pgconn.PgError, or another driver's error with an SQLState method
// (lib/pq's *pq.Error), so that package idemsql classifies alike.
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	var stateErr interface{ SQLState() string }
	if errors.As(err, &stateErr) {
		return stateErr.SQLState()
	}
	return ""
}

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
	return err != nil && (errors.Is(err, ErrUnavailable) || isUnavailable(err))
}

// isUnavailable is Unavailable without the ErrUnavailable check.
func isUnavailable(err error) bool {
	if code := pgCode(err); code != "" && serverUnavailable(&pgconn.PgError{Code: code}) {
		return true
	}
	// Another server error does not hide a lost connection further down the
	// chain: Do joins fn's error (a 23505, say) with the failed undo's
	// "conn closed".
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connectErr) || errors.As(err, &netErr) || pgconn.Timeout(err) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		// pgx's "conn closed": a statement, Begin, Commit or Rollback on a
		// connection that broke earlier (a lost COMMIT acknowledgement
		// closes it; so does a restart of the server).
		errors.Is(err, pgconn.ErrConnClosed) ||
		// database/sql's forms of the same (Migrate runs through it).
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) ||
		errors.Is(err, puddle.ErrClosedPool)
}

// serverUnavailable reports whether the server answered with an error of
// SQLSTATE class 08, 53, 57 or 58 (see Unavailable).
func serverUnavailable(pgErr *pgconn.PgError) bool {
	switch {
	case strings.HasPrefix(pgErr.Code, "08"), strings.HasPrefix(pgErr.Code, "53"),
		strings.HasPrefix(pgErr.Code, "57"), strings.HasPrefix(pgErr.Code, "58"):
		return true
	}
	return false
}

// isRetryable reports whether err is a serialization failure or a deadlock,
// after which the whole transaction may be run again.
func isRetryable(err error) bool {
	switch pgCode(err) {
	case pgerrcode.SerializationFailure, pgerrcode.DeadlockDetected:
		return true
	}
	return false
}
