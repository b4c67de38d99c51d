package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/loghash"
)

// Webhook is a verified Standard Webhook, as WebhookHandler hands it to its
// function.
type Webhook struct {
	// ID is the webhook-id: the event's ID, the same on every delivery.
	ID string
	// Timestamp is the webhook-timestamp of this delivery (whole seconds).
	Timestamp time.Time
	// Body is the request body, byte for byte as signed.
	Body []byte
	// Header is the request's header.
	Header http.Header
}

// WebhookOptions configures WebhookHandler. Secrets is required; every
// other field's zero value means its default.
type WebhookOptions struct {
	// Secrets verify the signatures: a webhook is accepted when one of its
	// signatures matches one of them. Each in Standard Webhooks' form
	// ("whsec_" and the standard base64 of the key). During a rotation give
	// the new secret and the old one, and drop the old one once the sender
	// signs with the new one. Required.
	Secrets []string

	// Tolerance is how far the webhook-timestamp may be from the
	// receiver's clock, in the past or the future; a webhook outside it is
	// answered 401 (a replay of a captured request). Default
	// DefaultWebhookTolerance, 5 minutes, Standard Webhooks' own.
	Tolerance time.Duration

	// Consumer is the Inbox's consumer (idem.Inbox): the stream in which
	// webhook-ids are unique. Give each sender a consumer of its own when a
	// service receives webhooks from several. Default
	// DefaultWebhookConsumer, "webhooks".
	Consumer string

	// MaxBodyBytes bounds the request body, read in full before it is
	// verified; a larger one is answered 413 and nothing runs. Default
	// DefaultMaxBodyBytes, 1 MiB.
	MaxBodyBytes int64

	// Timeout bounds the transaction of a webhook, fn and commit included.
	// It does not end when the sender hangs up, so that a webhook whose
	// answer was lost commits and its redelivery is acknowledged as a
	// duplicate. A webhook that runs out of time is rolled back and
	// answered 503. Config.Wait is capped at half of it. Default
	// DefaultTimeout, 30 seconds.
	Timeout time.Duration

	// Config configures the idempotency store of the Inbox (see
	// idem.Config). Its TTL (or TTLFor(idem.InboxOperation), asked once at
	// construction) is how long a webhook-id is remembered: a redelivery
	// after it runs fn again, so it must outlast the sender's retries, and
	// it may not be under twice the Tolerance (the span in which one signed
	// request verifies), or a replayed capture would run fn again. Default
	// TTL: DefaultWebhookTTL, 72 hours (Standard Webhooks' schedule retries
	// for about 27.5 hours).
	Config idem.Config

	// Logger receives a record for each webhook refused as unverified and
	// each 5xx (fn's errors, panics, store failures), with the keyed hash
	// of the webhook-id (key_hash), never the id. Default slog.Default().
	Logger *slog.Logger
}

// Defaults of WebhookOptions.
const (
	DefaultWebhookTolerance = 5 * time.Minute
	DefaultWebhookConsumer  = "webhooks"
	DefaultWebhookTTL       = 72 * time.Hour
)

// Problem codes of WebhookHandler, beside CodeKeyReused (422),
// CodeKeyInvalid (400), CodeInProgress (409), CodeBodyTooLarge (413),
// CodeBodyUnreadable (400), CodeMethodNotAllowed (405),
// CodeStoreUnavailable and CodeTimeout (503) and CodeInternal (500).
const (
	// CodeWebhookUnverified (401): the webhook-id, webhook-timestamp or
	// webhook-signature header is missing or malformed, or no signature
	// matches a secret. Nothing ran.
	CodeWebhookUnverified = "WEBHOOK_SIGNATURE_INVALID"
	// CodeWebhookStale (401): the signature matches but the
	// webhook-timestamp is outside WebhookOptions.Tolerance. Nothing ran.
	CodeWebhookStale = "WEBHOOK_TIMESTAMP_OUT_OF_TOLERANCE"
	// CodeWebhookFailed (500): the handler's function returned an error;
	// nothing was committed, and a redelivery runs it again.
	CodeWebhookFailed = "WEBHOOK_HANDLER_FAILED"
)

