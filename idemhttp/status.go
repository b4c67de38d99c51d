package idemhttp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/metric/noop"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/front"
	"github.com/pgidem/idem/internal/loghash"
)

// The status URL of a request in flight: where Middleware sends a duplicate
// (202 Accepted + Location) when Options.StatusURL is set, and what
// StatusHandler answers there.
//
// The URL carries the scope's operation and the key as query parameters,
// StatusURL?key=K&operation=O, never as path segments: a key is any visible
// ASCII ("/", "%", "?", and "." or ".." whole) and the default operation
// holds a space and a slash ("POST /v1/orders"), which in a path would be
// undone by dot-segment removal, or refused or decoded by proxies that
// treat %2F specially. The actor is never in the URL: it is the caller's,
// from authentication, on every request.

// Query parameters of the status URL.
const (
	StatusParamOperation = "operation"
	StatusParamKey       = "key"
)

// AcceptedStatusProcessing is the "status" member of the JSON document of
// a 202 Accepted answer, {"status":"processing"}: the request with the key
// is still running; ask again after Retry-After. It is a string in a
// response body, not an idem.Status.
const AcceptedStatusProcessing = "processing"

// StatusProcessing is AcceptedStatusProcessing.
//
// Deprecated: use AcceptedStatusProcessing. This name is easily taken for
// idem.StatusProcessing, the Status of a record.
const StatusProcessing = AcceptedStatusProcessing

// statusLocation returns the status URL of (operation, key) under base, an
// Options.StatusURL that parseStatusURL accepted.
func statusLocation(base, operation, key string) string {
	return base + "?" + url.Values{StatusParamOperation: {operation}, StatusParamKey: {key}}.Encode()
}

// parseStatusURL checks Options.StatusURL: an absolute URL or a path,
// without a query or a fragment.
func parseStatusURL(s string) error {
	u, err := url.Parse(s)
	switch {
	case err != nil:
		return fmt.Errorf("idemhttp: Options.StatusURL: %w", err)
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || u.Opaque != "":
		return fmt.Errorf("idemhttp: Options.StatusURL %q has a query or a fragment; the status URL adds its own query", s)
	case u.Path == "" && u.Host == "":
		return fmt.Errorf("idemhttp: Options.StatusURL %q is neither a path nor an absolute URL", s)
	}
	return nil
}

// writeAccepted writes a 202 Accepted with the JSON status document of a
// request in flight, Location (when not empty) and Retry-After.
func writeAccepted(w http.ResponseWriter, location string, retryAfter time.Duration) {
	body, _ := json.Marshal(struct {
		Status string `json:"status"`
	}{AcceptedStatusProcessing})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("Cache-Control", "no-store")
	if location != "" {
		h.Set("Location", location)
	}
	h.Set("Retry-After", strconv.FormatInt(retrySeconds(retryAfter), 10))
	w.WriteHeader(http.StatusAccepted)
	_, _ = w.Write(body)
}

// retrySeconds is d in whole seconds, rounded up, at least 1.
func retrySeconds(d time.Duration) int64 {
	return max(1, ceilSeconds(d))
}

// authenticate returns the actor of r by actorOf, or an error when there is
// none usable: an error of actorOf, an empty actor, or one that
// idem.ValidateScope refuses.
func authenticate(actorOf func(*http.Request) (string, error), r *http.Request) (string, error) {
	actor, err := actorOf(r)
	if err == nil && actor == "" {
		err = errors.New("empty actor")
	}
	if err == nil {
		err = idem.ValidateScope(idem.Scope{Actor: actor, Operation: "-"})
	}
	return actor, err
}

// StatusOptions configures StatusHandler. Actor is required; every other
// field's zero value means its default.
type StatusOptions struct {
	// Actor returns the authenticated principal of the request: give it
	// the middleware's Options.Actor. The handler looks keys up in this
	// actor's scope only. An error, an empty actor or one that
	// idem.ValidateScope refuses is answered with 401 before anything is
	// looked up. Required.
	Actor func(*http.Request) (string, error)

	// Challenge is the WWW-Authenticate value of the 401. Default
	// "Bearer".
	Challenge string

	// Config supplies the key length bounds (MinKeyLength, MaxKeyLength)
	// and LogHashKey (empty: the process's random secret, the middleware's
	// too): give it the middleware's Options.Config. Its other fields do
	// not matter here, and the handler's lookups are never counted in its
	// metrics nor logged through its Logger.
	Config idem.Config

	// Citus says that the *sql.DB of StatusHandlerSQL is a Citus
	// coordinator: give it the middleware's Options.Citus. StatusHandler
	// ignores it. Default false.
	Citus bool

	// Logger receives a record for every 5xx the handler writes, with a
	// hash of the key, never the key. Default: slog.Default().
	Logger *slog.Logger

	// StoredHeaders are the stored headers a replay carries: give it the
	// middleware's Options.StoredHeaders (same default: Content-Type,
	// Content-Encoding, Location). Headers a record holds beyond these (one
	// written by idem.Resolve or idem.DoInTx directly) are not sent.
	StoredHeaders []string
}

