package idemhttp_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

func TestFirstThenReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	c := call{path: "/items", actor: "alice", key: "0f8fad5b-d9cb-469f-a165-70867728950e", body: `{"a":1,"b":[1,2]}`}

	first := e.do(c)
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %s replayed=%t", first, first.replayed())
	}
	if first.header.Get("X-Not-Stored") == "" || first.header.Get("Location") == "" {
		t.Errorf("first response lost the handler's headers: %v", first.header)
	}

	// Retries, including a reformatted body and the quoted key form, get
	// the stored status, stored headers and the same bytes.
	retries := []call{c, c, c}
	retries[1].body = ` { "b": [1, 2.0], "a": 1e0 } `
	retries[2].key = `"` + c.key + `"`
	for i, rc := range retries {
		again := e.do(rc)
		if again.status != first.status || !bytes.Equal(again.body, first.body) || !again.replayed() {
			t.Errorf("retry %d: %s replayed=%t; first %s", i, again, again.replayed(), first)
		}
		for _, h := range []string{"Content-Type", "Location"} {
			if again.header.Get(h) != first.header.Get(h) {
				t.Errorf("retry %d: %s %q, first %q", i, h, again.header.Get(h), first.header.Get(h))
			}
		}
		if again.header.Get("X-Not-Stored") != "" {
			t.Errorf("retry %d replayed a header that is not stored", i)
		}
	}
	if s := e.state(); s != (state{calls: 1, effects: 1, keys: 1}) {
		t.Errorf("after one request and three retries: %+v", s)
	}
}

// Every malformed, missing or doubled key is a 400 problem, and nothing
// runs or is stored.
func TestBadKeysChangeNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	cases := []struct {
		name string
		keys []string
		code string
	}{
		{"missing", nil, idemhttp.CodeKeyMissing},
		{"empty", []string{""}, idemhttp.CodeKeyInvalid},
		{"space", []string{"a b"}, idemhttp.CodeKeyInvalid},
		{"non-ASCII", []string{"ключ"}, idemhttp.CodeKeyInvalid},
		{"too long", []string{strings.Repeat("k", 256)}, idemhttp.CodeKeyInvalid},
		{"two headers", []string{"k1", "k2"}, idemhttp.CodeKeyInvalid},
		{"two headers, same key", []string{"k1", "k1"}, idemhttp.CodeKeyInvalid},
		{"comma-joined", []string{"k1,k2"}, idemhttp.CodeKeyInvalid},
		{"comma and space", []string{"k1, k2"}, idemhttp.CodeKeyInvalid},
		{"unterminated string", []string{`"k1`}, idemhttp.CodeKeyInvalid},
		{"bad escape", []string{`"k\1"`}, idemhttp.CodeKeyInvalid},
		{"garbage after string", []string{`"k1" x`}, idemhttp.CodeKeyInvalid},
		{"quoted space", []string{`"k 1"`}, idemhttp.CodeKeyInvalid},
		{"quoted empty", []string{`""`}, idemhttp.CodeKeyInvalid},
		{"bad parameter", []string{`"k1";P=1`}, idemhttp.CodeKeyInvalid},
		{"bad boolean", []string{`"k1";p=?2`}, idemhttp.CodeKeyInvalid},
		{"list of strings", []string{`"k1", "k2"`}, idemhttp.CodeKeyInvalid},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := e.state()
			r := e.do(call{path: "/items", actor: "alice", keys: c.keys, body: `{}`})
			if r.status != http.StatusBadRequest {
				t.Fatalf("%s", r)
			}
			if code := r.problem(t); code != c.code {
				t.Errorf("code %s, want %s", code, c.code)
			}
			if after := e.state(); after != before {
				t.Errorf("changed: %+v -> %+v", before, after)
			}
		})
	}
}

