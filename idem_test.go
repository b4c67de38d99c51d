package idem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"reflect"
	"strings"
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

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// newPool returns a pool on a fresh, migrated database with an "effects"
// table that test functions write to, one row per execution.
func newPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, idem.Migrate)
	if _, err := pool.Exec(context.Background(),
		`CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, note text)`); err != nil {
		t.Fatal(err)
	}
	return pool
}

// withDeferredConflict creates the table deferred, holding the value 1
// under a deferred unique constraint: a transaction that inserts 1 again
// fails at COMMIT.
func withDeferredConflict(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `CREATE TABLE deferred (v int UNIQUE DEFERRABLE INITIALLY DEFERRED);
		INSERT INTO deferred VALUES (1)`); err != nil {
		t.Fatal(err)
	}
}

// recordEffect is an fn that writes one effects row and returns a response
// naming it; calls counts its executions.
func recordEffect(calls *atomic.Int64, key string) func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
	return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		calls.Add(1)
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO effects (key) VALUES ($1) RETURNING id`, key).Scan(&id); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{
			Status: 201,
			Header: map[string][]string{"Content-Type": {"application/json"}, "Location": {fmt.Sprintf("/effects/%d", id)}},
			Body:   fmt.Appendf(nil, `{"id":%d}`, id),
		}, nil
	}
}

func count(t *testing.T, pool *pgxpool.Pool, query string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func effects(t *testing.T, pool *pgxpool.Pool) int {
	return count(t, pool, `SELECT count(*) FROM effects`)
}

func keyRows(t *testing.T, pool *pgxpool.Pool) int {
	return count(t, pool, `SELECT count(*) FROM idem_keys`)
}

var (
	scope = idem.Scope{Actor: "alice", Operation: "draw"}
	fpA   = idem.FingerprintParts([]byte("A"))
	fpB   = idem.FingerprintParts([]byte("B"))
)

func TestFirstCallThenReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64

	first, err := idem.DoInTx(ctx, pool, scope, "key-1", fpA, recordEffect(&calls, "key-1"))
	if err != nil {
		t.Fatal(err)
	}
	if first.Replayed || first.Status != 201 || calls.Load() != 1 {
		t.Fatalf("first call: %+v, calls %d", first, calls.Load())
	}
	for range 3 {
		again, err := idem.DoInTx(ctx, pool, scope, "key-1", fpA, recordEffect(&calls, "key-1"))
		if err != nil {
			t.Fatal(err)
		}
		if !again.Replayed {
			t.Fatal("retry not replayed")
		}
		if !reflect.DeepEqual(again.Response, first.Response) {
			t.Fatalf("replay differs:\n got %#v\nwant %#v", again.Response, first.Response)
		}
	}
	if calls.Load() != 1 || effects(t, pool) != 1 {
		t.Fatalf("fn ran %d times, %d effects; want 1", calls.Load(), effects(t, pool))
	}

	// A response without body or headers reads the same first and replayed.
	empty := func(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{Status: 204}, nil }
	first, err = idem.DoInTx(ctx, pool, scope, "key-empty", fpA, empty)
	if err != nil {
		t.Fatal(err)
	}
	again, err := idem.DoInTx(ctx, pool, scope, "key-empty", fpA, empty)
	if err != nil || !again.Replayed || !reflect.DeepEqual(again.Response, first.Response) {
		t.Fatalf("empty response: first %#v, replay %#v, %v", first.Response, again.Response, err)
	}
}

func TestReplayIsByteExact(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	// Bytes that text handling would mangle: NUL, invalid UTF-8, CR LF, and
	// JSON whose key order and spacing must survive.
	body := []byte("{\"b\": 1,  \"a\":\"\x00\xff\xfe\"}\r\n")
	header := map[string][]string{
		"Content-Type": {"application/json; charset=utf-8"},
		"X-Multi":      {"one", "two", ""},
		"X-Empty":      {},
		"X-Html":       {"<a href=\"x\">&amp;</a>"},
		"X-Escapes":    {`a"b\c`, "tab\there", "\x01\x1f", "é ☃ \u2028"},
		"X-Nil":        nil,
	}
	want := idem.Response{Status: 418, Header: header, Body: body}
	_, err := idem.DoInTx(ctx, pool, scope, "bytes", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return want, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := idem.DoInTx(ctx, pool, scope, "bytes", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		t.Fatal("fn ran on replay")
		return idem.Response{}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !got.Replayed || got.Status != 418 || !bytes.Equal(got.Body, body) || !reflect.DeepEqual(got.Header, header) {
		t.Fatalf("replay = %#v", got)
	}

	// No header map and no body are replayed as such.
	_, err = idem.DoInTx(ctx, pool, scope, "empty", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 204}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err = idem.DoInTx(ctx, pool, scope, "empty", fpA, recordEffect(new(atomic.Int64), "x"))
	if err != nil {
		t.Fatal(err)
	}
	if !got.Replayed || got.Status != 204 || len(got.Body) != 0 || got.Header != nil {
		t.Fatalf("replay = %#v", got)
	}
}

func TestKeyReusedWithDifferentFingerprint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	if _, err := idem.DoInTx(ctx, pool, scope, "k", fpA, recordEffect(&calls, "k")); err != nil {
		t.Fatal(err)
	}
	_, err := idem.DoInTx(ctx, pool, scope, "k", fpB, recordEffect(&calls, "k"))
	if !errors.Is(err, idem.ErrKeyReused) {
		t.Fatalf("err = %v, want ErrKeyReused", err)
	}
	if calls.Load() != 1 || effects(t, pool) != 1 || keyRows(t, pool) != 1 {
		t.Fatal("a reused key changed something")
	}
	// The original request still replays.
	res, err := idem.DoInTx(ctx, pool, scope, "k", fpA, recordEffect(&calls, "k"))
	if err != nil || !res.Replayed {
		t.Fatalf("replay after reuse: %+v, %v", res, err)
	}
}

