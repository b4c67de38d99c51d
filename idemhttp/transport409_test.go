package idemhttp_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// NoConflictRetry returns a 409 at once; Stripe-Should-Retry: false stops
// a 503 at once, true retries a 400; BeforeAttempt sees each attempt
// (1-based), refreshes a header, and cannot change the key; its error
// stops the call (ErrNotSent before anything was sent).
func TestTransportConflictStripeBeforeAttempt(t *testing.T) {
	t.Parallel()
	var n atomic.Int64
	var keys, sigs []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := n.Add(1)
		keys = append(keys, r.Header.Get(idemhttp.HeaderKey))
		sigs = append(sigs, r.Header.Get("Signature"))
		switch r.URL.Path {
		case "/conflict":
			w.WriteHeader(http.StatusConflict)
		case "/stripe-false":
			w.Header().Set(idemhttp.HeaderStripeShouldRetry, "false")
			w.WriteHeader(http.StatusServiceUnavailable)
		case "/stripe-true":
			if i == 1 {
				w.Header().Set(idemhttp.HeaderStripeShouldRetry, "true")
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			w.WriteHeader(http.StatusCreated)
		}
	}))
	defer srv.Close()
	do := func(tr *idemhttp.Transport, path string) (*http.Response, error) {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+path, strings.NewReader("x"))
		req.Header.Set(idemhttp.HeaderKey, "key-1")
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return resp, err
	}
	policy := idem.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: time.Millisecond}
	for _, c := range []struct {
		path     string
		tr       *idemhttp.Transport
		status   int
		attempts int64
	}{
		{"/conflict", &idemhttp.Transport{Policy: policy, NoConflictRetry: true}, 409, 1},
		{"/stripe-false", &idemhttp.Transport{Policy: policy}, 503, 1},
		{"/stripe-true", &idemhttp.Transport{Policy: policy, BeforeAttempt: func(r *http.Request, attempt int) error {
			r.Header.Set("Signature", "sig-"+string(rune('0'+attempt)))
			r.Header.Set(idemhttp.HeaderKey, "changed")
			return nil
		}}, 201, 2},
	} {
		n.Store(0)
		keys, sigs = nil, nil
		resp, err := do(c.tr, c.path)
		if err != nil || resp.StatusCode != c.status || n.Load() != c.attempts {
			t.Errorf("%s: %v %v after %d attempts, want %d after %d", c.path, resp, err, n.Load(), c.status, c.attempts)
		}
		for _, k := range keys {
			if k != "key-1" {
				t.Errorf("%s: key %q sent", c.path, k)
			}
		}
	}
	if len(sigs) != 2 || sigs[0] != "sig-1" || sigs[1] != "sig-2" {
		t.Errorf("BeforeAttempt's headers: %q", sigs)
	}
	n.Store(0)
	refuse := errors.New("no signing key")
	_, err := do(&idemhttp.Transport{Policy: policy, BeforeAttempt: func(*http.Request, int) error { return refuse }}, "/conflict")
	if !errors.Is(err, refuse) || !errors.Is(err, idem.ErrNotSent) || n.Load() != 0 {
		t.Errorf("BeforeAttempt's error: %v after %d attempts", err, n.Load())
	}
}

// An attempt cut at AttemptTimeout after it was sent, as the last one, is
// a CallError (ErrOutcomeUnknown), and NewClient keeps it. Both attempts
// reach the server, with the call's key; the test waits for the server to
// get them rather than counting them when the call returns, since a loaded
// machine may run the server's handler only after the client gave up on
// it (the client rightly counts such an attempt as may-have-happened).
// AttemptTimeout is far above the time it takes to send an attempt, so
// that each is sent before it is cut.
func TestTransportAttemptTimeout(t *testing.T) {
	t.Parallel()
	arrived := make(chan string, 3) // the key of each request the server got
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- r.Header.Get(idemhttp.HeaderKey)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	client := idemhttp.NewClient(&idemhttp.Transport{Policy: idem.RetryPolicy{
		MaxAttempts: 2, BaseDelay: time.Millisecond, AttemptTimeout: time.Second,
	}}, time.Minute)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("x"))
	_, err := client.Do(req)
	var ce *idem.CallError
	if !errors.As(err, &ce) || ce.Attempts != 2 || ce.Key == "" || errors.Is(err, idem.ErrNotSent) {
		t.Fatalf("%v", err)
	}
	for i := range 2 {
		select {
		case key := <-arrived:
			if key != ce.Key {
				t.Fatalf("attempt %d's key %q, the call's %q", i+1, key, ce.Key)
			}
		case <-time.After(time.Minute):
			t.Fatalf("the server got %d of the 2 attempts", i)
		}
	}
}

// A 409 in progress that asks for no wait (Retry-After: 0, or a date
// already past by the caller's clock: skew) is waited out with the
// backoff (its wait: internal/callretry's TestWait), not taken as a wait of
// nothing: 409s do not count toward MaxAttempts, so it used to make
// thousands of requests a second until MaxElapsed. Here the call goes on
// past MaxAttempts until the receiver answers.
func TestTransportConflictRetryAfterNoWait(t *testing.T) {
	t.Parallel()
	for name, after := range map[string]func() string{
		"zero":      func() string { return "0" },
		"past date": func() string { return time.Now().Add(-2 * time.Second).UTC().Format(http.TimeFormat) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var n atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if n.Add(1) <= 5 {
					w.Header().Set("Retry-After", after())
					w.WriteHeader(http.StatusConflict)
					return
				}
				w.WriteHeader(http.StatusCreated)
			}))
			defer srv.Close()
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("{}"))
			if err != nil {
				t.Fatal(err)
			}
			resp, err := (&http.Client{Transport: &idemhttp.Transport{}}).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if got := n.Load(); resp.StatusCode != http.StatusCreated || got != 6 {
				t.Fatalf("%d after %d attempts, want 201 after 6", resp.StatusCode, got)
			}
		})
	}
}
