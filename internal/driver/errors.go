package driver

import (
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
)

// ErrTxAborted means a statement of idem's ran into a transaction that an
// earlier statement had aborted (SQLSTATE 25P02): one of fn's failed, and
// fn went on as though it had not. The server's error stays in the chain.
var ErrTxAborted = errors.New("the transaction was aborted by an earlier statement")

// txAborted returns err wrapped with ErrTxAborted when the server refused
// the statement because the transaction was aborted already.
func txAborted(err error) error {
	if err != nil && SQLState(err) == "25P02" {
		return abortedError{err}
	}
	return err
}

// abortedError is a statement's error in an aborted transaction: it is
// ErrTxAborted, and wraps the server's error.
type abortedError struct{ err error }

func (e abortedError) Error() string        { return e.err.Error() }
func (e abortedError) Unwrap() error        { return e.err }
func (e abortedError) Is(target error) bool { return target == ErrTxAborted }

// Interpret turns an error of one of idem's statements into the driver
// package's terms, keeping the database's error in the chain: a
// transaction aborted before the statement is ErrTxAborted.
func Interpret(err error) error { return txAborted(err) }

// SQLState returns the SQLSTATE of err if it is (or wraps) a PostgreSQL
// error: pgx's *pgconn.PgError, or another driver's error with an SQLState
// method (lib/pq's *pq.Error), so that every driver classifies alike.
func SQLState(err error) string {
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

// Unavailable reports whether err says the database could not serve,
// through no fault of the statement: the server could not be reached, or
// dropped the connection (pgx's "conn closed", database/sql's
// driver.ErrBadConn and sql.ErrConnDone), the pool is closed, a deadline ran
// out on the way, or the server answered with SQLSTATE class 08, 53, 57 or
// 58 (ServerUnavailable). It reads the whole chain: another server error
// does not hide a lost connection further down.
func Unavailable(err error) bool {
	if code := SQLState(err); code != "" && ServerUnavailable(code) {
		return true
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connectErr) || errors.As(err, &netErr) || pgconn.Timeout(err) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) ||
		errors.Is(err, puddle.ErrClosedPool)
}

// ServerUnavailable reports whether SQLSTATE code says the server cannot
// serve now: class 08 (connection exception), 53 (insufficient resources),
// 57 (operator intervention: a shutdown, a cancelled or timed-out
// statement) or 58 (system error).
func ServerUnavailable(code string) bool {
	switch {
	case strings.HasPrefix(code, "08"), strings.HasPrefix(code, "53"),
		strings.HasPrefix(code, "57"), strings.HasPrefix(code, "58"):
		return true
	}
	return false
}

// What the core tells apart in a database's errors, named in the driver
// package's terms: the core reads no SQLSTATE and no message text.

// LockNotAvailable reports whether err is a wait for a lock that ran out
// (lock_timeout, or NOWAIT: SQLSTATE 55P03).
func LockNotAvailable(err error) bool { return SQLState(err) == "55P03" }

// Retryable reports whether err is a serialization failure or a deadlock
// (40001, 40P01), after which a whole transaction may run again.
func Retryable(err error) bool {
	switch SQLState(err) {
	case "40001", "40P01":
		return true
	}
	return false
}

// InFailedTx reports whether err says the transaction was aborted by an
// earlier statement (25P02).
func InFailedTx(err error) bool { return errors.Is(err, ErrTxAborted) || SQLState(err) == "25P02" }

// KeyRowChanged reports whether err is the completion's refusal to store an
// outcome because fn changed the claimed row (KeyComplete raises it as a
// failed cast of its message to integer, SQLSTATE 22P02).
func KeyRowChanged(err error) bool {
	return err != nil && SQLState(err) == "22P02" && strings.Contains(err.Error(), "idem_keys row changed under fn")
}

// PreparedStatementsLost reports whether err is pgx's cached prepared
// statement missing (26000) or already there (42P05) on the server
// connection: what a transaction pooler without prepared-statement support
// does to pgx's default exec mode.
func PreparedStatementsLost(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "42P05") &&
		strings.Contains(pgErr.Message, "stmtcache_")
}

// Unsupported is why the server refused one of idem's statements as
// something this database does not support.
type Unsupported int

const (
	// Supported: not such a refusal.
	Supported Unsupported = iota
	// FeatureNotSupported: 0A000 (Citus refuses statements it cannot
	// distribute that way).
	FeatureNotSupported
	// NoTokenSequence: idem's token sequence is missing (a Citus worker,
	// or a database idem did not migrate).
	NoTokenSequence
	// NoLockTimeoutSetting: the setting PostgreSQL's claim saves the
	// caller's lock_timeout in is unknown (the claim ran on a Citus
	// worker).
	NoLockTimeoutSetting
)

// UnsupportedOf classifies err, an error of one of idem's statements.
func UnsupportedOf(err error) Unsupported {
	switch code := SQLState(err); {
	case code == "0A000":
		return FeatureNotSupported
	case code == "42P01" && strings.Contains(err.Error(), "idem_keys_token_seq"):
		return NoTokenSequence
	case code == "42704" && strings.Contains(err.Error(), "idem.lock_timeout"):
		return NoLockTimeoutSetting
	}
	return Supported
}
