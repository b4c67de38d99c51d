package idemsql_test

import (
	"context"
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
