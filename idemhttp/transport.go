package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/callretry"
	"github.com/pgidem/idem/internal/keyhdr"
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
// failed, broke or timed out, or no answer's headers within
// Policy.AttemptTimeout), a 5xx other than 501, a 429, or a 409 (the
// receiver's "in progress", with or without Retry-After, as the IETF draft
// and Stripe send it). A 409 does not count toward Policy.MaxAttempts
// (unless it is 1): the call waits the other request out, within
// Policy.MaxElapsed and the context. A 409 whose problem body's code is
// IDEMPOTENCY_OUTCOME_UNKNOWN (idemhttp's), and every 409 when
// NoConflictRetry is set, is returned at once. On a 4xx or 5xx,
// Stripe-Should-Retry: true retries and false stops at once. Any other
// answer (2xx, 3xx, 422, 400, other 4xx) is returned at once. Only a
// request with a key or an idempotent method is retried.
//
// When the retries run out on an answer, that answer is returned (a final
// 409 too: the request may still be running). When they run out without
// one, or the context ends, after an attempt that may have reached the
// receiver, the error is an *idem.CallError: errors.Is(err,
// idem.ErrOutcomeUnknown) is true and its Key field holds the key; keep the
// operation pending with that key and retry or reconcile it later, never
// with a new key. When no attempt reached the receiver (refused, no name,
// a refused certificate, the context ended before a connection was made),
// the error matches idem.ErrNotSent, never ErrOutcomeUnknown.
//
// Bound each attempt with Policy.AttemptTimeout and the whole call with
// the request's context or NewClient, not with http.Client.Timeout (which
// can hide the CallError). Transport never changes the caller's request:
// each attempt sends a clone, which BeforeAttempt may change (all but its
// key). A Transport is safe for concurrent use. docs/calling.md has the
// full story: Retry-After and backoff, bodies without GetBody
// (MaxBufferedBody), how an attempt that never reached the receiver is told
// apart.
type Transport struct {
	// Base sends each attempt. Default http.DefaultTransport.
	Base http.RoundTripper
	// Policy bounds the retries and each attempt (see idem.RetryPolicy).
	// Zero fields mean their defaults.
	Policy idem.RetryPolicy
	// BeforeAttempt, when set, is called before each attempt (attempt
	// counts from 1) with the request that attempt sends, a clone of the
	// caller's, to refresh its headers: a new signature and timestamp, a
	// fresh token. It cannot change the key: the Idempotency-Key header is
	// set back after it returns. An error stops the call before that
	// attempt is sent; RoundTrip returns it (wrapped in an *idem.CallError
	// when an earlier attempt may have reached the receiver, else matching
	// idem.ErrNotSent).
	BeforeAttempt func(req *http.Request, attempt int) error
	// NoConflictRetry turns off the retries of 409 Conflict: every 409 is
	// returned at once, as a plain answer.
	NoConflictRetry bool
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
	b := &attempts{req: req, base: t.Base, before: t.BeforeAttempt, noConflict: t.NoConflictRetry}
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

	keyValues  []string // the request's own Idempotency-Key entries, when header is ""
	timeout    time.Duration
	before     func(*http.Request, int) error
	noConflict bool
}

