package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/demo/draw"
	"github.com/pgidem/idem/internal/testkit/pgserver"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// TestMain runs the tests, or, with IDEM_DEMO_MAIN=1 in the environment,
// the demo itself with the binary's arguments: a child process of the
// tests that can be killed (TestCrashAfterChargeResumes).
func TestMain(m *testing.M) {
	if os.Getenv("IDEM_DEMO_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(pgtest.Main(m))
}

func migrateDemo(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	if err := draw.Setup(ctx, pool); err != nil {
		return err
	}
	return draw.AddWallet(ctx, pool, "bob", 300)
}

// testAPI is newAPI on pool with a seeded picker, a payment service and
// no log.
func testAPI(pool *pgxpool.Pool) http.Handler {
	return newAPI(pool, newPayments(pool, newGateway(pool)), newPicker(1), slog.New(slog.DiscardHandler))
}

type apiReply struct {
	status   int
	replayed bool
	body     []byte
}

func apiCall(t *testing.T, base, method, path, token, key, body string) apiReply {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return apiReply{resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true", b}
}

func wallet(t *testing.T, base, user string) draw.Wallet {
	t.Helper()
	r := apiCall(t, base, "GET", "/v1/wallets/"+user, user, "", "")
	var w draw.Wallet
	if r.status != http.StatusOK || json.Unmarshal(r.body, &w) != nil {
		t.Fatalf("wallet %s: %d %s", user, r.status, r.body)
	}
	return w
}

func problemCode(t *testing.T, r apiReply) string {
	t.Helper()
	var p struct{ Code string }
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("%d %s: %v", r.status, r.body, err)
	}
	return p.Code
}

func TestDrawAPI(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, migrateDemo)
	if err := draw.AddBox(t.Context(), pool, draw.Box{ID: 3, Name: "Last One", Price: 50, Stock: 1,
		Prizes: []draw.Prize{{Name: "Goose Egg", Weight: 1}}}); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(testAPI(pool))
	t.Cleanup(srv.Close)
	base := srv.URL

	first := apiCall(t, base, "POST", "/v1/draws", "alice", "k1", `{"box_id":1,"quantity":2}`)
	if first.status != http.StatusCreated || first.replayed {
		t.Fatalf("draw: %d %s", first.status, first.body)
	}
	again := apiCall(t, base, "POST", "/v1/draws", "alice", "k1", `{"quantity":2, "box_id":1}`)
	if again.status != first.status || !again.replayed || !bytes.Equal(again.body, first.body) {
		t.Errorf("retry: %d %t %s", again.status, again.replayed, again.body)
	}
	if r := apiCall(t, base, "POST", "/v1/draws", "alice", "k1", `{"box_id":1,"quantity":3}`); r.status != http.StatusUnprocessableEntity {
		t.Errorf("reused key: %d %s", r.status, r.body)
	}

	// Refusals are stored; the out-of-stock one undoes the debit that came
	// before it.
	for _, c := range []struct {
		token, key, body string
		status           int
		code             string
	}{
		{"bob", "b1", `{"box_id":1,"quantity":5}`, http.StatusPaymentRequired, draw.CodeInsufficientPoints},
		{"alice", "k2", `{"box_id":3,"quantity":2}`, http.StatusConflict, draw.CodeOutOfStock},
		{"alice", "k3", `{"box_id":9,"quantity":1}`, http.StatusNotFound, draw.CodeUnknownBox},
	} {
		for i := range 2 {
			r := apiCall(t, base, "POST", "/v1/draws", c.token, c.key, c.body)
			if r.status != c.status || problemCode(t, r) != c.code || r.replayed != (i == 1) {
				t.Errorf("%s %s: %d replayed=%t %s", c.token, c.body, r.status, r.replayed, r.body)
			}
		}
	}

	if w := wallet(t, base, "alice"); w.Points != draw.SeedPoints-2*draw.SeedPrice || w.Draws != 2 {
		t.Errorf("alice: %+v", w)
	}
	if w := wallet(t, base, "bob"); w.Points != 300 || w.Draws != 0 {
		t.Errorf("bob: %+v", w)
	}
	s, err := draw.Read(t.Context(), pool, "alice", 3)
	if err != nil {
		t.Fatal(err)
	}
	if s.Stock != 1 || s.Debits != 1 {
		t.Errorf("box 3 after the refusal: %+v", s)
	}

	// Authentication.
	for _, c := range []struct {
		method, path, token string
		status              int
	}{
		{"POST", "/v1/draws", "", http.StatusUnauthorized},
		{"POST", "/v1/draws", "mallory", http.StatusUnauthorized},
		{"GET", "/v1/wallets/alice", "", http.StatusUnauthorized},
		{"GET", "/v1/wallets/alice", "bob", http.StatusForbidden},
	} {
		if r := apiCall(t, base, c.method, c.path, c.token, "k9", `{"box_id":1,"quantity":1}`); r.status != c.status {
			t.Errorf("%s %s as %q: %d %s", c.method, c.path, c.token, r.status, r.body)
		}
	}
}

