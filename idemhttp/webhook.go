package idemhttp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"

	"github.com/pgidem/idem"
)

// The headers of Standard Webhooks (standardwebhooks.com) that
// WebhookSender sends and WebhookHandler verifies.
const (
	// HeaderWebhookID carries the event's ID, the same on every attempt:
	// the receiver deduplicates by it.
	HeaderWebhookID = "webhook-id"
	// HeaderWebhookTimestamp carries the attempt's time in Unix seconds,
	// fresh on every attempt and covered by the signature.
	HeaderWebhookTimestamp = "webhook-timestamp"
	// HeaderWebhookSignature carries the signatures of the attempt, one
	// "v1,<base64 HMAC-SHA256>" per secret, separated by spaces.
	HeaderWebhookSignature = "webhook-signature"
)

// secretPrefix begins every secret in Standard Webhooks' form.
const secretPrefix = "whsec_"

// ErrInvalidSecret is the error (wrapped) of a webhook secret that is not in
// Standard Webhooks' form, "whsec_" followed by the standard base64 of a
// non-empty key (whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw), or of an empty
// list of secrets. Neither side uses such a secret: WebhookSender sends
// nothing, WebhookHandler panics at construction.
var ErrInvalidSecret = errors.New("idemhttp: invalid webhook secret")

// parseSecrets returns a signer for each secret, in order. Its errors never
// hold a secret.
func parseSecrets(secrets []string) ([]*standardwebhooks.Webhook, error) {
	if len(secrets) == 0 {
		return nil, fmt.Errorf("%w: no secret", ErrInvalidSecret)
	}
	keys := make([]*standardwebhooks.Webhook, 0, len(secrets))
	for i, s := range secrets {
		if !strings.HasPrefix(s, secretPrefix) {
			return nil, fmt.Errorf("%w: secret %d does not begin with %q", ErrInvalidSecret, i, secretPrefix)
		}
		key, err := standardwebhooks.NewWebhook(s)
		if err != nil {
			return nil, fmt.Errorf("%w: secret %d is not %q and the standard base64 of a non-empty key", ErrInvalidSecret, i, secretPrefix)
		}
		keys = append(keys, key)
	}
	return keys, nil
}

// Endpoint is where WebhookSender sends the events of a destination.
type Endpoint struct {
	// URL receives each event as a POST: an absolute http or https URL.
	URL string
	// Secrets sign every attempt, each in Standard Webhooks' form
	// ("whsec_" and the standard base64 of the key). During a rotation give
	// the new secret and the old one: each attempt carries a signature for
	// each, and a receiver that knows either accepts it. At least one.
	Secrets []string
}

// Defaults of the Client that WebhookSender uses when its own is nil.
const (
	// DefaultWebhookAttemptTimeout bounds each attempt: the wait for the
	// answer's headers (idem.RetryPolicy.AttemptTimeout).
	DefaultWebhookAttemptTimeout = 15 * time.Second
	// DefaultWebhookTimeout bounds one Send, its retries and the answer
	// included (NewClient's timeout).
	DefaultWebhookTimeout = time.Minute
)

