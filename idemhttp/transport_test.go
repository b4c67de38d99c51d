package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/httprelay"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// fastPolicy retries quickly, so that the tests do not wait.
var fastPolicy = idem.RetryPolicy{MaxAttempts: 5, BaseDelay: time.Millisecond, MaxDelay: 20 * time.Millisecond}

// migrateOrders installs idem's table and the orders the handler writes,
// one row per execution.
func migrateOrders(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, op text NOT NULL)`)
	return err
}

// ordersServer serves POST /orders behind idemhttp's Middleware on a fresh
// database: each execution writes one order in the request's transaction.
func ordersServer(t *testing.T) (base string, pool *pgxpool.Pool) {
	t.Helper()
	pool = pgtest.Pool(t, migrateOrders)
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: func(*http.Request) (string, error) { return "alice", nil }})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct{ Op string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var id int64
		if err := idemhttp.Tx(r.Context()).QueryRow(r.Context(), `INSERT INTO orders (op) VALUES ($1) RETURNING id`, in.Op).Scan(&id); err != nil {
			panic(err)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"op":%q}`, id, in.Op)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL, pool
}

// keysByOp returns the distinct Idempotency-Key values the relay saw for
// each X-Op, and how many requests carried each X-Op.
func keysByOp(relay *httprelay.Relay) (keys map[string]map[string]bool, attempts map[string]int) {
	keys, attempts = map[string]map[string]bool{}, map[string]int{}
	for _, r := range relay.Requests() {
		op := r.Header.Get("X-Op")
		if keys[op] == nil {
			keys[op] = map[string]bool{}
		}
		keys[op][r.Header.Get(idemhttp.HeaderKey)] = true
		attempts[op]++
	}
	return keys, attempts
}

