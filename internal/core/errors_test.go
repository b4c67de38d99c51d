package core

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// unsupportedIf marks what Citus refuses (0A000) and a missing token
// sequence (a worker) with ErrUnsupported, keeping the server's error in the
// chain, and leaves every other error as it is.
func TestUnsupportedIf(t *testing.T) {
	notSupported := &pgconn.PgError{Code: "0A000", Message: "could not run distributed query with FOR UPDATE/SHARE commands"}
	noSeq := &pgconn.PgError{Code: "42P01", Message: `relation "idem_keys_token_seq" does not exist`}
	noTable := &pgconn.PgError{Code: "42P01", Message: `relation "orders" does not exist`}
	other := errors.New("boom")
	for _, c := range []struct {
		err         error
		unsupported bool
	}{
		{fmt.Errorf("x: %w", notSupported), true},
		{noSeq, true},
		{noTable, false},
		{other, false},
		{nil, false},
	} {
		got := unsupportedIf(c.err)
		if errors.Is(got, ErrUnsupported) != c.unsupported {
			t.Errorf("unsupportedIf(%v) = %v, unsupported %v", c.err, got, c.unsupported)
		}
		if c.err != nil && !errors.Is(got, c.err) {
			t.Errorf("unsupportedIf(%v) = %v lost the original error", c.err, got)
		}
		if c.err == nil && got != nil {
			t.Errorf("unsupportedIf(nil) = %v", got)
		}
	}
	errWorker := errorf("idem: %w: connected to a Citus worker; connect to the coordinator", ErrUnsupported)
	if got := unsupportedIf(errWorker); got != errWorker {
		t.Errorf("wrapped twice: %v", got)
	}
}