// WebhookSender is an idem.Sender that delivers each event as a Standard
// Webhook (standardwebhooks.com): a POST of the event's Payload, byte for
// byte, to the URL of its destination's Endpoint, with
//
//   - webhook-id: the event's ID, the same on every attempt and every Send
//     of the event, and Idempotency-Key: the same value (so receivers that
//     deduplicate by either recognise a redelivery);
//   - webhook-timestamp: the attempt's time in Unix seconds, fresh on every
//     attempt, also the retries inside one Send;
//   - webhook-signature: "v1,<base64 HMAC-SHA256 of id.timestamp.body>" for
//     each of the endpoint's secrets, separated by spaces;
//   - Content-Type: application/json, unless the event's Header sets one;
//   - the event's Header, which cannot replace webhook-id, Idempotency-Key,
//     webhook-timestamp or webhook-signature.
//
// Send returns nil when the endpoint answered 2xx, or 410 with idemhttp's
// IDEMPOTENCY_RESPONSE_EXPIRED problem and a 2xx stored_status (the
// receiver processed the event, then dropped its stored response after
// Config.BodyTTL). Otherwise:
//
//   - 202 with Retry-After, the document {"status":"processing"} alone and
//     a status URL as Location (idemhttp's answer to a duplicate of a
//     delivery still running, with Options.StatusURL; that run may yet
//     fail): a *WebhookError, retried after the Retry-After;
//   - 410 Gone: idem.Permanent(*WebhookError): the endpoint is gone and the
//     relay stops at once;
//   - 422 with idemhttp's IDEMPOTENCY_KEY_REUSED problem (WebhookHandler's
//     answer when it processed another body under this webhook-id):
//     permanent too, since no retry of the same id and body can succeed;
//   - any other answer (3xx, 400, 401, 403, 404, 413, every other 4xx and
//     5xx): a *WebhookError, retried on the relay's schedule. Standard
//     Webhooks counts every non-2xx as a failure, and these are the answers
//     of an endpoint being deployed or misconfigured (a route missing, a
//     secret not rotated yet), which someone fixes within the schedule;
//   - no answer: the Client's error, a *url.Error whose URL is cut to its
//     scheme and host (a webhook URL's path or query may hold a token),
//     wrapping, with the default Client, an *idem.CallError or an error
//     matching idem.ErrNotSent; retried on the schedule;
//   - an Endpoint that fails or is unusable (an invalid URL, no secret, a
//     secret not in whsec_ form): an *EndpointError, before anything is
//     sent, retried on the schedule (an Endpoint function may return
//     idem.Permanent(err) for a destination that will never exist);
//   - an event ID that is not a valid Idempotency-Key (idem.ValidateKey: 1
//     to 255 bytes of visible ASCII) or holds a "." (which Standard
//     Webhooks forbids: the signed id.timestamp.body would split another
//     way too): permanent, matching idem.ErrInvalidKey, before anything is
//     sent. idem.EventID's are UUIDs, which are neither;
//   - an event Header that no HTTP request can carry (a name that is not a
//     token, a value with a control character): permanent, matching
//     idem.ErrInvalidArgument, before anything is sent.
//
// Inside one Send, the Client's idemhttp.Transport retries what another
// attempt may fix (no answer, a cut attempt, 429, 5xx other than 501, 409
// in progress) with the same webhook-id and a new timestamp and signature
// for each attempt (Transport.BeforeAttempt). The default Client honours
// Retry-After exactly: it waits what the answer asks when that fits in its
// Policy.MaxElapsed (30 s) and the Send's deadline, and otherwise returns
// the answer at once, as a *WebhookError whose RetryAfter method reads it.
// The relay's schedule covers the longer outages. WebhookSender is safe for
// concurrent use.
type WebhookSender struct {
	// Client sends the webhooks. A Client whose Transport is an
	// idemhttp.Transport, or one of NewClient, gets a fresh timestamp and
	// signature on every attempt (they are set after the Transport's own
	// BeforeAttempt, if any); another Client sends the signature made when
	// Send began on each of its attempts. No Client follows a redirect,
	// whatever its CheckRedirect (Send uses a copy): a 3xx is a failure, as
	// Standard Webhooks says. nil means NewClient(&Transport{Policy:
	// idem.RetryPolicy{AttemptTimeout: DefaultWebhookAttemptTimeout,
	// MaxDelay: idem.DefaultRetryMaxElapsed}}, DefaultWebhookTimeout). Its
	// MaxDelay lets every Retry-After that fits in MaxElapsed be waited in
	// full: a longer one ends the Send with the answer rather than a retry
	// before its time.
	Client *http.Client
	// Endpoint returns the endpoint of a destination (idem.Event's
	// Destination); it is called on every Send, so a rotated secret or a
	// moved URL is used from the next attempt on. Required.
	Endpoint func(ctx context.Context, destination string) (Endpoint, error)
}

// EndpointError is the error of WebhookSender.Send when the endpoint of the
// event's destination could not be had or cannot be used: the Endpoint
// function failed (Err is its error; idem.IsPermanent sees through), or
// gave an invalid URL or secret (Err wraps idem.ErrInvalidArgument or
// ErrInvalidSecret). Nothing was sent.
type EndpointError struct {
	Destination string
	Err         error
}

func (e *EndpointError) Error() string {
	return fmt.Sprintf("idemhttp: endpoint of destination %q: %v", e.Destination, e.Err)
}

func (e *EndpointError) Unwrap() error { return e.Err }

// WebhookError is the error of WebhookSender.Send when the endpoint
// answered with a status other than 2xx (after the Transport's retries).
type WebhookError struct {
	// StatusCode is the answer's status.
	StatusCode int
	// Header is the answer's header.
	Header http.Header
	// Body is the beginning of the answer's body, at most 1 KiB.
	Body []byte
}

func (e *WebhookError) Error() string {
	msg := fmt.Sprintf("idemhttp: webhook endpoint answered %d %s", e.StatusCode, http.StatusText(e.StatusCode))
	if body := strings.TrimSpace(strings.ToValidUTF8(string(e.Body), "?")); body != "" {
		msg += ": " + body
	}
	return msg
}

