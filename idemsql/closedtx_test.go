package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// DoInTx with a context already done fails to begin its transaction and
// returns the context's error: nothing to undo, nothing stored.
func TestDoInTxCancelledBeforeBegin(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, pool := migrated(t, driver)
		cancelled, cancel := context.WithCancel(context.Background())
		cancel()
		c, err := idemsql.New(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.DoInTx(cancelled, db, scope, "cancelled", fpOf("a"), okFn); !errors.Is(err, context.Canceled) {
			t.Errorf("err = %v, want context.Canceled", err)
		}
		if n := keyCount(t, pool); n != 0 {
			t.Errorf("%d key rows", n)
		}
	})
}

// Do on a transaction that is closed (committed or rolled back) or aborted
// is idem.ErrInvalidArgument, as in idem.Do: nothing runs.
func TestDoOnAClosedTransaction(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, pool := migrated(t, driver)
		ran := false
		fn := func(context.Context, *sql.Tx) (idem.Response, error) { ran = true; return created, nil }
		for _, state := range []string{"committed", "rolled back", "aborted"} {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			switch state {
			case "committed":
				err = tx.Commit()
			case "rolled back":
				err = tx.Rollback()
			case "aborted":
				if _, err = tx.ExecContext(ctx, `SELECT 1/0`); err != nil {
					err = nil
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			if _, err := idemsql.Do(ctx, tx, scope, "closed", fpOf("a"), fn); !errors.Is(err, idem.ErrInvalidArgument) {
				t.Errorf("Do on the %s transaction: err = %v, want ErrInvalidArgument", state, err)
			}
			_ = tx.Rollback()
		}
		if ran || keyCount(t, pool) != 0 {
			t.Fatalf("fn ran: %v; %d key rows", ran, keyCount(t, pool))
		}
	})
}
