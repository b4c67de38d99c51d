package idemhttp

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/callretry"
)

// MaxBufferedBody is the largest request body, in bytes, that Transport
// buffers so that it can send it again, when the request has no GetBody. A
// longer body without GetBody is sent once, without retries.
// (http.NewRequest sets GetBody for a *bytes.Buffer, *bytes.Reader or
// *strings.Reader body; those are never buffered.)
const MaxBufferedBody = 1 << 20

// Transport is an http.RoundTripper for calls to services that deduplicate
// by Idempotency-Key (idemhttp's Middleware, Stripe and the IETF draft's
// other followers). It sends a request with a key and retries it, with the
// same key, while another attempt may succeed, so that a lost reply or a
// receiver's transient failure costs a retry and never a second execution.
//
//	client := &http.Client{Transport: &idemhttp.Transport{}} // no Timeout: it would hide the CallError
//	ctx, cancel := context.WithTimeout(idem.WithCallKey(ctx, r.CallKey("charge")), 20*time.Second) // r from idem.Reserve
//	defer cancel()
//	req, _ := http.NewRequestWithContext(ctx, "POST", gatewayURL, bytes.NewReader(body))
//	resp, err := client.Do(req) // errors.Is(err, idem.ErrOutcomeUnknown): it may have been charged
//
// Every attempt of one RoundTrip carries the same Idempotency-Key: the
// request's own header; else the context's call key (idem.WithCallKey);
// else, for POST and PATCH, a key minted once (idem.NewCallKey). A key that
// idem.ValidateKey refuses (such as the empty key Reservation.CallKey
// returns for an invalid step), or a Policy with a negative field, is
// refused before anything is sent (idem.ErrInvalidKey,
// idem.ErrInvalidArgument).
//
// Within Policy, an attempt is retried after no answer (a connection that
// failed, broke or timed out), a 5xx other than 501, a 429, or a 409 with
// Retry-After (the receiver's "in progress"); any other answer (2xx, 3xx,
// 422, 400, other 4xx, a 409 without Retry-After) is returned at once. Only
// a request with a key or an idempotent method is retried. When the
// retries run out on an answer, that answer is returned. When they run out
// without one, or the context ends, after an attempt that may have reached
// the receiver, the error is an *idem.CallError: errors.Is(err, idem.ErrOutcomeUnknown) is
// true and its Key field holds the key; keep the operation pending with
// that key and retry or reconcile it later, never with a new key. An error
// that is not a CallError means nothing reached the receiver.
//
// Bound the whole call with the request's context, not with
// http.Client.Timeout (which can hide the CallError), and one attempt with
// Base's timeouts. Transport never changes the caller's request. A
// Transport is safe for concurrent use. docs/calling.md has the full story:
// Retry-After and backoff, bodies without GetBody (MaxBufferedBody), how an
// attempt that never reached the receiver is told apart.
type Transport struct {
	// Base sends each attempt. Default http.DefaultTransport.
	Base http.RoundTripper
	// Policy bounds the retries (see idem.RetryPolicy). Zero fields mean
	// their defaults.
	Policy idem.RetryPolicy
}

// Replayed reports whether resp is a replay of a stored response: its
// Idempotent-Replayed header is "true" (idemhttp's Middleware and Stripe
// set it on the answer to a retry of a request they already processed).
func Replayed(resp *http.Response) bool {
	return resp != nil && strings.EqualFold(strings.TrimSpace(resp.Header.Get(HeaderReplayed)), "true")
}

// discardLimit is how much of a retried answer's body is read before it is
// closed, so that its connection can be used again.
const discardLimit = 4 << 10

// RoundTrip sends req, and again with the same key while another attempt
// may succeed (see Transport). It closes req's body, also on errors.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	b := &attempts{req: req, base: t.Base}
	if b.base == nil {
		b.base = http.DefaultTransport
	}
	policy, key, err := b.prepare(t.Policy)
	if err != nil {
		b.closeBody()
		return nil, err
	}
	resp, err := callretry.Run(req.Context(), policy, key, b.send, b.judge, discard)
	if b.sent == 0 {
		b.closeBody()
	}
	return resp, err
}

// attempts are the attempts of one RoundTrip.
type attempts struct {
	req     *http.Request
	base    http.RoundTripper
	header  string                        // the key to set on each attempt, "" to send the header as it is
	body    io.ReadCloser                 // the first attempt's body
	getBody func() (io.ReadCloser, error) // the next attempts' bodies
	length  int64                         // the body's length, when it was buffered
	closed  bool                          // the request's body, once buffered
	sent    int
	conn    *callretry.Conn // the last attempt's connection, as its client trace saw it
}

