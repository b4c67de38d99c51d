package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/httprelay"
)

// The review's tests: a hostile sender, a hostile network and a busy relay.

// A 3xx is a failure whatever the Client: with a Client of the caller's
// (which follows redirects by default), a 302 would turn the signed POST
// into a GET without the payload, and the 2xx of the URL it points to would
// count as delivered though the endpoint never got the event. Standard
// Webhooks: 3xx is a failure; update the endpoint's URL instead.
func TestWebhookSenderFollowsNoRedirect(t *testing.T) {
	ctx := context.Background()
	var elsewhere atomic.Int64
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		elsewhere.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(other.Close)
	clients := map[string]*http.Client{"NewClient": fastClient(), "plain": {}, "Transport": {Transport: &idemhttp.Transport{}}}
	for _, status := range []int{301, 302, 303, 307, 308} {
		s := newEndpointScript(t, scriptAnswer{status: status, header: map[string]string{"Location": other.URL}})
		for name, client := range clients {
			err := idemhttp.WebhookSender{Client: client, Endpoint: endpointOf(s.srv.URL, oldSecret)}.Send(ctx, delivery("evt-moved", `{}`))
			var werr *idemhttp.WebhookError
			if !errors.As(err, &werr) || werr.StatusCode != status || idem.IsPermanent(err) {
				t.Errorf("%d, %s Client: %v; want a retryable WebhookError %d", status, name, err, status)
			}
		}
	}
	if n := elsewhere.Load(); n != 0 {
		t.Fatalf("the redirect was followed %d times", n)
	}
	if client := clients["plain"]; client.CheckRedirect != nil {
		t.Fatal("the caller's Client was changed")
	}
}