// The bare key and every structured-field spelling of it name one key.
func TestKeyForms(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	first := e.do(call{path: "/items", actor: "alice", key: "1754321000_Ab-9_x", body: `{}`})
	if first.status != http.StatusCreated {
		t.Fatalf("%s", first)
	}
	for _, v := range []string{
		`"1754321000_Ab-9_x"`,
		`  "1754321000_Ab-9_x"  `,
		`"1754321000_Ab-9_x";v=1`,
		`"1754321000_Ab-9_x"; a; b=:aGk=:;c=-1.5;d=tok/x;e="s\"q";f=?0`,
		"\t1754321000_Ab-9_x",
	} {
		r := e.do(call{path: "/items", actor: "alice", keys: []string{v}, body: `{}`})
		if !r.replayed() || !bytes.Equal(r.body, first.body) {
			t.Errorf("%q: %s replayed=%t", v, r, r.replayed())
		}
	}
	if n := e.calls.Load(); n != 1 {
		t.Errorf("%d executions", n)
	}
}

func TestKeyReusedWithDifferentRequest(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	if r := e.do(call{path: "/items", actor: "alice", key: "k", body: `{"n":1}`}); r.status != http.StatusCreated {
		t.Fatalf("%s", r)
	}
	if r := e.do(call{method: "PATCH", path: "/items/1", actor: "alice", key: "p", body: `{"n":1}`}); r.status != http.StatusOK {
		t.Fatalf("%s", r)
	}
	before := e.state()
	for _, c := range []call{
		{path: "/items", actor: "alice", key: "k", body: `{"n":2}`},
		{path: "/items?dry_run=1", actor: "alice", key: "k", body: `{"n":1}`},
		{path: "/items", actor: "alice", key: "k", body: `{"n":1}`, contentType: "text/plain"},
		// Same route pattern, another path: the same operation, another request.
		{method: "PATCH", path: "/items/2", actor: "alice", key: "p", body: `{"n":1}`},
	} {
		r := e.do(c)
		if r.status != http.StatusUnprocessableEntity || r.problem(t) != idemhttp.CodeKeyReused {
			t.Errorf("%s %s %s: %s", c.method, c.path, c.body, r)
		}
	}
	if after := e.state(); after != before {
		t.Errorf("changed: %+v -> %+v", before, after)
	}
}

// A 4xx is a deterministic refusal: the handler's writes are undone, the
// refusal is stored and replayed.
func TestRefusalIsStoredAndWritesUndone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	c := call{path: "/refuse", actor: "alice", key: "r1", body: `{}`}
	first := e.do(c)
	if first.status != http.StatusPaymentRequired || first.replayed() {
		t.Fatalf("%s", first)
	}
	again := e.do(c)
	if again.status != first.status || !again.replayed() || !bytes.Equal(again.body, first.body) ||
		again.header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("replay %s %v", again, again.header)
	}
	if s := e.state(); s != (state{calls: 1, effects: 0, keys: 1}) {
		t.Errorf("%+v", s)
	}
}

// 5xx, 408, 425, 429 and panics roll everything back and store nothing: a
// retry runs the handler again.
func TestFailuresStoreNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	for _, path := range []string{"/fail", "/fail?status=503", "/fail?status=429", "/fail?status=408", "/fail?status=425"} {
		c := call{path: path, actor: "alice", key: "f-" + path, body: `{}`}
		before := e.state()
		for range 2 {
			r := e.do(c)
			if r.status < 400 || string(r.body) != "boom" || r.header.Get("X-Fail") != "yes" || r.replayed() {
				t.Errorf("%s: %s %v", path, r, r.header)
			}
		}
		after := e.state()
		if after.calls != before.calls+2 || after.effects != before.effects || after.keys != before.keys {
			t.Errorf("%s: %+v -> %+v", path, before, after)
		}
	}

	c := call{path: "/panic", actor: "alice", key: "secret-key-p1", body: `{}`}
	for range 2 {
		r := e.do(c)
		if r.status != http.StatusInternalServerError || r.problem(t) != idemhttp.CodeInternal {
			t.Errorf("panic: %s", r)
		}
	}
	if s := e.state(); s.effects != 0 || s.keys != 0 {
		t.Errorf("after panics: %+v", s)
	}
	logs := e.logs.String()
	if !strings.Contains(logs, "handler bug") || !strings.Contains(logs, "key_hash=") {
		t.Errorf("panic not logged with a key hash:\n%s", logs)
	}
	if strings.Contains(logs, "secret-key-p1") {
		t.Errorf("the key itself was logged:\n%s", logs)
	}
}

