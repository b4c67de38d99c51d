package idem_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// runTogether starts n calls of f at once and waits for them.
func runTogether(n int, f func(i int)) {
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			f(i)
		})
	}
	close(start)
	wg.Wait()
}

// Concurrent DoInTx calls with one key on one Client share the first one's
// outcome without going to the database.
func TestDoInTxCoalescesDuplicates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client, err := idem.New(idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	slow := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		time.Sleep(100 * time.Millisecond)
		return recordEffect(&calls, "co")(ctx, tx)
	}
	const n = 12
	results := make([]idem.Result, n)
	errs := make([]error, n)
	runTogether(n, func(i int) {
		fp := fpA
		if i == n-1 {
			fp = fpB // a client bug: same key, another request
		}
		results[i], errs[i] = client.DoInTx(ctx, pool, scope, "co", fp, slow)
		if errs[i] == nil && !results[i].Replayed {
			// The caller owns what it got, and may change it at once
			// while the others are still reading theirs (-race checks).
			got := results[i]
			results[i].Body = bytes.Clone(got.Body) // for the checks below
			got.Body[0] = 'X'
			got.Header["Location"][0] = "changed"
		}
	})
	// Whichever call won, the calls with its fingerprint replay its
	// response and the others are refused.
	winner := -1
	for i := range n {
		if errs[i] == nil && !results[i].Replayed {
			if winner >= 0 {
				t.Fatalf("calls %d and %d both executed", winner, i)
			}
			winner = i
		}
	}
	if winner < 0 || calls.Load() != 1 || effects(t, pool) != 1 {
		t.Fatalf("winner %d, calls %d, effects %d; want one execution", winner, calls.Load(), effects(t, pool))
	}
	winnerIsB := winner == n-1
	for i := range n {
		sameRequest := (i == n-1) == winnerIsB
		switch {
		case i == winner:
		case sameRequest && (errs[i] != nil || !bytes.Equal(results[i].Body, results[winner].Body)):
			t.Fatalf("call %d: %v %q, want a replay of %q", i, errs[i], results[i].Body, results[winner].Body)
		case !sameRequest && !errors.Is(errs[i], idem.ErrKeyReused):
			t.Fatalf("call %d: err = %v, want ErrKeyReused", i, errs[i])
		}
	}
	// Followers get their own copies of the response.
	for i := range n {
		if i != winner && errs[i] == nil && (results[i].Header["Location"][0] == "changed" || results[i].Body[0] == 'X') {
			t.Fatal("followers share the leader's response")
		}
	}
}

// When the first call fails, nothing was stored and the others go to the
// database themselves: one of them runs fn. That holds too when the leader's
// fn fails with an in-progress error of another key (a nested Do's): only
// the leader's own claim giving up makes the others give up.
func TestDoInTxCoalescedLeaderFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client, err := idem.New(idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	boom := errors.New("transient")
	var panics atomic.Int64
	for _, mode := range []string{"error", "panic", "in-progress"} {
		key := "lead-" + mode
		var first atomic.Bool
		fn := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			if first.CompareAndSwap(false, true) {
				time.Sleep(100 * time.Millisecond)
				switch mode {
				case "panic":
					panic("leader")
				case "in-progress":
					return idem.Response{}, &idem.InProgressError{RetryAfter: time.Second}
				}
				return idem.Response{}, boom
			}
			return recordEffect(&calls, key)(ctx, tx)
		}
		errs := make([]error, 6)
		fresh := atomic.Int64{}
		runTogether(6, func(i int) {
			defer func() {
				if p := recover(); p != nil {
					panics.Add(1)
				}
			}()
			res, err := client.DoInTx(ctx, pool, scope, key, fpA, fn)
			errs[i] = err
			if err == nil && !res.Replayed {
				fresh.Add(1)
			}
		})
		failed := 0
		for _, err := range errs {
			if err != nil {
				failed++
			}
		}
		if mode != "panic" && failed != 1 || fresh.Load() != 1 {
			t.Fatalf("%s: %d failed, %d fresh; want the leader's failure and one execution after it", mode, failed, fresh.Load())
		}
	}
	if panics.Load() != 1 || calls.Load() != 3 {
		t.Fatalf("panics %d, executions %d; want 1 and 3", panics.Load(), calls.Load())
	}
}

// A waiting duplicate gives up after Config.Wait, as it would at the claim.
func TestDoInTxCoalescedWaitRunsOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client, err := idem.New(idem.Config{Wait: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	release := make(chan struct{})
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := client.DoInTx(ctx, pool, scope, "long", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			close(started)
			<-release
			return recordEffect(&calls, "long")(ctx, tx)
		})
		done <- err
	}()
	<-started
	_, err = client.DoInTx(ctx, pool, scope, "long", fpA, recordEffect(&calls, "long"))
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("err = %v, want ErrInProgress", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := client.DoInTx(cctx, pool, scope, "long", fpA, recordEffect(&calls, "long")); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled waiter: err = %v", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 1 {
		t.Fatalf("fn ran %d times", calls.Load())
	}
}

// The same key on two databases is two requests, even at the same moment on
// one Client.
func TestDoInTxDoesNotCoalesceAcrossPools(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pools := []*pgxpool.Pool{newPool(t), newPool(t)}
	client, err := idem.New(idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	slow := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		time.Sleep(50 * time.Millisecond)
		return recordEffect(&calls, "x")(ctx, tx)
	}
	results := make([]idem.Result, 4)
	errs := make([]error, 4)
	runTogether(4, func(i int) {
		results[i], errs[i] = client.DoInTx(ctx, pools[i%2], scope, "same-key", fpA, slow)
	})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	for _, pool := range pools {
		if n := effects(t, pool); n != 1 {
			t.Fatalf("a database holds %d effects, want 1 each", n)
		}
	}
	if calls.Load() != 2 {
		t.Fatalf("fn ran %d times, want once per database", calls.Load())
	}
}

// When the key is held by a transaction the leader's claim cannot wait out,
// the leader and every waiter get ErrInProgress, and fn never runs.
func TestDoInTxCoalescedKeyHeldElsewhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client, err := idem.New(idem.Config{Wait: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	holder, err := pool.Begin(ctx) // another "process" holds the key
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := client.Do(ctx, holder, scope, "held", fpA, recordEffect(&calls, "held")); err != nil {
		t.Fatal(err)
	}
	other, err := pgxpool.New(ctx, pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	errs := make([]error, 6)
	runTogether(len(errs), func(i int) {
		_, errs[i] = client.DoInTx(ctx, other, scope, "held", fpA, recordEffect(&calls, "held"))
	})
	for i, err := range errs {
		if !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("call %d: err = %v, want ErrInProgress", i, err)
		}
	}
	if calls.Load() != 1 {
		t.Fatalf("fn ran %d times; want only the holder's run", calls.Load())
	}
}