// Lost replies, closed connections and slow replies between a client and
// idemhttp's Middleware over PostgreSQL: every operation runs exactly once,
// every attempt of it carries the same key, and the client gets the answer.
func TestTransportHealsLostReplies(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	base, pool := ordersServer(t)
	faults := map[string][]httprelay.Action{ // by attempt; then forward
		"none":       nil,
		"drop":       {{Fault: httprelay.DropReply}},
		"drop-twice": {{Fault: httprelay.DropReply}, {Fault: httprelay.DropReply}},
		"close":      {{Fault: httprelay.CloseBefore}},
		"close-drop": {{Fault: httprelay.CloseBefore}, {Fault: httprelay.DropReply}},
		"delay":      {{Delay: 4 * time.Second}}, // longer than the client's ResponseHeaderTimeout
	}
	relay := httprelay.New(t, base, func(r *http.Request, attempt int) httprelay.Action {
		if f := faults[strings.SplitN(r.Header.Get("X-Op"), "/", 2)[0]]; attempt <= len(f) {
			return f[attempt-1]
		}
		return httprelay.Action{}
	})
	// No keep-alive: each attempt is one connection, so the standard
	// transport never retries by itself and the counts are the client's.
	client := &http.Client{Transport: &idemhttp.Transport{Base: &http.Transport{DisableKeepAlives: true}, Policy: fastPolicy}}
	// The slow replies' client gives up on an attempt after a second.
	impatient := &http.Client{Transport: &idemhttp.Transport{
		Base: &http.Transport{DisableKeepAlives: true, ResponseHeaderTimeout: time.Second}, Policy: fastPolicy}}

	type result struct {
		op       string
		status   int
		replayed bool
		key      string // the key the caller chose, "" when minted
		err      error
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		results []result
	)
	for fault := range faults {
		for _, source := range []string{"minted", "context", "header"} {
			wg.Go(func() {
				op := fault + "/" + source
				res := result{op: op}
				ctx := ctx
				body := strings.NewReader(fmt.Sprintf(`{"op":%q}`, op))
				req, _ := http.NewRequestWithContext(ctx, "POST", relay.URL+"/orders", body)
				switch source {
				case "context":
					res.key = idem.NewCallKey()
					req = req.WithContext(idem.WithCallKey(ctx, res.key))
				case "header":
					res.key = "own-" + idem.NewCallKey()
					req.Header.Set(idemhttp.HeaderKey, res.key)
				}
				req.Header.Set("X-Op", op)
				c := client
				if fault == "delay" {
					c = impatient
				}
				resp, err := c.Do(req)
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					_ = resp.Body.Close()
					res.status, res.replayed = resp.StatusCode, idemhttp.Replayed(resp)
				}
				res.err = err
				mu.Lock()
				results = append(results, res)
				mu.Unlock()
			})
		}
	}
	wg.Wait()

	keys, attempts := keysByOp(relay)
	for _, res := range results {
		fault := strings.SplitN(res.op, "/", 2)[0]
		reached := fault == "drop" || fault == "drop-twice" || fault == "delay" || fault == "close-drop"
		if res.err != nil || res.status != http.StatusCreated || res.replayed != reached {
			t.Errorf("%s: %d replayed=%t, %v", res.op, res.status, res.replayed, res.err)
		}
		var runs int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE op = $1`, res.op).Scan(&runs); err != nil {
			t.Fatal(err)
		}
		if runs != 1 {
			t.Errorf("%s: %d executions, want 1", res.op, runs)
		}
		if len(keys[res.op]) != 1 || keys[res.op][""] || (res.key != "" && !keys[res.op][res.key]) {
			t.Errorf("%s: keys %v, want one (%q)", res.op, keys[res.op], res.key)
		}
		if want := len(faults[fault]) + 1; attempts[res.op] != want && (fault != "delay" || attempts[res.op] < want) {
			t.Errorf("%s: %d attempts, want %d", res.op, attempts[res.op], want)
		}
	}
	var executions int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&executions); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d operations, %d requests, %d executions", len(results), len(relay.Requests()), executions)
}

// scripted is a server that answers the attempts of a path (/name) with
// the answers of its script in turn, the last one repeating, and records
// what each attempt carried.
type scripted struct {
	URL     string
	scripts map[string][]func(w http.ResponseWriter)
	mu      sync.Mutex
	seen    map[string][]attempt
}

// attempt is what one attempt carried, and when the server answered it.
type attempt struct {
	key      string
	body     string
	arrived  time.Time
	answered time.Time
}

func newScripted(t *testing.T, scripts map[string][]func(w http.ResponseWriter)) *scripted {
	if scripts == nil {
		scripts = map[string][]func(w http.ResponseWriter){}
	}
	s := &scripted{scripts: scripts, seen: map[string][]attempt{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a := attempt{key: r.Header.Get(idemhttp.HeaderKey), arrived: time.Now()}
		body, _ := io.ReadAll(r.Body)
		a.body = string(body)
		name := strings.TrimPrefix(r.URL.Path, "/")
		s.mu.Lock()
		script := s.scripts[name]
		n := len(s.seen[name])
		s.mu.Unlock()
		if len(script) == 0 {
			w.WriteHeader(http.StatusOK)
		} else {
			script[min(n, len(script)-1)](w)
		}
		a.answered = time.Now()
		s.mu.Lock()
		s.seen[name] = append(s.seen[name], a)
		s.mu.Unlock()
	}))
	t.Cleanup(srv.Close)
	s.URL = srv.URL
	return s
}

// set gives name a script.
func (s *scripted) set(name string, script ...func(w http.ResponseWriter)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.scripts[name] = script
}

func (s *scripted) attempts(name string) []attempt {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]attempt(nil), s.seen[name]...)
}

// status answers code, with Retry-After when after is not "".
func status(code int, after string) func(w http.ResponseWriter) {
	return func(w http.ResponseWriter) {
		if after != "" {
			w.Header().Set("Retry-After", after)
		}
		w.WriteHeader(code)
		fmt.Fprintf(w, "answer %d", code)
	}
}

// post sends a POST with body to target through client.
func post(t *testing.T, ctx context.Context, client *http.Client, target, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, "POST", target, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err == nil {
		t.Cleanup(func() { _ = resp.Body.Close() })
	}
	return resp, err
}

// Which answers are retried: 5xx but 501, 429, and 409 with Retry-After;
// never 422, 400, another 4xx, or a 409 without a Retry-After the transport
// can read. Every attempt
// carries the same key; the retries run out on the last answer.
func TestTransportRetriesByStatus(t *testing.T) {
	t.Parallel()
	ok := status(http.StatusCreated, "")
	cases := []struct {
		name     string
		script   []func(http.ResponseWriter)
		attempts int
		final    int
	}{
		{"500", []func(http.ResponseWriter){status(500, ""), ok}, 2, 201},
		{"502", []func(http.ResponseWriter){status(502, ""), ok}, 2, 201},
		{"503", []func(http.ResponseWriter){status(503, "0"), ok}, 2, 201},
		{"504", []func(http.ResponseWriter){status(504, ""), status(504, ""), ok}, 3, 201},
		{"429", []func(http.ResponseWriter){status(429, "0"), ok}, 2, 201},
		{"409 in progress", []func(http.ResponseWriter){status(409, "0"), status(409, "0"), ok}, 3, 201},
		{"409", []func(http.ResponseWriter){status(409, ""), ok}, 2, 201},
		{"409 unreadable Retry-After", []func(http.ResponseWriter){status(409, "soon"), ok}, 2, 201},
		{"409 past MaxAttempts", []func(http.ResponseWriter){status(409, ""), status(409, ""), status(409, ""), status(409, ""), status(409, ""), ok}, 6, 201},
		{"503 unreadable Retry-After", []func(http.ResponseWriter){status(503, "soon"), ok}, 2, 201},
		{"501", []func(http.ResponseWriter){status(501, ""), ok}, 1, 501},
		{"422", []func(http.ResponseWriter){status(422, ""), ok}, 1, 422},
		{"400", []func(http.ResponseWriter){status(400, ""), ok}, 1, 400},
		{"404", []func(http.ResponseWriter){status(404, ""), ok}, 1, 404},
		{"401", []func(http.ResponseWriter){status(401, ""), ok}, 1, 401},
		{"500 forever", []func(http.ResponseWriter){status(500, "")}, fastPolicy.MaxAttempts, 500},
		{"201", []func(http.ResponseWriter){ok}, 1, 201},
	}
	scripts := map[string][]func(http.ResponseWriter){}
	for _, c := range cases {
		scripts[strings.ReplaceAll(c.name, " ", "-")] = c.script
	}
	s := newScripted(t, scripts)
	client := &http.Client{Transport: &idemhttp.Transport{Policy: fastPolicy}}
	for _, c := range cases {
		name := strings.ReplaceAll(c.name, " ", "-")
		resp, err := post(t, t.Context(), client, s.URL+"/"+name, `{"a":1}`)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		got := s.attempts(name)
		if resp.StatusCode != c.final || len(got) != c.attempts {
			t.Errorf("%s: %d after %d attempts, want %d after %d", c.name, resp.StatusCode, len(got), c.final, c.attempts)
		}
		for _, a := range got {
			if a.key != got[0].key || a.key == "" || a.body != `{"a":1}` {
				t.Errorf("%s: attempt with key %q body %q, first key %q", c.name, a.key, a.body, got[0].key)
			}
		}
	}
}

// Retry-After is honoured in both forms, capped by MaxDelay (also a number
// of seconds too large for a uint64), and a wait
// that would pass MaxElapsed ends the call with the answer at hand. (The
// checks are orderings the transport guarantees, not speeds: a retry never
// arrives before the time its Retry-After named.)
func TestTransportRetryAfter(t *testing.T) {
	t.Parallel()
	var date time.Time // the date the 429 named
	var dateMu sync.Mutex
	s := newScripted(t, map[string][]func(http.ResponseWriter){
		"seconds": {status(503, "1"), status(201, "")},
		"date": {func(w http.ResponseWriter) {
			dateMu.Lock()
			date = time.Now().Add(2 * time.Second).Truncate(time.Second)
			dateMu.Unlock()
			status(429, date.UTC().Format(http.TimeFormat))(w)
		}, status(201, "")},
		"capped":  {status(503, "3600"), status(201, "")},
		"huge":    {status(503, "99999999999999999999999"), status(201, "")},
		"elapsed": {status(503, "3600"), status(201, "")},
	})
	patient := &http.Client{Transport: &idemhttp.Transport{Policy: idem.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: 5 * time.Second}}}
	var wg sync.WaitGroup
	for _, name := range []string{"seconds", "date"} {
		wg.Go(func() {
			resp, err := post(t, t.Context(), patient, s.URL+"/"+name, "x")
			got := s.attempts(name)
			if err != nil || resp.StatusCode != 201 || len(got) != 2 {
				t.Errorf("%s: %v, %d attempts", name, err, len(got))
				return
			}
			notBefore := got[0].answered.Add(time.Second)
			if name == "date" {
				dateMu.Lock()
				notBefore = date
				dateMu.Unlock()
			}
			if got[1].arrived.Before(notBefore) {
				t.Errorf("%s: the retry came %s before Retry-After allowed", name, notBefore.Sub(got[1].arrived))
			}
		})
	}
	wg.Wait()

	capped := &http.Client{Transport: &idemhttp.Transport{Policy: idem.RetryPolicy{MaxDelay: 10 * time.Millisecond}}}
	if resp, err := post(t, t.Context(), capped, s.URL+"/capped", "x"); err != nil || resp.StatusCode != 201 || len(s.attempts("capped")) != 2 {
		t.Errorf("capped: %v, %d attempts", err, len(s.attempts("capped")))
	}
	// Too large for ParseUint: the longest wait, capped by MaxDelay, not
	// the (much shorter) backoff.
	huge := &http.Client{Transport: &idemhttp.Transport{Policy: idem.RetryPolicy{BaseDelay: time.Microsecond, MaxDelay: 300 * time.Millisecond}}}
	if resp, err := post(t, t.Context(), huge, s.URL+"/huge", "x"); err != nil || resp.StatusCode != 201 || len(s.attempts("huge")) != 2 {
		t.Errorf("huge: %v, %d attempts", err, len(s.attempts("huge")))
	} else if got := s.attempts("huge"); got[1].arrived.Before(got[0].answered.Add(300 * time.Millisecond)) {
		t.Errorf("huge: the retry came %s after the answer, before MaxDelay", got[1].arrived.Sub(got[0].answered))
	}
	short := &http.Client{Transport: &idemhttp.Transport{Policy: idem.RetryPolicy{MaxElapsed: time.Second, MaxDelay: time.Hour}}}
	if resp, err := post(t, t.Context(), short, s.URL+"/elapsed", "x"); err != nil || resp.StatusCode != 503 || len(s.attempts("elapsed")) != 1 {
		t.Errorf("past MaxElapsed: %v, %d attempts", err, len(s.attempts("elapsed")))
	}
	// A wait that would pass the context's deadline is not begun either.
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	s.set("deadline", status(503, "60"), status(201, ""))
	unbounded := &http.Client{Transport: &idemhttp.Transport{Policy: idem.RetryPolicy{MaxElapsed: time.Hour, MaxDelay: time.Hour}}}
	if resp, err := post(t, ctx, unbounded, s.URL+"/deadline", "x"); err != nil || resp.StatusCode != 503 || len(s.attempts("deadline")) != 1 {
		t.Errorf("past the deadline: %v, %d attempts", err, len(s.attempts("deadline")))
	}
}

// Giving up: without an answer after an attempt that may have reached the
// server, the error is an idem.CallError (ErrOutcomeUnknown) with the key;
// when no attempt can have reached it, the plain error.
func TestTransportGivesUp(t *testing.T) {
	t.Parallel()
	s := newScripted(t, nil)
	relay := httprelay.New(t, s.URL, func(*http.Request, int) httprelay.Action {
		return httprelay.Action{Fault: httprelay.DropReply}
	})
	policy := idem.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: 5 * time.Millisecond}
	client := &http.Client{Transport: &idemhttp.Transport{Base: &http.Transport{DisableKeepAlives: true}, Policy: policy}}
	_, err := post(t, t.Context(), client, relay.URL+"/lost", "x")
	var ce *idem.CallError
	keys := relay.Keys()
	if !errors.Is(err, idem.ErrOutcomeUnknown) || !errors.As(err, &ce) || ce.Attempts != 3 || len(keys) != 3 || ce.Key != keys[0] {
		t.Fatalf("lost replies: %v (%+v), relay saw %v", err, ce, keys)
	}
	for _, k := range keys {
		if k != ce.Key {
			t.Fatalf("keys %v", keys)
		}
	}
	for _, want := range []string{"may have been processed", "retry later with the same idempotency key"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q lacks %q", err, want)
		}
	}
	if strings.Contains(err.Error(), ce.Key) {
		t.Errorf("message %q holds the key", err)
	}
	if got := len(s.attempts("lost")); got != 3 {
		t.Errorf("server executed %d attempts", got)
	}

	// Nothing listens: no attempt reached anything.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	_, err = post(t, t.Context(), client, "http://"+addr+"/x", "x")
	if err == nil || errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("refused connections: %v", err)
	}

	// The context ends during the wait after a 503: the outcome is unknown.
	ctx, cancel := context.WithCancel(t.Context())
	s.set("cancel", func(w http.ResponseWriter) {
		status(503, "10")(w)
		time.AfterFunc(50*time.Millisecond, cancel)
	})
	slow := &http.Client{Transport: &idemhttp.Transport{Policy: idem.RetryPolicy{MaxDelay: time.Minute}}}
	_, err = post(t, ctx, slow, s.URL+"/cancel", "x")
	if !errors.As(err, &ce) || !errors.Is(err, context.Canceled) || ce.Attempts != 1 {
		t.Fatalf("cancelled while waiting: %v", err)
	}
}

// Bound a call with its context's deadline: when it passes while an
// attempt is under way, the error is the transport's idem.CallError. Not
// with http.Client.Timeout: net/http may replace the transport's error with
// its own timeout error, which does not wrap it (a race inside net/http
// decides), so the CallError can be lost although the request reached the
// server, as docs/calling.md and Transport's doc say. Over 20 tries at
// least one must lose it (if none does, net/http changed: fix the docs).
func TestTransportDeadline(t *testing.T) {
	t.Parallel()
	var arrived atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived.Add(1)
		// No answer before the client gives up. (The body is read, so that
		// the server notices the client leave.)
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	}))
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	client := &http.Client{Transport: &idemhttp.Transport{Policy: fastPolicy}}
	_, err := post(t, ctx, client, srv.URL+"/deadline", "x")
	var ce *idem.CallError
	if !errors.As(err, &ce) || !errors.Is(err, idem.ErrOutcomeUnknown) || !errors.Is(err, context.DeadlineExceeded) || ce.Attempts != 1 {
		t.Errorf("context deadline: %v", err)
	}

	timed := &http.Client{Timeout: 50 * time.Millisecond, Transport: &idemhttp.Transport{Policy: fastPolicy}}
	lost := 0
	for range 20 {
		_, err = post(t, t.Context(), timed, srv.URL+"/timeout", "x")
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Client.Timeout: %v", err)
		}
		if !errors.As(err, &ce) && !errors.Is(err, idem.ErrOutcomeUnknown) {
			lost++
		}
	}
	if lost == 0 {
		t.Errorf("Client.Timeout kept the CallError in 20 of 20 calls: net/http changed, fix the docs")
	}
	if n := arrived.Load(); n < 2 {
		t.Errorf("%d requests reached the server, want at least 2", n)
	}
}

// An attempt that never got a connection sent nothing, so the call ends
// with the plain error, not idem.CallError: the context ends while the
// connection is still being dialled, or the server does not speak TLS (not
// retried). The caller's own client trace still runs.
func TestTransportNothingSent(t *testing.T) {
	t.Parallel()
	var dials atomic.Int64
	blocked := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		dials.Add(1)
		<-ctx.Done() // net/http ends the dial once the request gave up on it
		return nil, ctx.Err()
	}}
	var gets atomic.Int64
	ctx := httptrace.WithClientTrace(t.Context(), &httptrace.ClientTrace{GetConn: func(string) { gets.Add(1) }})
	ctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	client := &http.Client{Transport: &idemhttp.Transport{Base: blocked, Policy: fastPolicy}}
	_, err := post(t, ctx, client, "http://127.0.0.1:1/never", "x")
	if err == nil || errors.Is(err, idem.ErrOutcomeUnknown) || !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, idem.ErrNotSent) {
		t.Errorf("the context ended during the dial: %v", err)
	}
	if dials.Load() != 1 || gets.Load() != 1 {
		t.Errorf("%d dials, the caller's GetConn hook ran %d times; want 1, 1", dials.Load(), gets.Load())
	}

	plain := newScripted(t, nil)
	var attempts atomic.Int64
	tlsClient := &http.Client{Transport: &idemhttp.Transport{Policy: fastPolicy, Base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		attempts.Add(1)
		return http.DefaultTransport.RoundTrip(r)
	})}}
	_, err = post(t, t.Context(), tlsClient, "https"+strings.TrimPrefix(plain.URL, "http")+"/tls", "x")
	// (idem.ErrNotSent's wrapper keeps http.Client from turning the
	// transport's tls.RecordHeaderError into ErrSchemeMismatch.)
	if !errors.Is(err, idem.ErrNotSent) || errors.Is(err, idem.ErrOutcomeUnknown) || attempts.Load() != 1 {
		t.Errorf("a server that does not speak TLS: %v after %d attempts", err, attempts.Load())
	}
}

// roundTripFunc is a RoundTripper made of a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// trackedBody is a request body without GetBody that records its Close.
type trackedBody struct {
	io.Reader
	closed atomic.Bool
}

func (b *trackedBody) Close() error { b.closed.Store(true); return nil }

// A body without GetBody is buffered and sent again, up to
// MaxBufferedBody; a longer one is sent once. Either way it is closed.
func TestTransportBody(t *testing.T) {
	t.Parallel()
	s := newScripted(t, map[string][]func(http.ResponseWriter){
		"small": {status(500, ""), status(201, "")},
		"large": {status(500, ""), status(201, "")},
		"reset": {status(500, ""), status(201, "")},
	})
	client := &http.Client{Transport: &idemhttp.Transport{Policy: fastPolicy}}
	for name, size := range map[string]int{"small": 100, "large": idemhttp.MaxBufferedBody + 1} {
		body := &trackedBody{Reader: strings.NewReader(strings.Repeat("b", size))}
		req, _ := http.NewRequestWithContext(t.Context(), "POST", s.URL+"/"+name, body)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		got := s.attempts(name)
		want, status := 2, 201
		if name == "large" {
			want, status = 1, 500
		}
		if len(got) != want || resp.StatusCode != status || !body.closed.Load() {
			t.Errorf("%s: %d attempts, %d, closed %t", name, len(got), resp.StatusCode, body.closed.Load())
		}
		for _, a := range got {
			if len(a.body) != size {
				t.Errorf("%s: the server got %d bytes of %d", name, len(a.body), size)
			}
		}
	}
	// With GetBody, every attempt gets the body from it.
	req, _ := http.NewRequestWithContext(t.Context(), "POST", s.URL+"/reset", bytes.NewReader([]byte("abc")))
	if resp, err := client.Do(req); err != nil || resp.StatusCode != 201 {
		t.Fatalf("GetBody: %v", err)
	}
	for _, a := range s.attempts("reset") {
		if a.body != "abc" {
			t.Errorf("GetBody: body %q", a.body)
		}
	}
}

// Invalid input is refused before anything is sent: an invalid key from
// the context (a bad step's empty CallKey), an invalid own header, a
// negative policy field. The body is closed all the same.
func TestTransportRefusesBadInput(t *testing.T) {
	t.Parallel()
	s := newScripted(t, nil)
	r := idem.Reservation{Scope: idem.Scope{Actor: "alice", Operation: "pay"}, Key: "k1"}
	ctx := t.Context()
	cases := []struct {
		name   string
		ctx    context.Context
		header []string
		policy idem.RetryPolicy
		want   error
	}{
		{"step with a newline", idem.WithCallKey(ctx, r.CallKey("charge\n")), nil, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"empty step", idem.WithCallKey(ctx, r.CallKey("")), nil, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"context key with a space", idem.WithCallKey(ctx, "a b"), nil, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"context key too long", idem.WithCallKey(ctx, strings.Repeat("k", 256)), nil, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"own header with a space", ctx, []string{"a b"}, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"two own headers", ctx, []string{"a", "b"}, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"negative MaxAttempts", ctx, nil, idem.RetryPolicy{MaxAttempts: -1}, idem.ErrInvalidArgument},
		{"negative MaxElapsed", ctx, nil, idem.RetryPolicy{MaxElapsed: -time.Second}, idem.ErrInvalidArgument},
		{"negative BaseDelay", ctx, nil, idem.RetryPolicy{BaseDelay: -1}, idem.ErrInvalidArgument},
		{"negative MaxDelay", ctx, nil, idem.RetryPolicy{MaxDelay: -1}, idem.ErrInvalidArgument},
	}
	for _, c := range cases {
		body := &trackedBody{Reader: strings.NewReader("x")}
		req, _ := http.NewRequestWithContext(c.ctx, "POST", s.URL+"/bad", body)
		req.Header[idemhttp.HeaderKey] = c.header
		resp, err := (&idemhttp.Transport{Policy: c.policy}).RoundTrip(req)
		if resp != nil || !errors.Is(err, c.want) || !body.closed.Load() {
			t.Errorf("%s: %v, closed %t", c.name, err, body.closed.Load())
		}
	}
	if n := len(s.attempts("bad")); n != 0 {
		t.Fatalf("%d requests reached the server", n)
	}
}

// closeCounter is a Base that counts the closed bodies of the answers it
// returned.
type closeCounter struct {
	base   http.RoundTripper
	closed atomic.Int64
	last   http.Header // the last attempt's header
	mu     sync.Mutex
}

func (c *closeCounter) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	c.last = r.Header.Clone()
	c.mu.Unlock()
	resp, err := c.base.RoundTrip(r)
	if err == nil {
		resp.Body = &countedClose{ReadCloser: resp.Body, n: &c.closed}
	}
	return resp, err
}

type countedClose struct {
	io.ReadCloser
	n *atomic.Int64
}

func (c *countedClose) Close() error { c.n.Add(1); return c.ReadCloser.Close() }

// Where the key comes from, and the RoundTripper contract: the caller's
// request is never changed, and every answer the transport retries is
// closed.
func TestTransportKeys(t *testing.T) {
	t.Parallel()
	s := newScripted(t, map[string][]func(http.ResponseWriter){
		"retried": {status(500, ""), status(502, ""), status(201, "")},
		"custom":  {status(500, ""), status(201, "")},
	})
	counter := &closeCounter{base: http.DefaultTransport}
	tr := &idemhttp.Transport{Base: counter, Policy: fastPolicy}
	send := func(ctx context.Context, method, path string, header http.Header) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, method, s.URL+path, strings.NewReader("body"))
		for k, v := range header {
			req.Header[k] = v
		}
		before := req.Header.Clone()
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		_ = resp.Body.Close()
		if fmt.Sprint(req.Header) != fmt.Sprint(before) {
			t.Errorf("%s %s: the caller's header changed: %v", method, path, req.Header)
		}
		counter.mu.Lock()
		defer counter.mu.Unlock()
		return resp, counter.last.Get(idemhttp.HeaderKey)
	}
	ctx := t.Context()
	_, minted1 := send(ctx, "POST", "/a", nil)
	_, minted2 := send(ctx, "POST", "/a", nil)
	_, patched := send(ctx, "PATCH", "/a", nil)
	if idem.ValidateKey(minted1) != nil || minted1 == minted2 || idem.ValidateKey(patched) != nil {
		t.Errorf("minted keys: %q %q %q", minted1, minted2, patched)
	}
	for _, m := range []string{"GET", "PUT", "DELETE"} {
		if _, k := send(ctx, m, "/a", nil); k != "" {
			t.Errorf("%s without a key got %q", m, k)
		}
	}
	if _, k := send(idem.WithCallKey(ctx, "ctx-key"), "GET", "/a", nil); k != "ctx-key" {
		t.Errorf("GET with a context key sent %q", k)
	}
	own := http.Header{idemhttp.HeaderKey: {`"own-key"`}}
	if _, k := send(idem.WithCallKey(ctx, "ctx-key"), "POST", "/a", own); k != `"own-key"` {
		t.Errorf("the request's own header lost to %q", k)
	}

	closedBefore := counter.closed.Load()
	resp, _ := send(ctx, "POST", "/retried", nil)
	if resp.StatusCode != 201 || len(s.attempts("retried")) != 3 || counter.closed.Load()-closedBefore != 3 {
		t.Errorf("retried: %d after %d attempts, %d bodies closed (2 by the transport, 1 by the test)",
			resp.StatusCode, len(s.attempts("retried")), counter.closed.Load()-closedBefore)
	}
	// A request built by hand, without a header map, gets one on its clone.
	bare := &http.Request{Method: "POST", URL: mustURL(t, s.URL+"/bare")}
	resp, err := tr.RoundTrip(bare.WithContext(ctx))
	if err != nil || resp.StatusCode != 200 || bare.Header != nil {
		t.Fatalf("no header map: %v", err)
	}
	_ = resp.Body.Close()
	if got := s.attempts("bare"); len(got) != 1 || idem.ValidateKey(got[0].key) != nil {
		t.Errorf("no header map: %+v", got)
	}
	// A method that is not idempotent, without a key, is sent once.
	if resp, _ := send(ctx, "CHARGE", "/custom", nil); resp.StatusCode != 500 || len(s.attempts("custom")) != 1 {
		t.Errorf("CHARGE without a key: %d after %d attempts", resp.StatusCode, len(s.attempts("custom")))
	}
}

func mustURL(t *testing.T, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func TestReplayed(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{"true": true, "TRUE": true, " true ": true, "false": false, "": false} {
		resp := &http.Response{Header: http.Header{}}
		if v != "" {
			resp.Header.Set(idemhttp.HeaderReplayed, v)
		}
		if idemhttp.Replayed(resp) != want {
			t.Errorf("%q: %t", v, !want)
		}
	}
	if idemhttp.Replayed(nil) {
		t.Error("nil response replayed")
	}
}

// BenchmarkTransportOverhead compares a POST that needs no retry through
// Transport (a minted key, a clone of the request) with the same POST
// through its Base alone, against a server on 127.0.0.1, interleaved in
// one run; "ratio" is Transport's time over Base's:
//
//	go test -run '^$' -bench TransportOverhead -benchtime 5000x ./idemhttp/
func BenchmarkTransportOverhead(b *testing.B) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":1}`))
	}))
	defer srv.Close()
	base := &http.Transport{MaxIdleConnsPerHost: 4}
	defer base.CloseIdleConnections()
	clients := [2]*http.Client{{Transport: base}, {Transport: &idemhttp.Transport{Base: base}}}
	body := []byte(`{"customerId":"cus-1","amountCents":12000,"currency":"KRW"}`)
	call := func(c *http.Client) time.Duration {
		start := time.Now()
		req, _ := http.NewRequest("POST", srv.URL+"/charges", bytes.NewReader(body))
		resp, err := c.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return time.Since(start)
	}
	var spent [2]time.Duration
	i := 0
	for b.Loop() {
		first := i % 2 // alternate which goes first
		spent[first] += call(clients[first])
		spent[1-first] += call(clients[1-first])
		i++
	}
	b.ReportMetric(float64(spent[0].Nanoseconds())/float64(i), "base-ns/call")
	b.ReportMetric(float64(spent[1].Nanoseconds())/float64(i), "idem-ns/call")
	b.ReportMetric(float64(spent[1])/float64(spent[0]), "ratio")
}