// StatusHandler returns the handler of the status URL that Middleware
// gives a duplicate of a request in flight when Options.StatusURL is set
// (202 Accepted with Location). Mount it at that URL for GET:
//
//	mux.Handle("GET /v1/idempotency", idemhttp.StatusHandler(pool, idemhttp.StatusOptions{Actor: userFromToken}))
//	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: userFromToken, StatusURL: "/v1/idempotency"})
//
// It answers GET and HEAD for StatusURL?key=K&operation=O (the query
// parameters StatusParamKey and StatusParamOperation, URL-encoded), in
// this order:
//
//   - 405 for another method (CodeMethodNotAllowed, with Allow);
//   - 401 with WWW-Authenticate when StatusOptions.Actor finds no actor
//     (CodeUnauthenticated), before the URL is even read: a key never
//     bypasses authentication;
//   - 400 for a malformed query, a missing or repeated parameter, or an
//     operation that idem.ValidateScope refuses (CodeBadRequest), or a key
//     that Config's bounds refuse (CodeKeyInvalid);
//   - 202 Accepted with Retry-After and {"status":"processing"} while the
//     request with the key still runs: its transaction has not committed
//     yet, or its reservation (idem.Reserve) holds a live lease;
//   - the stored response once the request finished (succeeded, or
//     refused with a stored 4xx): its status, the stored headers named in
//     StatusOptions.StoredHeaders and body exactly as Middleware replays
//     it, with Idempotent-Replayed: true;
//   - 409 when the outcome is unknown (CodeOutcomeUnknown): a reservation
//     marked unknown, or whose lease ran out, until it is reconciled;
//   - 404 (CodeKeyNotFound) when the caller has no such request: never
//     sent, expired, pruned or forgotten, ended without storing anything
//     (a 5xx, a request refused with Invalid, a reservation that failed
//     retryably), or held by another actor. The client sends the request
//     again with the same key, which runs it.
//   - 503 (CodeStoreUnavailable, with Retry-After) when the database
//     cannot be reached; 500 (CodeInternal) for any other failure.
//
// The key is only ever looked up in the scope (the caller's actor, the
// operation of the URL), so another user's key is 404, exactly as a key
// that does not exist, never 403: the answer does not tell whether it
// exists. Every answer carries Cache-Control: no-store (a stored one
// included), since it depends on who asks. The key is in the URL, so access
// logs that record URLs hold it; it grants nothing without the actor's
// credentials (idem's own logs keep only a hash of it).
//
// The stored response is replayed rather than redirected (303) to the
// resource: a replay is what the first request decided (a refusal
// included, which has no resource to point to), not the resource's state
// of now, and a client handles it exactly as the answer to a retry.
//
// A request in flight in the caller's own transaction (Middleware,
// idem.DoInTx) has no committed record: the handler tells it from a key
// nobody holds by claiming the key itself (idem.DoInTx, waiting at most a
// millisecond for the holder) in a transaction it always rolls back; it
// never commits anything. A request
// with the same key that arrives meanwhile waits for that rollback (one
// round trip); two polls of one key at the same instant may see 202 for a
// key nobody else holds, and 404 on the next poll. Expiry and leases are
// judged by this process's clock.
//
// StatusHandler panics if db is nil or opts is invalid (nil Actor, a
// Config that idem.New refuses).
func StatusHandler(db idem.Beginner, opts StatusOptions) http.Handler {
	h, err := newStatusHandler(opts, txs.Pgx(db))
	if err != nil {
		panic(err)
	}
	return h
}

// statusHandler is the handler StatusHandler returns.
type statusHandler struct {
	store     front.Store  // of probe
	probe     *idem.Client // key bounds; claims that wait for nothing and count nowhere
	actor     func(*http.Request) (string, error)
	challenge string
	log       *slog.Logger
	hash      *loghash.Hasher // of keys in log records
	stored    []string        // canonical names of the headers a replay carries
}

