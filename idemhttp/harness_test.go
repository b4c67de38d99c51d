package idemhttp_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/pgtest"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// migrate installs idem's table, an effects table the test handlers write
// one row to per execution, and a table whose deferred unique constraint
// makes a COMMIT fail on demand.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `
		CREATE TABLE effects (id bigserial PRIMARY KEY, actor text NOT NULL, route text NOT NULL);
		CREATE TABLE deferred (v int CONSTRAINT deferred_v_key UNIQUE DEFERRABLE INITIALLY DEFERRED);
		INSERT INTO deferred VALUES (1);`)
	return err
}

// poolConns bounds each test's pool: the concurrent tests queue for
// connections rather than crowd the server, which other test packages share.
const poolConns = 8

// newPool returns a pool of poolConns connections on a fresh database
// migrated by m, closed when the test ends (before pgtest drops the
// database).
func newPool(t *testing.T, m pgtest.MigrateFunc) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t, m))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = poolConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// env is a test server: the routes of newEnv, each wrapped in the
// middleware, on an httptest.Server (a real loopback listener), and a pool
// on a fresh database.
type env struct {
	t     *testing.T
	pool  *pgxpool.Pool
	srv   *httptest.Server
	calls atomic.Int64 // handler executions, committed or not

	started chan struct{}  // /block sends once it runs
	release chan struct{}  // /block waits for it (closed by the test)
	done    chan struct{}  // closed when the test ends, so /block never hangs
	logs    testlog.Buffer // the middleware's log
}

// bearer is the test's Actor: "Authorization: Bearer <actor>".
func bearer(r *http.Request) (string, error) {
	actor, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return "", errors.New("no bearer token")
	}
	return actor, nil
}

// envConfig tweaks newEnv.
type envConfig struct {
	opts      idemhttp.Options
	wrapMux   bool                                         // wrap the whole mux instead of each route
	outer     func(http.Handler) http.Handler              // around everything
	db        func(*pgxpool.Pool) idem.Beginner            // the middleware's database handle
	beforeRun func(w http.ResponseWriter, r *http.Request) // first thing every handler does
	routes    func(mux *http.ServeMux, pool *pgxpool.Pool) // more routes, not wrapped
	pool      func(t *testing.T) *pgxpool.Pool             // the pool (default: newPool(t, migrate))
}

func newEnv(t *testing.T, cfg envConfig) *env {
	t.Helper()
	e := &env{
		t:       t,
		started: make(chan struct{}, 16),
		release: make(chan struct{}),
		done:    make(chan struct{}),
	}
	if cfg.pool != nil {
		e.pool = cfg.pool(t)
	} else {
		e.pool = newPool(t, migrate)
	}
	opts := cfg.opts
	if opts.Actor == nil {
		opts.Actor = bearer
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(&e.logs, nil))
	}
	var db idem.Beginner = e.pool
	if cfg.db != nil {
		db = cfg.db(e.pool)
	}
	mw := idemhttp.Middleware(db, opts)
	wrap := mw
	if cfg.wrapMux {
		wrap = func(h http.Handler) http.Handler { return h }
	}

	mux := http.NewServeMux()
	handle := func(pattern string, f func(w http.ResponseWriter, r *http.Request)) {
		mux.Handle(pattern, wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if cfg.beforeRun != nil {
				cfg.beforeRun(w, r)
			}
			f(w, r)
		})))
	}
	// effect records one execution in the request's transaction.
	effect := func(r *http.Request) int64 {
		e.calls.Add(1)
		tx := idemhttp.Tx(r.Context())
		if tx == nil {
			panic("no transaction")
		}
		actor, _ := bearer(r)
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO effects (actor, route) VALUES ($1, $2) RETURNING id`,
			actor, r.Pattern).Scan(&id); err != nil {
			panic(err)
		}
		return id
	}
	created := func(w http.ResponseWriter, id int64, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/items/%d", id))
		w.Header().Set("X-Not-Stored", "first response only")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"request":%q}`, id, body)
	}
	handle("POST /items", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		created(w, effect(r), body)
	})
	handle("PATCH /items/{id}", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		fmt.Fprintf(w, "patched %s", r.PathValue("id"))
	})
	handle("PUT /items/{id}", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "put %s tx=%t", r.PathValue("id"), idemhttp.Tx(r.Context()) != nil)
	})
	handle("GET /items", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "list tx=%t", idemhttp.Tx(r.Context()) != nil)
	})
	// /hide writes, runs a statement that fails, swallows its error and
	// answers 201 (a handler bug: its transaction is aborted).
	handle("POST /hide", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		_, _ = idemhttp.Tx(r.Context()).Exec(r.Context(), `SELECT 1/0`)
		w.WriteHeader(http.StatusCreated)
	})
	// /commit-panic writes, commits the middleware's transaction itself
	// and panics (a handler bug: its write is durable, no outcome stored).
	handle("POST /commit-panic", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		if err := idemhttp.Tx(r.Context()).Commit(r.Context()); err != nil {
			panic(err)
		}
		panic("the handler's panic")
	})
	// /refuse: a deterministic refusal after a write.
	handle("POST /refuse", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusPaymentRequired)
		fmt.Fprint(w, `{"status":402,"code":"NO_FUNDS"}`)
	})
	// /fail?status=N: a transient failure after a write (default 500).
	handle("POST /fail", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		status := http.StatusInternalServerError
		if s := r.URL.Query().Get("status"); s != "" {
			status, _ = strconv.Atoi(s)
		}
		w.Header().Set("X-Fail", "yes")
		w.WriteHeader(status)
		fmt.Fprint(w, "boom")
	})
	// /validate writes, then refuses with Invalid and 400 a body whose
	// "qty" is not a positive integer (?status=N answers N instead).
	handle("POST /validate", func(w http.ResponseWriter, r *http.Request) {
		id := effect(r)
		body, _ := io.ReadAll(r.Body)
		var req struct {
			Qty int `json:"qty"`
		}
		if err := json.Unmarshal(body, &req); err != nil || req.Qty <= 0 {
			idemhttp.Invalid(r.Context())
			status := http.StatusBadRequest
			if s := r.URL.Query().Get("status"); s != "" {
				status, _ = strconv.Atoi(s)
			}
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(status)
			fmt.Fprint(w, `{"code":"INVALID_QTY"}`)
			return
		}
		created(w, id, body)
	})
	handle("POST /panic", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		panic("handler bug")
	})
	// /block runs, tells the test, and waits to be released.
	handle("POST /block", func(w http.ResponseWriter, r *http.Request) {
		e.started <- struct{}{}
		select {
		case <-e.release:
		case <-e.done:
		}
		body, _ := io.ReadAll(r.Body)
		created(w, effect(r), body)
	})
	// /violate makes the COMMIT fail when asked to (X-Violate is not part
	// of the fingerprint).
	handle("POST /violate", func(w http.ResponseWriter, r *http.Request) {
		id := effect(r)
		if r.Header.Get("X-Violate") != "" {
			if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(), `INSERT INTO deferred VALUES (1)`); err != nil {
				panic(err)
			}
		}
		created(w, id, nil)
	})
	// /terminate loses the database connection after the handler's write,
	// before the commit, when asked to (X-Terminate is not part of the
	// fingerprint).
	handle("POST /terminate", func(w http.ResponseWriter, r *http.Request) {
		id := effect(r)
		if r.Header.Get("X-Terminate") != "" {
			var pid int
			if err := idemhttp.Tx(r.Context()).QueryRow(r.Context(), `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				panic(err)
			}
			if _, err := e.pool.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err != nil {
				panic(err)
			}
		}
		created(w, id, nil)
	})
	// /slow writes, then runs until Options.Timeout ends its context.
	handle("POST /slow", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		<-r.Context().Done()
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(), `SELECT 1`); err == nil {
			panic("a statement ran after the timeout")
		}
		w.WriteHeader(http.StatusCreated)
	})
	// /deadline writes, then answers 500 when a statement fails on the
	// deadline, as a handler that respects its context would.
	handle("POST /deadline", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(), `SELECT pg_sleep(10)`); err != nil {
			http.Error(w, "timeout: "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	// /gzip answers with a compressed body, as a compressing handler would.
	handle("POST /gzip", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzip.NewWriter(w)
		fmt.Fprint(zw, "compressed hello")
		_ = zw.Close()
	})
	handle("POST /big", func(w http.ResponseWriter, r *http.Request) {
		effect(r)
		_, err := w.Write(bytes.Repeat([]byte("x"), 4096))
		if err == nil {
			panic("an oversized write was accepted")
		}
	})

	if cfg.routes != nil {
		cfg.routes(mux, e.pool)
	}
	var h http.Handler = mux
	if cfg.wrapMux {
		h = mw(mux)
	}
	if cfg.outer != nil {
		h = cfg.outer(h)
	}
	e.srv = httptest.NewServer(h)
	t.Cleanup(e.srv.Close)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("middleware log:\n%s", e.logs.String())
		}
	})
	t.Cleanup(func() { close(e.done) }) // runs first
	return e
}