// prepare checks the policy and the key and makes the body re-readable. It
// returns the policy of this RoundTrip and its key.
func (b *attempts) prepare(p idem.RetryPolicy) (callretry.Policy, string, error) {
	policy, err := callretry.New(p)
	if err != nil {
		return policy, "", err
	}
	b.timeout = policy.AttemptTimeout()
	b.keyValues = b.req.Header.Values(HeaderKey)
	key, err := callretry.Own(b.keyValues, HeaderKey+" header")
	if err != nil {
		return policy, "", err
	}
	if key == "" {
		mint := b.req.Method == http.MethodPost || b.req.Method == http.MethodPatch
		if key, err = callretry.Key(b.req.Context(), mint); err != nil {
			return policy, "", err
		}
		b.header = keyhdr.Format(key) // a key that is not a bare key goes as an RFC 8941 string
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

// errBefore marks an error of BeforeAttempt: not sent, not retried.
type errBefore struct {
	attempt int
	err     error
}

func (e *errBefore) Error() string {
	return fmt.Sprintf("idemhttp: BeforeAttempt refused attempt %d: %v", e.attempt, e.err)
}
func (e *errBefore) Unwrap() error { return e.err }

// headerError is the error of a request whose header net/http would
// refuse to send: not sent, not retried.
type headerError struct {
	name string
	why  string
}

func (e *headerError) Error() string {
	return fmt.Sprintf("%v: idemhttp: the request's header %q %s; nothing was sent", idem.ErrInvalidArgument, e.name, e.why)
}
func (e *headerError) Unwrap() error { return idem.ErrInvalidArgument }

// checkHeader refuses a header that net/http would refuse to send, so
// that the call ends as not sent instead of as an attempt whose outcome is
// unknown.
func checkHeader(h http.Header) error {
	if name, why := headerProblem(h); name != "" || why != "" {
		return &headerError{name, why}
	}
	return nil
}

// headerProblem finds in h what no HTTP request can carry (RFC 9110
// sections 5.1 and 5.5; net/http's own test): a name that is not a token,
// or a value holding a control character other than tab. It returns the
// header's name and what is wrong with it (never its value), or "", "".
func headerProblem(h map[string][]string) (name, why string) {
	for name, values := range h {
		if name == "" || strings.ContainsFunc(name, func(r rune) bool {
			return r <= ' ' || r >= 0x7f || strings.ContainsRune(`"(),/:;<=>?@[\]{}`, r)
		}) {
			return name, "is not a valid header name"
		}
		for _, v := range values {
			if strings.ContainsFunc(v, func(r rune) bool { return (r < ' ' && r != '\t') || r == 0x7f }) {
				return name, "holds a control character in its value"
			}
		}
	}
	return "", ""
}

// attemptTimeoutError is the error of an attempt cut at
// Policy.AttemptTimeout.
type attemptTimeoutError struct {
	timeout time.Duration
	err     error
}

func (e *attemptTimeoutError) Error() string {
	return fmt.Sprintf("idemhttp: no answer within RetryPolicy.AttemptTimeout (%s): %v", e.timeout, e.err)
}
func (e *attemptTimeoutError) Unwrap() error { return e.err }
func (e *attemptTimeoutError) Timeout() bool { return true }

// cancelBody releases an attempt's context when its answer's body is closed.
type cancelBody struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c *cancelBody) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// send makes one attempt.
func (b *attempts) send() (*http.Response, error) {
	b.sent++
	body := b.body
	if b.sent > 1 && b.getBody != nil { // none: a request without a body
		var err error
		if body, err = b.getBody(); err != nil {
			return nil, &errBody{err}
		}
	}
	ctx, conn := callretry.TraceConn(b.req.Context())
	b.conn = conn
	ctx, cancel := context.WithCancel(ctx)
	r := b.req.Clone(ctx)
	r.Body, r.GetBody, r.ContentLength = body, b.getBody, b.length
	if r.Header == nil {
		r.Header = http.Header{}
	}
	b.setKey(r)
	if b.before != nil {
		if err := b.before(r, b.sent); err != nil {
			cancel()
			if body != nil {
				_ = body.Close()
			}
			return nil, &errBefore{b.sent, err}
		}
		b.setKey(r) // set back: BeforeAttempt cannot change the key
	}
	if err := checkHeader(r.Header); err != nil {
		cancel()
		if body != nil {
			_ = body.Close()
		}
		return nil, err
	}
	var timer *time.Timer
	var timedOut atomic.Bool
	if b.timeout > 0 {
		timer = time.AfterFunc(b.timeout, func() { timedOut.Store(true); cancel() })
	}
	resp, err := b.base.RoundTrip(r)
	if err == nil && resp == nil {
		err = errors.New("idemhttp: Base returned neither a response nor an error")
	}
	if timer != nil && !timer.Stop() && err == nil {
		// The bound passed as the answer came: its body cannot be read.
		_ = resp.Body.Close()
		resp, err = nil, context.Canceled
	}
	if err != nil {
		cancel()
		if timedOut.Load() && b.req.Context().Err() == nil {
			err = &attemptTimeoutError{b.timeout, err}
		}
		return nil, err
	}
	resp.Body = &cancelBody{resp.Body, cancel}
	return resp, nil
}

// setKey sets r's Idempotency-Key header to the call's key.
func (b *attempts) setKey(r *http.Request) {
	switch {
	case b.header != "":
		r.Header.Set(HeaderKey, b.header)
	case len(b.keyValues) > 0:
		r.Header[HeaderKey] = b.keyValues
	default:
		r.Header.Del(HeaderKey)
	}
}

// judge says what the last attempt's outcome means (see Transport).
func (b *attempts) judge(resp *http.Response, err error) callretry.Verdict {
	var bodyErr *errBody
	var beforeErr *errBefore
	var headerErr *headerError
	switch {
	case errors.As(err, &bodyErr), errors.As(err, &beforeErr), errors.As(err, &headerErr):
		return callretry.Verdict{}
	case err != nil:
		return callretry.Network(err, b.conn)
	}
	v := callretry.Verdict{Answered: true}
	v.After, v.HasAfter = retryAfter(resp.Header.Get("Retry-After"))
	code := resp.StatusCode
	switch {
	case code >= 500 && code != http.StatusNotImplemented:
		v.Retry, v.MaybeDone = true, true
	case code == http.StatusTooManyRequests:
		v.Retry = true
	case code == http.StatusConflict:
		if b.noConflict || outcomeUnknown(resp) {
			return v
		}
		v.Retry, v.MaybeDone, v.InProgress = true, true, true
	}
	if code >= 400 {
		switch strings.ToLower(strings.TrimSpace(resp.Header.Get(HeaderStripeShouldRetry))) {
		case "false":
			v.Retry = false
		case "true":
			v.Retry = true
			v.MaybeDone = v.MaybeDone || code >= 500
		}
	}
	return v
}

// HeaderStripeShouldRetry is Stripe's answer header that says whether a
// retry may succeed ("true") or not ("false"); Transport obeys it.
const HeaderStripeShouldRetry = "Stripe-Should-Retry"

// outcomeUnknown reports whether resp, a 409, is idemhttp's
// IDEMPOTENCY_OUTCOME_UNKNOWN problem: the first few KiB of its body are
// read, and put back.
func outcomeUnknown(resp *http.Response) bool {
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), ContentTypeProblem) || resp.Body == nil {
		return false
	}
	head, err := io.ReadAll(io.LimitReader(resp.Body, discardLimit))
	resp.Body = &struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(head), resp.Body), resp.Body}
	return err == nil && bytes.Contains(head, []byte(`"`+CodeOutcomeUnknown+`"`))
}