// prepare checks the policy and the key and makes the body re-readable. It
// returns the policy of this RoundTrip and its key.
func (b *attempts) prepare(p idem.RetryPolicy) (callretry.Policy, string, error) {
	policy, err := callretry.New(p)
	if err != nil {
		return policy, "", err
	}
	key, err := callretry.Own(b.req.Header.Values(HeaderKey), HeaderKey+" header")
	if err != nil {
		return policy, "", err
	}
	if key == "" {
		mint := b.req.Method == http.MethodPost || b.req.Method == http.MethodPatch
		if key, err = callretry.Key(b.req.Context(), mint); err != nil {
			return policy, "", err
		}
		b.header = key
	}
	if key == "" && !idempotent(b.req.Method) {
		policy = policy.Once()
	}
	b.body, b.getBody, b.length = b.req.Body, b.req.GetBody, b.req.ContentLength
	if b.body == nil || b.body == http.NoBody || b.getBody != nil {
		return policy, key, nil
	}
	// No GetBody: buffer the body to send it again, up to MaxBufferedBody.
	buf, err := io.ReadAll(io.LimitReader(b.body, MaxBufferedBody+1))
	if err != nil {
		return policy, "", fmt.Errorf("idemhttp: read the request body: %w", err)
	}
	if len(buf) > MaxBufferedBody {
		b.body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), b.body), b.body}
		return policy.Once(), key, nil
	}
	b.closeBody()
	b.closed = true
	b.body = io.NopCloser(bytes.NewReader(buf))
	b.getBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf)), nil }
	b.length = int64(len(buf))
	return policy, key, nil
}

// closeBody closes the request's body, as a RoundTripper must.
func (b *attempts) closeBody() {
	if b.req.Body != nil && !b.closed {
		_ = b.req.Body.Close()
	}
}

// errBody marks a body that GetBody could not give again: not retried.
type errBody struct{ err error }

func (e *errBody) Error() string { return "idemhttp: get the request body again: " + e.err.Error() }
func (e *errBody) Unwrap() error { return e.err }

// send makes one attempt.
func (b *attempts) send() (*http.Response, error) {
	b.sent++
	body := b.body
	if b.sent > 1 {
		var err error
		if body, err = b.getBody(); err != nil {
			return nil, &errBody{err}
		}
	}
	ctx, conn := callretry.TraceConn(b.req.Context())
	b.conn = conn
	r := b.req.Clone(ctx)
	r.Body, r.GetBody, r.ContentLength = body, b.getBody, b.length
	if b.header != "" {
		if r.Header == nil {
			r.Header = http.Header{}
		}
		r.Header.Set(HeaderKey, b.header)
	}
	resp, err := b.base.RoundTrip(r)
	if err == nil && resp == nil {
		err = errors.New("idemhttp: Base returned neither a response nor an error")
	}
	return resp, err
}

// judge says what the last attempt's outcome means (see Transport).
func (b *attempts) judge(resp *http.Response, err error) callretry.Verdict {
	var bodyErr *errBody
	switch {
	case errors.As(err, &bodyErr):
		return callretry.Verdict{}
	case err != nil:
		return callretry.Network(err, b.conn)
	}
	v := callretry.Verdict{Answered: true}
	v.After, v.HasAfter = retryAfter(resp.Header.Get("Retry-After"))
	switch code := resp.StatusCode; {
	case code >= 500 && code != http.StatusNotImplemented:
		v.Retry, v.MaybeDone = true, true
	case code == http.StatusTooManyRequests:
		v.Retry = true
	case code == http.StatusConflict && v.HasAfter: // in progress; without a Retry-After it can read, another conflict
		v.Retry, v.MaybeDone = true, true
	}
	return v
}

// discard reads a little of a retried answer's body and closes it.
func discard(resp *http.Response) {
	_, _ = io.CopyN(io.Discard, resp.Body, discardLimit)
	_ = resp.Body.Close()
}

// retryAfter reads a Retry-After value: a number of seconds or an HTTP
// date (RFC 9110 section 10.2.3). A date in the past is a zero wait; a
// number of seconds too large for a time.Duration (or a uint64) is the
// longest wait, which Policy.MaxDelay caps. It reports false for no value
// and for one it cannot read.
func retryAfter(v string) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	secs, err := strconv.ParseUint(v, 10, 64)
	if err == nil || errors.Is(err, strconv.ErrRange) {
		if err != nil || secs > math.MaxInt64/uint64(time.Second) {
			return math.MaxInt64, true
		}
		return time.Duration(secs) * time.Second, true
	}
	if at, err := http.ParseTime(v); err == nil {
		return max(time.Until(at), 0), true
	}
	return 0, false
}

// idempotent reports whether method is idempotent (RFC 9110 section 9.2.2).
func idempotent(method string) bool {
	switch method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete:
		return true
	}
	return false
}