// call is one request.
type call struct {
	method, path string
	actor        string   // Bearer token; "" for none
	key          string   // Idempotency-Key; "" for none
	keys         []string // raw header lines, instead of key
	body         string
	contentType  string
	header       http.Header
}

// reply is a response read in full.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) replayed() bool { return r.header.Get("Idempotent-Replayed") == "true" }

func (r reply) String() string { return fmt.Sprintf("%d %s", r.status, r.body) }

// problem decodes a problem+json reply and checks its framing.
func (r reply) problem(t *testing.T) (code string) {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != idemhttp.ContentTypeProblem {
		t.Errorf("Content-Type %q, want %q (%s)", ct, idemhttp.ContentTypeProblem, r)
	}
	var p struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Code   string `json:"code"`
		Detail string `json:"detail"`
	}
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("decode problem %s: %v", r.body, err)
	}
	if p.Status != r.status || p.Type != "about:blank" || p.Title != http.StatusText(r.status) {
		t.Errorf("problem %+v for status %d", p, r.status)
	}
	if r.replayed() {
		t.Errorf("a problem of the middleware is marked replayed")
	}
	return p.Code
}

func (e *env) request(ctx context.Context, c call) *http.Request {
	e.t.Helper()
	if c.method == "" {
		c.method = http.MethodPost
	}
	req, err := http.NewRequestWithContext(ctx, c.method, e.srv.URL+c.path, strings.NewReader(c.body))
	if err != nil {
		e.t.Fatal(err)
	}
	for name, v := range c.header {
		req.Header[name] = v
	}
	if c.actor != "" {
		req.Header.Set("Authorization", "Bearer "+c.actor)
	}
	if c.key != "" {
		req.Header.Set("Idempotency-Key", c.key)
	}
	if c.keys != nil {
		req.Header["Idempotency-Key"] = c.keys
	}
	if c.contentType == "" {
		c.contentType = "application/json"
	}
	req.Header.Set("Content-Type", c.contentType)
	return req
}

// do sends c and reads the reply; a transport error fails the test.
func (e *env) do(c call) reply {
	e.t.Helper()
	r, err := e.try(e.t.Context(), c)
	if err != nil {
		e.t.Fatalf("%s %s: %v", c.method, c.path, err)
	}
	return r
}

// try sends c and reads the reply.
func (e *env) try(ctx context.Context, c call) (reply, error) {
	resp, err := e.srv.Client().Do(e.request(ctx, c))
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: body}, nil
}

// retry sends c until the reply is not a 409 (in progress), like a client
// that honours Retry-After (but with a short pause). Bounded in count.
func (e *env) retry(c call) reply {
	e.t.Helper()
	for range 500 {
		r := e.do(c)
		if r.status != http.StatusConflict {
			return r
		}
		time.Sleep(5 * time.Millisecond)
	}
	e.t.Fatalf("still in progress after 500 retries")
	return reply{}
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) effects() int { return e.count(`SELECT count(*) FROM effects`) }
func (e *env) keyRows() int { return e.count(`SELECT count(*) FROM idem_keys`) }

// state is what a bad request must leave unchanged.
type state struct{ calls, effects, keys int }

func (e *env) state() state {
	return state{int(e.calls.Load()), e.effects(), e.keyRows()}
}