// A header net/http refuses to send (a name that is not a token, a value
// holding a control character), on the request or set by BeforeAttempt,
// ends the call at once as not sent and invalid, not as an outcome unknown
// retried until MaxElapsed; after an attempt that may have taken effect,
// the call is still an outcome unknown. The error never shows the value.
func TestTransportRefusesBadHeader(t *testing.T) {
	t.Parallel()
	srv := newScripted(t, nil)
	srv.set("late", status(http.StatusServiceUnavailable, ""))
	for _, tc := range []struct {
		name, header, value string
	}{
		{"name", "Bad Name", "v"},
		{"value", "X-Token", "secret\r\nX-Injected: 1"},
		{"nul", "X-Token", "secret\x00"},
	} {
		req, err := http.NewRequestWithContext(t.Context(), "POST", srv.URL+"/"+tc.name, strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		req.Header[tc.header] = []string{tc.value}
		client := &http.Client{Transport: &idemhttp.Transport{Policy: fastPolicy}}
		_, err = client.Do(req)
		if !errors.Is(err, idem.ErrNotSent) || !errors.Is(err, idem.ErrInvalidArgument) || errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Errorf("%s: %v, want ErrNotSent and ErrInvalidArgument", tc.name, err)
		}
		if err != nil && strings.Contains(err.Error(), "secret") {
			t.Errorf("%s: the error shows the header's value: %v", tc.name, err)
		}
		if n := len(srv.attempts(tc.name)); n != 0 {
			t.Errorf("%s: %d attempts reached the server", tc.name, n)
		}
	}

	// BeforeAttempt sets a bad header on the second attempt, after a 503.
	client := &http.Client{Transport: &idemhttp.Transport{Policy: fastPolicy, BeforeAttempt: func(r *http.Request, attempt int) error {
		if attempt == 2 {
			r.Header.Set("X-Sig", "a\nb")
		}
		return nil
	}}}
	_, err := post(t, t.Context(), client, srv.URL+"/late", "x")
	if !errors.Is(err, idem.ErrOutcomeUnknown) || !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("a bad header after a 503: %v, want ErrOutcomeUnknown wrapping ErrInvalidArgument", err)
	}
	if n := len(srv.attempts("late")); n != 1 {
		t.Errorf("%d attempts reached the server, want 1", n)
	}
}

