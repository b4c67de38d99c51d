package idemhttp_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/httprelay"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

// Two secrets in whsec_ form: the one being rotated out and its successor.
const (
	oldSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	newSecret = "whsec_c2Vjb25kLXNlY3JldC1vZi10aGUtdGVzdHMtMzI="
)

// migrateWebhooks installs idem's tables and the receiver's: one row per
// processed webhook.
func migrateWebhooks(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE received (id text NOT NULL, body text NOT NULL)`)
	return err
}

// receiver is a WebhookHandler on an httptest.Server whose fn records each
// webhook in the table received and counts its runs.
type receiver struct {
	pool *pgxpool.Pool
	srv  *httptest.Server
	runs atomic.Int64 // fn's runs, committed or not
	fail atomic.Int64 // fn fails (after its write) while positive, counting down
	slow atomic.Bool  // fn sleeps a little, so that duplicates overlap
	rej  atomic.Bool  // fn refuses the webhook for good (idem.Reject)
	logs testlog.Buffer
}

func newReceiver(t *testing.T, opts idemhttp.WebhookOptions) *receiver {
	t.Helper()
	rc := &receiver{pool: newPool(t, migrateWebhooks)}
	if opts.Secrets == nil {
		opts.Secrets = []string{oldSecret}
	}
	opts.Logger = slog.New(slog.NewTextHandler(&rc.logs, nil))
	h := idemhttp.WebhookHandler(rc.pool, opts, func(ctx context.Context, tx pgx.Tx, w idemhttp.Webhook) error {
		rc.runs.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO received (id, body) VALUES ($1, $2)`, w.ID, string(w.Body)); err != nil {
			return err
		}
		if rc.slow.Load() {
			time.Sleep(50 * time.Millisecond)
		}
		if rc.rej.Load() {
			return idem.Reject(idem.Response{})
		}
		if rc.fail.Add(-1) >= 0 {
			return errors.New("the receiver's handler failed")
		}
		return nil
	})
	rc.srv = httptest.NewServer(h)
	t.Cleanup(rc.srv.Close)
	return rc
}