// WebhookHandler returns a handler that receives Standard Webhooks
// (standardwebhooks.com) and runs fn once per webhook-id, in a transaction
// on db.
//
// For a POST it reads the body (up to WebhookOptions.MaxBodyBytes),
// verifies the signature (any of its "v1," signatures under any of
// WebhookOptions.Secrets) and that the webhook-timestamp is within
// WebhookOptions.Tolerance of now, then runs fn through idem.InboxInTx
// keyed by the webhook-id (WebhookOptions.Consumer): fn's writes and the
// record of the id commit together. The answers:
//
//   - 204 No Content: fn ran and committed; or the webhook-id was
//     processed before, with the same body (a redelivery): fn did not run,
//     and the answer carries Idempotent-Replayed: true. Either way the
//     sender stops. fn may refuse a webhook for good with
//     idem.Reject(idem.Response{}): its writes are undone, the id is
//     recorded, and the answer is 204 (redeliveries too).
//   - 401 (CodeWebhookUnverified, CodeWebhookStale): no signature matches,
//     a header is missing or malformed, or the timestamp is outside the
//     tolerance. Nothing ran.
//   - 422 (CodeKeyReused): the webhook-id was processed with another body.
//     fn does not run; idemhttp's WebhookSender stops at this answer.
//   - 409 (CodeInProgress, with Retry-After): another delivery of the id is
//     running and did not finish within Config.Wait; the sender's retry
//     gets 204 once it commits.
//   - 500 (CodeWebhookFailed): fn returned an error (logged); fn's writes
//     are rolled back, nothing is recorded, and a redelivery runs fn again.
//     A panic of fn is answered 500 (CodeInternal); its transaction is
//     rolled back, unless fn had committed it itself.
//   - 500 (CodeInternal): fn committed or rolled back the transaction it
//     was given (logged). When it committed on a pool, its writes stand and
//     the webhook-id is unknown: redeliveries get 500 until an operator
//     settles it (idem.Resolve).
//   - 503 (CodeStoreUnavailable, CodeTimeout): the database failed or the
//     webhook ran out of WebhookOptions.Timeout; rolled back, or its
//     commit's outcome unknown: a redelivery runs fn or is a duplicate.
//   - 400 (CodeKeyInvalid): the webhook-id cannot be an Inbox key (see
//     idem.InboxKey: only with a Config.MaxKeyLength under 71 or a
//     MinKeyLength over 71, the length of a hashed id). Nothing ran.
//   - 413, 400: the body is too large or unreadable; 405 for other
//     methods. Nothing ran.
//
// Error answers are application/problem+json with a "code" member, as
// Middleware's. fn may run more than once for one delivery after a
// serialization failure or a deadlock (only one run commits): keep its
// effects inside tx.
//
// WebhookHandler panics if db or fn is nil or opts is invalid (no secret, a
// secret not in whsec_ form, a negative duration or limit, a Consumer that
// idem.ValidateScope refuses, a Config that idem.New refuses, a TTL under
// twice the Tolerance, which wraps idem.ErrInvalidConfig): a programming
// error to find at start-up, as with Middleware.
func WebhookHandler(db idem.Beginner, opts WebhookOptions,
	fn func(ctx context.Context, tx pgx.Tx, w Webhook) error) http.Handler {
	h, err := newWebhookHandler(db, opts, fn)
	if err != nil {
		panic(err)
	}
	return h
}

// webhookHandler is WebhookHandler's handler.
type webhookHandler struct {
	db        idem.Beginner
	fn        func(ctx context.Context, tx pgx.Tx, w Webhook) error
	client    *idem.Client
	keys      []*standardwebhooks.Webhook
	tolerance time.Duration
	consumer  string
	maxBody   int64
	timeout   time.Duration
	log       *slog.Logger
	hash      *loghash.Hasher
}

