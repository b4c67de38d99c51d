package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/httprelay"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// relayedPayments is a payment service whose gateway is reached through a
// relay that treats each charge as rule says; the payments give up on an
// attempt after timeout.
func relayedPayments(t *testing.T, timeout time.Duration, rule httprelay.Rule) (*payments, *gateway, *httprelay.Relay) {
	t.Helper()
	pool := pgtest.Pool(t, migratePayments)
	gw := newGateway(pool)
	t.Cleanup(gw.close)
	url, err := gw.baseURL()
	if err != nil {
		t.Fatal(err)
	}
	relay := httprelay.New(t, url, rule)
	s := newPayments(pool, gw)
	s.gatewayURL, s.gatewayTimeout = relay.URL, timeout
	s.gatewayPolicy = idem.RetryPolicy{MaxAttempts: 5, BaseDelay: time.Millisecond, MaxDelay: 20 * time.Millisecond}
	return s, gw, relay
}

// Payments through a network that loses the gateway's answers, closes
// connections and delays answers: each payment succeeds, with exactly one
// charge, and every attempt of it carries one key, the reservation's call
// key.
func TestGatewayBehindLossyRelay(t *testing.T) {
	t.Parallel()
	faults := map[string][]httprelay.Action{ // by attempt; then forward
		"none":       nil,
		"drop":       {{Fault: httprelay.DropReply}},
		"drop-twice": {{Fault: httprelay.DropReply}, {Fault: httprelay.DropReply}},
		"close":      {{Fault: httprelay.CloseBefore}},
		"close-drop": {{Fault: httprelay.CloseBefore}, {Fault: httprelay.DropReply}},
		"delay":      {{Delay: 3 * time.Second}}, // past the attempt's timeout
	}
	var mu sync.Mutex
	opOf := map[string]string{} // call key -> payment key
	s, gw, relay := relayedPayments(t, time.Second, func(r *http.Request, attempt int) httprelay.Action {
		mu.Lock()
		op := opOf[r.Header.Get(idemhttp.HeaderKey)]
		mu.Unlock()
		if f := faults[strings.SplitN(op, "/", 2)[0]]; attempt <= len(f) {
			return f[attempt-1]
		}
		return httprelay.Action{}
	})
	ctx := t.Context()
	var wg sync.WaitGroup
	for fault := range faults {
		key := fault + "/1"
		mu.Lock()
		opOf[chargeKey("alice", key)] = key
		mu.Unlock()
		wg.Go(func() {
			resp, replayed, err := s.pay(ctx, "alice", key, demoPayment, "")
			if err != nil || resp.Status != http.StatusCreated || replayed {
				t.Errorf("%s: %d %t %v", key, resp.Status, replayed, err)
			}
		})
	}
	wg.Wait()

	seen := map[string]map[string]bool{} // payment key -> call keys
	for _, r := range relay.Requests() {
		k := r.Header.Get(idemhttp.HeaderKey)
		op := opOf[k]
		if seen[op] == nil {
			seen[op] = map[string]bool{}
		}
		seen[op][k] = true
	}
	for fault := range faults {
		key := fault + "/1"
		if len(seen[key]) != 1 || !seen[key][chargeKey("alice", key)] {
			t.Errorf("%s: keys %v, want only its call key", key, seen[key])
		}
		// Every attempt went through the relay; those it closed before
		// forwarding never reached the gateway.
		want := len(faults[fault]) + 1
		for _, f := range faults[fault] {
			if f.Fault == httprelay.CloseBefore {
				want--
			}
		}
		c, ok := lookupCharge(t, gw, "alice", key)
		if !ok || c.Requests < want || (fault != "delay" && c.Requests != want) {
			t.Errorf("%s: charge %+v, want %d requests at the gateway", key, c, want)
		}
		var rows int
		if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE idem_key = $1`, key).Scan(&rows); err != nil || rows != 1 {
			t.Errorf("%s: %d payments (%v)", key, rows, err)
		}
	}
	if charges := len(listCharges(t, gw)); charges != len(faults) {
		t.Fatalf("%d charges for %d payments", charges, len(faults))
	}
}

// No attempt gets an answer: the transport gives up with an unknown
// outcome; without a window the payment waits for an operator, and its
// retries never reach the gateway. The gateway charged once.
func TestGatewayAnswersLost(t *testing.T) {
	t.Parallel()
	s, gw, relay := relayedPayments(t, time.Second, func(*http.Request, int) httprelay.Action {
		return httprelay.Action{Fault: httprelay.DropReply}
	})
	s.resumeWithin = 0
	ctx := t.Context()
	_, _, err := s.pay(ctx, "alice", "lost", demoPayment, "")
	if !errors.Is(err, errOutcomeUnknown) {
		t.Fatalf("pay: %v", err)
	}
	rec, err := idem.Lookup(ctx, s.pool, idem.Scope{Actor: "alice", Operation: paymentOperation}, "lost")
	if err != nil || rec.Status != idem.StatusUnknown || !strings.Contains(rec.LastError, "may have been charged") {
		t.Fatalf("record: %+v %v", rec, err)
	}
	if _, _, err := s.pay(ctx, "alice", "lost", demoPayment, ""); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("retry: %v", err)
	}
	c, ok := lookupCharge(t, gw, "alice", "lost")
	if !ok || c.Requests != 5 || len(relay.Requests()) != 5 || len(listCharges(t, gw)) != 1 {
		t.Fatalf("charge %+v; relay saw %d requests", c, len(relay.Requests()))
	}
}

// A resumed payment whose gateway cannot be reached stays in doubt: an
// earlier attempt charged under the same call key, so "this attempt sent
// nothing" is no proof that nothing was charged. The record stays
// resumable (not failed_retryable, which would let a person's list miss
// it), and the next retry gets the first charge back.
func TestResumedPaymentNeverFailsRetryable(t *testing.T) {
	t.Parallel()
	drop := true
	var mu sync.Mutex
	s, gw, _ := relayedPayments(t, time.Second, func(*http.Request, int) httprelay.Action {
		mu.Lock()
		defer mu.Unlock()
		if drop {
			return httprelay.Action{Fault: httprelay.DropReply}
		}
		return httprelay.Action{}
	})
	s.resumeWithin = time.Hour
	ctx := t.Context()
	scope := idem.Scope{Actor: "alice", Operation: paymentOperation}
	if _, _, err := s.pay(ctx, "alice", "resumed", demoPayment, ""); !errors.Is(err, errResumable) {
		t.Fatalf("pay: %v", err)
	}
	relayURL := s.gatewayURL
	s.gatewayURL = closedURL(t) // the retry resumes, but reaches no gateway
	if _, _, err := s.pay(ctx, "alice", "resumed", demoPayment, ""); !errors.Is(err, errResumable) {
		t.Fatalf("resumed retry without a gateway: %v", err)
	}
	rec, err := idem.Lookup(ctx, s.pool, scope, "resumed")
	if err != nil || rec.Status != idem.StatusUnknown {
		t.Fatalf("record after the unreachable gateway: %+v %v", rec, err)
	}
	mu.Lock()
	drop = false
	mu.Unlock()
	s.gatewayURL = relayURL
	resp, replayed, err := s.pay(ctx, "alice", "resumed", demoPayment, "")
	if err != nil || resp.Status != http.StatusCreated || replayed {
		t.Fatalf("resumed retry: %d %t %v", resp.Status, replayed, err)
	}
	if n := len(listCharges(t, gw)); n != 1 {
		t.Fatalf("%d charges", n)
	}
}

// closedURL is the URL of a port on 127.0.0.1 that nothing listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

// The gateway deduplicates by Idempotency-Key as Stripe does: a retry gets
// the first answer back, the same key with another body 422, no key 400; a
// refusal is not remembered; a key is forgotten after 24 hours.
func TestGatewayDeduplicates(t *testing.T) {
	t.Parallel()
	gw := newGateway(pgtest.Pool(t, migratePayments))
	t.Cleanup(gw.close)
	now := time.Now()
	var clock sync.Mutex
	gw.now = func() time.Time { clock.Lock(); defer clock.Unlock(); return now }
	url, err := gw.baseURL()
	if err != nil {
		t.Fatal(err)
	}
	send := func(key, body, mode string) (int, bool, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(t.Context(), "POST", url+"/v1/charges", strings.NewReader(body))
		if key != "" {
			req.Header.Set(idemhttp.HeaderKey, key)
		}
		if mode != "" {
			req.Header.Set(headerGatewayMode, mode)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, idemhttp.Replayed(resp), string(b)
	}
	body := `{"customerId":"cus-1","amountCents":500,"currency":"KRW"}`
	st, rp, first := send("g1", body, "")
	if st != 201 || rp {
		t.Fatalf("charge: %d %t %s", st, rp, first)
	}
	if st, rp, again := send("g1", body, ""); st != 201 || !rp || again != first {
		t.Fatalf("retry: %d %t %s", st, rp, again)
	}
	if st, _, _ := send("g1", strings.Replace(body, "500", "501", 1), ""); st != 422 {
		t.Fatalf("another body: %d", st)
	}
	if st, _, _ := send("", body, ""); st != 400 {
		t.Fatalf("no key: %d", st)
	}
	if st, _, _ := send("g2", body, modeUnavailable); st != 503 {
		t.Fatalf("unavailable: %d", st)
	}
	if st, rp, _ := send("g2", body, ""); st != 201 || rp {
		t.Fatalf("after a refusal: %d %t", st, rp)
	}
	big := `{"customerId":"cus-1","amountCents":2000000,"currency":"KRW"}`
	for i := range 2 {
		if st, rp, _ := send("g3", big, ""); st != 402 || rp != (i == 1) {
			t.Fatalf("decline %d: %d %t", i, st, rp)
		}
	}
	clock.Lock()
	now = now.Add(gatewayKeyTTL + time.Second)
	clock.Unlock()
	st, rp, later := send("g1", body, "")
	if st != 201 || rp || later == first {
		t.Fatalf("after 24 h: %d %t %s", st, rp, later)
	}
	if n := len(listCharges(t, gw)); n != 3 || !bytes.Contains([]byte(later), []byte(fmt.Sprintf(`"ch_%d"`, n))) {
		t.Fatalf("%d charges: %s", n, later)
	}
}

// lookupCharge is the gateway's latest charge for the payment (actor, key).
func lookupCharge(t *testing.T, gw *gateway, actor, key string) (gatewayCharge, bool) {
	t.Helper()
	c, ok, err := gw.lookup(t.Context(), chargeKey(actor, key))
	if err != nil {
		t.Fatal(err)
	}
	return c, ok
}

// listCharges is every charge the gateway made.
func listCharges(t *testing.T, gw *gateway) []gatewayCharge {
	t.Helper()
	charges, err := gw.list(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return charges
}