// received returns how many webhooks with id are committed.
func (rc *receiver) received(t *testing.T, id string) int {
	t.Helper()
	var n int
	if err := rc.pool.QueryRow(context.Background(), `SELECT count(*) FROM received WHERE id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// inboxRows counts idem's records: processed webhooks.
func (rc *receiver) inboxRows(t *testing.T) int {
	t.Helper()
	var n int
	if err := rc.pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_keys`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// sign returns the headers of a webhook signed with secret at ts, computed
// by hand from the spec (HMAC-SHA256 of id.timestamp.body under the
// base64-decoded key), not by the code under test.
func sign(t *testing.T, secret, id string, ts time.Time, body []byte) http.Header {
	t.Helper()
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		t.Fatal(err)
	}
	mac := hmac.New(sha256.New, key)
	fmt.Fprintf(mac, "%s.%d.%s", id, ts.Unix(), body)
	h := http.Header{}
	h.Set("webhook-id", id)
	h.Set("webhook-timestamp", strconv.FormatInt(ts.Unix(), 10))
	h.Set("webhook-signature", "v1,"+base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	h.Set("Content-Type", "application/json")
	return h
}

// postWebhook sends body with header to url and returns the status, the answer's
// problem code (if any) and whether it says Idempotent-Replayed.
func postWebhook(t *testing.T, url string, header http.Header, body []byte) (int, string, bool) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header = header
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var p struct{ Code string }
	if strings.HasPrefix(resp.Header.Get("Content-Type"), idemhttp.ContentTypeProblem) {
		if err := json.NewDecoder(resp.Body).Decode(&p); err != nil {
			t.Fatal(err)
		}
	}
	return resp.StatusCode, p.Code, resp.Header.Get(idemhttp.HeaderReplayed) == "true"
}

// Tampered, unsigned, stale and future webhooks get 401 and nothing runs;
// other methods 405 and bodies over the limit 413.
func TestWebhookHandlerRefuses(t *testing.T) {
	rc := newReceiver(t, idemhttp.WebhookOptions{MaxBodyBytes: 64})
	body := []byte(`{"type":"payment.succeeded"}`)
	now := time.Now()
	good := sign(t, oldSecret, "evt-1", now, body)

	tampered := func(f func(h http.Header)) http.Header { h := good.Clone(); f(h); return h }
	cases := []struct {
		name   string
		header http.Header
		body   []byte
		status int
		code   string
	}{
		{"body changed", good, []byte(`{"type":"payment.failed"}`), 401, idemhttp.CodeWebhookUnverified},
		{"id changed", tampered(func(h http.Header) { h.Set("webhook-id", "evt-2") }), body, 401, idemhttp.CodeWebhookUnverified},
		{"timestamp changed", tampered(func(h http.Header) { h.Set("webhook-timestamp", strconv.FormatInt(now.Unix()+1, 10)) }), body, 401, idemhttp.CodeWebhookUnverified},
		{"unknown secret", sign(t, newSecret, "evt-1", now, body), body, 401, idemhttp.CodeWebhookUnverified},
		{"signature v2", tampered(func(h http.Header) {
			h.Set("webhook-signature", strings.Replace(h.Get("webhook-signature"), "v1,", "v2,", 1))
		}), body, 401, idemhttp.CodeWebhookUnverified},
		{"no signature", tampered(func(h http.Header) { h.Del("webhook-signature") }), body, 401, idemhttp.CodeWebhookUnverified},
		{"no id", tampered(func(h http.Header) { h.Del("webhook-id") }), body, 401, idemhttp.CodeWebhookUnverified},
		{"no timestamp", tampered(func(h http.Header) { h.Del("webhook-timestamp") }), body, 401, idemhttp.CodeWebhookUnverified},
		{"stale", sign(t, oldSecret, "evt-1", now.Add(-10*time.Minute), body), body, 401, idemhttp.CodeWebhookStale},
		{"future", sign(t, oldSecret, "evt-1", now.Add(10*time.Minute), body), body, 401, idemhttp.CodeWebhookStale},
		{"too large", sign(t, oldSecret, "evt-1", now, bytes.Repeat([]byte("x"), 65)), bytes.Repeat([]byte("x"), 65), 413, idemhttp.CodeBodyTooLarge},
	}
	for _, c := range cases {
		status, code, _ := postWebhook(t, rc.srv.URL, c.header, c.body)
		if status != c.status || code != c.code {
			t.Errorf("%s: %d %s, want %d %s", c.name, status, code, c.status, c.code)
		}
	}
	resp, err := http.Get(rc.srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != "POST" {
		t.Errorf("GET: %d Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
	}
	if rc.runs.Load() != 0 || rc.inboxRows(t) != 0 {
		t.Fatalf("fn ran %d times, %d inbox rows: nothing should have run", rc.runs.Load(), rc.inboxRows(t))
	}
	// The genuine one still runs.
	if status, code, _ := postWebhook(t, rc.srv.URL, good, body); status != http.StatusNoContent {
		t.Fatalf("genuine webhook: %d %s", status, code)
	}
	if strings.Contains(rc.logs.String(), "evt-1") {
		t.Fatalf("the log holds a webhook-id:\n%s", rc.logs.String())
	}
}

// A redelivery is acknowledged and fn runs once; eight concurrent
// duplicates too. The same id with another body is 422.
func TestWebhookHandlerRedelivery(t *testing.T) {
	rc := newReceiver(t, idemhttp.WebhookOptions{})
	body := []byte(`{"type":"payment.succeeded","amount":100}`)
	for i, replayed := range []bool{false, true, true} {
		status, code, rep := postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-once", time.Now(), body), body)
		if status != http.StatusNoContent || rep != replayed {
			t.Fatalf("delivery %d: %d %s replayed %v", i+1, status, code, rep)
		}
	}
	if rc.runs.Load() != 1 || rc.received(t, "evt-once") != 1 {
		t.Fatalf("fn ran %d times, %d rows; want 1", rc.runs.Load(), rc.received(t, "evt-once"))
	}

	rc.slow.Store(true)
	var wg sync.WaitGroup
	statuses := make([]int, 8)
	for i := range statuses {
		wg.Go(func() {
			statuses[i], _, _ = postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-8", time.Now(), body), body)
		})
	}
	wg.Wait()
	for i, s := range statuses {
		if s != http.StatusNoContent {
			t.Errorf("concurrent delivery %d: %d", i, s)
		}
	}
	if n := rc.received(t, "evt-8"); n != 1 || rc.runs.Load() != 2 {
		t.Fatalf("8 concurrent duplicates: %d rows, fn ran %d times in all; want 1 row, 2 runs", n, rc.runs.Load())
	}

	other := []byte(`{"type":"payment.succeeded","amount":999}`)
	status, code, _ := postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-once", time.Now(), other), other)
	if status != http.StatusUnprocessableEntity || code != idemhttp.CodeKeyReused || rc.runs.Load() != 2 {
		t.Fatalf("same id, other body: %d %s, fn ran %d times", status, code, rc.runs.Load())
	}
}

// fn's error is a 500 and commits nothing; the next delivery runs fn again.
func TestWebhookHandlerFnError(t *testing.T) {
	rc := newReceiver(t, idemhttp.WebhookOptions{})
	rc.fail.Store(1)
	body := []byte(`{"type":"payment.succeeded"}`)
	status, code, _ := postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-fail", time.Now(), body), body)
	if status != http.StatusInternalServerError || code != idemhttp.CodeWebhookFailed {
		t.Fatalf("fn failed: %d %s", status, code)
	}
	if rc.received(t, "evt-fail") != 0 || rc.inboxRows(t) != 0 {
		t.Fatalf("fn's error committed something")
	}
	status, code, rep := postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-fail", time.Now(), body), body)
	if status != http.StatusNoContent || rep || rc.runs.Load() != 2 || rc.received(t, "evt-fail") != 1 {
		t.Fatalf("redelivery: %d %s replayed %v, fn ran %d times", status, code, rep, rc.runs.Load())
	}
	if !strings.Contains(rc.logs.String(), "the receiver's handler failed") {
		t.Fatalf("fn's error not logged:\n%s", rc.logs.String())
	}

	// idem.Reject: fn's writes undone, the id recorded, 204; a redelivery
	// does not run fn.
	rc.rej.Store(true)
	for i, replayed := range []bool{false, true} {
		status, code, rep := postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-poison", time.Now(), body), body)
		if status != http.StatusNoContent || rep != replayed {
			t.Fatalf("rejected, delivery %d: %d %s replayed %v", i+1, status, code, rep)
		}
	}
	if rc.runs.Load() != 3 || rc.received(t, "evt-poison") != 0 {
		t.Fatalf("rejected: fn ran %d times in all, %d rows", rc.runs.Load(), rc.received(t, "evt-poison"))
	}
}

// Bad options panic at construction, naming the field; a bad secret's
// panic matches ErrInvalidSecret and never shows the secret.
func TestWebhookHandlerBadOptions(t *testing.T) {
	fn := func(context.Context, pgx.Tx, idemhttp.Webhook) error { return nil }
	pool := newPool(t, migrateWebhooks)
	cases := []struct {
		name   string
		db     idem.Beginner
		opts   idemhttp.WebhookOptions
		fn     func(context.Context, pgx.Tx, idemhttp.Webhook) error
		secret bool // the panic wraps ErrInvalidSecret
		says   string
	}{
		{"no secret", pool, idemhttp.WebhookOptions{}, fn, true, "no secret"},
		{"no prefix", pool, idemhttp.WebhookOptions{Secrets: []string{"MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}}, fn, true, "secret 0"},
		{"not base64", pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret, "whsec_not*base64"}}, fn, true, "secret 1"},
		{"empty key", pool, idemhttp.WebhookOptions{Secrets: []string{"whsec_"}}, fn, true, "secret 0"},
		{"negative tolerance", pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}, Tolerance: -1}, fn, false, "Tolerance"},
		{"negative timeout", pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}, Timeout: -1}, fn, false, "Timeout"},
		{"negative body", pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}, MaxBodyBytes: -1}, fn, false, "MaxBodyBytes"},
		{"bad consumer", pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}, Consumer: "bad\x00consumer"}, fn, false, "Consumer"},
		{"bad config", pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}, Config: idem.Config{MaxKeyLength: 5000}}, fn, false, "Config"},
		{"nil db", nil, idemhttp.WebhookOptions{Secrets: []string{oldSecret}}, fn, false, "nil database"},
		{"nil fn", pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}}, nil, false, "nil function"},
	}
	for _, c := range cases {
		func() {
			defer func() {
				v := recover()
				err, _ := v.(error)
				switch {
				case err == nil:
					t.Errorf("%s: no panic with an error (%v)", c.name, v)
				case c.secret != errors.Is(err, idemhttp.ErrInvalidSecret), !strings.Contains(err.Error(), c.says):
					t.Errorf("%s: panic %v", c.name, err)
				case strings.Contains(err.Error(), "MfKQ9r8G"):
					t.Errorf("%s: the panic shows the secret: %v", c.name, err)
				}
			}()
			idemhttp.WebhookHandler(c.db, c.opts, c.fn)
		}()
	}
}

