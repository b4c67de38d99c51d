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