func TestScopesAreIndependent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	scopes := []idem.Scope{
		{Actor: "alice", Operation: "draw"},
		{Actor: "bob", Operation: "draw"},
		{Actor: "alice", Operation: "shipping_request"},
	}
	for _, s := range scopes {
		res, err := idem.DoInTx(ctx, pool, s, "shared-key", fpA, recordEffect(&calls, s.Actor+"/"+s.Operation))
		if err != nil {
			t.Fatal(err)
		}
		if res.Replayed {
			t.Fatalf("scope %+v replayed another scope's response", s)
		}
	}
	// A different fingerprint under another actor is not a reuse either.
	if _, err := idem.DoInTx(ctx, pool, idem.Scope{Actor: "carol", Operation: "draw"}, "shared-key", fpB,
		recordEffect(&calls, "carol")); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 4 || keyRows(t, pool) != 4 {
		t.Fatalf("calls %d, rows %d; want 4 and 4", calls.Load(), keyRows(t, pool))
	}
}

func TestConcurrentDuplicatesExecuteOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	const n = 16
	var calls atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		// Hold the claim a little so the duplicates really wait.
		time.Sleep(50 * time.Millisecond)
		return recordEffect(&calls, "storm")(ctx, tx)
	}
	start := make(chan struct{})
	results := make([]idem.Result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			// A Client of its own for each, so the duplicates meet at the
			// primary key, as they would from separate processes, rather
			// than in DoInTx's in-process coalescing.
			client, err := idem.New(idem.Config{})
			if err != nil {
				errs[i] = err
				return
			}
			<-start
			if i%2 == 0 {
				results[i], errs[i] = client.DoInTx(ctx, pool, scope, "storm", fpA, fn)
				return
			}
			errs[i] = client.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				var err error
				results[i], err = client.Do(ctx, tx, scope, "storm", fpA, fn)
				return err
			})
		})
	}
	close(start)
	wg.Wait()
	fresh := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if !results[i].Replayed {
			fresh++
		}
		if !bytes.Equal(results[i].Body, results[0].Body) {
			t.Fatalf("call %d got %q, call 0 got %q", i, results[i].Body, results[0].Body)
		}
	}
	if fresh != 1 || calls.Load() != 1 || effects(t, pool) != 1 {
		t.Fatalf("fresh %d, calls %d, effects %d; want 1 each", fresh, calls.Load(), effects(t, pool))
	}
}

func TestConcurrentDuplicatesSerializable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	for _, level := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(level), func(t *testing.T) {
			key := "iso-" + strings.ReplaceAll(string(level), " ", "-")
			var calls atomic.Int64
			var wg sync.WaitGroup
			var failed atomic.Int64
			replayed := atomic.Int64{}
			for range 8 {
				wg.Go(func() {
					// One Client each: the race happens in the database.
					client, err := idem.New(idem.Config{IsolationLevel: level, MaxRetries: 20})
					if err != nil {
						t.Error(err)
						failed.Add(1)
						return
					}
					res, err := client.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key))
					if err != nil {
						t.Error(err)
						failed.Add(1)
						return
					}
					if res.Replayed {
						replayed.Add(1)
					}
				})
			}
			wg.Wait()
			if failed.Load() == 0 && (replayed.Load() != 7 || count(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key) != 1) {
				t.Fatalf("replayed %d, effects %d; want 7 and 1", replayed.Load(),
					count(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key))
			}
		})
	}
}

