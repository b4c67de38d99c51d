// Package httprelay is an HTTP/1.1 proxy for tests that loses what a real
// network loses. It forwards each request to a server on 127.0.0.1 and, as
// its rule says for that request, closes the client's connection before
// forwarding it (the server never sees it), drops the reply after the
// server answered (the server acted; the client sees its connection close
// without an answer), or delays the reply. It records every request it
// received. (Package relay does the same for PostgreSQL's protocol.)
package httprelay

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// Fault is what the relay does to one request.
type Fault int

// The faults.
const (
	// Forward forwards the request and passes the reply on.
	Forward Fault = iota
	// CloseBefore closes the client's connection without forwarding the
	// request.
	CloseBefore
	// DropReply forwards the request, waits for the server's whole reply,
	// and closes the client's connection without sending any of it.
	DropReply
)

// Action is the rule's decision for one request.
type Action struct {
	Fault Fault
	// Delay is how long the relay holds the server's reply before it
	// passes it on (or drops it); it ends early if the client hangs up.
	Delay time.Duration
}

// Rule decides the fate of a request; attempt is 1 for the first request
// the relay received with its Idempotency-Key header value (requests
// without one count together), 2 for the next, and so on.
type Rule func(r *http.Request, attempt int) Action

// Request is a request the relay received.
type Request struct {
	Method, Path string
	Header       http.Header
	Action       Action
	Attempt      int
}

// Relay is a running relay.
type Relay struct {
	// URL is the relay's base URL, http://127.0.0.1:port, which stands in
	// for the target's.
	URL string

	target   string
	rule     Rule
	client   *http.Client
	mu       sync.Mutex
	requests []Request
	attempts map[string]int
}

// New starts a relay in front of target (a base URL such as an
// httptest.Server's) with rule (nil: forward everything). It stops when
// the test ends.
func New(tb testing.TB, target string, rule Rule) *Relay {
	tb.Helper()
	if rule == nil {
		rule = func(*http.Request, int) Action { return Action{} }
	}
	transport := &http.Transport{}
	r := &Relay{
		target:   target,
		rule:     rule,
		client:   &http.Client{Transport: transport, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		attempts: map[string]int{},
	}
	srv := httptest.NewServer(http.HandlerFunc(r.serve))
	tb.Cleanup(func() {
		srv.Close()
		transport.CloseIdleConnections()
	})
	r.URL = srv.URL
	return r
}

// Requests returns the requests received so far, in order.
func (r *Relay) Requests() []Request {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Request(nil), r.requests...)
}

// Keys returns the Idempotency-Key values of the requests received so far,
// in order ("" for a request without one).
func (r *Relay) Keys() []string {
	var keys []string
	for _, req := range r.Requests() {
		keys = append(keys, req.Header.Get("Idempotency-Key"))
	}
	return keys
}

func (r *Relay) serve(w http.ResponseWriter, req *http.Request) {
	key := req.Header.Get("Idempotency-Key")
	r.mu.Lock()
	r.attempts[key]++
	attempt := r.attempts[key]
	r.mu.Unlock()
	act := r.rule(req, attempt)
	r.mu.Lock()
	r.requests = append(r.requests, Request{Method: req.Method, Path: req.URL.Path, Header: req.Header.Clone(), Action: act, Attempt: attempt})
	r.mu.Unlock()

	body, err := io.ReadAll(req.Body)
	if err != nil {
		return // the client went away
	}
	if act.Fault == CloseBefore {
		hangUp(w)
		return
	}
	out, err := http.NewRequestWithContext(context.WithoutCancel(req.Context()), req.Method, r.target+req.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	out.Header = req.Header.Clone()
	out.Header.Del("Connection")
	resp, err := r.client.Do(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	reply, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	if act.Delay > 0 {
		t := time.NewTimer(act.Delay)
		select {
		case <-t.C:
		case <-req.Context().Done():
			t.Stop()
		}
	}
	if act.Fault == DropReply {
		hangUp(w)
		return
	}
	for name, values := range resp.Header {
		w.Header()[name] = values
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(reply)
}

// hangUp closes the client's connection without an answer.
func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic("httprelay: hijack: " + err.Error())
	}
	_ = conn.Close()
}
