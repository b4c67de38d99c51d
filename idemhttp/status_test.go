package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// statusPath is where statusEnv mounts StatusHandler for GET; /status-any
// has it for every method.
const statusPath = "/idempotency"

// statusEnv is newEnv with Options.StatusURL set and StatusHandler mounted
// at it. Duplicates wait 10 ms for the request in flight.
func statusEnv(t *testing.T) *env {
	t.Helper()
	return newEnv(t, envConfig{
		opts: idemhttp.Options{StatusURL: statusPath, Config: idem.Config{Wait: 10 * time.Millisecond}},
		routes: func(mux *http.ServeMux, pool *pgxpool.Pool) {
			h := idemhttp.StatusHandler(pool, idemhttp.StatusOptions{Actor: bearer})
			mux.Handle("GET "+statusPath, h)
			mux.Handle("/status-any", h)
		},
	})
}

// statusOf is the status URL of (operation, key), as a client would build
// it from the documented parameters.
func statusOf(operation, key string) string {
	return statusPath + "?" + url.Values{
		idemhttp.StatusParamOperation: {operation}, idemhttp.StatusParamKey: {key}}.Encode()
}

// processing checks a 202 with Retry-After and {"status":"processing"}.
func processing(t *testing.T, what string, r reply) {
	t.Helper()
	var doc struct{ Status string }
	if r.status != http.StatusAccepted || r.header.Get("Retry-After") == "" ||
		r.header.Get("Content-Type") != "application/json" || r.header.Get("Cache-Control") != "no-store" ||
		json.Unmarshal(r.body, &doc) != nil || doc.Status != idemhttp.AcceptedStatusProcessing || r.replayed() {
		t.Fatalf("%s: %s %v, want 202 processing with Retry-After", what, r, r.header)
	}
}

// The 202 flow over HTTP: a duplicate of a request in flight gets 202 with
// the Location of its status URL; polling it gives 202 while the request
// runs and the stored response once it finished; only the key's own actor
// sees anything.
func TestAcceptedWhileInFlight(t *testing.T) {
	t.Parallel()
	e := statusEnv(t)
	c := call{path: "/block", actor: "alice", key: "a/../%2F?#..", body: `{"q":1}`}
	first := make(chan reply, 1)
	go func() { first <- e.do(c) }()
	<-e.started

	dup := e.do(c)
	processing(t, "duplicate", dup)
	loc := dup.header.Get("Location")
	u, err := url.Parse(loc)
	if err != nil || u.Path != statusPath || u.Query().Get("operation") != "POST /block" || u.Query().Get("key") != c.key {
		t.Fatalf("Location %q", loc)
	}

	// While the first runs: 202 for alice, 404 for bob, 401 for nobody.
	processing(t, "poll in flight", e.do(call{method: "GET", path: loc, actor: "alice"}))
	if r := e.do(call{method: "HEAD", path: loc, actor: "alice"}); r.status != http.StatusAccepted || len(r.body) != 0 {
		t.Errorf("HEAD in flight: %s", r)
	}
	notFound := e.do(call{method: "GET", path: loc, actor: "bob"})
	if notFound.status != http.StatusNotFound || notFound.problem(t) != idemhttp.CodeKeyNotFound {
		t.Errorf("another actor in flight: %s", notFound)
	}
	r := e.do(call{method: "GET", path: loc})
	if r.status != http.StatusUnauthorized || r.problem(t) != idemhttp.CodeUnauthenticated || r.header.Get("WWW-Authenticate") != "Bearer" {
		t.Errorf("no actor: %s %v", r, r.header)
	}

	close(e.release)
	created := <-first
	if created.status != http.StatusCreated || created.replayed() {
		t.Fatalf("first: %s", created)
	}

	// Finished: alice gets the stored response, as a retry would.
	r = e.do(call{method: "GET", path: loc, actor: "alice"})
	if r.status != http.StatusCreated || !r.replayed() || !bytes.Equal(r.body, created.body) ||
		r.header.Get("Location") != created.header.Get("Location") || r.header.Get("Content-Type") != "application/json" ||
		r.header.Get("X-Not-Stored") != "" || r.header.Get("Cache-Control") != "no-store" {
		t.Errorf("poll after the first finished: %s %v; first %s %v", r, r.header, created, created.header)
	}
	if retry := e.do(c); retry.status != http.StatusCreated || !retry.replayed() || !bytes.Equal(retry.body, r.body) {
		t.Errorf("retry: %s", retry)
	}
	// bob learns nothing: the same 404 as for a key nobody used.
	r = e.do(call{method: "GET", path: loc, actor: "bob"})
	never := e.do(call{method: "GET", path: statusOf("POST /block", "never-used"), actor: "alice"})
	if r.status != http.StatusNotFound || !bytes.Equal(r.body, never.body) || !bytes.Equal(r.body, notFound.body) {
		t.Errorf("another actor after the first finished: %s; never used: %s", r, never)
	}
	if s := e.state(); s != (state{calls: 1, effects: 1, keys: 1}) {
		t.Errorf("%+v", s)
	}
}