// The request is answered only after the COMMIT; a failing COMMIT is a 5xx
// and stores nothing, so the retry executes.
func TestCommitFailureStoresNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	c := call{path: "/violate", actor: "alice", key: "v1", body: `{}`, header: http.Header{"X-Violate": {"1"}}}
	r := e.do(c)
	if r.status != http.StatusInternalServerError || r.problem(t) != idemhttp.CodeInternal {
		t.Fatalf("%s", r)
	}
	if s := e.state(); s != (state{calls: 1, effects: 0, keys: 0}) {
		t.Errorf("after a failed commit: %+v", s)
	}
	c.header = nil
	r = e.do(c)
	if r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("retry: %s", r)
	}
	if s := e.state(); s != (state{calls: 2, effects: 1, keys: 1}) {
		t.Errorf("after the retry: %+v", s)
	}
}

// The connection dies between the handler and the commit (a terminated
// backend): 503, nothing stored, and the retry executes.
func TestConnectionLostBeforeCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	c := call{path: "/terminate", actor: "alice", key: "t1", body: `{}`, header: http.Header{"X-Terminate": {"1"}}}
	r := e.do(c)
	if r.status != http.StatusServiceUnavailable || r.problem(t) != idemhttp.CodeStoreUnavailable {
		t.Fatalf("%s", r)
	}
	if s := e.state(); s != (state{calls: 1, effects: 0, keys: 0}) {
		t.Errorf("after the lost connection: %+v", s)
	}
	c.header = nil
	if r := e.do(c); r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("retry: %s", r)
	}
	if s := e.state(); s != (state{calls: 2, effects: 1, keys: 1}) {
		t.Errorf("after the retry: %+v", s)
	}
}

func TestActorRequired(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	for _, actor := range []string{"", strings.Repeat("a", 256)} {
		r := e.do(call{path: "/items", actor: actor, key: "k", body: `{}`})
		if r.status != http.StatusUnauthorized || r.problem(t) != idemhttp.CodeUnauthenticated {
			t.Errorf("actor %.10q: %s", actor, r)
		}
		if got := r.header.Get("WWW-Authenticate"); got != "Bearer" {
			t.Errorf("actor %.10q: WWW-Authenticate %q", actor, got)
		}
	}
	r := e.do(call{path: "/items", header: http.Header{"Authorization": {"Bearer "}}, key: "k", body: `{}`})
	if r.status != http.StatusUnauthorized {
		t.Errorf("empty actor: %s", r)
	}
	if s := e.state(); s != (state{}) {
		t.Errorf("%+v", s)
	}
}

func TestBodyTooLarge(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{MaxBodyBytes: 64}})
	big := `{"pad":"` + strings.Repeat("x", 64) + `"}`
	r := e.do(call{path: "/items", actor: "alice", key: "k", body: big})
	if r.status != http.StatusRequestEntityTooLarge || r.problem(t) != idemhttp.CodeBodyTooLarge {
		t.Errorf("with Content-Length: %s", r)
	}

	// Without a Content-Length (chunked), the limit applies while reading.
	req := e.request(t.Context(), call{path: "/items", actor: "alice", key: "k"})
	req.Body = io.NopCloser(io.MultiReader(strings.NewReader(big)))
	req.ContentLength = -1
	resp, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("chunked: %d", resp.StatusCode)
	}
	if s := e.state(); s != (state{}) {
		t.Errorf("%+v", s)
	}
	// The key is still free.
	if r := e.do(call{path: "/items", actor: "alice", key: "k", body: `{}`}); r.status != http.StatusCreated || r.replayed() {
		t.Errorf("small body after the refusal: %s", r)
	}
}