// endpointOf returns a WebhookSender.Endpoint that sends every destination
// to url with secrets.
func endpointOf(url string, secrets ...string) func(context.Context, string) (idemhttp.Endpoint, error) {
	return func(context.Context, string) (idemhttp.Endpoint, error) {
		return idemhttp.Endpoint{URL: url, Secrets: secrets}, nil
	}
}

// endpointScript is an endpoint that answers each attempt as script says (the
// last entry for every attempt past it) and records the attempts.
type endpointScript struct {
	srv     *httptest.Server
	mu      sync.Mutex
	headers []http.Header
	bodies  [][]byte
}

type scriptAnswer struct {
	status int
	header map[string]string
	body   string
}

func newEndpointScript(t *testing.T, script ...scriptAnswer) *endpointScript {
	s := &endpointScript{}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.headers = append(s.headers, r.Header.Clone())
		s.bodies = append(s.bodies, body)
		a := script[min(len(s.headers), len(script))-1]
		s.mu.Unlock()
		for k, v := range a.header {
			w.Header().Set(k, v)
		}
		w.WriteHeader(a.status)
		_, _ = io.WriteString(w, a.body)
	}))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *endpointScript) attempts() []http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]http.Header(nil), s.headers...)
}

// fastClient retries quickly: waits of at most 10 ms, so a Retry-After of
// two minutes is capped.
func fastClient() *http.Client {
	return idemhttp.NewClient(&idemhttp.Transport{Policy: idem.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: 10 * time.Millisecond}}, 30*time.Second)
}

func delivery(id string, payload string) idem.Delivery {
	return idem.Delivery{Event: idem.Event{ID: id, Topic: "payment.succeeded", Destination: "shop", Payload: []byte(payload)}, Attempt: 1}
}