func newWebhookHandler(db idem.Beginner, opts WebhookOptions,
	fn func(ctx context.Context, tx pgx.Tx, w Webhook) error) (*webhookHandler, error) {
	if db == nil {
		return nil, errors.New("idemhttp: WebhookHandler: nil database")
	}
	if fn == nil {
		return nil, errors.New("idemhttp: WebhookHandler: nil function")
	}
	keys, err := parseSecrets(opts.Secrets)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: WebhookOptions.Secrets: %w", err)
	}
	h := &webhookHandler{db: db, fn: fn, keys: keys, tolerance: opts.Tolerance, consumer: opts.Consumer,
		maxBody: opts.MaxBodyBytes, timeout: opts.Timeout, log: opts.Logger}
	switch {
	case h.tolerance < 0:
		return nil, fmt.Errorf("idemhttp: WebhookOptions.Tolerance %s is negative", h.tolerance)
	case h.timeout < 0:
		return nil, fmt.Errorf("idemhttp: WebhookOptions.Timeout %s is negative", h.timeout)
	case h.maxBody < 0:
		return nil, fmt.Errorf("idemhttp: WebhookOptions.MaxBodyBytes %d is negative", h.maxBody)
	}
	if h.tolerance == 0 {
		h.tolerance = DefaultWebhookTolerance
	}
	if h.consumer == "" {
		h.consumer = DefaultWebhookConsumer
	}
	if err := idem.ValidateScope(idem.Scope{Actor: h.consumer, Operation: idem.InboxOperation}); err != nil {
		return nil, fmt.Errorf("idemhttp: WebhookOptions.Consumer: %w", err)
	}
	if h.maxBody == 0 {
		h.maxBody = DefaultMaxBodyBytes
	}
	if h.timeout == 0 {
		h.timeout = DefaultTimeout
	}
	if h.log == nil {
		h.log = slog.Default()
	}
	cfg := opts.Config
	if cfg.TTL == 0 {
		cfg.TTL = DefaultWebhookTTL
	}
	if len(cfg.LogHashKey) == 0 {
		cfg.LogHashKey = loghash.Default() // the process's: idem's logs and the handler's hash alike
	}
	if h.client, err = idem.New(cfg); err != nil {
		return nil, fmt.Errorf("idemhttp: WebhookOptions.Config: %w", err)
	}
	ttl := cfg.TTL
	if cfg.TTLFor != nil {
		switch t := cfg.TTLFor(idem.InboxOperation); {
		case t > 0 && t < time.Microsecond, t < 0:
			// Every call would fail with ErrInvalidConfig: found here,
			// at start-up.
			return nil, fmt.Errorf("idemhttp: WebhookOptions.Config.TTLFor(%q) is %s: a TTL must be at least 1µs (0: Config.TTL)",
				idem.InboxOperation, t)
		case t > 0:
			ttl = t
		}
	}
	if cfg.BodyTTLFor != nil {
		if t := cfg.BodyTTLFor(idem.InboxOperation); t < 0 || t > 0 && t < time.Microsecond {
			return nil, fmt.Errorf("idemhttp: WebhookOptions.Config.BodyTTLFor(%q) is %s: a body's life must be at least 1µs (0: BodyTTL)",
				idem.InboxOperation, t)
		}
	}
	if ttl/2 < h.tolerance { // ttl < 2×Tolerance, without overflow
		// One signed request is accepted for 2×Tolerance (its timestamp
		// may be Tolerance ahead of the receiver's clock, then Tolerance
		// behind): a shorter TTL forgets its id while a replay still
		// verifies, and fn runs again.
		return nil, fmt.Errorf("idemhttp: WebhookOptions.Config: %w: the TTL of the Inbox's ids, %s, is under twice the Tolerance, %s: a captured webhook replayed after its id is forgotten would still verify and run fn again",
			idem.ErrInvalidConfig, ttl, h.tolerance)
	}
	if cfg = h.client.Config(); cfg.Wait > h.timeout/2 {
		cfg.Wait = max(h.timeout/2, time.Nanosecond)
		if h.client, err = idem.New(cfg); err != nil {
			return nil, fmt.Errorf("idemhttp: WebhookOptions.Config: %w", err)
		}
	}
	h.hash = loghash.New(cfg.LogHashKey)
	return h, nil
}