func TestUncoveredMethodsPassThrough(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	r := e.do(call{method: "GET", path: "/items"})
	if r.status != http.StatusOK || string(r.body) != "list tx=false" {
		t.Errorf("GET: %s", r)
	}
	r = e.do(call{method: "PUT", path: "/items/1"})
	if r.status != http.StatusOK || string(r.body) != "put 1 tx=false" {
		t.Errorf("PUT: %s", r)
	}

	// Covering PUT: a key is required and the handler gets a transaction.
	e = newEnv(t, envConfig{opts: idemhttp.Options{Methods: []string{"PUT"}}})
	if r := e.do(call{method: "PUT", path: "/items/1", actor: "alice"}); r.status != http.StatusBadRequest {
		t.Errorf("covered PUT without a key: %s", r)
	}
	r = e.do(call{method: "PUT", path: "/items/1", actor: "alice", key: "k"})
	if r.status != http.StatusOK || string(r.body) != "put 1 tx=true" {
		t.Errorf("covered PUT: %s", r)
	}
}

func TestKeyOptional(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{KeyOptional: true}})
	for range 2 {
		if r := e.do(call{path: "/items", actor: "alice", body: `{}`}); r.status != http.StatusCreated || r.replayed() {
			t.Errorf("%s", r)
		}
	}
	if r := e.do(call{path: "/refuse", actor: "alice", body: `{}`}); r.status != http.StatusPaymentRequired {
		t.Errorf("%s", r)
	}
	if r := e.do(call{path: "/panic", actor: "alice", body: `{}`}); r.status != http.StatusInternalServerError {
		t.Errorf("%s", r)
	}
	// Both requests without a key ran and committed; the refusal and the
	// panic were rolled back; nothing was stored.
	if s := e.state(); s != (state{calls: 4, effects: 2, keys: 0}) {
		t.Errorf("%+v", s)
	}
	// Still 401 without an actor, and 400 for a malformed key.
	if r := e.do(call{path: "/items", body: `{}`}); r.status != http.StatusUnauthorized {
		t.Errorf("%s", r)
	}
	if r := e.do(call{path: "/items", actor: "alice", key: "a b", body: `{}`}); r.status != http.StatusBadRequest {
		t.Errorf("%s", r)
	}
}

func TestCrossActorIsolation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	c := call{path: "/items", key: "shared-key", body: `{}`}
	a, b := c, c
	a.actor, b.actor = "alice", "bob"
	ra, rb := e.do(a), e.do(b)
	if ra.status != http.StatusCreated || rb.status != http.StatusCreated || ra.replayed() || rb.replayed() ||
		bytes.Equal(ra.body, rb.body) {
		t.Fatalf("alice %s, bob %s", ra, rb)
	}
	if r := e.do(a); !r.replayed() || !bytes.Equal(r.body, ra.body) {
		t.Errorf("alice's retry: %s", r)
	}
	if r := e.do(b); !r.replayed() || !bytes.Equal(r.body, rb.body) {
		t.Errorf("bob's retry: %s", r)
	}
	if n := e.count(`SELECT count(DISTINCT actor) FROM effects`); n != 2 {
		t.Errorf("%d actors wrote", n)
	}
}

