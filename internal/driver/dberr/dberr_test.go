package dberr_test

import (
	"context"
	"database/sql"
	sqldriver "database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
	"github.com/lib/pq"
	"github.com/lib/pq/pqerror"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// Every database package's way of saying that the database could not
// serve is driver.ErrUnavailable once interpreted, wherever it is in the
// chain; a statement's own failure is not.
func TestInterpretUnavailable(t *testing.T) {
	for _, c := range []struct {
		name        string
		err         error
		unavailable bool
		server      bool
	}{
		{"EOF", io.EOF, true, false},
		{"unexpected EOF", fmt.Errorf("read: %w", io.ErrUnexpectedEOF), true, false},
		{"net.ErrClosed", net.ErrClosed, true, false},
		{"net.OpError", &net.OpError{Op: "dial", Err: errors.New("refused")}, true, false},
		{"database/sql bad conn", sqldriver.ErrBadConn, true, false},
		{"database/sql conn done", sql.ErrConnDone, true, false},
		{"pool closed", puddle.ErrClosedPool, true, false},
		{"pgx admin shutdown", &pgconn.PgError{Code: "57P01"}, true, true},
		{"pgx too many connections", &pgconn.PgError{Code: "53300"}, true, true},
		{"lib/pq cannot connect now", &pq.Error{Code: "57P03"}, true, true},
		{"lost under another error", errors.Join(&pgconn.PgError{Code: "23505"}, io.EOF), true, false},
		{"lost under an error interpreted already", errors.Join(dberr.Interpret(&pgconn.PgError{Code: "25P02"}), io.EOF), true, false},
		{"unique violation", &pgconn.PgError{Code: "23505"}, false, false},
		{"lib/pq lock not available", &pq.Error{Code: "55P03"}, false, false},
		{"fn's own", errors.New("out of stock"), false, false},
	} {
		got := dberr.Interpret(c.err)
		if errors.Is(got, driver.ErrUnavailable) != c.unavailable || errors.Is(got, driver.ErrServerUnavailable) != c.server ||
			dberr.Unavailable(c.err) != c.unavailable {
			t.Errorf("%s: Interpret = %v (unavailable %v, server %v), want unavailable %v, server %v", c.name, got,
				errors.Is(got, driver.ErrUnavailable), errors.Is(got, driver.ErrServerUnavailable), c.unavailable, c.server)
		}
		if !errors.Is(got, c.err) {
			t.Errorf("%s: Interpret lost the error", c.name)
		}
	}
}

// lib/pq's errors read as pgx's: the same faults, the same SQLSTATE.
func TestInterpretLibPQ(t *testing.T) {
	for code, want := range map[pqerror.Code]driver.Fault{
		"55P03":                   driver.ErrLockNotAvailable,
		"40001":                   driver.ErrRetryable,
		"25P02":                   driver.ErrTxAborted,
		driver.StateKeyRowChanged: driver.ErrKeyRowChanged,
		driver.StateClaimReleased: driver.ErrClaimReleased,
	} {
		got := dberr.Interpret(&pq.Error{Code: code})
		var de *driver.Error
		if !errors.As(got, &de) || de.Faults != want || de.SQLState != string(code) {
			t.Errorf("Interpret(pq %s) = %#v, want %v", code, got, want)
		}
	}
}

// A missing idem_refuse (a database below migration 00008) and pgx's lost
// prepared statements are told by the server's words, here and only here.
func TestInterpretByMessage(t *testing.T) {
	for _, c := range []struct {
		err  error
		want driver.Fault
	}{
		{&pgconn.PgError{Code: "42883", Message: "function idem_refuse(unknown, text) does not exist"}, driver.ErrNoRefusal},
		{&pgconn.PgError{Code: "42703", Message: `column "body_expires_at" of relation "idem_keys" does not exist`}, driver.ErrNoBodyExpiry},
		{&pgconn.PgError{Code: "42703", Message: `column "unknown_at" of relation "idem_keys" does not exist`}, driver.ErrNoUnknownAt},
		{&pgconn.PgError{Code: "57014"}, driver.ErrCanceled | driver.ErrServerUnavailable | driver.ErrUnavailable},
		{&pgconn.PgError{Code: "42883", Message: "function other() does not exist"}, 0},
		{&pgconn.PgError{Code: "26000", Message: `prepared statement "stmtcache_1" does not exist`}, driver.ErrPreparedStatementsLost},
		{&pgconn.PgError{Code: "42P05", Message: `prepared statement "stmtcache_2" already exists`}, driver.ErrPreparedStatementsLost},
		{&pgconn.PgError{Code: "26000", Message: `prepared statement "mine" does not exist`}, 0},
		{&pgconn.PgError{Code: "42704", Message: `unrecognized configuration parameter "idem.lock_timeout"`}, driver.ErrNoLockTimeoutSetting},
	} {
		got := dberr.Interpret(c.err)
		var de *driver.Error
		if errors.As(got, &de) != (c.want != 0) || c.want != 0 && de.Faults != c.want {
			t.Errorf("Interpret(%v) = %#v, want %v", c.err, got, c.want)
		}
	}
}

// A COMMIT's error is in doubt only when the COMMIT may have reached the
// server and no answer came back.
func TestCommitError(t *testing.T) {
	for _, c := range []struct {
		name    string
		err     error
		inDoubt bool
	}{
		{"the connection broke", io.ErrUnexpectedEOF, true},
		{"database/sql bad conn", sqldriver.ErrBadConn, true},
		{"pgx's stdlib stopped reading", context.Canceled, true},
		{"the server rolled back", &pgconn.PgError{Code: "40001"}, false},
		{"lib/pq, the server cancelled it", &pq.Error{Code: "57014"}, false},
		{"database/sql: the transaction had ended", sql.ErrTxDone, false},
		{"pgx: nothing was sent", unsent{}, false},
	} {
		got := dberr.CommitError(c.err)
		if errors.Is(got, driver.ErrCommitInDoubt) != c.inDoubt || !errors.Is(got, c.err) {
			t.Errorf("%s: %v; want in doubt %v, the error kept", c.name, got, c.inDoubt)
		}
		if c.inDoubt && errors.Is(got, driver.ErrUnavailable) != dberr.Unavailable(c.err) {
			t.Errorf("%s: %v; want its other faults kept", c.name, got)
		}
	}
	if dberr.CommitError(nil) != nil {
		t.Error("CommitError(nil) is not nil")
	}
}

// unsent is an error of pgx's that says nothing was sent.
type unsent struct{}

func (unsent) Error() string     { return "conn busy" }
func (unsent) SafeToRetry() bool { return true }