// An invalid body is refused with a detail of the demo's own and is not
// stored: the corrected body with the same key draws.
func TestInvalidDrawIsNotStored(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, migrateDemo)
	srv := httptest.NewServer(testAPI(pool))
	t.Cleanup(srv.Close)

	for body, detail := range map[string]string{
		`{"box_id":"1","quantity":2}`:          "box_id must be a positive integer.",
		`{"box_id":1,"quantity":0}`:            "quantity must be an integer from 1 to 10.",
		`{"box_id":1,"quantity":1,"user":"b"}`: `Unknown field "user"; a draw request has box_id and quantity only.`,
		`{"box_id":1,`:                         `The body is not a JSON object such as {"box_id":1,"quantity":2}.`,
	} {
		key := "fix-" + newKey()
		for range 2 { // the same mistake again: refused again, not replayed
			r := apiCall(t, srv.URL, "POST", "/v1/draws", "alice", key, body)
			var p struct{ Code, Detail string }
			if err := json.Unmarshal(r.body, &p); err != nil || r.status != http.StatusUnprocessableEntity || r.replayed ||
				p.Code != draw.CodeInvalidRequest || p.Detail != detail {
				t.Errorf("%s: %d replayed=%t %s; want 422 %s %q", body, r.status, r.replayed, r.body, draw.CodeInvalidRequest, detail)
			}
		}
		if r := apiCall(t, srv.URL, "POST", "/v1/draws", "alice", key, `{"box_id":1,"quantity":1}`); r.status != http.StatusCreated || r.replayed {
			t.Errorf("%s, corrected with the same key: %d replayed=%t %s", body, r.status, r.replayed, r.body)
		}
	}
	if w := wallet(t, srv.URL, "alice"); w.Points != draw.SeedPoints-4*draw.SeedPrice || w.Draws != 4 {
		t.Errorf("alice after 4 corrected draws: %+v", w)
	}

	// An X-Demo-Delay that is not a duration up to 10s: 400, not stored.
	key := "delay-" + newKey()
	for _, delay := range []string{"forever", "11s", "-1s", "0s"} {
		req, err := http.NewRequestWithContext(t.Context(), "POST", srv.URL+"/v1/draws", strings.NewReader(`{"box_id":1,"quantity":1}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(headerDelay, delay)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "X-Demo-Delay must be a duration") {
			t.Errorf("%s: %s: %d %s", headerDelay, delay, resp.StatusCode, body)
		}
	}
	if r := apiCall(t, srv.URL, "POST", "/v1/draws", "alice", key, `{"box_id":1,"quantity":1}`); r.status != http.StatusCreated || r.replayed {
		t.Errorf("after refused delays, the same key: %d replayed=%t %s", r.status, r.replayed, r.body)
	}
}

// Requests that match no route get problems too, not the mux's text/plain.
func TestUnroutedRequestsGetProblems(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(testAPI(pgtest.Pool(t, migrateDemo)))
	t.Cleanup(srv.Close)
	for _, c := range []struct {
		method, path string
		status       int
		code, allow  string
	}{
		{"GET", "/v1/draws", http.StatusMethodNotAllowed, "METHOD_NOT_ALLOWED", "POST"},
		{"DELETE", "/v1/wallets/alice", http.StatusMethodNotAllowed, "METHOD_NOT_ALLOWED", "GET, HEAD"},
		{"GET", "/v1/nothing", http.StatusNotFound, "NOT_FOUND", ""},
		{"POST", "/", http.StatusNotFound, "NOT_FOUND", ""},
	} {
		req, err := http.NewRequestWithContext(t.Context(), c.method, srv.URL+c.path, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var p struct {
			Status int
			Code   string
		}
		if resp.StatusCode != c.status || resp.Header.Get("Content-Type") != "application/problem+json" ||
			json.Unmarshal(body, &p) != nil || p.Status != c.status || p.Code != c.code ||
			resp.Header.Get("Allow") != c.allow {
			t.Errorf("%s %s: %d %v %s", c.method, c.path, resp.StatusCode, resp.Header, body)
		}
	}
}

// lineWriter collects output and reports the serving address once printed.
type lineWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	addr chan string
	sent bool
}

var servingRE = regexp.MustCompile(`Serving the draw API on (http://\S+)`)

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if m := servingRE.FindSubmatch(w.buf.Bytes()); m != nil && !w.sent {
		w.sent = true
		w.addr <- string(m[1])
	}
	return len(p), nil
}

func (w *lineWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// dropAtEnd drops the database called name on srv when the test ends.
func dropAtEnd(t *testing.T, srv *pgserver.Server, name string) {
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), srv.URL)
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close(context.Background())
		if _, err := conn.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Error(err)
		}
	})
}