// The sender's answers to each status: 2xx delivered, 429 and 503 retried
// inside one Send (same webhook-id, a new signature every attempt, set
// after the Transport's own BeforeAttempt), 410 and the handler's 422
// permanent, other 4xx and 5xx retryable errors carrying Retry-After.
func TestWebhookSenderStatuses(t *testing.T) {
	ctx := context.Background()
	problem := map[string]string{"Content-Type": idemhttp.ContentTypeProblem}
	cases := []struct {
		name      string
		script    []scriptAnswer
		attempts  int
		ok        bool
		permanent bool
		status    int
		after     time.Duration
	}{
		{"200", []scriptAnswer{{status: 200}}, 1, true, false, 0, 0},
		{"204", []scriptAnswer{{status: 204}}, 1, true, false, 0, 0},
		{"429 then 204", []scriptAnswer{{status: 429, header: map[string]string{"Retry-After": "0"}}, {status: 204}}, 2, true, false, 0, 0},
		{"503 then 200", []scriptAnswer{{status: 503}, {status: 200}}, 2, true, false, 0, 0},
		{"502 504 then 200", []scriptAnswer{{status: 502}, {status: 504}, {status: 200}}, 3, true, false, 0, 0},
		{"503 always", []scriptAnswer{{status: 503, header: map[string]string{"Retry-After": "120"}}}, 3, false, false, 503, 2 * time.Minute},
		{"410", []scriptAnswer{{status: 410}}, 1, false, true, 410, 0},
		{"422 key reused", []scriptAnswer{{status: 422, header: problem, body: `{"code":"IDEMPOTENCY_KEY_REUSED"}`}}, 1, false, true, 422, 0},
		{"422 other", []scriptAnswer{{status: 422, body: `{"error":"amount"}`}}, 1, false, false, 422, 0},
		{"400", []scriptAnswer{{status: 400}}, 1, false, false, 400, 0},
		{"401", []scriptAnswer{{status: 401}}, 1, false, false, 401, 0},
		{"404", []scriptAnswer{{status: 404}}, 1, false, false, 404, 0},
		{"301", []scriptAnswer{{status: 301, header: map[string]string{"Location": "/elsewhere"}}}, 1, false, false, 301, 0},
		{"500", []scriptAnswer{{status: 500, body: "boom"}}, 3, false, false, 500, 0},
	}
	for _, c := range cases {
		s := newEndpointScript(t, c.script...)
		var before []int
		var mu sync.Mutex
		client := idemhttp.NewClient(&idemhttp.Transport{
			Policy: idem.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: 10 * time.Millisecond},
			BeforeAttempt: func(req *http.Request, attempt int) error {
				mu.Lock()
				before = append(before, attempt)
				mu.Unlock()
				req.Header.Set("webhook-timestamp", "0") // the sender signs after this
				return nil
			}}, 30*time.Second)
		client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
		sender := idemhttp.WebhookSender{Client: client, Endpoint: endpointOf(s.srv.URL, newSecret, oldSecret)}
		err := sender.Send(ctx, delivery("evt-"+strings.ReplaceAll(c.name, " ", "-"), `{"n":1}`))

		got := s.attempts()
		if len(got) != c.attempts || len(before) != c.attempts {
			t.Errorf("%s: %d attempts, BeforeAttempt %v; want %d", c.name, len(got), before, c.attempts)
		}
		for i, h := range got {
			if h.Get("webhook-id") != "evt-"+strings.ReplaceAll(c.name, " ", "-") || h.Get("Idempotency-Key") != h.Get("webhook-id") {
				t.Errorf("%s: attempt %d: webhook-id %q, Idempotency-Key %q", c.name, i+1, h.Get("webhook-id"), h.Get("Idempotency-Key"))
			}
			ts, _ := strconv.ParseInt(h.Get("webhook-timestamp"), 10, 64)
			at := time.Unix(ts, 0)
			want := sign(t, newSecret, h.Get("webhook-id"), at, []byte(`{"n":1}`)).Get("webhook-signature") + " " +
				sign(t, oldSecret, h.Get("webhook-id"), at, []byte(`{"n":1}`)).Get("webhook-signature")
			if ts == 0 || h.Get("webhook-signature") != want {
				t.Errorf("%s: attempt %d: timestamp %q, signature %q, want %q", c.name, i+1, h.Get("webhook-timestamp"), h.Get("webhook-signature"), want)
			}
			if h.Get("Content-Type") != "application/json" {
				t.Errorf("%s: Content-Type %q", c.name, h.Get("Content-Type"))
			}
		}
		if c.ok {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			continue
		}
		var werr *idemhttp.WebhookError
		switch {
		case !errors.As(err, &werr):
			t.Errorf("%s: err %v, want a WebhookError", c.name, err)
		case werr.StatusCode != c.status || idem.IsPermanent(err) != c.permanent || werr.RetryAfter() != c.after:
			t.Errorf("%s: %v: status %d, permanent %v, RetryAfter %s", c.name, err, werr.StatusCode, idem.IsPermanent(err), werr.RetryAfter())
		}
	}
	// The default Client waited a Retry-After of one second: the second
	// attempt's timestamp is a later second than the first's, each signed
	// afresh.
	s := newEndpointScript(t, scriptAnswer{status: 429, header: map[string]string{"Retry-After": "1"}}, scriptAnswer{status: 200})
	if err := (idemhttp.WebhookSender{Endpoint: endpointOf(s.srv.URL, oldSecret)}).Send(ctx, delivery("evt-fresh", `{}`)); err != nil {
		t.Fatal(err)
	}
	got := s.attempts()
	if len(got) != 2 {
		t.Fatalf("%d attempts, want 2", len(got))
	}
	t1, _ := strconv.ParseInt(got[0].Get("webhook-timestamp"), 10, 64)
	t2, _ := strconv.ParseInt(got[1].Get("webhook-timestamp"), 10, 64)
	if t2 <= t1 || got[0].Get("webhook-signature") == got[1].Get("webhook-signature") {
		t.Fatalf("attempts %v: the second attempt is not signed afresh", got)
	}

	// It does not retry before a Retry-After that does not fit in its 30
	// seconds: the answer comes back at once, for the relay's schedule.
	s = newEndpointScript(t, scriptAnswer{status: 503, header: map[string]string{"Retry-After": "120"}})
	err := idemhttp.WebhookSender{Endpoint: endpointOf(s.srv.URL, oldSecret)}.Send(ctx, delivery("evt-later", `{}`))
	var werr *idemhttp.WebhookError
	if !errors.As(err, &werr) || werr.RetryAfter() != 2*time.Minute || len(s.attempts()) != 1 {
		t.Fatalf("Retry-After 120: %v after %d attempts", err, len(s.attempts()))
	}
}