// An event ID holding a "." is refused before anything is sent, for good:
// Standard Webhooks signs id.timestamp.body, and with a "." in the id the
// signed bytes split another way too. A capture of the webhook
// "pay.<T1>" sent at T2 with body B verifies as the webhook "pay" sent at
// T1 with body "<T2>.B", within the tolerance whenever T1 is.
func TestWebhookSenderRefusesDottedID(t *testing.T) {
	ctx := context.Background()
	rc := newReceiver(t, idemhttp.WebhookOptions{})
	now := time.Now()
	t1 := now.Add(-time.Minute).Unix()
	body := []byte(`{"type":"payment.succeeded"}`)
	// The split, by hand: the capture's signature over the forged fields.
	captured := sign(t, oldSecret, "pay."+itoa(t1), now, body)
	forgedBody := []byte(itoa(now.Unix()) + "." + string(body))
	forged := sign(t, oldSecret, "pay", time.Unix(t1, 0), forgedBody)
	if forged.Get("webhook-signature") != captured.Get("webhook-signature") {
		t.Fatal("the signed bytes do not split: the test is wrong")
	}
	if status, _, _ := postWebhook(t, rc.srv.URL, forged, forgedBody); status != http.StatusNoContent {
		t.Fatalf("the forgery got %d: the receiver cannot tell it, only the sender can prevent it", status)
	}

	s := newEndpointScript(t, scriptAnswer{status: 204})
	for _, id := range []string{"pay." + itoa(t1), "evt.1", "."} {
		err := idemhttp.WebhookSender{Endpoint: endpointOf(s.srv.URL, oldSecret)}.Send(ctx, delivery(id, string(body)))
		if !errors.Is(err, idem.ErrInvalidKey) || !idem.IsPermanent(err) {
			t.Errorf("id %q: %v; want a permanent ErrInvalidKey", id, err)
		}
	}
	if n := len(s.attempts()); n != 0 {
		t.Fatalf("%d requests sent for dotted ids", n)
	}
	// idem.EventID's are UUIDs: never a ".".
	id := idem.EventID(idem.Scope{Actor: "alice", Operation: "POST /v1/payments"}, "k.1", "payment.succeeded")
	if err := (idemhttp.WebhookSender{Endpoint: endpointOf(s.srv.URL, oldSecret)}).Send(ctx, delivery(id, string(body))); err != nil {
		t.Fatal(err)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// A TTL that forgets a webhook-id while a capture of its webhook is still
// within the tolerance would let a replay run fn again: WebhookHandler
// refuses a TTL (or TTLFor of the Inbox's operation) under twice the
// Tolerance, the span in which one signed request is accepted.
func TestWebhookHandlerRefusesTTLUnderTolerance(t *testing.T) {
	pool := newPool(t, migrateWebhooks)
	fn := func(context.Context, pgx.Tx, idemhttp.Webhook) error { return nil }
	for _, c := range []struct {
		name string
		opts idemhttp.WebhookOptions
		ok   bool
	}{
		{"TTL 1 min, default tolerance", idemhttp.WebhookOptions{Config: idem.Config{TTL: time.Minute}}, false},
		{"TTL 9 min, default tolerance", idemhttp.WebhookOptions{Config: idem.Config{TTL: 9 * time.Minute}}, false},
		{"TTL 10 min, default tolerance", idemhttp.WebhookOptions{Config: idem.Config{TTL: 10 * time.Minute}}, true},
		{"TTL 1 h, tolerance 1 h", idemhttp.WebhookOptions{Tolerance: time.Hour, Config: idem.Config{TTL: time.Hour}}, false},
		{"default TTL, tolerance 48 h", idemhttp.WebhookOptions{Tolerance: 48 * time.Hour}, false},
		{"TTLFor the inbox 1 min", idemhttp.WebhookOptions{Config: idem.Config{TTLFor: func(op string) time.Duration {
			if op == idem.InboxOperation {
				return time.Minute
			}
			return 0
		}}}, false},
		{"tolerance past half the longest Duration", idemhttp.WebhookOptions{Tolerance: 1 << 62}, false},
		{"TTLFor another operation", idemhttp.WebhookOptions{Config: idem.Config{TTLFor: func(string) time.Duration { return 0 }}}, true},
	} {
		c.opts.Secrets = []string{oldSecret}
		func() {
			defer func() {
				v := recover()
				err, _ := v.(error)
				switch {
				case c.ok && v != nil:
					t.Errorf("%s: panic %v", c.name, v)
				case !c.ok && (!errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "Tolerance")):
					t.Errorf("%s: panic %v; want ErrInvalidConfig naming the Tolerance", c.name, v)
				}
			}()
			idemhttp.WebhookHandler(pool, c.opts, fn)
		}()
	}
}

// A relay's workers share one WebhookSender and call Send at once: 40
// events, each sent twice (the relay's next attempt after a lost reply),
// by 16 goroutines, through a proxy that loses the first reply of every
// webhook-id. Every Send succeeds, every attempt is signed for itself, and
// the receiver's fn runs once per event. Run with -race.
func TestWebhookSenderConcurrentSends(t *testing.T) {
	ctx := context.Background()
	rc := newReceiver(t, idemhttp.WebhookOptions{Secrets: []string{newSecret}})
	proxy := httprelay.New(t, rc.srv.URL, func(r *http.Request, attempt int) httprelay.Action {
		if attempt == 1 {
			return httprelay.Action{Fault: httprelay.DropReply}
		}
		return httprelay.Action{}
	})
	var before atomic.Int64
	client := idemhttp.NewClient(&idemhttp.Transport{
		Policy: idem.RetryPolicy{MaxAttempts: 5, BaseDelay: time.Millisecond, MaxDelay: 20 * time.Millisecond},
		BeforeAttempt: func(req *http.Request, attempt int) error {
			before.Add(1)
			req.Header.Set("X-Attempt", strconv.Itoa(attempt))
			return nil
		}}, 30*time.Second)
	senders := []idemhttp.WebhookSender{
		{Client: client, Endpoint: endpointOf(proxy.URL, newSecret, oldSecret)},
		{Endpoint: endpointOf(proxy.URL, newSecret)}, // the default Client
	}
	const events, workers = 40, 16
	jobs := make(chan idem.Delivery)
	errs := make(chan error, 2*events)
	var wg sync.WaitGroup
	for w := range workers {
		sender := senders[w%len(senders)]
		wg.Go(func() {
			for d := range jobs {
				if err := sender.Send(ctx, d); err != nil {
					errs <- fmt.Errorf("%s attempt %d: %w", d.Event.ID, d.Attempt, err)
				}
			}
		})
	}
	for attempt := 1; attempt <= 2; attempt++ {
		for i := range events {
			d := delivery(fmt.Sprintf("evt-c%02d", i), fmt.Sprintf(`{"n":%d}`, i))
			d.Attempt = attempt
			jobs <- d
		}
	}
	close(jobs)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i := range events {
		if n := rc.received(t, fmt.Sprintf("evt-c%02d", i)); n != 1 {
			t.Errorf("evt-c%02d processed %d times", i, n)
		}
	}
	if rc.runs.Load() != events {
		t.Fatalf("fn ran %d times for %d events", rc.runs.Load(), events)
	}
	// Each request carries the signature of its own id, timestamp and body.
	for _, r := range proxy.Requests() {
		var i int
		if _, err := fmt.Sscanf(r.Header.Get("webhook-id"), "evt-c%02d", &i); err != nil {
			t.Fatal(err)
		}
		ts, _ := strconv.ParseInt(r.Header.Get("webhook-timestamp"), 10, 64)
		want := sign(t, newSecret, r.Header.Get("webhook-id"), time.Unix(ts, 0), fmt.Appendf(nil, `{"n":%d}`, i)).Get("webhook-signature")
		if !slices.Contains(strings.Fields(r.Header.Get("webhook-signature")), want) {
			t.Fatalf("request %v: signature %q, want %q among them", r.Header.Get("webhook-id"), r.Header.Get("webhook-signature"), want)
		}
	}
	if before.Load() == 0 {
		t.Fatal("the Client's own BeforeAttempt never ran")
	}
}

// A captured webhook replayed byte for byte within the tolerance, at once
// and concurrently, is a redelivery: 204 Idempotent-Replayed, fn does not
// run again.
func TestWebhookHandlerReplayedCapture(t *testing.T) {
	rc := newReceiver(t, idemhttp.WebhookOptions{})
	body := []byte(`{"type":"payment.succeeded","amount":100}`)
	captured := sign(t, oldSecret, "evt-captured", time.Now(), body)
	if status, code, rep := postWebhook(t, rc.srv.URL, captured.Clone(), body); status != http.StatusNoContent || rep {
		t.Fatalf("first delivery: %d %s replayed %v", status, code, rep)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if status, code, rep := postWebhook(t, rc.srv.URL, captured.Clone(), body); status != http.StatusNoContent || !rep {
				t.Errorf("replay: %d %s replayed %v", status, code, rep)
			}
		})
	}
	wg.Wait()
	if rc.runs.Load() != 1 || rc.received(t, "evt-captured") != 1 {
		t.Fatalf("fn ran %d times, %d rows; want 1", rc.runs.Load(), rc.received(t, "evt-captured"))
	}
}