// Finished requests at the status URL: a stored refusal replays, a request
// that stored nothing is 404, so the client sends it again.
func TestStatusOfFinishedRequests(t *testing.T) {
	t.Parallel()
	e := statusEnv(t)

	refused := e.do(call{path: "/refuse", actor: "alice", key: "r", body: `{}`})
	r := e.do(call{method: "GET", path: statusOf("POST /refuse", "r"), actor: "alice"})
	if r.status != http.StatusPaymentRequired || !r.replayed() || !bytes.Equal(r.body, refused.body) {
		t.Errorf("stored refusal: %s, first %s", r, refused)
	}

	for _, c := range []call{
		{path: "/fail", key: "f"},                        // 500: nothing stored
		{path: "/fail?status=429", key: "busy"},          // 429: nothing stored
		{path: "/validate", key: "v", body: `{"qty":0}`}, // Invalid: nothing stored
	} {
		c.actor = "alice"
		if c.body == "" {
			c.body = `{}`
		}
		if first := e.do(c); first.status < 400 {
			t.Fatalf("%s: %s", c.path, first)
		}
		op := "POST " + strings.SplitN(c.path, "?", 2)[0]
		if r := e.do(call{method: "GET", path: statusOf(op, c.key), actor: "alice"}); r.status != http.StatusNotFound || r.problem(t) != idemhttp.CodeKeyNotFound {
			t.Errorf("%s: %s", c.path, r)
		}
	}
	// The invalid request corrected, same key: it runs, and the status URL
	// has its response.
	ok := e.do(call{path: "/validate", key: "v", actor: "alice", body: `{"qty":1}`})
	if r := e.do(call{method: "GET", path: statusOf("POST /validate", "v"), actor: "alice"}); ok.status != http.StatusCreated ||
		r.status != http.StatusCreated || !bytes.Equal(r.body, ok.body) {
		t.Errorf("corrected: %s; status URL: %s", ok, r)
	}
	if s := e.state(); s.keys != 2 {
		t.Errorf("%+v", s)
	}
}