func TestConcurrentDuplicatesExecuteOnce(t *testing.T) {
	t.Parallel()
	const n = 16
	e := newEnv(t, envConfig{})
	c := call{path: "/items", actor: "alice", key: "race", body: `{"q":1}`}

	replies := make([]reply, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			replies[i] = e.do(c)
		})
	}
	close(start)
	wg.Wait()

	executed, replayed, inProgress := 0, 0, 0
	var body []byte
	for _, r := range replies {
		switch {
		case r.status == http.StatusConflict:
			inProgress++
			if r.problem(t) != idemhttp.CodeInProgress || r.header.Get("Retry-After") == "" {
				t.Errorf("409 without Retry-After: %s", r)
			}
			continue
		case r.status != http.StatusCreated:
			t.Fatalf("%s", r)
		case r.replayed():
			replayed++
		default:
			executed++
		}
		if body == nil {
			body = r.body
		} else if !bytes.Equal(body, r.body) {
			t.Errorf("bodies differ: %s / %s", body, r.body)
		}
	}
	t.Logf("%d executed, %d replayed, %d in progress", executed, replayed, inProgress)
	if executed != 1 || e.calls.Load() != 1 || e.effects() != 1 {
		t.Errorf("executed %d, calls %d, effects %d", executed, e.calls.Load(), e.effects())
	}
}

// A client gives up while its request is still running; the work goes on
// and commits, the retry gets 409 while it runs and then the stored
// response.
func TestClientTimeoutThenRetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{Config: idem.Config{Wait: 10 * time.Millisecond}}})
	c := call{path: "/block", actor: "alice", key: "slow", body: `{"q":1}`}

	ctx, cancel := context.WithCancel(t.Context())
	firstErr := make(chan error, 1)
	go func() {
		_, err := e.try(ctx, c)
		firstErr <- err
	}()
	<-e.started
	cancel() // the client times out and hangs up
	if err := <-firstErr; !errors.Is(err, context.Canceled) {
		t.Fatalf("first request: %v", err)
	}

	r := e.do(c) // still running: in progress
	if r.status != http.StatusConflict || r.problem(t) != idemhttp.CodeInProgress || r.header.Get("Retry-After") == "" {
		t.Errorf("retry while running: %s %v", r, r.header)
	}
	close(e.release)

	r = e.retry(c)
	if r.status != http.StatusCreated || !r.replayed() {
		t.Errorf("retry after the first finished: %s replayed=%t", r, r.replayed())
	}
	if s := e.state(); s != (state{calls: 1, effects: 1, keys: 1}) {
		t.Errorf("%+v", s)
	}
}

// dropWriter loses the response: its first WriteHeader (which the
// middleware calls only after the COMMIT) closes the connection instead.
type dropWriter struct {
	http.ResponseWriter
	dropped bool
}

func (d *dropWriter) WriteHeader(int) {
	if !d.dropped {
		d.dropped = true
		if conn, _, err := http.NewResponseController(d.ResponseWriter).Hijack(); err == nil {
			conn.Close()
		}
	}
}

func (d *dropWriter) Write(p []byte) (int, error) {
	d.WriteHeader(http.StatusOK)
	return 0, net.ErrClosed
}

// dropAfterCommit is outer middleware that loses the response of requests
// marked X-Drop: after-commit.
func dropAfterCommit(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Drop") == "after-commit" {
			w = &dropWriter{ResponseWriter: w}
		}
		next.ServeHTTP(w, r)
	})
}

func TestResponseLostAfterCommitReplays(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{outer: dropAfterCommit})
	c := call{path: "/items", actor: "alice", key: "lost", body: `{}`, header: http.Header{"X-Drop": {"after-commit"}}}
	if _, err := e.try(t.Context(), c); err == nil {
		t.Fatal("the response was not lost")
	}
	if s := e.state(); s != (state{calls: 1, effects: 1, keys: 1}) {
		t.Fatalf("after the lost response: %+v", s)
	}
	c.header = nil
	r := e.do(c)
	if r.status != http.StatusCreated || !r.replayed() {
		t.Errorf("retry: %s", r)
	}
	if s := e.state(); s != (state{calls: 1, effects: 1, keys: 1}) {
		t.Errorf("after the retry: %+v", s)
	}
}

