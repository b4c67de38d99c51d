package idemhttp_test

import (
	"database/sql"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/pgtest"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

// A handler that swallows a failed statement and answers 201 is answered
// 500 (a server error, never stored), with the reason logged: its
// transaction was aborted by a statement it did not report. Concurrent
// duplicates get the same, or wait.
func TestHandlerHidingAFailedStatement(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			r := e.do(call{path: "/hide", actor: "alice", key: "hidden", body: `{}`})
			if r.status == http.StatusConflict {
				return // a duplicate waited in vain
			}
			if r.status != http.StatusInternalServerError || r.problem(t) != idemhttp.CodeInternal {
				t.Errorf("%s", r)
			}
		})
	}
	wg.Wait()
	if !strings.Contains(e.logs.String(), "aborted by a statement it did not report") {
		t.Errorf("the reason is not logged:\n%s", e.logs.String())
	}
	if s := e.state(); s.effects != 0 || s.keys != 0 {
		t.Fatalf("left %+v", s)
	}
}

// A handler that commits the middleware's transaction itself and then
// panics is answered 500 (a server error, the panic logged), and the key's
// record is unknown at once: ListUnknown lists it before any retry.
// Under concurrent duplicates one runs; the others and every retry get 409
// IDEMPOTENCY_OUTCOME_UNKNOWN and the handler never runs again.
func TestHandlerCommittingThenPanicking(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	if r := e.do(call{path: "/commit-panic", actor: "alice", key: "alone", body: `{}`}); r.status != http.StatusInternalServerError {
		t.Errorf("alone: %s, want 500", r)
	}
	if page, err := idem.ListUnknown(t.Context(), e.pool, 10, nil); err != nil || len(page) != 1 || page[0].Key != "alone" {
		t.Errorf("ListUnknown before any retry: %+v, %v", page, err)
	}
	e.calls.Store(0)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range 4 {
		wg.Go(func() {
			r := e.do(call{path: "/commit-panic", actor: "alice", key: "orphan", body: `{}`})
			switch {
			case r.status == http.StatusInternalServerError && r.problem(t) == idemhttp.CodeInternal:
				failed.Add(1)
			case r.status == http.StatusConflict:
			default:
				t.Errorf("%s", r)
			}
		})
	}
	wg.Wait()
	if failed.Load() != 1 || e.calls.Load() != 1 {
		t.Errorf("%d answered 500, the handler ran %d times; want 1 and 1", failed.Load(), e.calls.Load())
	}
	if r := e.do(call{path: "/commit-panic", actor: "alice", key: "orphan", body: `{}`}); r.status != http.StatusConflict ||
		r.problem(t) != idemhttp.CodeOutcomeUnknown {
		t.Errorf("a retry: %s, want 409 %s", r, idemhttp.CodeOutcomeUnknown)
	}
	if page, err := idem.ListUnknown(t.Context(), e.pool, 10, nil); err != nil || len(page) != 2 || page[1].Key != "orphan" {
		t.Errorf("ListUnknown: %+v, %v", page, err)
	}
	if e.effects() != 2 || e.calls.Load() != 1 {
		t.Errorf("%d effects, %d runs of orphan; want 2 (alone's and orphan's) and 1", e.effects(), e.calls.Load())
	}
	if !strings.Contains(e.logs.String(), "the handler's panic") {
		t.Errorf("the panic is not logged:\n%s", e.logs.String())
	}
}

// The same two handler bugs through MiddlewareSQL, with both database/sql
// drivers: a swallowed failed statement is a 500 with the reason logged
// and nothing left; a COMMIT of the handler's own then a panic is a 500,
// then 409 IDEMPOTENCY_OUTCOME_UNKNOWN, and ListUnknown lists the key.
func TestMiddlewareSQLHandlerBugs(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			url := pgtest.URL(t, migrate)
			db, err := sql.Open(driver, url)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			var calls atomic.Int64
			handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				tx := idemhttp.TxSQL(r.Context())
				if _, err := tx.ExecContext(r.Context(), `INSERT INTO effects (actor, route) VALUES ('alice', $1)`, r.URL.Path); err != nil {
					panic(err)
				}
				switch r.URL.Path {
				case "/hide":
					_, _ = tx.ExecContext(r.Context(), `SELECT 1/0`)
				case "/commit-panic":
					if err := tx.Commit(); err != nil {
						panic(err)
					}
					panic("the handler's panic")
				}
				w.WriteHeader(http.StatusCreated)
			})
			var logs testlog.Buffer
			srv := httptest.NewServer(idemhttp.MiddlewareSQL(db, idemhttp.Options{Actor: bearer, Logger: slog.New(slog.NewTextHandler(&logs, nil))})(handler))
			defer srv.Close()
			post := func(path, key string) (int, string) {
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+path, strings.NewReader(`{}`))
				req.Header.Set("Authorization", "Bearer alice")
				req.Header.Set("Idempotency-Key", key)
				req.Header.Set("Content-Type", "application/json")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				var p struct {
					Code string `json:"code"`
				}
				_ = json.NewDecoder(resp.Body).Decode(&p)
				return resp.StatusCode, p.Code
			}
			count := func(query string) int {
				var n int
				if err := db.QueryRowContext(ctx, query).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}

			if status, code := post("/hide", "hidden"); status != 500 || code != idemhttp.CodeInternal {
				t.Errorf("/hide: %d %s, want 500 %s", status, code, idemhttp.CodeInternal)
			}
			if !strings.Contains(logs.String(), "aborted by a statement it did not report") {
				t.Errorf("the reason is not logged:\n%s", logs.String())
			}
			if n := count(`SELECT count(*) FROM effects`) + count(`SELECT count(*) FROM idem_keys`); n != 0 {
				t.Errorf("/hide left %d rows", n)
			}

			if status, code := post("/commit-panic", "orphan"); status != 500 || code != idemhttp.CodeInternal {
				t.Errorf("/commit-panic: %d %s, want 500 %s", status, code, idemhttp.CodeInternal)
			}
			if page, err := idemsql.ListUnknown(ctx, db, 10, nil); err != nil || len(page) != 1 || page[0].Key != "orphan" {
				t.Errorf("ListUnknown before any retry: %+v, %v", page, err)
			}
			if status, code := post("/commit-panic", "orphan"); status != 409 || code != idemhttp.CodeOutcomeUnknown {
				t.Errorf("/commit-panic again: %d %s, want 409 %s", status, code, idemhttp.CodeOutcomeUnknown)
			}
			if calls.Load() != 2 || count(`SELECT count(*) FROM effects`) != 1 {
				t.Errorf("%d runs, %d effects; want 2 and 1", calls.Load(), count(`SELECT count(*) FROM effects`))
			}
		})
	}
}
