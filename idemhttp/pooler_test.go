package idemhttp_test

import (
	"bytes"
	"net/http"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// The middleware behind PgBouncer in transaction pooling mode
// (IDEM_PGBOUNCER_URL, started by .ci/pgbouncer), in each exec mode pgx
// documents as working there: a request, its replays, and concurrent
// duplicates that execute once.
func TestBehindPooler(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envConfig{pool: func(t *testing.T) *pgxpool.Pool {
				cfg, err := pgxpool.ParseConfig(pgtest.BehindPooler(t, migrate))
				if err != nil {
					t.Fatal(err)
				}
				cfg.ConnConfig.DefaultQueryExecMode = mode
				cfg.MaxConns = poolConns
				pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(pool.Close)
				return pool
			}})
			first := e.do(call{path: "/items", actor: "alice", key: "pooled-1", body: `{"a":1}`})
			if first.status != http.StatusCreated || first.replayed() {
				t.Fatalf("first: %s", first)
			}
			if again := e.do(call{path: "/items", actor: "alice", key: "pooled-1", body: `{"a":1}`}); !again.replayed() ||
				!bytes.Equal(again.body, first.body) {
				t.Fatalf("retry: %s; first %s", again, first)
			}

			const n = 12
			replies := make([]reply, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					replies[i] = e.retry(call{path: "/items", actor: "alice", key: "pooled-race", body: `{"q":1}`})
				})
			}
			wg.Wait()
			for _, r := range replies {
				if r.status != http.StatusCreated || !bytes.Equal(r.body, replies[0].body) {
					t.Fatalf("duplicate: %s; first %s", r, replies[0])
				}
			}
			if e.calls.Load() != 2 || e.effects() != 2 {
				t.Fatalf("%d calls, %d effects for two keys", e.calls.Load(), e.effects())
			}
		})
	}
}