// holdClaim claims key in a transaction of its own and keeps it open until
// release is closed; then it commits (commit true) or rolls back.
func holdClaim(t *testing.T, pool *pgxpool.Pool, key string, calls *atomic.Int64, commit bool) (claimed, release chan struct{}, done chan error) {
	t.Helper()
	claimed, release, done = make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		ctx := context.Background()
		tx, err := pool.Begin(ctx)
		if err != nil {
			done <- err
			return
		}
		_, err = idem.Do(ctx, tx, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			r, err := recordEffect(calls, key)(ctx, tx)
			close(claimed)
			<-release
			return r, err
		})
		if err == nil && commit {
			err = tx.Commit(ctx)
		} else {
			err = errors.Join(err, tx.Rollback(ctx))
		}
		done <- err
	}()
	return claimed, release, done
}

func TestDuplicateReplaysAfterWinnerCommits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	claimed, release, done := holdClaim(t, pool, "wait", &calls, true)
	<-claimed
	go func() { time.Sleep(200 * time.Millisecond); close(release) }()
	res, err := idem.DoInTx(ctx, pool, scope, "wait", fpA, recordEffect(&calls, "wait"))
	if err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !res.Replayed || calls.Load() != 1 {
		t.Fatalf("replayed %v, calls %d", res.Replayed, calls.Load())
	}
}

func TestDuplicateExecutesAfterWinnerRollsBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	claimed, release, done := holdClaim(t, pool, "rb", &calls, false)
	<-claimed
	go func() { time.Sleep(200 * time.Millisecond); close(release) }()
	res, err := idem.DoInTx(ctx, pool, scope, "rb", fpA, recordEffect(&calls, "rb"))
	if err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if res.Replayed || calls.Load() != 2 || effects(t, pool) != 1 {
		t.Fatalf("replayed %v, calls %d, effects %d", res.Replayed, calls.Load(), effects(t, pool))
	}
}

func TestDuplicateGivesUpAfterWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client, err := idem.New(idem.Config{Wait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	claimed, release, done := holdClaim(t, pool, "slow", &calls, true)
	<-claimed

	// In the caller's own transaction: ErrInProgress, and the transaction
	// is as it was before Do: what it wrote before still commits.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ('before', 'caller')`); err != nil {
		t.Fatal(err)
	}
	_, err = client.Do(ctx, tx, scope, "slow", fpA, recordEffect(&calls, "slow"))
	var inProgress *idem.InProgressError
	if !errors.Is(err, idem.ErrInProgress) || !errors.As(err, &inProgress) || inProgress.RetryAfter <= 0 {
		t.Fatalf("err = %v, want ErrInProgress with a retry hint", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit after ErrInProgress: %v", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects WHERE note = 'caller'`); n != 1 {
		t.Fatalf("the caller's own write: %d rows, want 1", n)
	}
	// DoInTx rolls its own transaction back.
	if _, err := client.DoInTx(ctx, pool, scope, "slow", fpA, recordEffect(&calls, "slow")); !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("DoInTx: err = %v, want ErrInProgress", err)
	}

	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	res, err := client.DoInTx(ctx, pool, scope, "slow", fpA, recordEffect(&calls, "slow"))
	if err != nil || !res.Replayed || calls.Load() != 1 {
		t.Fatalf("after the winner: %+v, %v, calls %d", res, err, calls.Load())
	}
}

