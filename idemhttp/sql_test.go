package idemhttp_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver
	_ "github.com/lib/pq"              // the "postgres" driver

	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// MiddlewareSQL and StatusHandlerSQL with both database/sql drivers: the
// handler writes through TxSQL, and the outcomes are Middleware's.
func TestMiddlewareSQL(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			db, err := sql.Open(driver, pgtest.URL(t, migrate))
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			db.SetMaxOpenConns(8)
			var calls atomic.Int64
			handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				tx := idemhttp.TxSQL(r.Context())
				body, _ := io.ReadAll(r.Body)
				var id int64
				if err := tx.QueryRowContext(r.Context(), `INSERT INTO effects (actor, route) VALUES ('a', $1) RETURNING id`,
					r.URL.Path).Scan(&id); err != nil {
					http.Error(w, err.Error(), http.StatusServiceUnavailable)
					return
				}
				switch r.URL.Path {
				case "/refuse":
					w.WriteHeader(http.StatusPaymentRequired)
				case "/fail":
					w.WriteHeader(http.StatusInternalServerError)
				default:
					w.WriteHeader(http.StatusCreated)
				}
				fmt.Fprintf(w, `{"id":%d,"body":%q}`, id, body)
			})
			mux := http.NewServeMux()
			mux.Handle("/", idemhttp.MiddlewareSQL(db, idemhttp.Options{Actor: bearer, StatusURL: "/status"})(handler))
			mux.Handle("GET /status", idemhttp.StatusHandlerSQL(db, idemhttp.StatusOptions{Actor: bearer}))
			srv := httptest.NewServer(mux)
			defer srv.Close()

			post := func(path, key, body string) (int, http.Header, string) {
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+path, strings.NewReader(body))
				req.Header.Set("Authorization", "Bearer alice")
				req.Header.Set("Idempotency-Key", key)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, resp.Header, string(b)
			}
			effects := func() int {
				var n int
				if err := db.QueryRowContext(ctx, `SELECT count(*) FROM effects`).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}

			status, _, first := post("/orders", "k1", `{"item":1}`)
			if status != 201 {
				t.Fatalf("first: %d %s", status, first)
			}
			status, h, again := post("/orders", "k1", `{"item":1}`)
			if status != 201 || again != first || h.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("replay: %d %s %v", status, again, h)
			}
			if status, _, _ := post("/orders", "k1", `{"item":2}`); status != 422 {
				t.Fatalf("other body: %d", status)
			}
			if calls.Load() != 1 || effects() != 1 {
				t.Fatalf("%d calls, %d effects after a replay", calls.Load(), effects())
			}
			// A refusal is stored, its writes undone; a 5xx stores nothing.
			status, _, refused := post("/refuse", "k2", `{}`)
			if again, _, body := post("/refuse", "k2", `{}`); status != 402 || again != 402 || body != refused {
				t.Fatalf("refusal: %d %d", status, again)
			}
			for range 2 {
				if status, _, _ := post("/fail", "k3", `{}`); status != 500 {
					t.Fatalf("failure: %d", status)
				}
			}
			if calls.Load() != 4 || effects() != 1 {
				t.Fatalf("%d calls, %d effects after a refusal and two failures", calls.Load(), effects())
			}

			// Concurrent duplicates: one execution, one answer.
			var wg sync.WaitGroup
			answers := make([]string, 8)
			for i := range answers {
				wg.Go(func() {
					status, _, body := post("/orders", "k4", `{"item":4}`)
					answers[i] = strconv.Itoa(status) + " " + body
				})
			}
			wg.Wait()
			for _, a := range answers {
				if !strings.HasPrefix(a, "201 ") && !strings.HasPrefix(a, "202 ") && !strings.HasPrefix(a, "409 ") {
					t.Fatalf("concurrent duplicate: %s", a)
				}
				if strings.HasPrefix(a, "201 ") && a != answers[slicesIndex(answers)] {
					t.Fatalf("different answers: %q", answers)
				}
			}
			if effects() != 2 {
				t.Fatalf("%d effects after concurrent duplicates, want 2", effects())
			}

			// The status URL serves the stored response, and 404 for a
			// key nobody used.
			get := func(key string) int {
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/status?operation=POST+%2F&key="+key, nil)
				req.Header.Set("Authorization", "Bearer alice")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				return resp.StatusCode
			}
			if s := get("k1"); s != 201 {
				t.Fatalf("status of a stored key: %d", s)
			}
			if s := get("nobody"); s != 404 {
				t.Fatalf("status of an unused key: %d", s)
			}
			if idemhttp.TxSQL(context.Background()) != nil {
				t.Fatal("TxSQL outside a request")
			}
		})
	}
}

// slicesIndex is the index of the first 201 answer.
func slicesIndex(answers []string) int {
	for i, a := range answers {
		if strings.HasPrefix(a, "201 ") {
			return i
		}
	}
	return 0
}