// The store is down: 503, and the handler never runs.
func TestStoreOutageFailsClosed(t *testing.T) {
	t.Parallel()
	// A port nobody listens on.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadURL := fmt.Sprintf("postgres://postgres@%s/idem?connect_timeout=5", l.Addr())
	l.Close()
	dead, err := pgxpool.New(t.Context(), deadURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dead.Close)

	for name, db := range map[string]func(*pgxpool.Pool) idem.Beginner{
		"refused": func(*pgxpool.Pool) idem.Beginner { return dead },
		"closed pool": func(p *pgxpool.Pool) idem.Beginner {
			closed, err := pgxpool.New(context.Background(), p.Config().ConnString())
			if err != nil {
				t.Fatal(err)
			}
			closed.Close()
			return closed
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envConfig{db: db})
			r := e.do(call{path: "/items", actor: "alice", key: "k", body: `{}`})
			if r.status != http.StatusServiceUnavailable || r.problem(t) != idemhttp.CodeStoreUnavailable ||
				r.header.Get("Retry-After") == "" {
				t.Errorf("%s %v", r, r.header)
			}
			if e.calls.Load() != 0 {
				t.Errorf("the handler ran %d times without the store", e.calls.Load())
			}
		})
	}
}

// A database without idem's table answers, but with an error: 500, and
// the handler never runs.
func TestStoreErrorIs500(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	if _, err := e.pool.Exec(t.Context(), `DROP TABLE idem_keys`); err != nil {
		t.Fatal(err)
	}
	r := e.do(call{path: "/items", actor: "alice", key: "k", body: `{}`})
	if r.status != http.StatusInternalServerError || r.problem(t) != idemhttp.CodeInternal {
		t.Errorf("%s", r)
	}
	if e.calls.Load() != 0 {
		t.Errorf("the handler ran")
	}
}

func TestResponseTooLargeStoresNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{Config: idem.Config{MaxResponseBytes: 1024}}})
	r := e.do(call{path: "/big", actor: "alice", key: "k", body: `{}`})
	if r.status != http.StatusInternalServerError || r.problem(t) != idemhttp.CodeInternal {
		t.Errorf("%s", r)
	}
	if s := e.state(); s != (state{calls: 1}) {
		t.Errorf("%+v", s)
	}
}

// Without per-route wrapping there is no route pattern: the operation is
// the method and path.
func TestDefaultOperation(t *testing.T) {
	t.Parallel()
	for _, wrapMux := range []bool{false, true} {
		t.Run(fmt.Sprintf("wrapMux=%t", wrapMux), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envConfig{wrapMux: wrapMux})
			for _, path := range []string{"/items/1", "/items/2"} {
				e.do(call{method: "PATCH", path: path, actor: "alice", key: "k", body: `{}`})
			}
			rows, err := e.pool.Query(t.Context(), `SELECT operation FROM idem_keys ORDER BY operation`)
			if err != nil {
				t.Fatal(err)
			}
			var ops []string
			for rows.Next() {
				var op string
				if err := rows.Scan(&op); err != nil {
					t.Fatal(err)
				}
				ops = append(ops, op)
			}
			if err := rows.Err(); err != nil {
				t.Fatal(err)
			}
			want := []string{"PATCH /items/{id}"} // the second is a 422
			if wrapMux {
				want = []string{"PATCH /items/1", "PATCH /items/2"}
			}
			if !slices.Equal(ops, want) {
				t.Errorf("operations %q, want %q", ops, want)
			}
		})
	}
}

func TestCustomOperationAndFingerprint(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{
		Operation: func(*http.Request) string { return "create-item" },
		Fingerprint: func(r *http.Request, body []byte) (idem.Fingerprint, error) {
			if len(body) == 0 {
				return idem.Fingerprint{}, errors.New("empty body")
			}
			return idem.FingerprintParts(body), nil
		},
	}})
	r := e.do(call{path: "/items", actor: "alice", key: "k"})
	if r.status != http.StatusBadRequest || r.problem(t) != idemhttp.CodeBadRequest {
		t.Errorf("%s", r)
	}
	if r := e.do(call{path: "/items", actor: "alice", key: "k", body: "x"}); r.status != http.StatusCreated {
		t.Errorf("%s", r)
	}
	// The custom fingerprint ignores the path: the same operation and body
	// on another route replays.
	if r := e.do(call{path: "/refuse", actor: "alice", key: "k", body: "x"}); r.status != http.StatusCreated || !r.replayed() {
		t.Errorf("%s", r)
	}
	if n := e.count(`SELECT count(*) FROM idem_keys WHERE operation = 'create-item'`); n != 1 {
		t.Errorf("%d rows", n)
	}
}