func TestRejectIsStoredAndReplayed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	refusal := idem.Response{Status: 402, Header: map[string][]string{"Content-Type": {"application/problem+json"}},
		Body: []byte(`{"title":"insufficient points"}`)}
	fn := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		calls.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ('rej', 'must be undone')`); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{}, fmt.Errorf("draw: %w", idem.Reject(refusal))
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res, err := idem.Do(ctx, tx, scope, "rej", fpA, fn)
	if err != nil {
		t.Fatal(err)
	}
	if res.Replayed || !reflect.DeepEqual(res.Response, refusal) {
		t.Fatalf("result = %+v", res)
	}
	// The caller's own writes around Do survive; fn's are undone.
	if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ('caller', 'kept')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = 'rej'`); n != 0 {
		t.Fatalf("fn's writes survived a Reject: %d rows", n)
	}
	if effects(t, pool) != 1 {
		t.Fatal("the caller's write was lost")
	}
	if got, ok := idem.RejectedResponse(fmt.Errorf("wrapped: %w", idem.Reject(refusal))); !ok || !reflect.DeepEqual(got, refusal) {
		t.Fatalf("RejectedResponse = %+v, %v", got, ok)
	}
	if _, ok := idem.RejectedResponse(errors.New("other")); ok {
		t.Fatal("RejectedResponse accepted a plain error")
	}
	again, err := idem.DoInTx(ctx, pool, scope, "rej", fpA, fn)
	if err != nil || !again.Replayed || !reflect.DeepEqual(again.Response, refusal) || calls.Load() != 1 {
		t.Fatalf("replay of refusal: %+v, %v, calls %d", again, err, calls.Load())
	}
}

func TestErrorStoresNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	boom := errors.New("gateway timeout")
	failing := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		if _, err := recordEffect(&calls, "err")(ctx, tx); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{}, boom
	}

	// The caller commits anyway: fn's writes and the claim are already gone.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Do(ctx, tx, scope, "err", fpA, failing); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want fn's error", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("transaction unusable after fn's error: %v", err)
	}
	if effects(t, pool) != 0 || keyRows(t, pool) != 0 {
		t.Fatal("a failed fn left rows behind")
	}

	// An SQL error inside fn aborts its statements, not the caller's
	// transaction.
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = idem.Do(ctx, tx, scope, "err", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		_, err := tx.Exec(ctx, `SELECT 1/0`)
		return idem.Response{}, err
	})
	if err == nil {
		t.Fatal("want the division error")
	}
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatalf("transaction unusable after an SQL error in fn: %v", err)
	}
	_ = tx.Rollback(ctx)

	// The key is free: the retry executes normally.
	res, err := idem.DoInTx(ctx, pool, scope, "err", fpA, recordEffect(&calls, "err"))
	if err != nil || res.Replayed || effects(t, pool) != 1 {
		t.Fatalf("retry: %+v, %v, effects %d", res, err, effects(t, pool))
	}
}

func TestCallerRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Do(ctx, tx, scope, "rollback", fpA, recordEffect(&calls, "rollback")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if effects(t, pool) != 0 || keyRows(t, pool) != 0 {
		t.Fatal("rolled back work is visible")
	}
	res, err := idem.DoInTx(ctx, pool, scope, "rollback", fpA, recordEffect(&calls, "rollback"))
	if err != nil || res.Replayed || calls.Load() != 2 || effects(t, pool) != 1 {
		t.Fatalf("retry: %+v, %v, calls %d", res, err, calls.Load())
	}
}

func TestPanicInFnStoresNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	func() {
		defer func() {
			if p := recover(); p != "kaboom" {
				t.Fatalf("recovered %v, want the panic passed on", p)
			}
		}()
		_, _ = idem.DoInTx(ctx, pool, scope, "panic", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			_, _ = recordEffect(&calls, "panic")(ctx, tx)
			panic("kaboom")
		})
	}()
	if effects(t, pool) != 0 || keyRows(t, pool) != 0 {
		t.Fatal("a panicking fn left rows behind")
	}
	res, err := idem.DoInTx(ctx, pool, scope, "panic", fpA, recordEffect(&calls, "panic"))
	if err != nil || res.Replayed {
		t.Fatalf("retry: %+v, %v", res, err)
	}
}