// newStatusHandler configures the handler on the store that open returns
// for its probe client (front.Pgx or front.SQL on the application's
// handle).
func newStatusHandler(opts StatusOptions, open front.Open) (*statusHandler, error) {
	if opts.Actor == nil {
		return nil, errors.New("idemhttp: StatusOptions.Actor is required")
	}
	if _, err := idem.New(opts.Config); err != nil {
		return nil, fmt.Errorf("idemhttp: StatusOptions.Config: %w", err)
	}
	probe, err := idem.New(idem.Config{
		Wait:          -1, // do not wait for the request in flight: it is the answer
		MinKeyLength:  opts.Config.MinKeyLength,
		MaxKeyLength:  opts.Config.MaxKeyLength,
		MaxRetries:    -1,
		MeterProvider: noop.NewMeterProvider(),
	})
	if err != nil {
		return nil, fmt.Errorf("idemhttp: StatusOptions.Config: %w", err)
	}
	stored, err := storedHeaderNames(opts.StoredHeaders)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: StatusOptions.StoredHeaders: %w", err)
	}
	st, err := open(probe)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: %w", err)
	}
	hashKey := opts.Config.LogHashKey
	if len(hashKey) == 0 {
		hashKey = loghash.Default() // the middleware's, given the same Config
	}
	h := &statusHandler{store: st, probe: probe, actor: opts.Actor, challenge: opts.Challenge, log: opts.Logger,
		hash: loghash.New(hashKey), stored: stored}
	if h.challenge == "" {
		h.challenge = "Bearer"
	}
	if h.log == nil {
		h.log = slog.Default()
	}
	return h, nil
}

// errProbe is what the probe's function returns: the probe claimed the key,
// so nobody held it; everything is rolled back.
var errProbe = errors.New("idemhttp: status probe")

// probeFingerprint is the fingerprint of the probe's claims, which never
// commit.
var probeFingerprint = idem.FingerprintParts([]byte("idemhttp status probe"))

func (h *statusHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Cache-Control", "no-store")
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeProblem(w, http.StatusMethodNotAllowed, CodeMethodNotAllowed, "The status URL answers GET and HEAD.", 0)
		return
	}
	actor, err := authenticate(h.actor, r)
	if err != nil {
		w.Header().Set("WWW-Authenticate", h.challenge)
		writeProblem(w, http.StatusUnauthorized, CodeUnauthenticated, "The request is not authenticated.", 0)
		return
	}
	operation, key, code, detail := h.parse(r)
	if code != "" {
		writeProblem(w, http.StatusBadRequest, code, detail, 0)
		return
	}
	scope := idem.Scope{Actor: actor, Operation: operation}
	ctx := r.Context()

	// At most: a lookup, a probe, and a second lookup when the request
	// committed between the first two.
	for range 2 {
		rec, err := h.store.Lookup(ctx, scope, key)
		if err == nil {
			h.answer(w, r, key, rec)
			return
		}
		if !errors.Is(err, idem.ErrNotFound) {
			h.fail(ctx, w, r, key, err)
			return
		}
		_, err = h.store.DoInTx(ctx, scope, key, probeFingerprint,
			func(context.Context) (idem.Response, error) { return idem.Response{}, errProbe })
		var inProgress *idem.InProgressError
		switch {
		case errors.Is(err, errProbe):
			writeNotFound(w)
			return
		case errors.As(err, &inProgress):
			writeAccepted(w, "", inProgress.RetryAfter)
			return
		case errors.Is(err, idem.ErrOutcomeUnknown):
			writeOutcomeUnknown(w)
			return
		case err == nil, errors.Is(err, idem.ErrKeyReused):
			// A record committed since the lookup: read it.
		default:
			h.fail(ctx, w, r, key, err)
			return
		}
	}
	// The key keeps changing hands under the polls: let the client ask
	// again.
	writeAccepted(w, "", time.Second)
}

