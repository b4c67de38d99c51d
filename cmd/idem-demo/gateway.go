package main

// The demo's card gateway: an HTTP server of its own on 127.0.0.1, which
// the payments reach over the network through idemhttp.Transport, as a
// service reaches its payment provider.

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// headerGatewayMode tells the demo's gateway how to misbehave for one
// request. It is not part of the payment's fingerprint.
const headerGatewayMode = "X-Demo-Gateway"

// Gateway modes, sent with every attempt of a charge.
const (
	// modeTimeoutAfterCharge: the gateway charges, then never answers
	// (nor answers any retry of the charge).
	modeTimeoutAfterCharge = "timeout-after-charge"
	// modeReplyLost: the gateway charges, then its answer to the first
	// attempt is lost with the connection; a retry gets it.
	modeReplyLost = "reply-lost"
	// modeUnavailable: the gateway refuses the request (503) and charges
	// nothing.
	modeUnavailable = "unavailable"
)

// declineAboveCents is the amount above which the gateway declines a card.
const declineAboveCents = 1_000_000

// gatewayKeyTTL is how long the gateway remembers an idempotency key, as
// Stripe does: a key sent again within it gets the first answer back.
const gatewayKeyTTL = 24 * time.Hour

// gateway is the demo's card gateway. Like providers that take an
// idempotency key (Stripe, and the IETF draft), POST /v1/charges requires
// an Idempotency-Key, runs once per key, and remembers the key with a hash
// of the request and the answer for gatewayKeyTTL: a retry with the same
// key and body gets the same answer with Idempotent-Replayed: true; the
// same key with another body gets 422; a retry while the first still runs
// gets 409 with Retry-After. A refusal before anything ran (503) is not
// remembered. A card over declineAboveCents is declined (402), and the
// decline is remembered like a charge.
type gateway struct {
	mu       sync.Mutex
	keys     map[string]*gatewayKey // by idempotency key
	charges  []gatewayCharge        // in the order they were made
	byKey    map[string]int         // the index of the latest charge of a key
	requests map[string]int         // by idempotency key
	now      func() time.Time

	start sync.Once // of the listener, on first use
	url   string
	err   error
	srv   *http.Server
}

// gatewayKey is what the gateway remembers of a key.
type gatewayKey struct {
	fingerprint [sha256.Size]byte
	at          time.Time
	done        bool
	status      int
	body        []byte
}

type gatewayCharge struct {
	ID          string `json:"chargeId"`
	Key         string `json:"key"`
	CustomerID  string `json:"customerId"`
	AmountCents int64  `json:"amountCents"`
	Currency    string `json:"currency"`
	Requests    int    `json:"requests"`
}

// newGateway returns a gateway; it starts listening on first use.
func newGateway() *gateway {
	return &gateway{keys: map[string]*gatewayKey{}, byKey: map[string]int{}, requests: map[string]int{}, now: time.Now}
}

// baseURL returns the gateway's URL, starting its server on 127.0.0.1 the
// first time.
func (g *gateway) baseURL() (string, error) {
	g.start.Do(func() {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			g.err = fmt.Errorf("gateway: listen: %w", err)
			return
		}
		g.srv = &http.Server{Handler: g, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = g.srv.Serve(ln) }()
		g.url = "http://" + ln.Addr().String()
	})
	return g.url, g.err
}

// close stops the gateway's server, if it started.
func (g *gateway) close() {
	g.start.Do(func() {}) // not started: never will be
	if g.srv != nil {
		_ = g.srv.Close()
	}
}

// ServeHTTP serves POST /v1/charges.
func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/charges" {
		gatewayError(w, http.StatusNotFound, "no such route")
		return
	}
	key, err := idemhttp.ParseKey(r.Header)
	if err == nil {
		err = idem.ValidateKey(key)
	}
	if err != nil {
		gatewayError(w, http.StatusBadRequest, "send one valid Idempotency-Key")
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	var p paymentRequest
	if err == nil {
		err = json.Unmarshal(body, &p)
	}
	if err != nil {
		gatewayError(w, http.StatusBadRequest, "the body must be a charge")
		return
	}
	mode := r.Header.Get(headerGatewayMode)

	fate, k, attempt := g.claim(key, sha256.Sum256(body), mode)
	switch fate {
	case refused:
		gatewayError(w, http.StatusServiceUnavailable, "unavailable; nothing was charged")
		return
	case reused:
		gatewayError(w, http.StatusUnprocessableEntity, "this Idempotency-Key was used for another request")
		return
	case running:
		w.Header().Set("Retry-After", "1")
		gatewayError(w, http.StatusConflict, "a request with this Idempotency-Key is in progress")
		return
	case replay:
		w.Header().Set(idemhttp.HeaderReplayed, "true")
	case execute:
		g.execute(key, k, p)
	}

	switch {
	case mode == modeTimeoutAfterCharge:
		<-r.Context().Done() // never answers
		return
	case mode == modeReplyLost && attempt == 1:
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close() // the answer is lost with the connection
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(k.body)))
	w.WriteHeader(k.status)
	_, _ = w.Write(k.body)
}

// The fates of a request, as claim decides them.
const (
	execute = iota // a new key, claimed: run it
	replay         // the key's answer is there: send it again
	running        // the key's first request still runs
	reused         // the key holds another request
	refused        // the gateway refuses (modeUnavailable), remembering nothing
)

// claim counts a request with key and decides its fate; k is the key's
// record (new for execute), attempt the request's number among the key's.
func (g *gateway) claim(key string, fp [sha256.Size]byte, mode string) (fate int, k *gatewayKey, attempt int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.requests[key]++
	attempt = g.requests[key]
	k = g.keys[key]
	if k != nil && g.now().Sub(k.at) > gatewayKeyTTL {
		k = nil // forgotten: a new request
	}
	switch {
	case k != nil && k.fingerprint != fp:
		return reused, nil, attempt
	case k != nil && !k.done:
		return running, k, attempt
	case k != nil:
		return replay, k, attempt
	case mode == modeUnavailable:
		return refused, nil, attempt
	}
	k = &gatewayKey{fingerprint: fp, at: g.now()}
	g.keys[key] = k
	return execute, k, attempt
}

// execute charges p (or declines it) under key and records the answer in k.
func (g *gateway) execute(key string, k *gatewayKey, p paymentRequest) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if p.AmountCents > declineAboveCents {
		k.status, k.body = http.StatusPaymentRequired, []byte(`{"error":"card_declined"}`)
	} else {
		c := gatewayCharge{ID: fmt.Sprintf("ch_%d", len(g.charges)+1), Key: key,
			CustomerID: p.CustomerID, AmountCents: p.AmountCents, Currency: p.Currency}
		g.byKey[key] = len(g.charges)
		g.charges = append(g.charges, c)
		k.status = http.StatusCreated
		k.body, _ = json.Marshal(c)
	}
	k.done = true
}

// gatewayError writes the gateway's error answer.
func gatewayError(w http.ResponseWriter, status int, msg string) {
	body, _ := json.Marshal(map[string]string{"error": msg})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// lookup returns the charge made under key, as an operator finds it in the
// gateway's dashboard.
func (g *gateway) lookup(key string) (gatewayCharge, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	i, ok := g.byKey[key]
	if !ok {
		return gatewayCharge{}, false
	}
	c := g.charges[i]
	c.Requests = g.requests[key]
	return c, true
}

// list returns every charge, oldest first.
func (g *gateway) list() []gatewayCharge {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]gatewayCharge, len(g.charges))
	for i, c := range g.charges {
		c.Requests = g.requests[c.Key]
		out[i] = c
	}
	return out
}