func TestExpiredKeyIsNewRequest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	short, err := idem.New(idem.Config{TTL: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	if _, err := short.DoInTx(ctx, pool, scope, "ttl", fpA, recordEffect(&calls, "ttl")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	// Even a different fingerprint is a new request once the key expired.
	res, err := idem.DoInTx(ctx, pool, scope, "ttl", fpB, recordEffect(&calls, "ttl"))
	if err != nil || res.Replayed || calls.Load() != 2 {
		t.Fatalf("after expiry: %+v, %v, calls %d", res, err, calls.Load())
	}
	// The new claim has the default TTL and replays.
	res, err = idem.DoInTx(ctx, pool, scope, "ttl", fpB, recordEffect(&calls, "ttl"))
	if err != nil || !res.Replayed || keyRows(t, pool) != 1 {
		t.Fatalf("replay after takeover: %+v, %v", res, err)
	}
}

func TestExpiredKeyConcurrentTakeover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	short, err := idem.New(idem.Config{TTL: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	if _, err := short.DoInTx(ctx, pool, scope, "ttl", fpA, recordEffect(&calls, "ttl")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(350 * time.Millisecond)
	var wg sync.WaitGroup
	var fresh atomic.Int64
	for range 8 {
		wg.Go(func() {
			res, err := idem.DoInTx(ctx, pool, scope, "ttl", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				time.Sleep(30 * time.Millisecond)
				return recordEffect(&calls, "ttl")(ctx, tx)
			})
			if err != nil {
				t.Error(err)
				return
			}
			if !res.Replayed {
				fresh.Add(1)
			}
		})
	}
	wg.Wait()
	if fresh.Load() != 1 || calls.Load() != 2 {
		t.Fatalf("fresh %d, calls %d; want one takeover", fresh.Load(), calls.Load())
	}
}

func TestSeveralKeysInOneTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		for _, key := range []string{"a", "b"} {
			if _, err := idem.Do(ctx, tx, scope, key, fpA, recordEffect(&calls, key)); err != nil {
				return err
			}
		}
		// Nested: fn of one key runs Do for another.
		_, err := idem.Do(ctx, tx, scope, "outer", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			inner, err := idem.Do(ctx, tx, scope, "inner", fpA, recordEffect(&calls, "inner"))
			if err != nil {
				return idem.Response{}, err
			}
			return idem.Response{Status: 200, Body: inner.Body}, nil
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if keyRows(t, pool) != 4 || calls.Load() != 3 {
		t.Fatalf("rows %d, calls %d", keyRows(t, pool), calls.Load())
	}
}

// A Do nested in DoInTx's fn runs in DoInTx's transaction like any other
// Do: it releases its savepoint and leaves the commit to DoInTx, so the
// outer outcome decides for both.
func TestDoNestedInDoInTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	inner := idem.Scope{Actor: scope.Actor, Operation: "inner"}
	outer := func(key string, outcome error) func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			res, err := idem.Do(ctx, tx, inner, key, fpA, recordEffect(&calls, key))
			if err != nil {
				return idem.Response{}, err
			}
			if outcome != nil {
				return idem.Response{}, outcome
			}
			return idem.Response{Status: 200, Body: res.Body}, nil
		}
	}

	// Success: both keys and the effect commit together.
	res, err := idem.DoInTx(ctx, pool, scope, "n1", fpA, outer("n1", nil))
	if err != nil || res.Replayed {
		t.Fatalf("first: %+v, %v", res, err)
	}
	if keyRows(t, pool) != 2 || effects(t, pool) != 1 {
		t.Fatalf("after success: %d keys, %d effects", keyRows(t, pool), effects(t, pool))
	}
	// The inner key is now committed: a new outer key replays it inside.
	if res, err = idem.DoInTx(ctx, pool, scope, "n1b", fpA, outer("n1", nil)); err != nil || res.Replayed {
		t.Fatalf("outer over a committed inner key: %+v, %v", res, err)
	}

	// Reject: the inner Do's key and effect are undone with fn's writes.
	refusal := idem.Response{Status: 409, Body: []byte("no")}
	res, err = idem.DoInTx(ctx, pool, scope, "n2", fpA, outer("n2", idem.Reject(refusal)))
	if err != nil || res.Status != 409 {
		t.Fatalf("reject: %+v, %v", res, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE idem_key = 'n2'`); n != 1 {
		t.Fatalf("after reject: %d rows for n2, want the outer refusal only", n)
	}
	if effects(t, pool) != 1 {
		t.Fatalf("after reject: %d effects", effects(t, pool))
	}
	res, err = idem.DoInTx(ctx, pool, scope, "n2", fpA, outer("n2", nil))
	if err != nil || !res.Replayed || res.Status != 409 {
		t.Fatalf("reject replay: %+v, %v", res, err)
	}

	// Error: nothing of either remains, and the key runs again later.
	boom := errors.New("boom")
	if _, err = idem.DoInTx(ctx, pool, scope, "n3", fpA, outer("n3", boom)); !errors.Is(err, boom) {
		t.Fatalf("error: %v", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE idem_key = 'n3'`); n != 0 || effects(t, pool) != 1 {
		t.Fatalf("after error: %d rows for n3, %d effects", n, effects(t, pool))
	}
	if res, err = idem.DoInTx(ctx, pool, scope, "n3", fpA, outer("n3", nil)); err != nil || res.Replayed {
		t.Fatalf("after error, again: %+v, %v", res, err)
	}
}

func TestLostResponse(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64

	// The first attempt commits, but the response never reaches the client:
	// the connection is terminated right after COMMIT.
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var pid uint32
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	first, err := idem.DoInTx(ctx, conn.Conn(), scope, "lost", fpA, recordEffect(&calls, "lost"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	// The client notices the dead connection; the pool drops it.
	_ = conn.Conn().Close(ctx)
	conn.Release()

	// The retry on a new connection replays.
	res, err := idem.DoInTx(ctx, pool, scope, "lost", fpA, recordEffect(&calls, "lost"))
	if err != nil || !res.Replayed || !bytes.Equal(res.Body, first.Body) {
		t.Fatalf("retry: %+v, %v", res, err)
	}
	if calls.Load() != 1 || effects(t, pool) != 1 {
		t.Fatalf("calls %d, effects %d", calls.Load(), effects(t, pool))
	}
}

func TestCancelledAfterCommit(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	var calls atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Do(ctx, tx, scope, "cancel", fpA, recordEffect(&calls, "cancel")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	cancel() // the client gave up right after the commit: its response is lost
	res, err := idem.DoInTx(context.Background(), pool, scope, "cancel", fpA, recordEffect(&calls, "cancel"))
	if err != nil || !res.Replayed || calls.Load() != 1 {
		t.Fatalf("retry: %+v, %v, calls %d", res, err, calls.Load())
	}
}

func TestBackendTerminatedBeforeCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	_, err := idem.DoInTx(ctx, pool, scope, "killed", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		if _, err := recordEffect(&calls, "killed")(ctx, tx); err != nil {
			return idem.Response{}, err
		}
		var pid uint32
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return idem.Response{}, err
		}
		// Another session kills this backend mid-transaction.
		if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
			return idem.Response{}, err
		}
		_, err := tx.Exec(ctx, `SELECT 1`)
		return idem.Response{Status: 200}, err
	})
	if !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("err = %v, want ErrUnavailable from the terminated backend", err)
	}
	if effects(t, pool) != 0 || keyRows(t, pool) != 0 {
		t.Fatal("a terminated transaction left rows behind")
	}
	res, err := idem.DoInTx(ctx, pool, scope, "killed", fpA, recordEffect(&calls, "killed"))
	if err != nil || res.Replayed || effects(t, pool) != 1 {
		t.Fatalf("retry: %+v, %v", res, err)
	}
}