// parse reads the operation and the key from r's query. On failure code is
// the problem code of a 400 and detail its detail.
func (h *statusHandler) parse(r *http.Request) (operation, key, code, detail string) {
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return "", "", CodeBadRequest, "The query of the status URL is malformed."
	}
	one := func(name string) (string, bool) {
		if v := q[name]; len(v) == 1 && v[0] != "" {
			return v[0], true
		}
		return "", false
	}
	var ok bool
	if operation, ok = one(StatusParamOperation); !ok {
		return "", "", CodeBadRequest, fmt.Sprintf("The status URL needs exactly one %q parameter.", StatusParamOperation)
	}
	if key, ok = one(StatusParamKey); !ok {
		return "", "", CodeBadRequest, fmt.Sprintf("The status URL needs exactly one %q parameter.", StatusParamKey)
	}
	if err := idem.ValidateScope(idem.Scope{Actor: "-", Operation: operation}); err != nil {
		return "", "", CodeBadRequest, "Invalid operation: " + errorText(err)
	}
	if err := h.probe.ValidateKey(key); err != nil {
		return "", "", CodeKeyInvalid, "Invalid key: " + errorText(err)
	}
	return operation, key, "", ""
}

// answer writes what rec, the caller's committed record, says of the
// request.
func (h *statusHandler) answer(w http.ResponseWriter, r *http.Request, key string, rec idem.Record) {
	now := time.Now()
	switch rec.Status {
	case idem.StatusSucceeded, idem.StatusRejected:
		if !rec.ExpiresAt.After(now) {
			writeNotFound(w) // an expired key is a new request
			return
		}
		var resp idem.Response
		if rec.Response != nil {
			resp = *rec.Response
		}
		// How long the key is remembered, from its record: from the first
		// request that carried it to its expiry.
		w.Header().Set(HeaderKeyLifetime, strconv.FormatInt(ceilSeconds(rec.ExpiresAt.Sub(rec.CreatedAt)), 10))
		if rec.ResponseGone {
			writeResponseExpired(w, resp.Status) // as Middleware answers the retry
			return
		}
		// As Middleware replays it, but never cached, whatever was stored.
		hdr := w.Header()
		replayHeaders(hdr, resp.Header, h.stored)
		hdr.Set("Cache-Control", "no-store")
		hdr.Set(HeaderReplayed, "true")
		writeBody(w, resp.Status, resp.Body)
	case idem.StatusProcessing:
		if rec.LeaseExpiresAt.IsZero() {
			writeAccepted(w, "", time.Second)
			return
		}
		left := rec.LeaseExpiresAt.Sub(now)
		if left <= 0 {
			writeOutcomeUnknown(w) // the owner's lease ran out
			return
		}
		writeAccepted(w, "", min(left, time.Minute))
	case idem.StatusFailedRetryable:
		writeNotFound(w) // certainly not executed: sending it again runs it
	case idem.StatusUnknown:
		writeOutcomeUnknown(w)
	default:
		h.fail(r.Context(), w, r, key, fmt.Errorf("idemhttp: record in unexpected state %q", rec.Status))
	}
}

// writeResponseExpired answers a finished request whose stored response
// was dropped (idem.ErrResponseGone, idem.Record.ResponseGone).
func writeResponseExpired(w http.ResponseWriter, status int) {
	writeProblemDoc(w, problem{Status: http.StatusGone, Code: CodeResponseExpired, StoredStatus: status,
		Detail: fmt.Sprintf("The request with this Idempotency-Key ran and finished with status %d; its stored response has expired. "+
			"It will not run again: read the result through the API, do not retry with a new key.", status)}, 0)
}

func writeNotFound(w http.ResponseWriter) {
	writeProblem(w, http.StatusNotFound, CodeKeyNotFound,
		"No request with this key is running or stored for you; send it again with the same key to run it.", 0)
}

func writeOutcomeUnknown(w http.ResponseWriter) {
	writeProblem(w, http.StatusConflict, CodeOutcomeUnknown,
		"The outcome of the request with this Idempotency-Key is unknown; it will not run again until it is reconciled.", 0)
}

// fail logs err and answers 503 when the store could not serve, 500
// otherwise.
func (h *statusHandler) fail(ctx context.Context, w http.ResponseWriter, r *http.Request, key string, err error) {
	attrs := append(requestAttrs(h.hash, r, key), slog.Any("error", err))
	if storeStatus(err) == http.StatusServiceUnavailable {
		h.log.LogAttrs(ctx, slog.LevelError, "idemhttp: status lookup: store unavailable", attrs...)
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreUnavailable,
			"The idempotency store is unavailable; retry later.", time.Second)
		return
	}
	h.log.LogAttrs(ctx, slog.LevelError, "idemhttp: status lookup failed", attrs...)
	writeProblem(w, http.StatusInternalServerError, CodeInternal, "The status could not be read.", 0)
}
