package idemui_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

var fp = idem.FingerprintParts([]byte("charge 12000 KRW"))

// env is a console mounted at /idem/ of a test server, on a fresh
// database, with an Authorize that records what it was asked.
type env struct {
	t       *testing.T
	pool    *pgxpool.Pool
	srv     *httptest.Server
	mu      sync.Mutex
	asked   []idemui.Action
	deny    bool                   // Authorize refuses
	refuse  map[idemui.Action]bool // Authorize refuses these actions
	offered []idemui.Action        // what Authorize was asked to offer
	name    string                 // the operator Authorize returns
	client  *http.Client
}

func newEnv(t *testing.T, mod func(*idemui.Options)) *env {
	t.Helper()
	e := &env{t: t, pool: pgtest.Pool(t, idem.Migrate), name: "alice"}
	opts := idemui.Options{DB: e.pool, Prefix: "/idem", Authorize: e.authorize}
	if mod != nil {
		mod(&opts)
	}
	h, err := idemui.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/idem/", h)
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	e.client = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	return e
}

func (e *env) authorize(r *http.Request, a idemui.Action) (string, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if idemui.IsOffer(r) {
		e.offered = append(e.offered, a)
	} else {
		e.asked = append(e.asked, a)
	}
	if e.deny || e.refuse[a] {
		return "", errSecret
	}
	return e.name, nil
}

// errSecret is what a refusing Authorize returns; no page may show it.
var errSecret = &secretError{}

type secretError struct{}

func (*secretError) Error() string { return "session 7f3a-secret expired for mallory@example.com" }

// lastAsked returns the actions Authorize was asked since the last call.
func (e *env) takeAsked() []idemui.Action {
	e.mu.Lock()
	defer e.mu.Unlock()
	a := e.asked
	e.asked = nil
	return a
}

// response is an answer read whole.
type response struct {
	status int
	header http.Header
	body   string
}

func (e *env) do(method, path, contentType, body string, header ...string) response {
	e.t.Helper()
	req, err := http.NewRequest(method, e.srv.URL+path, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := e.client.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return response{res.StatusCode, res.Header, string(b)}
}

func (e *env) get(path string) response { return e.do(http.MethodGet, path, "", "") }

func (e *env) postForm(path string, vs url.Values) response {
	return e.do(http.MethodPost, path, "application/x-www-form-urlencoded", vs.Encode())
}

func (e *env) postJSON(path string, v any) response {
	b, err := json.Marshal(v)
	if err != nil {
		e.t.Fatal(err)
	}
	return e.do(http.MethodPost, path, "application/json", string(b))
}

// code is the "code" of a JSON API error.
func (r response) code() string {
	var out struct {
		Error struct{ Code string } `json:"error"`
	}
	_ = json.Unmarshal([]byte(r.body), &out)
	return out.Error.Code
}

// reserve makes a 'processing' reservation of key under scope with lease.
func (e *env) reserve(scope idem.Scope, key string, lease time.Duration) idem.Reservation {
	e.t.Helper()
	r, err := idem.Reserve(context.Background(), e.pool, scope, key, fp, lease)
	if err != nil {
		e.t.Fatal(err)
	}
	return r
}

// unknown makes an 'unknown' record of key under scope, with reason.
func (e *env) unknown(scope idem.Scope, key, reason string) idem.Reservation {
	e.t.Helper()
	r := e.reserve(scope, key, time.Hour)
	if err := idem.MarkUnknown(context.Background(), e.pool, r, reason); err != nil {
		e.t.Fatal(err)
	}
	return r
}

// lapsed makes a reservation whose lease ran out (still 'processing').
func (e *env) lapsed(scope idem.Scope, key string) idem.Reservation {
	e.t.Helper()
	r := e.reserve(scope, key, time.Microsecond)
	time.Sleep(time.Millisecond)
	return r
}

// succeeded makes a 'succeeded' record of key under scope with body.
func (e *env) succeeded(scope idem.Scope, key string, resp idem.Response) idem.Reservation {
	e.t.Helper()
	ctx := context.Background()
	r := e.reserve(scope, key, time.Hour)
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := idem.Complete(ctx, tx, r, resp); err != nil {
		e.t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		e.t.Fatal(err)
	}
	return r
}

func (e *env) lookup(scope idem.Scope, key string) idem.Record {
	e.t.Helper()
	rec, err := idem.Lookup(context.Background(), e.pool, scope, key)
	if err != nil {
		e.t.Fatal(err)
	}
	return rec
}

// state is every row of idem_keys and idem_audit as text: what "nothing
// changed" compares.
func (e *env) state() string {
	e.t.Helper()
	var s string
	err := e.pool.QueryRow(context.Background(), `SELECT
		coalesce((SELECT string_agg(k::text, E'\n' ORDER BY actor, operation, idem_key) FROM idem_keys k), '') || E'\n--\n' ||
		coalesce((SELECT string_agg(a::text, E'\n' ORDER BY id) FROM idem_audit a), '')`).Scan(&s)
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

func (e *env) auditRows() int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_audit`).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// keyPath is the console's address of a record, each part path-escaped.
func keyPath(scope idem.Scope, key string) string {
	esc := func(s string) string {
		switch s {
		case ".":
			return "%2E"
		case "..":
			return "%2E%2E"
		}
		return url.PathEscape(s)
	}
	return "/idem/keys/" + esc(scope.Actor) + "/" + esc(scope.Operation) + "/" + esc(key)
}

// keyPage is the address of a record's page as the console links it: the
// names in the query, which no browser cleans.
func keyPage(scope idem.Scope, key string) string {
	return "/idem/key?" + url.Values{"actor": {scope.Actor}, "operation": {scope.Operation}, "key": {key}}.Encode()
}

// flashed follows a redirect's Location (path and query) and returns the
// page it leads to.
func (e *env) flashed(res response) response {
	e.t.Helper()
	loc := res.header.Get("Location")
	if res.status != http.StatusSeeOther || loc == "" {
		e.t.Fatalf("not a redirect: %d %q\n%s", res.status, loc, res.body)
	}
	return e.get(loc)
}

// forgetForm is a confirmed forget of the attempt (token, created) with
// reason.
func forgetForm(token int64, created, reason string) url.Values {
	return url.Values{"token": {strconv.FormatInt(token, 10)}, "created_at": {created}, "reason": {reason}, "confirm": {"yes"}}
}

// keyURLFor is the address of a record's action (resolve, forget) as the
// record page's forms post it.
func keyURLFor(scope idem.Scope, key, action string) string {
	return strings.Replace(keyPage(scope, key), "/key?", "/key/"+action+"?", 1)
}
