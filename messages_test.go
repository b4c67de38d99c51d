package idem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Every error message names idem once, however deep the chain it wraps
// (a heartbeat whose transaction could not begin, Distribute without
// Citus, a COMMIT that fails, refusals of arguments), and errors.Is still
// finds every sentinel in it.
func TestErrorsNameIdemOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	withDeferredConflict(t, pool)
	r, err := idem.Reserve(ctx, pool, scope, "r", fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	closed := newPool(t)
	closed.Close()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	inTx := openTx(t, conn)
	defer inTx.Rollback(ctx)

	cases := []struct {
		name string
		err  error
		is   []error
	}{
		{"heartbeat on a closed pool", second(idem.Heartbeat(ctx, closed, r, time.Minute)), []error{idem.ErrUnavailable}},
		{"reserve on a closed pool", second(idem.Reserve(ctx, closed, scope, "k", fpA, time.Minute)), []error{idem.ErrUnavailable}},
		{"DoInTx on a closed pool", second(idem.DoInTx(ctx, closed, scope, "k", fpA, noop)), []error{idem.ErrUnavailable}},
		{"distribute without Citus", idem.Distribute(ctx, pool), []error{idem.ErrUnsupported}},
		{"migrate on a closed pool", idem.Migrate(ctx, closed), nil},
		{"commit that fails", second(idem.DoInTx(ctx, pool, scope, "deferred", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			_, err := tx.Exec(ctx, `INSERT INTO deferred VALUES (1)`)
			return idem.Response{}, err
		})), nil},
		{"a connection in a transaction", second(idem.ExpireLeases(ctx, conn.Conn(), 10)), []error{idem.ErrInvalidArgument}},
		{"a closed transaction", second(idem.Do(ctx, closedTx(t, pool), scope, "k", fpA, noop)), []error{idem.ErrInvalidArgument}},
		{"an invalid key", second(idem.Do(ctx, inTx, scope, "", fpA, noop)), []error{idem.ErrInvalidKey}},
		{"key reused", second(idem.Reserve(ctx, pool, scope, "r", fpB, time.Minute)), []error{idem.ErrKeyReused}},
		{"in progress", second(idem.Reserve(ctx, pool, scope, "r", fpA, time.Minute)), []error{idem.ErrInProgress}},
		{"a bad config", second(idem.New(idem.Config{TTL: -time.Second})), []error{idem.ErrInvalidConfig}},
	}
	for _, c := range cases {
		if c.err == nil {
			t.Errorf("%s: no error", c.name)
			continue
		}
		if n := strings.Count(c.err.Error(), "idem: "); n != 1 {
			t.Errorf("%s: %q names idem %d times", c.name, c.err, n)
		}
		for _, target := range c.is {
			if !errors.Is(c.err, target) {
				t.Errorf("%s: %v is not %v", c.name, c.err, target)
			}
		}
	}
}

// noop is an fn that stores an empty response.
func noop(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{}, nil }

// second is the error of a call that returns two values.
func second[T any](_ T, err error) error { return err }

// openTx begins a transaction on db.
func openTx(t *testing.T, db idem.Beginner) pgx.Tx {
	t.Helper()
	tx, err := db.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return tx
}

// closedTx is a transaction on db that is already rolled back.
func closedTx(t *testing.T, db idem.Beginner) pgx.Tx {
	t.Helper()
	tx := openTx(t, db)
	_ = tx.Rollback(context.Background())
	return tx
}
