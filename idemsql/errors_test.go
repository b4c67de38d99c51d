package idemsql_test

import (
	"database/sql"
	"database/sql/driver"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/lib/pq"

	"github.com/pgidem/idem"
)

// idem.Unavailable is the one classification for both drivers: lib/pq's
// server errors by SQLSTATE class as pgx's, and database/sql's broken
// connections.
func TestUnavailableBothDrivers(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&pq.Error{Code: "08006"}, true},  // connection failure
		{&pq.Error{Code: "57P01"}, true},  // admin shutdown (a terminated backend)
		{&pq.Error{Code: "53300"}, true},  // too many connections
		{&pq.Error{Code: "58030"}, true},  // I/O error
		{&pq.Error{Code: "23505"}, false}, // unique violation: the request's fault
		{&pq.Error{Code: "40001"}, false}, // serialization failure: retried, not unavailable
		{&pgconn.PgError{Code: "57P01"}, true},
		{&pgconn.PgError{Code: "23505"}, false},
		{driver.ErrBadConn, true},
		{sql.ErrConnDone, true},
		{fmt.Errorf("idem: commit: %w", driver.ErrBadConn), true},
		{sql.ErrNoRows, false},
		{sql.ErrTxDone, false},
	} {
		if got := idem.Unavailable(c.err); got != c.want {
			t.Errorf("Unavailable(%#v) = %v, want %v", c.err, got, c.want)
		}
	}
}