// startServe runs serve with args on a fresh database of its own, listening
// on a free loopback port, and returns its address. When the test ends
// serve is stopped (it must return nil) and its database dropped; output
// returns what serve printed so far.
func startServe(t *testing.T, args ...string) (base string) {
	base, _ = startServeOutput(t, args...)
	return base
}

func startServeOutput(t *testing.T, args ...string) (base string, output func() string) {
	t.Helper()
	srv := pgtest.Server(t)
	var b [8]byte
	_, _ = rand.Read(b[:])
	name := "idemtest_serve_" + hex.EncodeToString(b[:])
	dropAtEnd(t, srv, name)

	cfg, err := parseServeFlags(append([]string{"-addr", "127.0.0.1:0", "-db", name}, args...), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	out := &lineWriter{addr: make(chan string, 1)}
	done := make(chan error, 1)
	go func() { done <- serve(ctx, out, cfg) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	select {
	case base = <-out.addr:
	case err := <-done:
		done <- err
		t.Fatalf("serve returned early: %v\n%s", err, out)
	case <-time.After(2 * time.Minute):
		t.Fatalf("serve printed no address:\n%s", out)
	}
	return base, out.String
}

// serve prints its address and example requests, serves, and returns nil
// once its context ends.
func TestServeCommand(t *testing.T) {
	t.Parallel()
	var output func() string
	t.Run("serve", func(t *testing.T) {
		var base string
		base, output = startServeOutput(t, "-seed", "1")
		if r := apiCall(t, base, "POST", "/v1/draws", "alice", "k1", `{"box_id":1,"quantity":1}`); r.status != http.StatusCreated {
			t.Errorf("draw: %d %s", r.status, r.body)
		}
		if w := wallet(t, base, "alice"); w.Points != draw.SeedPoints-draw.SeedPrice {
			t.Errorf("wallet: %+v", w)
		}
		for _, want := range []string{"curl -si " + base + "/v1/draws", "Idempotency-Key: ", "X-Demo-Delay: 6s"} {
			if !strings.Contains(output(), want) {
				t.Errorf("output lacks %q:\n%s", want, output())
			}
		}
	})
	// The subtest's cleanup stopped serve.
	if !strings.HasSuffix(output(), "Shutting down.\n") {
		t.Errorf("serve did not say it stopped:\n%s", output())
	}
}

func TestServeFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{}, {"-addr", "localhost:0"}, {"-addr", "[::1]:9000"}, {"-seed", "7", "-db", "idem_demo2"},
		{"-keep"}, {"-lease", "5s"}, {"-resume-within", "0"}, {"-lease", "1m", "-resume-within", "1m"}, {"-resume-within", "24h"},
	} {
		if _, err := parseServeFlags(args, io.Discard); err != nil {
			t.Errorf("%q: %v", args, err)
		}
	}
	for _, args := range [][]string{
		{"-addr", "0.0.0.0:8080"}, {"-addr", ":8080"}, {"-addr", "example.com:80"}, {"-addr", "nonsense"},
		{"-db", "postgres"}, {"-db", "idem-x"}, {"-db", "idem;DROP"}, {"extra"}, {"-seed", "x"},
		{"-lease", "0"}, {"-lease", "-1s"}, {"-lease", "x"}, {"-resume-within", "-1h"}, {"-resume-within", "10s"},
		{"-resume-within", "25h"}, {"-keep=maybe"},
	} {
		if _, err := parseServeFlags(args, io.Discard); !errors.As(err, new(usageError)) {
			t.Errorf("%q: %v, want a usage error", args, err)
		}
	}
}

func TestRunFlags(t *testing.T) {
	t.Parallel()
	for args, want := range map[string]string{"": defaultDatabase, "-db idem_x1": "idem_x1"} {
		if got, err := parseRunFlags(strings.Fields(args), io.Discard); err != nil || got != want {
			t.Errorf("%q: %q, %v; want %q", args, got, err, want)
		}
	}
	for _, args := range []string{"-db postgres", "-db idem-x", "-db " + strings.Repeat("idem", 16), "-addr :1", "extra"} {
		if _, err := parseRunFlags(strings.Fields(args), io.Discard); !errors.As(err, new(usageError)) {
			t.Errorf("%q: %v, want a usage error", args, err)
		}
	}
}
