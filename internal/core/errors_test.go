package core

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// unsupportedIf marks what Citus refuses (0A000), a missing token sequence
// (a worker) and a missing idem_refuse, as the driver translates them, with
// ErrUnsupported, keeping the server's error in the
// chain, and leaves every other error as it is.
func TestUnsupportedIf(t *testing.T) {
	notSupported := &pgconn.PgError{Code: "0A000", Message: "could not run distributed query with FOR UPDATE/SHARE commands"}
	noSeq := &pgconn.PgError{Code: "42P01", Message: `relation "idem_keys_token_seq" does not exist`}
	noTable := &pgconn.PgError{Code: "42P01", Message: `relation "orders" does not exist`}
	noRefuse := &pgconn.PgError{Code: "42883", Message: `function idem_refuse(unknown, text) does not exist`}
	other := errors.New("boom")
	for _, c := range []struct {
		err         error
		unsupported bool
	}{
		{fmt.Errorf("x: %w", notSupported), true},
		{noSeq, true},
		{noTable, false},
		{noRefuse, true},
		{other, false},
		{nil, false},
	} {
		got := unsupportedIf(dberr.Interpret(c.err))
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

// The faults the core reads are the driver package's: dberr.Interpret turns
// a server's error into them, keeps its SQLSTATE and the error itself, and
// leaves other errors as they are.
func TestInterpretedFaults(t *testing.T) {
	for _, c := range []struct {
		code string
		want driver.Fault
	}{
		{"55P03", driver.ErrLockNotAvailable},
		{"40001", driver.ErrRetryable},
		{"40P01", driver.ErrRetryable},
		{"25P02", driver.ErrTxAborted},
		{driver.StateKeyRowChanged, driver.ErrKeyRowChanged},
		{driver.StateClaimReleased, driver.ErrClaimReleased},
		{"0A000", driver.ErrFeatureNotSupported},
		{"57014", driver.ErrUnavailable | driver.ErrServerUnavailable | driver.ErrCanceled},
		{"08006", driver.ErrUnavailable | driver.ErrServerUnavailable},
	} {
		pgErr := &pgconn.PgError{Code: c.code, Message: "m"}
		got := dberr.Interpret(fmt.Errorf("step: %w", pgErr))
		var de *driver.Error
		if !errors.As(got, &de) || de.Faults != c.want || de.SQLState != c.code || !errors.Is(got, pgErr) {
			t.Errorf("Interpret(%s) = %#v, want faults %v", c.code, got, c.want)
		}
		if !errors.Is(got, c.want) || errors.Is(got, driver.ErrNoRefusal) {
			t.Errorf("Interpret(%s) matches %v: %v; ErrNoRefusal: %v", c.code, c.want, errors.Is(got, c.want), errors.Is(got, driver.ErrNoRefusal))
		}
		if again := dberr.Interpret(got); again != got {
			t.Errorf("Interpret(%s) twice wraps twice", c.code)
		}
	}
	for _, err := range []error{nil, errors.New("boom"), &pgconn.PgError{Code: "23505"}} {
		if got := dberr.Interpret(err); got != err {
			t.Errorf("Interpret(%v) = %v, want it as it is", err, got)
		}
	}
}

// A context's error keeps its cause, and matches both: errors.Is finds
// context.Canceled (or DeadlineExceeded) whatever the cause.
func TestCtxError(t *testing.T) {
	plain, cancel := context.WithCancel(context.Background())
	cancel()
	if err := ctxError(plain); err != context.Canceled {
		t.Errorf("no cause: %v, want context.Canceled itself", err)
	}
	gone := errors.New("the client went away")
	caused, cancelCause := context.WithCancelCause(context.Background())
	cancelCause(gone)
	if err := ctxError(caused); !errors.Is(err, context.Canceled) || !errors.Is(err, gone) || err.Error() != "context canceled: the client went away" {
		t.Errorf("a cause: %v, want both matched", err)
	}
	late, cancelLate := context.WithDeadlineCause(context.Background(), time.Now().Add(-time.Second), gone)
	defer cancelLate()
	if err := ctxError(late); !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, gone) {
		t.Errorf("a deadline's cause: %v, want both matched", err)
	}
	if err := ctxError(context.Background()); err != nil {
		t.Errorf("a live context: %v", err)
	}
}