func (h *webhookHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		writeProblem(w, http.StatusMethodNotAllowed, CodeMethodNotAllowed, "Webhooks are received with POST.", 0)
		return
	}
	body, status, detail := readLimited(w, r, h.maxBody)
	if status != 0 {
		code := CodeBodyUnreadable
		if status == http.StatusRequestEntityTooLarge {
			code = CodeBodyTooLarge
		}
		writeProblem(w, status, code, detail, 0)
		return
	}
	hook, code, err := h.verify(r.Header, body, time.Now())
	if err != nil {
		h.log.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: webhook refused",
			append(h.attrs(r, hook.ID), slog.String("code", code), slog.Any("error", err))...)
		writeProblem(w, http.StatusUnauthorized, code, errorText(err), 0)
		return
	}

	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), h.timeout)
	defer cancel()
	dup, fnErr, err := h.run(ctx, w, r, hook)
	// byFn: the error is fn's, whatever it wraps (an idem refusal of a
	// call fn made of its own is fn's failure, not this webhook-id's).
	byFn := fnErr != nil && errors.Is(err, fnErr)
	var inProgress *idem.InProgressError
	switch {
	case errors.Is(err, errPanicked):
		// run answered already.
	case err == nil:
		if dup {
			w.Header().Set(HeaderReplayed, "true")
		}
		w.WriteHeader(http.StatusNoContent)
	case !byFn && errors.Is(err, idem.ErrInvalidKey):
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid,
			"This webhook-id cannot be recorded: "+errorText(err), 0)
	case !byFn && errors.Is(err, idem.ErrKeyReused):
		writeProblem(w, http.StatusUnprocessableEntity, CodeKeyReused,
			"This webhook-id was processed before with a different body.", 0)
	case !byFn && errors.As(err, &inProgress):
		writeProblem(w, http.StatusConflict, CodeInProgress,
			"A delivery of this webhook-id is in progress; deliver it again later.", inProgress.RetryAfter)
	case !byFn && errors.Is(err, idem.ErrInProgress):
		writeProblem(w, http.StatusConflict, CodeInProgress,
			"A delivery of this webhook-id is in progress; deliver it again later.", time.Second)
	case core.EndedByFn(err):
		// fn committed or rolled back the transaction it was given (also
		// when it then ran out of time): what it committed stands, and the
		// error says what became of the webhook-id.
		h.log.LogAttrs(ctx, slog.LevelError, "idemhttp: webhook handler ended its transaction itself",
			append(h.attrs(r, hook.ID), slog.Any("error", err))...)
		writeProblem(w, http.StatusInternalServerError, CodeInternal, "The webhook failed.", 0)
	case ctx.Err() != nil:
		h.log.LogAttrs(ctx, slog.LevelError, "idemhttp: webhook timed out", append(h.attrs(r, hook.ID), slog.Any("error", err))...)
		writeProblem(w, http.StatusServiceUnavailable, CodeTimeout,
			"The webhook did not finish in time; deliver it again.", time.Second)
	case byFn:
		h.log.LogAttrs(ctx, slog.LevelError, "idemhttp: webhook handler failed; rolled back",
			append(h.attrs(r, hook.ID), slog.Any("error", err))...)
		writeProblem(w, http.StatusInternalServerError, CodeWebhookFailed,
			"The webhook's handler failed; nothing was committed. Deliver it again.", 0)
	case storeStatus(err) == http.StatusServiceUnavailable:
		h.log.LogAttrs(ctx, slog.LevelError, "idemhttp: store unavailable", append(h.attrs(r, hook.ID), slog.Any("error", err))...)
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreUnavailable,
			"The idempotency store is unavailable; deliver the webhook again.", time.Second)
	default:
		h.log.LogAttrs(ctx, slog.LevelError, "idemhttp: webhook failed", append(h.attrs(r, hook.ID), slog.Any("error", err))...)
		writeProblem(w, http.StatusInternalServerError, CodeInternal, "The webhook failed.", 0)
	}
}

