package idem_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// The benchmarks below measure the library's own cost: fn is trivial and
// allocates nothing, so ns/op, B/op and allocs/op are Do's (and, for
// DoInTx, the transaction's) and not the business logic's. Calls get a
// cancelable context, as a request handler's is: pgx watches such a context
// for every round trip, which costs a few allocations that
// context.Background() would hide. Speed goals are read from these figures
// and from cmd/idem-bench; nothing here asserts a time. go test -bench .
// -benchtime 1x runs each once, quickly.

var (
	benchScope = idem.Scope{Actor: "bench-user", Operation: "draw"}
	benchFP    = idem.FingerprintParts([]byte(`{"box_id":1,"quantity":1}`))
	benchResp  = idem.Response{
		Status: 201,
		Header: map[string][]string{"Content-Type": {"application/json"}},
		Body:   []byte(`{"batch_id":1,"prizes":["Goose Sticker"],"points_spent":100,"points_left":900}`),
	}
)

func benchFn(context.Context, pgx.Tx) (idem.Response, error) { return benchResp, nil }

// benchKeys returns n keys no earlier call returned.
func benchKeys(n int) []string {
	run := rand.Text()[:10]
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("bench-%s-%d", run, i)
	}
	return keys
}

// benchChunk is how many Do calls share one transaction in the Do
// sub-benchmarks; BEGIN and COMMIT run with the timer stopped. A fresh Do
// takes up to two subtransaction ids: staying under the 64 a backend caches
// keeps the benchmark from slowing every other session's snapshots.
const benchChunk = 25

// benchDo runs Do alone: BEGIN and COMMIT are outside the timer and the
// allocation count, so the figures are Do's own round trips and
// allocations.
func benchDo(b *testing.B, pool *pgxpool.Pool, keys []string, wantReplayed bool) {
	ctx := b.Context()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Release()
	b.ReportAllocs()
	b.ResetTimer()
	for lo := 0; lo < len(keys); lo += benchChunk {
		b.StopTimer()
		tx, err := conn.Begin(ctx)
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		for _, key := range keys[lo:min(lo+benchChunk, len(keys))] {
			res, err := idem.Do(ctx, tx, benchScope, key, benchFP, benchFn)
			if err != nil {
				b.Fatal(err)
			}
			if res.Replayed != wantReplayed {
				b.Fatalf("key %s: Replayed %t, want %t", key, res.Replayed, wantReplayed)
			}
		}
		b.StopTimer()
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}

// benchDoInTx runs DoInTx: a pooled connection, the transaction and Do.
func benchDoInTx(b *testing.B, pool *pgxpool.Pool, keys []string, wantReplayed bool) {
	ctx := b.Context()
	b.ReportAllocs()
	b.ResetTimer()
	for _, key := range keys {
		res, err := idem.DoInTx(ctx, pool, benchScope, key, benchFP, benchFn)
		if err != nil {
			b.Fatal(err)
		}
		if res.Replayed != wantReplayed {
			b.Fatalf("key %s: Replayed %t, want %t", key, res.Replayed, wantReplayed)
		}
	}
}

// completeKeys runs every key once, so that later calls replay.
func completeKeys(b *testing.B, pool *pgxpool.Pool, keys []string) {
	ctx := b.Context()
	for lo := 0; lo < len(keys); lo += benchChunk {
		err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			for _, key := range keys[lo:min(lo+benchChunk, len(keys))] {
				if _, err := idem.Do(ctx, tx, benchScope, key, benchFP, benchFn); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDoFresh measures the first call with a key: claim, fn (trivial)
// and the stored response. Do: Do alone inside a transaction; DoInTx: the
// whole call, transaction included.
func BenchmarkDoFresh(b *testing.B) {
	pool := pgtest.Pool(b, idem.Migrate)
	b.Run("Do", func(b *testing.B) { benchDo(b, pool, benchKeys(b.N), false) })
	b.Run("DoInTx", func(b *testing.B) { benchDoInTx(b, pool, benchKeys(b.N), false) })
}

// BenchmarkDoReplay measures a call with a key that completed: the stored
// response comes back and fn does not run.
func BenchmarkDoReplay(b *testing.B) {
	pool := pgtest.Pool(b, idem.Migrate)
	b.Run("Do", func(b *testing.B) {
		keys := benchKeys(b.N)
		completeKeys(b, pool, keys)
		benchDo(b, pool, keys, true)
	})
	b.Run("DoInTx", func(b *testing.B) {
		keys := benchKeys(b.N)
		completeKeys(b, pool, keys)
		benchDoInTx(b, pool, keys, true)
	})
}
