package idem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/pgidem/idem"
)

// DoInTx with a context already done, on a Client that has not yet asked
// whether the database is Citus: the question fails before BEGIN, and the
// call returns the context's error (nothing to undo), never a panic.
func TestDoInTxCancelledBeforeCitusQuestion(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	conn, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for name, db := range map[string]idem.Beginner{"conn": conn.Conn(), "pool": pool} {
		c := waitingClient(t, 0)
		_, err := c.DoInTx(cancelled, db, scope, "cancelled-"+name, fpA, okFn)
		if !errors.Is(err, context.Canceled) {
			t.Errorf("%s: err = %v, want context.Canceled", name, err)
		}
	}
	if n := keyRows(t, pool); n != 0 {
		t.Fatalf("%d key rows", n)
	}
}