// Errors of fn come back as they are while the connection is fine, even
// when they look like network errors.
func TestFnErrorsComeBackAsTheyAre(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	for _, want := range []error{io.ErrUnexpectedEOF, io.EOF, context.DeadlineExceeded, net.ErrClosed} {
		_, err := idem.DoInTx(ctx, pool, scope, "as-is", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{}, want
		})
		if err != want {
			t.Fatalf("DoInTx: err = %v, want %v itself", err, want)
		}
		err = idem.InTx(ctx, pool, func(context.Context, pgx.Tx) error { return want })
		if err != want {
			t.Fatalf("InTx: err = %v, want %v itself", err, want)
		}
	}
}

// fn cancels the context and fails: Do still undoes fn's writes and the
// claim, so a caller that commits anyway leaves nothing behind.
func TestUndoOutlivesCancelledContext(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	var calls atomic.Int64
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	for _, reject := range []bool{false, true} {
		ctx, cancel := context.WithCancel(context.Background())
		key := fmt.Sprintf("cancelled-%t", reject)
		_, err = idem.Do(ctx, tx, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			if _, err := recordEffect(&calls, key)(ctx, tx); err != nil {
				return idem.Response{}, err
			}
			cancel()
			if reject {
				return idem.Response{}, idem.Reject(idem.Response{Status: 409})
			}
			return idem.Response{}, context.Canceled
		})
		if reject && err == nil {
			continue // the refusal was stored in the caller's transaction
		}
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("reject %t: err = %v", reject, err)
		}
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	if effects(t, pool) != 0 {
		t.Fatalf("%d effects committed after fn failed", effects(t, pool))
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE status = 'processing'`); n != 0 {
		t.Fatalf("%d claims left behind", n)
	}
}

// A COMMIT that fails (a deferred constraint) leaves nothing, reports the
// commit's error alone, and the key runs again.
func TestDoInTxCommitFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	withDeferredConflict(t, pool)
	var calls atomic.Int64
	_, err := idem.DoInTx(ctx, pool, scope, "deferred", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO deferred VALUES (1)`); err != nil {
			return idem.Response{}, err
		}
		return recordEffect(&calls, "deferred")(ctx, tx)
	})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" || strings.Contains(err.Error(), "undo") {
		t.Fatalf("err = %v, want the commit's unique violation alone", err)
	}
	if effects(t, pool) != 0 || keyRows(t, pool) != 0 {
		t.Fatal("a failed commit left rows")
	}
	res, err := idem.DoInTx(ctx, pool, scope, "deferred", fpA, recordEffect(&calls, "deferred"))
	if err != nil || res.Replayed {
		t.Fatalf("again: %+v, %v", res, err)
	}
}

func TestStoreDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var calls atomic.Int64
	_, err = idem.DoInTx(ctx, pool, scope, "down", fpA, recordEffect(&calls, "down"))
	if !errors.Is(err, idem.ErrUnavailable) || calls.Load() != 0 {
		t.Fatalf("err %v, calls %d: want ErrUnavailable, and fn must not run without the store", err, calls.Load())
	}
}

func TestBadInputTouchesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	fn := recordEffect(&calls, "bad")
	cases := []struct {
		name  string
		scope idem.Scope
		key   string
		want  error
	}{
		{"empty key", scope, "", idem.ErrInvalidKey},
		{"256 bytes", scope, strings.Repeat("k", 256), idem.ErrInvalidKey},
		{"space", scope, "a b", idem.ErrInvalidKey},
		{"tab", scope, "a\tb", idem.ErrInvalidKey},
		{"newline", scope, "a\n", idem.ErrInvalidKey},
		{"DEL", scope, "a\x7f", idem.ErrInvalidKey},
		{"non-ASCII", scope, "clé", idem.ErrInvalidKey},
		{"NUL", scope, "a\x00", idem.ErrInvalidKey},
		{"empty actor", idem.Scope{Operation: "draw"}, "k", idem.ErrInvalidScope},
		{"empty operation", idem.Scope{Actor: "alice"}, "k", idem.ErrInvalidScope},
		{"long actor", idem.Scope{Actor: strings.Repeat("a", 256), Operation: "draw"}, "k", idem.ErrInvalidScope},
		{"NUL actor", idem.Scope{Actor: "a\x00", Operation: "draw"}, "k", idem.ErrInvalidScope},
		{"invalid UTF-8 operation", idem.Scope{Actor: "a", Operation: "\xff"}, "k", idem.ErrInvalidScope},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if _, err := idem.DoInTx(ctx, pool, c.scope, c.key, fpA, fn); !errors.Is(err, c.want) {
				t.Fatalf("DoInTx: err = %v, want %v", err, c.want)
			}
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if _, err := idem.Do(ctx, tx, c.scope, c.key, fpA, fn); !errors.Is(err, c.want) {
				t.Fatalf("Do: err = %v, want %v", err, c.want)
			}
			if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
				t.Fatalf("transaction unusable: %v", err)
			}
		})
	}
	if ok := idem.ValidateKey(strings.Repeat("k", 255)); ok != nil {
		t.Fatalf("255-byte key refused: %v", ok)
	}
	if ok := idem.ValidateKey("1754000000_Ab-9_x~!\"#$%&'()*+,./:;<=>?@[\\]^`{|}"); ok != nil {
		t.Fatalf("visible ASCII key refused: %v", ok)
	}

	// Nil arguments.
	if _, err := idem.Do(ctx, nil, scope, "k", fpA, fn); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("nil tx: %v", err)
	}
	if _, err := idem.DoInTx(ctx, pool, scope, "k", fpA, nil); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("nil fn: %v", err)
	}
	if _, err := idem.DoInTx(ctx, nil, scope, "k", fpA, fn); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("nil db: %v", err)
	}
	var nilPool *pgxpool.Pool
	var nilConn *pgx.Conn
	for _, db := range []idem.Beginner{nilPool, nilConn} {
		if _, err := idem.DoInTx(ctx, db, scope, "k", fpA, fn); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Fatalf("DoInTx on a nil %T: %v", db, err)
		}
		if err := idem.InTx(ctx, db, func(context.Context, pgx.Tx) error { return nil }); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Fatalf("InTx on a nil %T: %v", db, err)
		}
	}
	if calls.Load() != 0 || keyRows(t, pool) != 0 || effects(t, pool) != 0 {
		t.Fatal("bad input ran fn or wrote rows")
	}
}

