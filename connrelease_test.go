package idem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// DoInTx on a pool gives back the connection its claim acquired on every
// way a call ends, not only at the COMMIT of a stored or read outcome: fn's
// error, a refusal stored by a claim of its own, fn ending the transaction
// itself (the claim then marked unknown on the same connection), a statement
// fn swallowed, fn's panic, ctx ending in fn, and a wait for a twin that
// ran out, with concurrent duplicates coalesced behind it.
func TestDoInTxGivesItsConnectionBackOnEveryEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	acquired := func(step string, want int32) {
		t.Helper()
		if n := pool.Stat().AcquiredConns(); n != want {
			t.Fatalf("%s: %d connections acquired, want %d", step, n, want)
		}
	}
	ok := func(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{Status: 200}, nil }
	for _, c := range []struct {
		name, key string
		fp        idem.Fingerprint
		fn        func(context.Context, pgx.Tx) (idem.Response, error)
	}{
		{"stored", "k", fpA, ok},
		{"replayed", "k", fpA, ok},
		{"reused", "k", fpB, ok},
		{"fn's error", "err", fpA, func(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{}, errors.New("no") }},
		{"refusal", "rej", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{}, idem.Reject(idem.Response{Status: 409})
		}},
		{"fn's COMMIT", "commit", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 200}, tx.Commit(ctx)
		}},
		{"outcome unknown", "commit", fpA, ok},
		{"fn's ROLLBACK", "rollback", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 200}, tx.Rollback(ctx)
		}},
		{"aborted", "abort", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			_, _ = tx.Exec(ctx, `SELECT 1/0`)
			return idem.Response{Status: 200}, nil
		}},
		{"panic", "panic", fpA, func(context.Context, pgx.Tx) (idem.Response, error) { panic("fn") }},
	} {
		func() {
			defer func() { _ = recover() }()
			_, _ = idem.DoInTx(ctx, pool, scope, "conn-"+c.key, c.fp, c.fn)
		}()
		acquired(c.name, 0)
	}
	cctx, cancel := context.WithCancel(ctx)
	_, err := idem.DoInTx(cctx, pool, scope, "conn-cancel", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		cancel()
		return idem.Response{Status: 200}, nil
	})
	if err == nil {
		t.Fatal("ctx ended in fn: no error")
	}
	acquired("ctx ended in fn", 0)

	// A twin holds the key on a connection of the same pool (not
	// coalesced): the claims wait for it and run out.
	held, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	claimed, release, done := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		_, err := idem.DoInTx(ctx, held.Conn(), scope, "conn-held", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
			close(claimed)
			<-release
			return idem.Response{Status: 200}, nil
		})
		done <- err
	}()
	<-claimed
	errs := make(chan error, 4)
	for range cap(errs) {
		go func() {
			_, err := idem.DoInTx(ctx, pool, scope, "conn-held", fpA, ok)
			errs <- err
		}()
	}
	for range cap(errs) {
		if err := <-errs; !errors.Is(err, idem.ErrInProgress) {
			t.Errorf("behind a twin: %v, want ErrInProgress", err)
		}
	}
	acquired("behind a twin", 1)
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