// NewClient returns an http.Client that sends through t (a Transport with
// its zero value when nil) and bounds every call, retries and the answer's
// body included, by timeout: the request's context gets that deadline
// (its own, when earlier, stays). Unlike http.Client.Timeout, whose error
// can replace the Transport's, its errors keep the *idem.CallError
// (idem.ErrOutcomeUnknown) and idem.ErrNotSent. timeout <= 0 means no
// bound but the request's context. Bound each attempt with
// t.Policy.AttemptTimeout.
//
//	client := idemhttp.NewClient(&idemhttp.Transport{Policy: idem.RetryPolicy{AttemptTimeout: 5 * time.Second}}, 30*time.Second)
func NewClient(t *Transport, timeout time.Duration) *http.Client {
	if t == nil {
		t = &Transport{}
	}
	return &http.Client{Transport: &boundTransport{t, timeout}}
}

// boundTransport is NewClient's RoundTripper.
type boundTransport struct {
	t       *Transport
	timeout time.Duration
}

func (b *boundTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if b.timeout <= 0 {
		return b.t.RoundTrip(req)
	}
	ctx, cancel := context.WithTimeout(req.Context(), b.timeout)
	resp, err := b.t.RoundTrip(req.WithContext(ctx))
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = &cancelBody{resp.Body, cancel}
	return resp, nil
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