func TestInvalidOptionsPanic(t *testing.T) {
	t.Parallel()
	pool := &pgxpool.Pool{}
	for name, f := range map[string]func(){
		"nil db":            func() { idemhttp.Middleware(nil, idemhttp.Options{Actor: bearer}) },
		"nil actor":         func() { idemhttp.Middleware(pool, idemhttp.Options{}) },
		"negative body":     func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, MaxBodyBytes: -1}) },
		"negative time":     func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, Timeout: -1}) },
		"bad method":        func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, Methods: []string{"PO ST"}}) },
		"lower-case method": func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, Methods: []string{"post"}}) },
		"bad header name":   func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, StoredHeaders: []string{"X Y"}}) },
		"bad config": func() {
			idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, Config: idem.Config{MaxKeyLength: 5000}})
		},
		"nil handler": func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer})(nil) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
}

// A request that runs past Options.Timeout is rolled back and answered 503
// with its own code, not as a store failure.
func TestTimeoutIs503(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{Timeout: 300 * time.Millisecond}})
	// A handler that ignores the deadline, and one that answers 500 when
	// its statement fails on it.
	for _, path := range []string{"/slow", "/deadline"} {
		r := e.do(call{path: path, actor: "alice", key: "slow" + path[1:], body: `{}`})
		if r.status != http.StatusServiceUnavailable || r.problem(t) != idemhttp.CodeTimeout || r.header.Get("Retry-After") == "" {
			t.Fatalf("%s: %s %v", path, r, r.header)
		}
	}
	if s := e.state(); s.effects != 0 || s.keys != 0 {
		t.Fatalf("a timed-out request left %+v", s)
	}
}

// Config.Wait longer than Timeout is capped, so a duplicate of a request in
// flight gets 409, not a timeout.
func TestDuplicateWithShortTimeoutGets409(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{Timeout: 2 * time.Second, Config: idem.Config{Wait: time.Minute}}})
	c := call{path: "/block", actor: "alice", key: "held", body: `{}`}
	first := make(chan reply, 1)
	go func() { first <- e.do(c) }()
	<-e.started
	if r := e.do(c); r.status != http.StatusConflict || r.problem(t) != idemhttp.CodeInProgress {
		t.Errorf("duplicate: %s", r)
	}
	close(e.release)
	if r := <-first; r.status != http.StatusCreated {
		t.Fatalf("first: %s", r)
	}
	if r := e.do(c); !r.replayed() {
		t.Fatalf("retry: %s", r)
	}
}

// Content-Encoding is stored by default: a compressed body replays with it.
func TestCompressedResponseReplays(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	c := call{path: "/gzip", actor: "alice", key: "gz", body: `{}`}
	var bodies [][]byte
	for i := range 2 {
		req := e.request(t.Context(), c)
		req.Header.Set("Accept-Encoding", "gzip") // the client decompresses itself
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		zr, err := gzip.NewReader(resp.Body)
		if err != nil {
			t.Fatalf("call %d: %v (Content-Encoding %q)", i, err, resp.Header.Get("Content-Encoding"))
		}
		b, err := io.ReadAll(zr)
		resp.Body.Close()
		if err != nil || resp.Header.Get("Content-Encoding") != "gzip" || (i == 1) != (resp.Header.Get("Idempotent-Replayed") == "true") {
			t.Fatalf("call %d: %v %v", i, err, resp.Header)
		}
		bodies = append(bodies, b)
	}
	if string(bodies[0]) != "compressed hello" || !bytes.Equal(bodies[0], bodies[1]) {
		t.Fatalf("bodies %q", bodies)
	}
}
