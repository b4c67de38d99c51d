package idemsql_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/pgtest"
	"github.com/pgidem/idem/internal/testkit/relay"
)

// BenchmarkRoundTrips measures what a call costs in round trips, side by
// side: idem on a pgx pool (pipelined batches) and idemsql on database/sql
// with pgx's stdlib driver and lib/pq (one statement per round trip; lib/pq
// also with binary_parameters=yes, which saves the Describe round trip of
// every statement with arguments). Every connection goes through a relay
// that delays each direction by benchDelay, so a round trip costs about
// 2*benchDelay and round-trips/op (ns/op divided by that) counts them,
// give or take the server's own work (see benchDelay). Each call is one connection's
// only work (one connection per handle). Run:
//
//	go test -run '^$' -bench RoundTrips -benchtime 40x ./idemsql
//
// "fresh" calls DoInTx with a new key (fn runs and its response is
// stored); "replay" with a key already stored; "do" runs Do in a
// transaction the caller began (BEGIN and COMMIT outside the timer);
// "intx" is InTx with an empty fn (BEGIN and COMMIT alone), the baseline of
// any transaction.
func BenchmarkRoundTrips(b *testing.B) {
	url := pgtest.URL(b, idem.Migrate)
	target, err := relay.Target(url)
	if err != nil {
		b.Fatal(err)
	}
	r, err := relay.Start(target, relay.Options{Delay: benchDelay})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	relayed, err := r.ConnString(url)
	if err != nil {
		b.Fatal(err)
	}
	fn := func(context.Context, *sql.Tx) (idem.Response, error) { return created, nil }
	pgxFn := func(context.Context, pgx.Tx) (idem.Response, error) { return created, nil }

	b.Run("idem-pgxpool", func(b *testing.B) {
		cfg, err := pgxpool.ParseConfig(relayed)
		if err != nil {
			b.Fatal(err)
		}
		cfg.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(b.Context(), cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer pool.Close()
		ctx := b.Context()
		calls := map[string]func(b *testing.B, key string){
			"fresh": func(b *testing.B, key string) {
				if _, err := idem.DoInTx(ctx, pool, scope, key, fpOf(key), pgxFn); err != nil {
					b.Fatal(err)
				}
			},
			"do": func(b *testing.B, key string) {
				b.StopTimer()
				tx, err := pool.Begin(ctx)
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, err := idem.Do(ctx, tx, scope, key, fpOf(key), pgxFn); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if err := tx.Commit(ctx); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			},
			"intx": func(b *testing.B, key string) {
				if err := idem.InTx(ctx, pool, func(context.Context, pgx.Tx) error { return nil }); err != nil {
					b.Fatal(err)
				}
			},
		}
		runCalls(b, calls, func(key string) {
			if _, err := idem.DoInTx(ctx, pool, scope, key, fpOf(key), pgxFn); err != nil {
				b.Fatal(err)
			}
		})
	})
	for _, d := range []struct{ name, driver, url string }{
		{"idemsql-pgx", "pgx", relayed},
		{"idemsql-pq", "postgres", relayed},
		{"idemsql-pq-binary", "postgres", relayed + "&binary_parameters=yes"},
	} {
		b.Run(d.name, func(b *testing.B) {
			db := open(b, d.driver, d.url)
			db.SetMaxOpenConns(1)
			ctx := b.Context()
			calls := map[string]func(b *testing.B, key string){
				"fresh": func(b *testing.B, key string) {
					if _, err := idemsql.DoInTx(ctx, db, scope, key, fpOf(key), fn); err != nil {
						b.Fatal(err)
					}
				},
				"do": func(b *testing.B, key string) {
					b.StopTimer()
					tx, err := db.BeginTx(ctx, nil)
					if err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
					if _, err := idemsql.Do(ctx, tx, scope, key, fpOf(key), fn); err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					if err := tx.Commit(); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				},
				"intx": func(b *testing.B, key string) {
					if err := idemsql.InTx(ctx, db, func(context.Context, *sql.Tx) error { return nil }); err != nil {
						b.Fatal(err)
					}
				},
			}
			runCalls(b, calls, func(key string) {
				if _, err := idemsql.DoInTx(ctx, db, scope, key, fpOf(key), fn); err != nil {
					b.Fatal(err)
				}
			})
		})
	}
}

// benchDelay is the relay's one-way delay in BenchmarkRoundTrips: 2ms, or
// IDEM_BENCH_DELAY. The server's own time per statement inflates
// round-trips/op a little; two runs with different delays cancel it: the
// round trips are the difference of ns/op divided by twice the difference
// of the delays.
var benchDelay = func() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("IDEM_BENCH_DELAY")); err == nil && d > 0 {
		return d
	}
	return 2 * time.Millisecond
}()

// runCalls runs each call as a sub-benchmark with fresh keys, and "replay"
// with keys that store made first; it reports round-trips/op.
func runCalls(b *testing.B, calls map[string]func(b *testing.B, key string), store func(key string)) {
	calls["replay"] = nil
	for _, name := range []string{"fresh", "replay", "do", "intx"} {
		b.Run(name, func(b *testing.B) {
			keys := make([]string, b.N)
			run := rand.Text()[:8]
			for i := range keys {
				keys[i] = fmt.Sprintf("%s-%s-%d", name, run, i)
			}
			call := calls[name]
			if name == "replay" {
				for _, k := range keys {
					store(k)
				}
				call = calls["fresh"]
			}
			// Warm up: connections open, statements prepared.
			call(b, fmt.Sprintf("warm-%s-%s", name, run))
			b.ResetTimer()
			for i := range b.N {
				call(b, keys[i])
			}
			b.ReportMetric(float64(b.Elapsed())/float64(b.N)/float64(2*benchDelay), "round-trips/op")
		})
	}
}