// run runs fn through the Inbox. A panic of fn (its transaction rolled back
// by the time it reaches run, unless fn had committed it itself) is
// answered 500 and run returns errPanicked;
// http.ErrAbortHandler is passed on.
// fnErr is the error of fn's last run, if it failed.
func (h *webhookHandler) run(ctx context.Context, w http.ResponseWriter, r *http.Request, hook Webhook) (dup bool, fnErr, err error) {
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		if v == http.ErrAbortHandler {
			panic(v)
		}
		h.log.LogAttrs(ctx, slog.LevelError, "idemhttp: webhook handler panicked",
			append(h.attrs(r, hook.ID), slog.Any("panic", v), slog.String("stack", string(debug.Stack())))...)
		writeProblem(w, http.StatusInternalServerError, CodeInternal, "The webhook failed.", 0)
		err = errPanicked
	}()
	dup, err = h.client.InboxInTx(ctx, h.db, h.consumer, hook.ID, hook.Body, func(ctx context.Context, tx pgx.Tx) error {
		fnErr = h.fn(ctx, tx, hook)
		return fnErr
	})
	return dup, fnErr, err
}

// verify checks the webhook's signature against every secret, then its
// timestamp against now. On failure it returns the problem code; the
// Webhook then holds the id, if any, for the log.
func (h *webhookHandler) verify(header http.Header, body []byte, now time.Time) (Webhook, string, error) {
	hook := Webhook{ID: header.Get(HeaderWebhookID), Body: body, Header: header}
	var err error
	for _, key := range h.keys {
		if err = key.VerifyIgnoringTimestamp(body, header); err == nil {
			break
		}
	}
	if err != nil {
		return hook, CodeWebhookUnverified, fmt.Errorf("idemhttp: webhook not verified: %w", unwrapLibrary(err))
	}
	secs, _ := strconv.ParseInt(header.Get(HeaderWebhookTimestamp), 10, 64) // verified: an integer
	hook.Timestamp = time.Unix(secs, 0)
	if d := now.Sub(hook.Timestamp); d > h.tolerance || d < -h.tolerance {
		return hook, CodeWebhookStale, fmt.Errorf("idemhttp: webhook-timestamp is %s away from the receiver's clock, over the tolerance of %s",
			d.Abs().Round(time.Second), h.tolerance)
	}
	return hook, "", nil
}

// unwrapLibrary returns the sentinel of the Standard Webhooks library that
// err holds, without the library's wording around it.
func unwrapLibrary(err error) error {
	for _, s := range []error{standardwebhooks.ErrRequiredHeaders, standardwebhooks.ErrInvalidHeaders,
		standardwebhooks.ErrNoMatchingSignature} {
		if errors.Is(err, s) {
			return s
		}
	}
	return err
}

func (h *webhookHandler) attrs(r *http.Request, id string) []slog.Attr {
	return requestAttrs(h.hash, r, id)
}

// readLimited reads the whole request body, up to limit bytes. On failure
// it returns the status and the detail to answer with.
func readLimited(w http.ResponseWriter, r *http.Request, limit int64) (body []byte, status int, detail string) {
	tooLarge := fmt.Sprintf("The request body is larger than %d bytes.", limit)
	if r.ContentLength > limit {
		return nil, http.StatusRequestEntityTooLarge, tooLarge
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	var maxErr *http.MaxBytesError
	switch {
	case errors.As(err, &maxErr):
		return nil, http.StatusRequestEntityTooLarge, tooLarge
	case err != nil:
		return nil, http.StatusBadRequest, "The request body could not be read."
	}
	return body, 0, ""
}