// A malformed status URL is a 400 problem (404 for no such key), after
// authentication, and a poll never leaves a row behind.
func TestStatusBadRequests(t *testing.T) {
	t.Parallel()
	e := statusEnv(t)
	long := strings.Repeat("k", 256)
	for _, tc := range []struct {
		query  string
		status int
		code   string
	}{
		{"", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"key=k", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=POST+%2Fitems", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=POST+%2Fitems&key=", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=&key=k", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=POST+%2Fitems&key=a&key=b", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=x&operation=y&key=k", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=POST+%2Fitems&key=%zz", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=POST+%2Fitems&key=k;x", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=" + strings.Repeat("o", 256) + "&key=k", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=%FF&key=k", http.StatusBadRequest, idemhttp.CodeBadRequest},
		{"operation=POST+%2Fitems&key=a+b", http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"operation=POST+%2Fitems&key=%C3%A9", http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"operation=POST+%2Fitems&key=" + long, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"operation=POST+%2Fitems&key=k", http.StatusNotFound, idemhttp.CodeKeyNotFound},
		{"operation=no-such-operation&key=k&unrelated=1", http.StatusNotFound, idemhttp.CodeKeyNotFound},
	} {
		path := statusPath + "?" + tc.query
		r := e.do(call{method: "GET", path: path, actor: "alice"})
		if r.status != tc.status || r.problem(t) != tc.code || r.header.Get("Cache-Control") != "no-store" {
			t.Errorf("%q: %s, want %d %s", tc.query, r, tc.status, tc.code)
		}
		if r := e.do(call{method: "GET", path: path}); r.status != http.StatusUnauthorized {
			t.Errorf("%q without an actor: %s", tc.query, r)
		}
	}
	for _, method := range []string{"POST", "PUT", "DELETE"} {
		r := e.do(call{method: method, path: "/status-any?" + "operation=x&key=k", actor: "alice"})
		if r.status != http.StatusMethodNotAllowed || r.problem(t) != idemhttp.CodeMethodNotAllowed || r.header.Get("Allow") != "GET, HEAD" {
			t.Errorf("%s: %s %v", method, r, r.header)
		}
	}
	if s := e.state(); s != (state{}) {
		t.Errorf("polls changed %+v", s)
	}
}

func TestStatusInvalidOptionsPanic(t *testing.T) {
	t.Parallel()
	pool := &pgxpool.Pool{}
	for name, f := range map[string]func(){
		"nil db":    func() { idemhttp.StatusHandler(nil, idemhttp.StatusOptions{Actor: bearer}) },
		"nil pool":  func() { idemhttp.StatusHandler((*pgxpool.Pool)(nil), idemhttp.StatusOptions{Actor: bearer}) },
		"nil actor": func() { idemhttp.StatusHandler(pool, idemhttp.StatusOptions{}) },
		"bad config": func() {
			idemhttp.StatusHandler(pool, idemhttp.StatusOptions{Actor: bearer, Config: idem.Config{MinKeyLength: -1}})
		},
		"url query": func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, StatusURL: "/status?a=1"}) },
		"url empty query": func() {
			idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, StatusURL: "/status?"})
		},
		"url fragment": func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, StatusURL: "/status#x"}) },
		"url opaque":   func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, StatusURL: "mailto:x"}) },
		"url escape":   func() { idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, StatusURL: "/st%zz"}) },
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
	// Both forms are accepted.
	for _, u := range []string{"/v1/idempotency", "https://api.example.com/v1/idempotency"} {
		idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, StatusURL: u})
	}
}