// An event whose Header no HTTP request can carry is a permanent failure,
// matching idem.ErrInvalidArgument, before anything is sent; the error
// never shows the value. (Sent as it was, net/http refused every attempt,
// and the Send failed as "outcome unknown", retried for the whole
// schedule.)
func TestWebhookSenderRefusesBadHeader(t *testing.T) {
	s := newEndpointScript(t, scriptAnswer{status: 204})
	for _, h := range []map[string][]string{
		{"X-Token": {"sk_live_1\r\nX-Injected: 1"}}, {"X-Nul": {"a\x00b"}}, {"X-Del": {"a\x7fb"}},
		{"Bad Name": {"v"}}, {"": {"v"}}, {"X-Colon:": {"v"}}, {"X-é": {"v"}},
	} {
		d := delivery("evt-header", `{}`)
		d.Event.Header = h
		err := idemhttp.WebhookSender{Client: fastClient(), Endpoint: endpointOf(s.srv.URL, oldSecret)}.Send(context.Background(), d)
		if !errors.Is(err, idem.ErrInvalidArgument) || !idem.IsPermanent(err) || errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Errorf("%q: %v; want a permanent ErrInvalidArgument", h, err)
		}
		if err != nil && strings.Contains(err.Error(), "sk_live") {
			t.Errorf("the error shows the value: %v", err)
		}
	}
	if n := len(s.attempts()); n != 0 {
		t.Fatalf("%d requests sent", n)
	}
	// Tabs, spaces and UTF-8 in a value are sent as they are.
	d := delivery("evt-header-ok", `{}`)
	d.Event.Header = map[string][]string{"X-Note": {"a\tb c", "café"}}
	if err := (idemhttp.WebhookSender{Endpoint: endpointOf(s.srv.URL, oldSecret)}).Send(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if got := s.attempts()[0].Values("X-Note"); len(got) != 2 || got[0] != "a\tb c" || got[1] != "café" {
		t.Fatalf("X-Note %q", got)
	}
}

