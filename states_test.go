package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// Two app instances (pools), keys done once and then retried after their
// TTL ran out, 4-6 concurrent retries per key split across the instances,
// while a pruner deletes expired rows: every call runs or replays (or
// meets a twin still running), and every execution that returned is the one
// committed effect of its key's generation.
func TestExpiredKeysRetriedAcrossInstancesWithPruner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	pools := make([]*pgxpool.Pool, 2)
	for i := range pools {
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		pools[i] = pool
	}
	if _, err := pools[0].Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, note text)`); err != nil {
		t.Fatal(err)
	}
	client, err := idem.New(idem.Config{TTL: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	const keys = 40
	var calls atomic.Int64
	for i := range keys {
		key := fmt.Sprintf("exp-%d", i)
		if _, err := client.DoInTx(ctx, pools[i%2], scope, key, fpA, recordEffect(&calls, key)); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(350 * time.Millisecond)

	stop := make(chan struct{})
	var pruned atomic.Int64
	var pruner sync.WaitGroup
	pruner.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, err := idem.Prune(ctx, pools[1], idem.PruneOptions{BatchSize: 7})
			if err != nil {
				t.Error("prune:", err)
				return
			}
			pruned.Add(n)
		}
	})

	var fresh atomic.Int64
	var wg sync.WaitGroup
	for i := range keys {
		key := fmt.Sprintf("exp-%d", i)
		for j := range 4 + i%3 {
			wg.Go(func() {
				// Each instance has its own Client, as separate processes do.
				c, _ := idem.New(idem.Config{TTL: 300 * time.Millisecond})
				res, err := c.DoInTx(ctx, pools[j%2], scope, key, fpA, recordEffect(&calls, key))
				switch {
				case errors.Is(err, idem.ErrInProgress):
				case err != nil:
					t.Errorf("%s: %v", key, err)
				case !res.Replayed:
					fresh.Add(1)
				}
			})
		}
	}
	wg.Wait()
	close(stop)
	pruner.Wait()
	t.Logf("%d executions after expiry, %d rows pruned meanwhile", fresh.Load(), pruned.Load())
	if got := int64(effects(t, pool0(pools))); got != keys+fresh.Load() || calls.Load() != got {
		t.Fatalf("%d effects, %d runs of fn, %d fresh results after %d first runs", got, calls.Load(), fresh.Load(), keys)
	}
}

func pool0(pools []*pgxpool.Pool) *pgxpool.Pool { return pools[0] }

// Do and DoInTx on keys held by reservations (every state Reserve leaves a
// committed row in).
func TestDoOnReservedKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	insert := func(key, status, lease string, fp idem.Fingerprint) {
		t.Helper()
		if _, err := pool.Exec(ctx, `INSERT INTO idem_keys
			(actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at, token, lease_expires_at)
			VALUES ($1, $2, $3, $4, $5, CASE WHEN $5 = 'succeeded' THEN 200 END, CASE WHEN $5 = 'succeeded' THEN '\x6f6b'::bytea END,
			        now() + interval '1 hour', 42, now() + $6::interval)`,
			scope.Actor, scope.Operation, key, fp[:], status, lease); err != nil {
			t.Fatal(err)
		}
	}
	insert("leased", "processing", "30 seconds", fpA)
	insert("lapsed", "processing", "-1 second", fpA)
	insert("unknown", "unknown", "-1 second", fpA)
	insert("retry", "failed_retryable", "-1 second", fpA)
	insert("retry-other", "failed_retryable", "-1 second", fpB)
	insert("done", "succeeded", "-1 second", fpA)

	var calls atomic.Int64
	for _, call := range []struct {
		name string
		do   func(key string, fp idem.Fingerprint) (idem.Result, error)
	}{
		{"DoInTx", func(key string, fp idem.Fingerprint) (idem.Result, error) {
			return idem.DoInTx(ctx, pool, scope, key, fp, recordEffect(&calls, key))
		}},
		{"Do", func(key string, fp idem.Fingerprint) (res idem.Result, err error) {
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				res, err = idem.Do(ctx, tx, scope, key, fp, recordEffect(&calls, key))
				return err
			})
			return res, err
		}},
	} {
		var ipe *idem.InProgressError
		if _, err := call.do("leased", fpA); !errors.As(err, &ipe) || ipe.RetryAfter < 25*time.Second || ipe.RetryAfter > 30*time.Second {
			t.Errorf("%s on a live lease: %v, want ErrInProgress with the lease's remaining time", call.name, err)
		}
		for _, key := range []string{"lapsed", "unknown"} {
			if _, err := call.do(key, fpA); !errors.Is(err, idem.ErrOutcomeUnknown) {
				t.Errorf("%s on %s: %v, want ErrOutcomeUnknown", call.name, key, err)
			}
		}
		if _, err := call.do("retry-other", fpA); !errors.Is(err, idem.ErrKeyReused) {
			t.Errorf("%s on failed_retryable with another fingerprint: %v", call.name, err)
		}
		if res, err := call.do("done", fpA); err != nil || !res.Replayed || string(res.Body) != "ok" {
			t.Errorf("%s on succeeded: %+v, %v", call.name, res, err)
		}
	}
	// A reservation that certainly did not execute runs again, once.
	res, err := idem.DoInTx(ctx, pool, scope, "retry", fpA, recordEffect(&calls, "retry"))
	if err != nil || res.Replayed {
		t.Fatalf("failed_retryable: %+v, %v; want a run", res, err)
	}
	if res, err := idem.DoInTx(ctx, pool, scope, "retry", fpA, recordEffect(&calls, "retry")); err != nil || !res.Replayed {
		t.Fatalf("after the run: %+v, %v; want a replay", res, err)
	}
	if calls.Load() != 1 || effects(t, pool) != 1 {
		t.Fatalf("fn ran %d times", calls.Load())
	}
	var status string
	var token int64
	if err := pool.QueryRow(ctx, `SELECT status, token FROM idem_keys WHERE idem_key = 'leased'`).Scan(&status, &token); err != nil || status != "processing" || token != 42 {
		t.Fatalf("the leased row changed: %s %d %v", status, token, err)
	}
}

// Header fields that would split or end a header line in whoever writes
// them out are refused, and nothing is stored.
func TestHeaderFieldsWithLineBreaksAreRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	for i, h := range []map[string][]string{
		{"X-A": {"one\r\nSet-Cookie: evil"}},
		{"X-A": {"line\nbreak"}},
		{"X-A": {"nul\x00"}},
		{"X-A\r\nB": {"v"}},
		{"X\nA": {"v"}},
	} {
		var calls atomic.Int64
		key := fmt.Sprintf("hdr-%d", i)
		_, err := idem.DoInTx(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			calls.Add(1)
			if _, err := recordEffect(&calls, key)(ctx, tx); err != nil {
				return idem.Response{}, err
			}
			return idem.Response{Status: 200, Header: h}, nil
		})
		if !errors.Is(err, idem.ErrInvalidResponse) {
			t.Errorf("%q: %v, want ErrInvalidResponse", h, err)
		}
	}
	if keyRows(t, pool) != 0 || effects(t, pool) != 0 {
		t.Fatalf("a refused response left %d keys, %d effects", keyRows(t, pool), effects(t, pool))
	}
}

func TestUnavailable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{idem.ErrUnavailable, true},
		{fmt.Errorf("x: %w", idem.ErrUnavailable), true},
		{&pgconn.PgError{Code: "08006"}, true},
		{&pgconn.PgError{Code: "53300"}, true}, // too many connections
		{&pgconn.PgError{Code: "57P01"}, true}, // admin shutdown
		{&pgconn.PgError{Code: "57014"}, true}, // statement timeout, cancelled
		{&pgconn.PgError{Code: "58030"}, true},
		{fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "57P03"}), true},
		{&pgconn.PgError{Code: "23505"}, false},
		{&pgconn.PgError{Code: "40001"}, false},
		{&pgconn.PgError{Code: "55P03"}, false},
		// Do's error when fn failed and undoing it found the connection gone.
		{errors.Join(&pgconn.PgError{Code: "23505"}, fmt.Errorf("idem: undo: %w", pgconn.ErrConnClosed)), true},
		{io.ErrUnexpectedEOF, true},
		{&net.OpError{Op: "dial", Err: errors.New("refused")}, true},
		{context.DeadlineExceeded, true},
		{context.Canceled, false},
		{idem.ErrKeyReused, false},
		{errors.New("something else"), false},
	} {
		if got := idem.Unavailable(tc.err); got != tc.want {
			t.Errorf("Unavailable(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// A reservation finished after its TTL ran out (a lease longer than the
// TTL, a late reconciliation) is kept for a TTL from its finish: the next
// Reserve replays it and never executes again.
func TestReservationFinishedAfterItsTTLReplays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	short, err := idem.New(idem.Config{TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	resp := idem.Response{Status: 201, Body: []byte(`{"charged":true}`)}

	// Completed after the TTL.
	r, err := short.Reserve(ctx, pool, scope, "late-complete", fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	if err := short.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error { return short.Complete(ctx, tx, r, resp) }); err != nil {
		t.Fatal(err)
	}
	again, err := short.Reserve(ctx, pool, scope, "late-complete", fpA, time.Minute)
	if err != nil || !again.Replayed || string(again.Body) != string(resp.Body) {
		t.Fatalf("after a late Complete: %+v, %v; want the replay", again, err)
	}

	// Resolved after the TTL.
	r, err = short.Reserve(ctx, pool, scope, "late-resolve", fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := short.MarkUnknown(ctx, pool, r, "timed out"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	if err := short.Resolve(ctx, pool, scope, "late-resolve", idem.Resolution{Token: r.Token, Succeeded: &resp, Reason: "found"}); err != nil {
		t.Fatal(err)
	}
	again, err = short.Reserve(ctx, pool, scope, "late-resolve", fpA, time.Minute)
	if err != nil || !again.Replayed {
		t.Fatalf("after a late Resolve: %+v, %v; want the replay", again, err)
	}
	if _, err := idem.Prune(ctx, pool, idem.PruneOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Lookup(ctx, pool, scope, "late-resolve"); err != nil {
		t.Fatalf("Prune deleted a record resolved just now: %v", err)
	}
}