func TestUnstorableResponseUndoesEverything(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	small, err := idem.New(idem.Config{MaxResponseBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		resp idem.Response
		want error
	}{
		{"too large", idem.Response{Status: 200, Body: bytes.Repeat([]byte("x"), 65)}, idem.ErrResponseTooLarge},
		{"headers count", idem.Response{Status: 200, Header: map[string][]string{"X": {strings.Repeat("v", 64)}}}, idem.ErrResponseTooLarge},
		{"status -1", idem.Response{Status: -1}, idem.ErrInvalidResponse},
		{"status 99", idem.Response{Status: 99}, idem.ErrInvalidResponse},
		{"status 1000", idem.Response{Status: 1000}, idem.ErrInvalidResponse},
		{"header NUL", idem.Response{Status: 200, Header: map[string][]string{"X": {"a\x00"}}}, idem.ErrInvalidResponse},
		{"empty header name", idem.Response{Status: 200, Header: map[string][]string{"": {"a"}}}, idem.ErrInvalidResponse},
		{"header bad UTF-8", idem.Response{Status: 200, Header: map[string][]string{"X\xff": {"a"}}}, idem.ErrInvalidResponse},
	}
	for _, c := range cases {
		for _, reject := range []bool{false, true} {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			_, err = small.Do(ctx, tx, scope, "big", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ('big')`); err != nil {
					return idem.Response{}, err
				}
				if reject {
					return idem.Response{}, idem.Reject(c.resp)
				}
				return c.resp, nil
			})
			if !errors.Is(err, c.want) {
				t.Fatalf("%s (reject %v): err = %v, want %v", c.name, reject, err, c.want)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("%s: transaction unusable: %v", c.name, err)
			}
		}
	}
	if effects(t, pool) != 0 || keyRows(t, pool) != 0 {
		t.Fatal("an unstorable response left rows behind")
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	bad := []idem.Config{
		{TTL: -time.Second},
		{MinKeyLength: -1},
		{MinKeyLength: 10, MaxKeyLength: 5},
		{MaxKeyLength: 2000},
		{MaxResponseBytes: -1},
		{IsolationLevel: "chaotic"},
		{Wait: 30 * 24 * time.Hour}, // beyond what lock_timeout takes
	}
	for _, cfg := range bad {
		if _, err := idem.New(cfg); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want ErrInvalidConfig", cfg, err)
		}
	}
	c, err := idem.New(idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	got := c.Config()
	if got.TTL != idem.DefaultTTL || got.Wait != idem.DefaultWait || got.MaxKeyLength != 255 || got.MinKeyLength != 1 {
		t.Fatalf("defaults: %+v", got)
	}
	c, err = idem.New(idem.Config{MinKeyLength: 8, MaxKeyLength: 16})
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(c.ValidateKey("short"), idem.ErrInvalidKey) || !errors.Is(c.ValidateKey(strings.Repeat("x", 17)), idem.ErrInvalidKey) ||
		c.ValidateKey("just-right") != nil {
		t.Fatal("custom key bounds not applied")
	}
}

// Do bounds its own wait with lock_timeout and leaves the caller's setting
// as it found it, on every path.
func TestCallerLockTimeoutIsRestored(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	if _, err := idem.DoInTx(ctx, pool, scope, "replayed", fpA, recordEffect(&calls, "x")); err != nil {
		t.Fatal(err)
	}
	paths := map[string]func(tx pgx.Tx) error{
		"fresh": func(tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, "fresh", fpA, recordEffect(&calls, "x"))
			return err
		},
		"replay": func(tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, "replayed", fpA, recordEffect(&calls, "x"))
			return err
		},
		"reused": func(tx pgx.Tx) error {
			if _, err := idem.Do(ctx, tx, scope, "replayed", fpB, recordEffect(&calls, "x")); !errors.Is(err, idem.ErrKeyReused) {
				return fmt.Errorf("want ErrKeyReused, got %v", err)
			}
			return nil
		},
		"rejected": func(tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, "rejected", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
				return idem.Response{}, idem.Reject(idem.Response{Status: 409})
			})
			return err
		},
	}
	for name, path := range paths {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '7s'`); err != nil {
			t.Fatal(err)
		}
		if err := path(tx); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var lt string
		if err := tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lt); err != nil {
			t.Fatal(err)
		}
		if lt != "7s" {
			t.Fatalf("%s: lock_timeout = %q after Do, want the caller's 7s", name, lt)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