// RetryAfter is the wait the answer asked for with Retry-After (seconds or
// an HTTP date, from now), or 0 when it asked none.
func (e *WebhookError) RetryAfter() time.Duration {
	d, _ := retryAfter(e.Header.Get("Retry-After"))
	return d
}

// webhookErrorBody bounds WebhookError.Body.
const webhookErrorBody = 1 << 10

// Send sends d's event to its destination's endpoint (see WebhookSender).
func (s WebhookSender) Send(ctx context.Context, d idem.Delivery) error {
	ev := d.Event
	if err := idem.ValidateKey(ev.ID); err != nil {
		return idem.Permanent(fmt.Errorf("idemhttp: event ID is not a valid webhook-id and Idempotency-Key: %w", err))
	}
	if strings.Contains(ev.ID, ".") {
		// The signature covers id.timestamp.body: with a "." in the id those
		// bytes also read as another id, timestamp and body (Standard
		// Webhooks: ids "not be allowed to include any '.'").
		return idem.Permanent(fmt.Errorf("%w: event ID holds a \".\", which Standard Webhooks forbids in a webhook-id: its signature would also verify a forged id, timestamp and body", idem.ErrInvalidKey))
	}
	if err := checkEventHeader(ev.Header); err != nil {
		return idem.Permanent(err)
	}
	target, keys, err := s.endpoint(ctx, ev.Destination)
	if err != nil {
		return err
	}
	sign := func(req *http.Request, _ int) error {
		return signWebhook(req.Header, keys, ev.ID, time.Now(), ev.Payload)
	}
	client, resigns := s.client(sign)

	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(ev.Payload))
	if err != nil {
		return &EndpointError{ev.Destination, fmt.Errorf("%w: %v", idem.ErrInvalidArgument, err)}
	}
	for name, values := range ev.Header {
		for _, v := range values {
			req.Header.Add(name, v)
		}
	}
	if req.Header.Get("Content-Type") == "" {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set(HeaderKey, ev.ID)
	if !resigns {
		if err := sign(req, 1); err != nil {
			return err
		}
	}

	resp, err := client.Do(req)
	if err != nil {
		return redactURL(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 200 && resp.StatusCode < 300 && resp.StatusCode != http.StatusAccepted {
		_, _ = io.CopyN(io.Discard, resp.Body, discardLimit) // so the connection is used again
		return nil
	}
	head, _ := io.ReadAll(io.LimitReader(resp.Body, discardLimit))
	werr := &WebhookError{StatusCode: resp.StatusCode, Header: resp.Header, Body: head[:min(len(head), webhookErrorBody)]}
	p := problemOf(resp.Header, head) // idemhttp's own problem, when it is one
	switch {
	case resp.StatusCode == http.StatusAccepted && inFlight(resp.Header, head):
		// idemhttp's answer to a duplicate of a delivery still running
		// (Options.StatusURL): that run may yet fail and store nothing,
		// so the event is not delivered; sent again after Retry-After.
		return werr
	case resp.StatusCode == http.StatusAccepted:
		return nil
	case resp.StatusCode == http.StatusGone && p.Code == CodeResponseExpired && p.StoredStatus >= 200 && p.StoredStatus < 300:
		// idemhttp's answer to a redelivery of an event it processed and
		// answered 2xx, whose stored response it dropped after
		// Config.BodyTTL: delivered. (A stored refusal, 4xx, stays a gone
		// endpoint's answer below.)
		return nil
	case resp.StatusCode == http.StatusGone:
		return idem.Permanent(werr)
	case resp.StatusCode == http.StatusUnprocessableEntity && p.Code == CodeKeyReused:
		return idem.Permanent(werr)
	}
	return werr
}

// inFlight reports whether a 202 Accepted is idemhttp's answer to a
// duplicate of a request still running (writeAccepted, with
// Options.StatusURL): Retry-After, the JSON document {"status":"processing"}
// alone, and a Location that is a status URL (its query names the key and
// the operation). A receiver that accepted an event for later work answers
// otherwise.
func inFlight(h http.Header, body []byte) bool {
	loc, err := url.Parse(h.Get("Location"))
	if h.Get("Retry-After") == "" || err != nil || !loc.Query().Has(StatusParamKey) || !loc.Query().Has(StatusParamOperation) {
		return false
	}
	var doc map[string]any
	return json.Unmarshal(body, &doc) == nil && len(doc) == 1 && doc["status"] == AcceptedStatusProcessing
}

// problemOf is the problem document of an answer (idemhttp's, whose code
// and stored_status the sender reads); the zero problem when the answer is
// not one.
func problemOf(h http.Header, body []byte) problem {
	var p problem
	if !strings.HasPrefix(h.Get("Content-Type"), ContentTypeProblem) || json.Unmarshal(body, &p) != nil {
		return problem{}
	}
	return p
}

// redactURL returns err, the error of http.Client.Do (a *url.Error), with
// its URL cut to the scheme and host: webhook URLs often hold a token in
// their path or query (Slack's, a "?token="), and Send's error ends up in
// the relay's attempt log and in logs. The chain below is kept.
func redactURL(err error) error {
	uerr, ok := err.(*url.Error)
	if !ok {
		return err
	}
	short := "(a URL that does not parse)"
	if u, perr := url.Parse(uerr.URL); perr == nil {
		short = u.Scheme + "://" + u.Host
		if (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
			short += "/…"
		}
	}
	return &url.Error{Op: uerr.Op, URL: short, Err: uerr.Err}
}

// checkEventHeader refuses an event's Header that no HTTP request can
// carry (headerProblem). The error names the header, never its value.
func checkEventHeader(h map[string][]string) error {
	if name, why := headerProblem(h); name != "" || why != "" {
		return fmt.Errorf("%w: event Header: %q %s", idem.ErrInvalidArgument, name, why)
	}
	return nil
}

// endpoint resolves destination and checks its endpoint: the URL to send
// to and a signer per secret.
func (s WebhookSender) endpoint(ctx context.Context, destination string) (string, []*standardwebhooks.Webhook, error) {
	if s.Endpoint == nil {
		return "", nil, &EndpointError{destination, fmt.Errorf("%w: WebhookSender.Endpoint is nil", idem.ErrInvalidArgument)}
	}
	ep, err := s.Endpoint(ctx, destination)
	if err != nil {
		return "", nil, &EndpointError{destination, err}
	}
	u, err := url.Parse(ep.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", nil, &EndpointError{destination, fmt.Errorf("%w: URL is not an absolute http or https URL", idem.ErrInvalidArgument)}
	}
	keys, err := parseSecrets(ep.Secrets)
	if err != nil {
		return "", nil, &EndpointError{destination, err}
	}
	return ep.URL, keys, nil
}

// client returns the client of one Send, and whether it calls sign before
// each attempt. It follows no redirect, whatever s.Client's CheckRedirect.
func (s WebhookSender) client(sign func(*http.Request, int) error) (*http.Client, bool) {
	if s.Client == nil {
		c := NewClient(&Transport{
			Policy:        idem.RetryPolicy{AttemptTimeout: DefaultWebhookAttemptTimeout, MaxDelay: idem.DefaultRetryMaxElapsed},
			BeforeAttempt: sign,
		}, DefaultWebhookTimeout)
		c.CheckRedirect = noRedirect
		return c, true
	}
	c := *s.Client // a copy: the caller's Client is not changed
	c.CheckRedirect = noRedirect
	rt, ok := signing(s.Client.Transport, sign)
	c.Transport = rt
	return &c, ok
}

// noRedirect is the CheckRedirect of WebhookSender's clients: the 3xx
// itself is the answer. Standard Webhooks counts a 3xx as a failure (the
// endpoint's URL is to be updated), and following one would turn the signed
// POST into a GET without the payload for 301, 302 and 303, whose 2xx would
// then count as delivered.
func noRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// signing returns a copy of rt that calls sign before each attempt, after
// rt's own BeforeAttempt, when rt is a Transport or NewClient's; else it
// reports false.
func signing(rt http.RoundTripper, sign func(*http.Request, int) error) (http.RoundTripper, bool) {
	switch t := rt.(type) {
	case *Transport:
		c := *t
		before := t.BeforeAttempt
		c.BeforeAttempt = func(req *http.Request, attempt int) error {
			if before != nil {
				if err := before(req, attempt); err != nil {
					return err
				}
			}
			return sign(req, attempt)
		}
		return &c, true
	case *boundTransport:
		inner, _ := signing(t.t, sign)
		return &boundTransport{inner.(*Transport), t.timeout}, true
	}
	return rt, false
}

// signWebhook sets the webhook headers of one attempt made at now.
func signWebhook(h http.Header, keys []*standardwebhooks.Webhook, id string, now time.Time, body []byte) error {
	sigs := make([]string, len(keys))
	for i, key := range keys {
		sig, err := key.Sign(id, now, body)
		if err != nil {
			return fmt.Errorf("idemhttp: sign the webhook: %w", err)
		}
		sigs[i] = sig
	}
	h.Set(HeaderWebhookID, id)
	h.Set(HeaderWebhookTimestamp, strconv.FormatInt(now.Unix(), 10))
	h.Set(HeaderWebhookSignature, strings.Join(sigs, " "))
	return nil
}
