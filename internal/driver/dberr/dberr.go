// Package dberr reads the errors of PostgreSQL's Go packages (pgx, pgx's
// stdlib, lib/pq, database/sql) and translates them into package driver's
// terms (driver.Error). The drivers and the fronts import it; the core
// never does, so that it imports no database package.
package dberr

import (
	"context"
	"database/sql"
	sqldriver "database/sql/driver"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"

	"github.com/pgidem/idem/internal/driver"
)

// Interpret returns err as a *driver.Error when it shows one of the faults
// the core tells apart, keeping err in the chain (nil, an error without
// such a fault and an error that shows its faults already come back as
// they are). It reads the whole chain, as Unavailable does: an error
// interpreted before, further down, hides no fault of the rest (a lost
// connection joined to it).
func Interpret(err error) error {
	if err == nil {
		return nil
	}
	code := SQLState(err)
	f := faults(err, code)
	if f == 0 || errors.Is(err, f) {
		return err
	}
	return &driver.Error{Faults: f, SQLState: code, Err: err}
}

// CommitError marks err, the error of a COMMIT, in doubt
// (driver.ErrCommitInDoubt) when the COMMIT may have reached the server and
// no answer came back: not when the server answered (an SQLSTATE: the
// transaction rolled back), nor when database/sql refused before sending
// (sql.ErrTxDone), nor when the driver says nothing was sent
// (pgconn.SafeToRetry). (database/sql's Tx.Commit also refuses with the
// context's error itself, before sending, once its context has ended, and
// pgx's stdlib returns the same when the context ends during the COMMIT:
// the caller tells them apart, all but the context ending at that very
// moment, by not committing once its context has ended.)
func CommitError(err error) error {
	if err == nil || SQLState(err) != "" || errors.Is(err, sql.ErrTxDone) || pgconn.SafeToRetry(err) {
		return err
	}
	return &driver.Error{Faults: driver.ErrCommitInDoubt | faults(err, ""), Err: err}
}

// faults are the faults err (of SQLSTATE code) shows.
func faults(err error, code string) driver.Fault {
	var f driver.Fault
	if Unavailable(err) {
		f |= driver.ErrUnavailable
	}
	if code != "" && ServerUnavailable(code) {
		f |= driver.ErrServerUnavailable
	}
	switch code {
	case "":
	case "55P03":
		f |= driver.ErrLockNotAvailable
	case "57014":
		f |= driver.ErrCanceled
	case "40001", "40P01":
		f |= driver.ErrRetryable
	case "25P02":
		f |= driver.ErrTxAborted
	case driver.StateKeyRowChanged:
		f |= driver.ErrKeyRowChanged
	case driver.StateClaimReleased:
		f |= driver.ErrClaimReleased
	case "26000", "42P05":
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && strings.Contains(pgErr.Message, "stmtcache_") {
			f |= driver.ErrPreparedStatementsLost
		}
	case "0A000":
		f |= driver.ErrFeatureNotSupported
	case "42P01":
		if strings.Contains(err.Error(), "idem_keys_token_seq") {
			f |= driver.ErrNoTokenSequence
		}
	case "42704":
		if strings.Contains(err.Error(), "idem.lock_timeout") {
			f |= driver.ErrNoLockTimeoutSetting
		}
	case "42883":
		if strings.Contains(err.Error(), "idem_refuse") {
			f |= driver.ErrNoRefusal
		}
	case "42703":
		if strings.Contains(err.Error(), "body_expires_at") {
			f |= driver.ErrNoBodyExpiry
		}
		if strings.Contains(err.Error(), "unknown_at") {
			f |= driver.ErrNoUnknownAt
		}
	}
	return f
}

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
// driver.ErrBadConn and sql.ErrConnDone), the pool is closed (a pgxpool,
// or a *sql.DB), a deadline ran out on the way, or the server answered
// with SQLSTATE class 08, 53, 57 or 58 (ServerUnavailable). It reads the whole chain: another server error
// does not hide a lost connection further down.
func Unavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, driver.ErrUnavailable) {
		return true
	}
	if code := SQLState(err); code != "" && ServerUnavailable(code) {
		return true
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connectErr) || errors.As(err, &netErr) || pgconn.Timeout(err) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, sqldriver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) ||
		errors.Is(err, puddle.ErrClosedPool) || errors.Is(err, errDBClosed)
}

// errDBClosed is database/sql's unexported error of a closed *sql.DB (its
// pool: "sql: database is closed"), taken from a *sql.DB closed at once.
var errDBClosed = func() error {
	db := sql.OpenDB(noConnector{})
	_ = db.Close()
	return db.Ping()
}()

// noConnector is a database/sql connector that never connects: errDBClosed's
// *sql.DB is closed before it could.
type noConnector struct{}

func (noConnector) Connect(context.Context) (sqldriver.Conn, error) {
	return nil, errors.New("dberr: no connection")
}
func (noConnector) Driver() sqldriver.Driver { return nil }

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