// Bad endpoints and ids are refused before anything is sent, with typed
// errors; the event's Header is sent but cannot replace the webhook's.
func TestWebhookSenderRefuses(t *testing.T) {
	ctx := context.Background()
	s := newEndpointScript(t, scriptAnswer{status: 204})
	gone := errors.New("no such destination")
	cases := []struct {
		name      string
		endpoint  func(context.Context, string) (idemhttp.Endpoint, error)
		id        string
		is        error
		endpointE bool
		permanent bool
	}{
		{"nil Endpoint", nil, "evt-1", idem.ErrInvalidArgument, true, false},
		{"Endpoint fails", func(context.Context, string) (idemhttp.Endpoint, error) { return idemhttp.Endpoint{}, gone }, "evt-1", gone, true, false},
		{"Endpoint fails for good", func(context.Context, string) (idemhttp.Endpoint, error) {
			return idemhttp.Endpoint{}, idem.Permanent(gone)
		}, "evt-1", gone, true, true},
		{"relative URL", endpointOf("/hooks", oldSecret), "evt-1", idem.ErrInvalidArgument, true, false},
		{"ftp URL", endpointOf("ftp://example.com/hooks", oldSecret), "evt-1", idem.ErrInvalidArgument, true, false},
		{"no secret", endpointOf(s.srv.URL), "evt-1", idemhttp.ErrInvalidSecret, true, false},
		{"no prefix", endpointOf(s.srv.URL, "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), "evt-1", idemhttp.ErrInvalidSecret, true, false},
		{"not base64", endpointOf(s.srv.URL, oldSecret, "whsec_%%%"), "evt-1", idemhttp.ErrInvalidSecret, true, false},
		{"empty id", endpointOf(s.srv.URL, oldSecret), "", idem.ErrInvalidKey, false, true},
		{"id with a space", endpointOf(s.srv.URL, oldSecret), "evt 1", idem.ErrInvalidKey, false, true},
		{"id too long", endpointOf(s.srv.URL, oldSecret), strings.Repeat("e", 256), idem.ErrInvalidKey, false, true},
	}
	for _, c := range cases {
		err := idemhttp.WebhookSender{Client: fastClient(), Endpoint: c.endpoint}.Send(ctx, delivery(c.id, `{}`))
		var eerr *idemhttp.EndpointError
		if !errors.Is(err, c.is) || errors.As(err, &eerr) != c.endpointE || idem.IsPermanent(err) != c.permanent {
			t.Errorf("%s: %v (EndpointError %v, permanent %v)", c.name, err, errors.As(err, &eerr), idem.IsPermanent(err))
		}
		if err != nil && strings.Contains(err.Error(), "MfKQ9r8G") {
			t.Errorf("%s: the error shows the secret: %v", c.name, err)
		}
	}
	if n := len(s.attempts()); n != 0 {
		t.Fatalf("%d requests sent for refused deliveries", n)
	}

	ev := delivery("evt-headers", `<ok/>`)
	ev.Event.Header = map[string][]string{"Content-Type": {"application/xml"}, "X-Tenant": {"t1"},
		"webhook-id": {"forged"}, "Idempotency-Key": {"forged"}}
	if err := (idemhttp.WebhookSender{Endpoint: endpointOf(s.srv.URL, oldSecret)}).Send(ctx, ev); err != nil {
		t.Fatal(err)
	}
	h := s.attempts()[0]
	if h.Get("Content-Type") != "application/xml" || h.Get("X-Tenant") != "t1" || h.Values("webhook-id")[0] != "evt-headers" ||
		len(h.Values("webhook-id")) != 1 || h.Get("Idempotency-Key") != "evt-headers" {
		t.Fatalf("headers %v", h)
	}
}

// End to end: WebhookSender's Send, as a relay calls it, to a
// WebhookHandler through a proxy that loses the first reply. The Transport
// retries with the same webhook-id and a fresh signature; the handler
// acknowledges the duplicate; a later Send of the same event (the relay's
// next attempt) too; fn ran once. Both secrets of a rotation verify, each
// on a receiver that knows only one.
func TestWebhookSenderToHandler(t *testing.T) {
	ctx := context.Background()
	rc := newReceiver(t, idemhttp.WebhookOptions{Secrets: []string{oldSecret}})
	relay := httprelay.New(t, rc.srv.URL, func(r *http.Request, attempt int) httprelay.Action {
		if attempt == 1 {
			return httprelay.Action{Fault: httprelay.DropReply}
		}
		return httprelay.Action{}
	})
	sender := idemhttp.WebhookSender{Client: fastClient(), Endpoint: endpointOf(relay.URL, newSecret, oldSecret)}
	payload := `{"type":"payment.succeeded","data":{"payment":"pay_1"}}`
	for attempt := 1; attempt <= 2; attempt++ {
		d := delivery(idem.EventID(idem.Scope{Actor: "alice", Operation: "POST /v1/payments"}, "pay-1", "payment.succeeded"), payload)
		d.Attempt = attempt
		if err := sender.Send(ctx, d); err != nil {
			t.Fatalf("Send %d: %v", attempt, err)
		}
	}
	reqs := relay.Requests()
	if len(reqs) != 3 || rc.runs.Load() != 1 || rc.inboxRows(t) != 1 {
		t.Fatalf("%d requests, fn ran %d times, %d inbox rows; want 3 requests (lost reply, retry, next Send), 1 run", len(reqs), rc.runs.Load(), rc.inboxRows(t))
	}
	for _, r := range reqs[1:] {
		if r.Header.Get("webhook-id") != reqs[0].Header.Get("webhook-id") {
			t.Fatalf("webhook-ids %q, %q", reqs[0].Header.Get("webhook-id"), r.Header.Get("webhook-id"))
		}
	}

	// Rotation: a receiver that knows only the new secret accepts the same
	// sender's webhooks.
	fresh := newReceiver(t, idemhttp.WebhookOptions{Secrets: []string{newSecret}, Consumer: "shop"})
	if err := (idemhttp.WebhookSender{Endpoint: endpointOf(fresh.srv.URL, newSecret, oldSecret)}).Send(ctx, delivery("evt-rotated", payload)); err != nil {
		t.Fatal(err)
	}
	if fresh.received(t, "evt-rotated") != 1 {
		t.Fatal("the receiver with the new secret did not process the webhook")
	}
	// A receiver with the wrong secret: 401, a retryable WebhookError.
	err := (idemhttp.WebhookSender{Client: fastClient(), Endpoint: endpointOf(fresh.srv.URL, oldSecret)}).Send(ctx, delivery("evt-wrong", payload))
	var werr *idemhttp.WebhookError
	if !errors.As(err, &werr) || werr.StatusCode != 401 || idem.IsPermanent(err) || !strings.Contains(err.Error(), idemhttp.CodeWebhookUnverified) {
		t.Fatalf("wrong secret: %v", err)
	}
	// Another body under a processed id: 422, permanent.
	err = (idemhttp.WebhookSender{Endpoint: endpointOf(fresh.srv.URL, newSecret)}).Send(ctx, delivery("evt-rotated", `{"other":true}`))
	if !errors.As(err, &werr) || werr.StatusCode != 422 || !idem.IsPermanent(err) {
		t.Fatalf("other body: %v", err)
	}
}

// A panic of fn (which left its transaction open) is rolled back and
// answered 500; fn running past Timeout is rolled back and answered 503. The next delivery runs fn again.
func TestWebhookHandlerPanicAndTimeout(t *testing.T) {
	pool := newPool(t, migrateWebhooks)
	var runs atomic.Int64
	var mode atomic.Value // "panic", "stall" or ""
	mode.Store("panic")
	h := idemhttp.WebhookHandler(pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}, Timeout: 500 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler)},
		func(ctx context.Context, tx pgx.Tx, w idemhttp.Webhook) error {
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO received (id, body) VALUES ($1, $2)`, w.ID, string(w.Body)); err != nil {
				return err
			}
			switch mode.Load() {
			case "panic":
				panic("the receiver's handler panicked")
			case "stall":
				_, err := tx.Exec(ctx, `SELECT pg_sleep(10)`)
				return err
			}
			return nil
		})
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	body := []byte(`{}`)
	count := func() (n int) {
		if err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM received) + (SELECT count(*) FROM idem_keys)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, c := range []struct {
		mode   string
		status int
		code   string
	}{{"panic", 500, idemhttp.CodeInternal}, {"stall", 503, idemhttp.CodeTimeout}} {
		mode.Store(c.mode)
		status, code, _ := postWebhook(t, srv.URL, sign(t, oldSecret, "evt-p", time.Now(), body), body)
		if status != c.status || code != c.code || count() != 0 {
			t.Fatalf("%s: %d %s, %d rows; want %d %s and nothing committed", c.mode, status, code, count(), c.status, c.code)
		}
	}
	mode.Store("")
	if status, _, _ := postWebhook(t, srv.URL, sign(t, oldSecret, "evt-p", time.Now(), body), body); status != 204 || runs.Load() != 3 || count() != 2 {
		t.Fatalf("redelivery: %d, fn ran %d times, %d rows", status, runs.Load(), count())
	}
}

// A handler that commits the transaction it was given and then fails, or
// runs out of time: its writes stand, so the answer is a 500 that does not
// say nothing was committed (CodeInternal, not CodeWebhookFailed or a 503
// asking for a redelivery), the handler's ending of its transaction is
// logged as such, and a redelivery gets 500 without running fn. A handler
// whose own error wraps idem.ErrInvalidArgument, its transaction left
// open, is a failed handler (CodeWebhookFailed).
func TestWebhookHandlerEndingItsTransaction(t *testing.T) {
	pool := newPool(t, migrateWebhooks)
	var logs bytes.Buffer
	var mode atomic.Value // "commit", "commit, stall" or "invalid"
	h := idemhttp.WebhookHandler(pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}, Timeout: time.Second,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))},
		func(ctx context.Context, tx pgx.Tx, w idemhttp.Webhook) error {
			if _, err := tx.Exec(ctx, `INSERT INTO received (id, body) VALUES ($1, $2)`, w.ID, string(w.Body)); err != nil {
				return err
			}
			if mode.Load() == "invalid" {
				return fmt.Errorf("forwarding the webhook: %w", idem.Publish(ctx, nil, idem.Event{}))
			}
			if err := tx.Commit(ctx); err != nil {
				return err
			}
			if mode.Load() == "commit, stall" {
				<-ctx.Done()
				return ctx.Err()
			}
			return errors.New("the handler failed after its COMMIT")
		})
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	body := []byte(`{}`)
	rows := func(id string) (n int) {
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM received WHERE id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, m := range []string{"commit", "commit, stall"} {
		mode.Store(m)
		logs.Reset()
		id := "evt-" + strings.ReplaceAll(m, ", ", "-")
		status, code, _ := postWebhook(t, srv.URL, sign(t, oldSecret, id, time.Now(), body), body)
		if status != 500 || code != idemhttp.CodeInternal || !strings.Contains(logs.String(), "ended its transaction itself") {
			t.Fatalf("%s: %d %s, logs %s; want 500 %s, logged", m, status, code, logs.String(), idemhttp.CodeInternal)
		}
		if n := rows(id); n != 1 {
			t.Fatalf("%s: %d of the handler's rows committed, want its one", m, n)
		}
		// The webhook-id is unknown now: a redelivery gets 500, fn does
		// not run again.
		if status, code, _ := postWebhook(t, srv.URL, sign(t, oldSecret, id, time.Now(), body), body); status != 500 || code != idemhttp.CodeInternal {
			t.Fatalf("%s: redelivery: %d %s, want 500 %s", m, status, code, idemhttp.CodeInternal)
		}
		if n := rows(id); n != 1 {
			t.Fatalf("%s: redelivery: %d rows, want fn's one", m, n)
		}
	}
	mode.Store("invalid")
	logs.Reset()
	status, code, _ := postWebhook(t, srv.URL, sign(t, oldSecret, "evt-invalid", time.Now(), body), body)
	if status != 500 || code != idemhttp.CodeWebhookFailed || strings.Contains(logs.String(), "ended its transaction") || rows("evt-invalid") != 0 {
		t.Fatalf("fn's own invalid argument: %d %s, logs %s; want 500 %s, nothing committed", status, code, logs.String(), idemhttp.CodeWebhookFailed)
	}
}

// A Client that is not an idemhttp.Transport sends the signature made when
// Send began, once; the default Client follows no redirect.
func TestWebhookSenderClients(t *testing.T) {
	ctx := context.Background()
	rc := newReceiver(t, idemhttp.WebhookOptions{})
	if err := (idemhttp.WebhookSender{Client: &http.Client{}, Endpoint: endpointOf(rc.srv.URL, oldSecret)}).Send(ctx, delivery("evt-plain", `{}`)); err != nil {
		t.Fatal(err)
	}
	if rc.received(t, "evt-plain") != 1 {
		t.Fatal("not received")
	}
	s := newEndpointScript(t, scriptAnswer{status: 308, header: map[string]string{"Location": rc.srv.URL}})
	err := idemhttp.WebhookSender{Endpoint: endpointOf(s.srv.URL, oldSecret)}.Send(ctx, delivery("evt-moved", `{}`))
	var werr *idemhttp.WebhookError
	if !errors.As(err, &werr) || werr.StatusCode != 308 || idem.IsPermanent(err) || rc.received(t, "evt-moved") != 0 {
		t.Fatalf("redirect: %v", err)
	}
}

// WebhookSender against idem's own receiver (Middleware): a duplicate of a
// delivery still running, answered 202 {"status":"processing"} (StatusURL),
// is not a delivery (that run may yet fail and store nothing) but an error
// the relay retries after Retry-After; a redelivery of an event processed
// whose stored response was dropped (BodyTTL), answered 410
// IDEMPOTENCY_RESPONSE_EXPIRED, is delivered, not a gone endpoint.
func TestWebhookSenderToIdemReceiver(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t, migrate)
	const secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	var runs atomic.Int64
	started, release := make(chan struct{}, 1), make(chan struct{})
	mux := http.NewServeMux()
	mux.Handle("POST /slow", idemhttp.Middleware(pool, idemhttp.Options{
		Actor: func(*http.Request) (string, error) { return "sender", nil }, StatusURL: "/status",
		Config: idem.Config{Wait: 50 * time.Millisecond},
	})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		select {
		case started <- struct{}{}:
		default:
		}
		<-release
		w.WriteHeader(http.StatusInternalServerError) // the run fails: nothing stored
	})))
	mux.Handle("POST /short", idemhttp.Middleware(pool, idemhttp.Options{
		Actor:  func(*http.Request) (string, error) { return "sender", nil },
		Config: idem.Config{BodyTTL: 50 * time.Millisecond},
	})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if r.Header.Get("webhook-id") == "refused" {
			w.WriteHeader(http.StatusNotFound) // a refusal, stored
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})))
	// A receiver of its own that accepts events for later work.
	mux.Handle("POST /async", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "5")
		w.WriteHeader(http.StatusAccepted)
		fmt.Fprint(w, `{"status":"processing"}`)
	}))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	sender := func(path string) idemhttp.WebhookSender {
		return idemhttp.WebhookSender{
			Client: idemhttp.NewClient(&idemhttp.Transport{Policy: idem.RetryPolicy{MaxAttempts: 1}}, 10*time.Second),
			Endpoint: func(context.Context, string) (idemhttp.Endpoint, error) {
				return idemhttp.Endpoint{URL: srv.URL + path, Secrets: []string{secret}}, nil
			},
		}
	}
	d := idem.Delivery{Attempt: 1, Event: idem.Event{ID: "3f1c0a52-9d4b-4f8e-a3b6-2e5f8d9c0b14", Topic: "t", Destination: "d", Payload: []byte(`{}`)}}

	first := make(chan error, 1)
	go func() { first <- sender("/slow").Send(ctx, d) }()
	<-started
	err := sender("/slow").Send(ctx, d)
	var werr *idemhttp.WebhookError
	if !errors.As(err, &werr) || werr.StatusCode != http.StatusAccepted || idem.IsPermanent(err) || werr.RetryAfter() <= 0 {
		t.Errorf("a duplicate of a delivery still running: %v; want a WebhookError 202 to retry after Retry-After", err)
	}
	close(release)
	if err := <-first; err == nil {
		t.Error("the first delivery, answered 500: nil")
	}
	if err := sender("/slow").Send(ctx, d); err == nil || runs.Load() != 2 {
		t.Errorf("the event sent again: %v after %d runs; want it run again (and failing again)", err, runs.Load())
	}

	d.Event.ID = "9b2d6e1a-4c3f-4a7e-8d5b-1f0e2c3a4b5d"
	if err := sender("/short").Send(ctx, d); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // past the stored body's life
	d.Attempt = 2                      // a redelivery after the first reply was lost
	if err := sender("/short").Send(ctx, d); err != nil || runs.Load() != 3 {
		t.Errorf("a redelivery of a processed event whose response was dropped: %v after %d runs; want delivered, not run again", err, runs.Load())
	}
	// A refusal stored (404), its response dropped: still not delivered.
	d.Event.ID, d.Attempt = "refused", 1
	if err := sender("/short").Send(ctx, d); err == nil {
		t.Fatal("a 404: delivered")
	}
	time.Sleep(100 * time.Millisecond)
	d.Attempt = 2
	if err := sender("/short").Send(ctx, d); err == nil || !idem.IsPermanent(err) {
		t.Errorf("a redelivery of a refused event whose response was dropped: %v; want a permanent failure, not delivered", err)
	}
	// Another receiver's 202 processing, with no status URL: delivered.
	if err := sender("/async").Send(ctx, d); err != nil {
		t.Errorf("a receiver's own 202 processing: %v; want delivered", err)
	}
}

// With Config.BodyTTL, a redelivery of a webhook processed before its body's
// life ran out is still a duplicate (204, fn does not run), not a 500: the
// Inbox's stored response is empty, and gone says only that its time passed.
func TestWebhookHandlerRedeliveryPastBodyTTL(t *testing.T) {
	t.Parallel()
	rc := newReceiver(t, idemhttp.WebhookOptions{Config: idem.Config{BodyTTL: 100 * time.Millisecond}})
	body := []byte(`{"a":1}`)
	if st, code, _ := postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-b", time.Now(), body), body); st != http.StatusNoContent {
		t.Fatalf("first delivery: %d %s", st, code)
	}
	time.Sleep(200 * time.Millisecond)
	st, code, replayed := postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-b", time.Now(), body), body)
	if st != http.StatusNoContent || !replayed || rc.runs.Load() != 1 {
		t.Errorf("redelivery past BodyTTL: %d %s (replayed %v), %d runs; want 204, a duplicate, 1 run", st, code, replayed, rc.runs.Load())
	}
}

// fn's own error is fn's failure (500 WEBHOOK_HANDLER_FAILED, a redelivery
// runs fn again), whatever idem error it wraps: not the webhook-id's 422
// IDEMPOTENCY_KEY_REUSED (which the sender takes as final) or 400.
func TestWebhookHandlerFnErrorWrappingAnIdemError(t *testing.T) {
	t.Parallel()
	for _, wrapped := range []error{idem.ErrKeyReused, idem.ErrInvalidKey, &idem.InProgressError{RetryAfter: time.Second}} {
		pool := newPool(t, migrateWebhooks)
		var runs atomic.Int64
		srv := httptest.NewServer(idemhttp.WebhookHandler(pool, idemhttp.WebhookOptions{Secrets: []string{oldSecret}},
			func(context.Context, pgx.Tx, idemhttp.Webhook) error {
				runs.Add(1)
				return fmt.Errorf("charge: %w", wrapped)
			}))
		body := []byte(`{"a":1}`)
		for range 2 {
			if st, code, _ := postWebhook(t, srv.URL, sign(t, oldSecret, "evt-x", time.Now(), body), body); st != http.StatusInternalServerError ||
				code != idemhttp.CodeWebhookFailed {
				t.Errorf("fn's error wrapping %v: %d %s, want 500 %s", wrapped, st, code, idemhttp.CodeWebhookFailed)
			}
		}
		if runs.Load() != 2 {
			t.Errorf("fn's error wrapping %v: %d runs, want 2 (a redelivery runs it again)", wrapped, runs.Load())
		}
		srv.Close()
	}
}

// A TTLFor that gives the inbox's operation a TTL under a microsecond
// (negative) is found at start-up, as every invalid Config is: WebhookHandler
// panics, rather than answering every webhook 500.
func TestWebhookHandlerTTLForChecked(t *testing.T) {
	t.Parallel()
	defer func() {
		if v := recover(); v == nil || !strings.Contains(fmt.Sprint(v), "TTLFor") {
			t.Errorf("panic %v, want one naming TTLFor", v)
		}
	}()
	idemhttp.WebhookHandler(newPool(t, migrateWebhooks), idemhttp.WebhookOptions{Secrets: []string{oldSecret},
		Config: idem.Config{TTLFor: func(string) time.Duration { return -time.Hour }}},
		func(context.Context, pgx.Tx, idemhttp.Webhook) error { return nil })
}

// So is a BodyTTLFor giving the inbox's operation a body's life under a
// microsecond.
func TestWebhookHandlerBodyTTLForChecked(t *testing.T) {
	t.Parallel()
	defer func() {
		if v := recover(); v == nil || !strings.Contains(fmt.Sprint(v), "BodyTTLFor") {
			t.Errorf("panic %v, want one naming BodyTTLFor", v)
		}
	}()
	idemhttp.WebhookHandler(newPool(t, migrateWebhooks), idemhttp.WebhookOptions{Secrets: []string{oldSecret},
		Config: idem.Config{BodyTTLFor: func(string) time.Duration { return -time.Hour }}},
		func(context.Context, pgx.Tx, idemhttp.Webhook) error { return nil })
}