// Reservations (idem.Reserve) at the status URL: a live lease is 202, an
// unknown outcome or a lapsed lease 409, a retryable failure 404, a
// completed one its stored response; a duplicate through the middleware
// that meets a live lease gets 202 with the Location of the same status.
func TestStatusOfReservations(t *testing.T) {
	t.Parallel()
	e := statusEnv(t)
	ctx := t.Context()
	op := "POST /items"
	scope := idem.Scope{Actor: "alice", Operation: op}
	body := `{"q":1}`
	req := httptest.NewRequest("POST", "/items", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json") // as the harness sends it
	fp, err := idemhttp.DefaultFingerprint(req, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	reserve := func(key string, lease time.Duration) idem.Reservation {
		t.Helper()
		r, err := idem.Reserve(ctx, e.pool, scope, key, fp, lease)
		if err != nil || r.Token == 0 {
			t.Fatalf("reserve %s: %+v %v", key, r, err)
		}
		return r
	}
	get := func(key, actor string) reply { return e.do(call{method: "GET", path: statusOf(op, key), actor: actor}) }

	reserve("live", time.Hour)
	r := get("live", "alice")
	processing(t, "live lease", r)
	if s, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || s < 1 || s > 60 {
		t.Errorf("Retry-After %q for a live lease: between 1 and 60 s", r.header.Get("Retry-After"))
	}
	if r := get("live", "bob"); r.status != http.StatusNotFound || r.problem(t) != idemhttp.CodeKeyNotFound {
		t.Errorf("another actor: %s", r)
	}
	dup := e.do(call{path: "/items", actor: "alice", key: "live", body: body})
	processing(t, "duplicate of a live reservation", dup)
	if loc := dup.header.Get("Location"); loc != statusOf(op, "live") {
		t.Errorf("Location %q, want %q", loc, statusOf(op, "live"))
	}

	reserve("lapsed", time.Microsecond)
	if r := get("lapsed", "alice"); r.status != http.StatusConflict || r.problem(t) != idemhttp.CodeOutcomeUnknown {
		t.Errorf("lapsed lease: %s", r)
	}
	if err := idem.MarkUnknown(ctx, e.pool, reserve("unknown", time.Hour), "gateway timeout"); err != nil {
		t.Fatal(err)
	}
	if r := get("unknown", "alice"); r.status != http.StatusConflict || r.problem(t) != idemhttp.CodeOutcomeUnknown {
		t.Errorf("unknown: %s", r)
	}
	if err := idem.FailRetryable(ctx, e.pool, reserve("retry", time.Hour), "refused before acting"); err != nil {
		t.Fatal(err)
	}
	if r := get("retry", "alice"); r.status != http.StatusNotFound || r.problem(t) != idemhttp.CodeKeyNotFound {
		t.Errorf("failed retryable: %s", r)
	}

	done := reserve("done", time.Hour)
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stored := idem.Response{Status: http.StatusCreated, Body: []byte(`{"paid":true}`), Header: map[string][]string{
		"Content-Type": {"application/json"}, "Cache-Control": {"max-age=60"}}}
	if err := idem.Complete(ctx, tx, done, stored); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r = get("done", "alice")
	if r.status != http.StatusCreated || !r.replayed() || string(r.body) != string(stored.Body) ||
		r.header.Get("Content-Type") != "application/json" || r.header.Get("Cache-Control") != "no-store" {
		t.Errorf("completed: %s %v", r, r.header)
	}
	if r := get("done", "bob"); r.status != http.StatusNotFound {
		t.Errorf("another actor, completed: %s", r)
	}
	if e.calls.Load() != 0 {
		t.Errorf("the handler ran %d times", e.calls.Load())
	}
}

// A record written without the middleware (idem.Resolve, idem.DoInTx) may
// hold any header: the status URL and the middleware's replay send only
// the stored headers the middleware stores (StoredHeaders), never the
// others.
func TestReplayOnlyStoredHeaders(t *testing.T) {
	t.Parallel()
	e := statusEnv(t)
	scope := idem.Scope{Actor: "alice", Operation: "POST /items"}
	fp, _ := idemhttp.DefaultFingerprint(e.request(t.Context(), call{path: "/items"}), []byte(`{}`))
	_, err := idem.DoInTx(t.Context(), e.pool, scope, "outside", fp,
		func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Body: []byte(`{}`), Header: map[string][]string{
				"Content-Type": {"application/json"}, "Location": {"/items/9"},
				"Set-Cookie": {"session=secret"}, "X-Internal": {"1"},
			}}, nil
		})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []call{
		{method: "GET", path: statusOf("POST /items", "outside"), actor: "alice"},
		{path: "/items", key: "outside", actor: "alice", body: `{}`},
	} {
		r := e.do(c)
		if r.status != http.StatusCreated || !r.replayed() || r.header.Get("Location") != "/items/9" ||
			r.header.Get("Content-Type") != "application/json" {
			t.Fatalf("%s %s: %s %v", c.method, c.path, r, r.header)
		}
		if r.header.Get("Set-Cookie") != "" || r.header.Get("X-Internal") != "" {
			t.Errorf("%s %s replayed headers the middleware does not store: %v", c.method, c.path, r.header)
		}
	}
}