// A request without a body (a GET, a DELETE, a bodiless POST) is retried
// as it was sent, without a body; a second attempt used to panic (no
// GetBody to read the body again).
func TestTransportRetriesBodilessRequests(t *testing.T) {
	t.Parallel()
	for _, method := range []string{http.MethodGet, http.MethodDelete, http.MethodPost} {
		t.Run(method, func(t *testing.T) {
			t.Parallel()
			var n atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if b, _ := io.ReadAll(r.Body); len(b) != 0 || r.ContentLength > 0 {
					t.Errorf("attempt %d carried a body: %q", n.Load()+1, b)
				}
				if n.Add(1) == 1 {
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				w.WriteHeader(http.StatusOK)
			}))
			defer srv.Close()
			req, err := http.NewRequestWithContext(t.Context(), method, srv.URL, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := (&http.Client{Transport: &idemhttp.Transport{}}).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || n.Load() != 2 {
				t.Fatalf("%d after %d attempts, want 200 after 2", resp.StatusCode, n.Load())
			}
		})
	}
}

// A context key that idem accepts but that is not a bare key of the
// header (a comma, a leading quote) is sent as an RFC 8941 string, so that
// idem's Middleware reads it back as the one key it is.
func TestTransportContextKeyNeedsQuoting(t *testing.T) {
	t.Parallel()
	base, pool := ordersServer(t)
	client := &http.Client{Transport: &idemhttp.Transport{Policy: fastPolicy}}
	for i, key := range []string{"order,1", `"order-2`, `order\3"`} {
		if err := idem.ValidateKey(key); err != nil {
			t.Fatal(err)
		}
		for n := range 2 {
			req, _ := http.NewRequestWithContext(idem.WithCallKey(t.Context(), key), "POST", base+"/orders",
				strings.NewReader(fmt.Sprintf(`{"op":"op-%d"}`, i)))
			resp, err := client.Do(req)
			if err != nil {
				t.Fatalf("%s, call %d: %v", key, n, err)
			}
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusCreated || (resp.Header.Get(idemhttp.HeaderReplayed) == "true") != (n == 1) {
				t.Errorf("%s, call %d: %d, replayed %q", key, n, resp.StatusCode, resp.Header.Get(idemhttp.HeaderReplayed))
			}
		}
		if _, err := idem.Lookup(t.Context(), pool, idem.Scope{Actor: "alice", Operation: "POST /orders"}, key); err != nil {
			t.Errorf("%s: %v", key, err)
		}
	}
	var orders int
	if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM orders`).Scan(&orders); err != nil || orders != 3 {
		t.Errorf("%d orders (%v); want 3", orders, err)
	}
}