// Send's error, which the relay records in its attempt log, holds no more
// of the endpoint's URL than its scheme and host: webhook URLs often carry
// a token in their path or query. The chain is intact.
func TestWebhookSenderErrorHidesURLToken(t *testing.T) {
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close() // nothing listens there now: refused
	for name, client := range map[string]*http.Client{"default": nil, "NewClient": fastClient(), "plain": {}} {
		err := idemhttp.WebhookSender{Client: client, Endpoint: endpointOf(down.URL+"/services/T0/B0/s3cr3tpath?token=s3cr3tquery", oldSecret)}.
			Send(context.Background(), delivery("evt-down", `{}`))
		var uerr *url.Error
		switch {
		case err == nil || strings.Contains(err.Error(), "s3cr3t"):
			t.Errorf("%s Client: %v", name, err)
		case !errors.As(err, &uerr) || !strings.Contains(err.Error(), down.URL):
			t.Errorf("%s Client: %v: want a *url.Error naming the scheme and host", name, err)
		case client != nil && client.Transport == nil:
			// A plain Client: net/http's own error.
		case !errors.Is(err, idem.ErrNotSent):
			t.Errorf("%s Client: %v: want ErrNotSent", name, err)
		}
	}
}

// A verified webhook whose id the Inbox cannot key (over a MaxKeyLength
// below a hashed key's 71 bytes) is a 400 IDEMPOTENCY_KEY_INVALID: nothing
// ran, and it is no server error.
func TestWebhookHandlerRefusesUnkeyableID(t *testing.T) {
	rc := newReceiver(t, idemhttp.WebhookOptions{Config: idem.Config{MaxKeyLength: 64}})
	body := []byte(`{}`)
	long := strings.Repeat("m", 100)
	status, code, _ := postWebhook(t, rc.srv.URL, sign(t, oldSecret, long, time.Now(), body), body)
	if status != http.StatusBadRequest || code != idemhttp.CodeKeyInvalid || rc.runs.Load() != 0 || rc.inboxRows(t) != 0 {
		t.Fatalf("id of 100 bytes: %d %s, fn ran %d times, %d rows", status, code, rc.runs.Load(), rc.inboxRows(t))
	}
	if status, code, _ := postWebhook(t, rc.srv.URL, sign(t, oldSecret, "evt-short", time.Now(), body), body); status != http.StatusNoContent {
		t.Fatalf("short id: %d %s", status, code)
	}
}
