package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/front"
	"github.com/pgidem/idem/internal/keyhdr"
	"github.com/pgidem/idem/internal/loghash"
)

// Options configures Middleware. Actor is required; every other field's
// zero value means its default.
type Options struct {
	// Actor returns the authenticated principal of the request, the actor
	// of the key's scope. It must come from authentication (a verified
	// token, a session), never from the request body. An error, an empty
	// actor, or one that idem.ValidateScope refuses (over 255 bytes, not
	// valid text) is answered with 401 and nothing runs. Required.
	Actor func(*http.Request) (string, error)

	// Operation names the kind of request, the operation of the key's
	// scope. Default: DefaultOperation, the method and the ServeMux route
	// pattern ("POST /v1/draws"), or the method and the path when the
	// middleware wraps the whole mux. An operation idem.ValidateScope
	// refuses is a 500. As for Fingerprint, the request's Body reads the
	// body again.
	Operation func(*http.Request) string

	// Methods are the request methods the middleware covers, in upper case
	// as clients send them (methods are case-sensitive). Requests with
	// other methods pass straight to the handler, without a transaction
	// (Tx returns nil) and without a key. Default: POST and PATCH.
	Methods []string

	// KeyOptional lets a covered request without an Idempotency-Key header
	// through: the handler runs in a transaction exactly as with a key (2xx
	// and 3xx commit, anything else rolls back), but nothing is stored, so
	// a retry runs again. Default false: such a request gets 400.
	KeyOptional bool

	// Fingerprint returns the fingerprint of a request given its body (read
	// in full, at most MaxBodyBytes); the request's Body reads that body
	// again, so r.ParseMultipartForm and r.FormValue work. The same key with a different
	// fingerprint is refused with 422. An error is answered with 400 and
	// nothing runs. Default: DefaultFingerprint (method, path, query and
	// the canonical body).
	Fingerprint func(r *http.Request, body []byte) (idem.Fingerprint, error)

	// MaxBodyBytes bounds the request body, which is read in full before
	// the key is claimed. A larger body is answered with 413 and nothing
	// runs. Default 1 MiB.
	MaxBodyBytes int64

	// StoredHeaders are the response headers stored with the response and
	// replayed with it; the first response carries every header the handler
	// set, a replay only these. Keep secrets (Set-Cookie) out. Default:
	// Content-Type, Content-Encoding (a compressed body replays as such) and
	// Location. Trailers are not stored or sent: the response is buffered and
	// sent with a Content-Length. On a replay, a value an outer middleware
	// set for one of these names is replaced by the stored one, or removed
	// when the handler had deleted it (stored as an empty list); a name the
	// record does not hold (one stored by idem.Do or Resolve, or before
	// deletions were stored) keeps the outer middleware's value.
	StoredHeaders []string

	// Citus says that the *sql.DB of MiddlewareSQL is a Citus coordinator
	// with idem_keys distributed by actor (idem.Distribute): the store's
	// statements then take the forms Citus accepts, those of an
	// idemsql.NewCitus Client (a *sql.DB does not say what it is connected
	// to). Without it, MiddlewareSQL on a coordinator answers every covered
	// request with a key 500 (idem.ErrUnsupported, logged). Middleware
	// ignores it: a pgx handle finds out by itself. Default false.
	Citus bool

	// Config configures the idempotency store (see idem.Config): the key's
	// TTL (default 24 h), how long a duplicate waits for the request that
	// holds its key before it gets 409 (Wait, default 2 s), the key length
	// bounds (default 1 to 255 bytes of visible ASCII), the largest
	// response (MaxResponseBytes, default 1 MiB; the handler's response is
	// buffered up to this size), the isolation level and the retries after
	// serialization failures.
	Config idem.Config

	// Timeout bounds the whole transaction of a covered request: claim,
	// handler and commit. The transaction does not end when the client
	// hangs up, so that a request that made it to the handler commits and
	// its retry replays; Timeout is what ends it instead. The handler's
	// context carries the request context's values and this deadline, not
	// its cancellation. A request that runs out of time is rolled back and
	// answered 503 with CodeTimeout, also when the handler answered 5xx
	// after the deadline. Timeout ends the database work; a handler that
	// ignores its context keeps the client waiting until it returns.
	// Config.Wait is capped at half of Timeout, so that a duplicate of a
	// request in flight gets 409 rather than running out of time waiting
	// for it. Default 30 seconds.
	Timeout time.Duration

	// Challenge is the WWW-Authenticate value of the 401 answered when
	// Actor fails. Default "Bearer".
	Challenge string

	// Logger receives a record for every 5xx the middleware writes itself
	// (handler panics, store failures), with the keyed hash of the key
	// (key_hash, HMAC-SHA256 under Config.LogHashKey, the same as idem's own
	// records when Config.Logger is set), never the key. Default:
	// slog.Default().
	Logger *slog.Logger

	// StatusURL, when set, changes the answer to a duplicate of a request
	// still in flight from 409 to 202 Accepted with Retry-After, the JSON
	// document {"status":"processing"}, and Location: the status URL of the
	// key, StatusURL?key=K&operation=O, which StatusHandler mounted at
	// StatusURL answers: 202 while the request runs, its stored response
	// once it finished, 404 if it ended storing nothing (seed 001's second
	// strategy; the first, waiting, still comes before it: Config.Wait).
	// An absolute URL or a path (resolved against the request's URL),
	// without a query or a fragment. Default "": 409 with Retry-After.
	StatusURL string
}

// Defaults of Options.
const (
	DefaultMaxBodyBytes = 1 << 20
	DefaultTimeout      = 30 * time.Second
)

// defaultMethods and defaultStoredHeaders are the defaults of Options.Methods
// and Options.StoredHeaders.
var (
	defaultMethods       = []string{http.MethodPost, http.MethodPatch}
	defaultStoredHeaders = []string{"Content-Type", "Content-Encoding", "Location"}
)

// runKey is the context key of the buffer of the handler's current run,
// which Invalid marks.
type runKey struct{}

// Tx returns the transaction of the covered request that ctx belongs to
// (the handler's r.Context()), or nil outside one.
//
// The handler's writes through it commit together with the stored response
// when the handler answers 2xx or 3xx, and are rolled back otherwise. The
// handler must not commit or roll it back, nor keep it after returning.
// After a serialization failure or a deadlock, met by one of the handler's
// own statements or at COMMIT, the middleware runs the handler again in a
// new transaction (see idem.InTx, Config.MaxRetries) and sends only the
// last run's answer, so the handler must not have effects outside the
// transaction. (The pgx.Tx returned watches the handler's statements for
// such failures; use it, not its Conn, for the handler's writes.)
func Tx(ctx context.Context) pgx.Tx { return txs.PgxTx(ctx) }

// txs holds the request's transaction in the handler's context: a pgx.Tx
// (Middleware) or a *sql.Tx (MiddlewareSQL).
var txs front.Txs

// Invalid tells the middleware that the handler refuses the covered request
// that ctx belongs to (the handler's r.Context()) as invalid, before acting
// on it: a body that does not parse, a field out of range. The handler then
// writes its 4xx answer as usual, and that answer is not stored: the
// handler's writes and the claim of the key are rolled back, the client gets
// the answer as the handler wrote it, and the key stays free, so the client
// can correct the request and send it again with the same key, and it runs.
//
// Without Invalid, a 4xx answer is a deterministic refusal, stored and
// replayed to every retry with the key (see Middleware): right for a
// business refusal that would come out the same on each retry (insufficient
// funds), wrong for a mistake the client is expected to fix. As in Stripe's
// practice, a result is stored only once the operation started executing.
//
// Call Invalid only for answers 400 to 499: a 2xx or 3xx answer after it is
// a programming error, rolled back and answered 500 (CodeInternal, logged);
// a 5xx answer is not stored anyway. Invalid applies to the current run of
// the handler only (it runs again, unmarked, after a serialization failure),
// is safe for concurrent use, and does nothing outside a covered request.
func Invalid(ctx context.Context) {
	if buf, ok := ctx.Value(runKey{}).(*bufferWriter); ok {
		buf.invalid.Store(true)
	}
}

// Middleware returns middleware that makes the covered requests (POST and
// PATCH by default) idempotent by their Idempotency-Key header, with the
// handler's own writes in the same transaction as the key.
//
// For a covered request it authenticates the actor (Options.Actor), parses
// and validates the key, reads the body (up to Options.MaxBodyBytes) and
// fingerprints it. It then begins a transaction on db, claims (actor,
// operation, key) and runs the handler with Tx(ctx) available and a
// ResponseWriter that buffers. The handler's outcome decides what happens:
//
//   - 2xx or 3xx: the handler's writes, the key and the response (status,
//     Options.StoredHeaders, body) commit together. Only after the commit
//     is the response written to the client. If the commit fails, the
//     client gets a 5xx problem and nothing is stored.
//   - 4xx, except 408, 425 and 429: a deterministic refusal. The handler's
//     writes are rolled back; the refusal is stored and replayed.
//   - 4xx after the handler called Invalid (a request refused as invalid,
//     before anything ran), 5xx, 408, 425, 429, or a panic: everything is
//     rolled back and nothing is stored, so a retry runs again. The client
//     gets the handler's own response (a panic gets a 500 problem;
//     http.ErrAbortHandler is re-panicked after the rollback).
//
// A later request with the same key, actor, operation and fingerprint gets
// the stored status, stored headers and body byte for byte, plus
// Idempotent-Replayed: true, and the handler does not run. The middleware's
// own errors are application/problem+json (RFC 9457) with a "code" member
// (see the Code constants), and none of them changes anything: 400 for a
// missing (when required) or malformed key, 401 when Actor fails, 413 for a
// body over the limit, 422 for the same key with a different request, 409
// with Retry-After while another request holds the key (or 202 Accepted with
// the Location of a status URL: Options.StatusURL), and 503 when the
// database cannot be reached (fail closed: the handler does not run) or the
// request runs past Options.Timeout (rolled back).
//
// A client that hangs up does not cancel the work: the transaction runs to
// its end (bounded by Options.Timeout) and commits, so the client's retry
// replays. The handler cannot flush or hijack the connection: the response
// is written only after the commit.
//
// Middleware panics if db is nil or opts is invalid (nil Actor, a negative
// limit, an empty method or header name, a Config that idem.New refuses):
// like an invalid ServeMux pattern, that is a programming error to find at
// start-up.
func Middleware(db idem.Beginner, opts Options) func(http.Handler) http.Handler {
	m, err := newMiddleware(opts, txs.Pgx(db))
	if err != nil {
		panic(err)
	}
	return m.wrap
}

// wrap returns the middleware around next.
func (m *middleware) wrap(next http.Handler) http.Handler {
	if next == nil {
		panic("idemhttp: nil handler")
	}
	h := *m
	h.next = next
	return &h
}

// middleware is the configured middleware around one handler.
type middleware struct {
	store       front.Store
	client      *idem.Client
	actor       func(*http.Request) (string, error)
	operation   func(*http.Request) string
	fingerprint func(*http.Request, []byte) (idem.Fingerprint, error)
	methods     []string
	stored      []string // canonical header names
	keyOptional bool
	maxBody     int64
	maxResponse int
	ttl         time.Duration                        // Config.TTL, with its default
	ttlFor      func(operation string) time.Duration // Config.TTLFor
	timeout     time.Duration
	challenge   string
	log         *slog.Logger
	hash        *loghash.Hasher // of keys in log records
	statusURL   string
	next        http.Handler
}

// newMiddleware configures the middleware on the store that open returns
// for its client (front.Pgx or front.SQL on the application's handle).
func newMiddleware(opts Options, open front.Open) (*middleware, error) {
	if opts.Actor == nil {
		return nil, errors.New("idemhttp: Options.Actor is required")
	}
	if opts.MaxBodyBytes < 0 {
		return nil, fmt.Errorf("idemhttp: Options.MaxBodyBytes %d is negative", opts.MaxBodyBytes)
	}
	if opts.Timeout < 0 {
		return nil, fmt.Errorf("idemhttp: Options.Timeout %s is negative", opts.Timeout)
	}
	if opts.Timeout == 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.StatusURL != "" {
		if err := parseStatusURL(opts.StatusURL); err != nil {
			return nil, err
		}
	}
	if len(opts.Config.LogHashKey) == 0 {
		// The process's random secret, for the core's logs and the
		// middleware's, and the status handler's given this Config: all
		// hash a key alike.
		opts.Config.LogHashKey = loghash.Default()
	}
	client, err := idem.New(opts.Config)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: Options.Config: %w", err)
	}
	if cfg := client.Config(); cfg.Wait > opts.Timeout/2 {
		cfg.Wait = max(opts.Timeout/2, time.Nanosecond) // 0 would mean the default
		if client, err = idem.New(cfg); err != nil {
			return nil, fmt.Errorf("idemhttp: Options.Config: %w", err)
		}
	}
	st, err := open(client)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: %w", err)
	}
	m := &middleware{
		store:       st,
		client:      client,
		actor:       opts.Actor,
		operation:   opts.Operation,
		fingerprint: opts.Fingerprint,
		keyOptional: opts.KeyOptional,
		maxBody:     opts.MaxBodyBytes,
		maxResponse: client.Config().MaxResponseBytes,
		ttl:         client.Config().TTL,
		ttlFor:      opts.Config.TTLFor,
		timeout:     opts.Timeout,
		log:         opts.Logger,
		hash:        loghash.New(opts.Config.LogHashKey),
		statusURL:   opts.StatusURL,
	}
	if m.operation == nil {
		m.operation = DefaultOperation
	}
	if m.fingerprint == nil {
		m.fingerprint = DefaultFingerprint
	}
	if m.maxBody == 0 {
		m.maxBody = DefaultMaxBodyBytes
	}
	if m.challenge = opts.Challenge; m.challenge == "" {
		m.challenge = "Bearer"
	}
	if m.log == nil {
		m.log = slog.Default()
	}
	m.methods = slices.Clone(opts.Methods)
	if len(m.methods) == 0 {
		m.methods = defaultMethods
	}
	for _, method := range m.methods {
		if method == "" || !isToken(method) {
			return nil, fmt.Errorf("idemhttp: Options.Methods: invalid method %q", method)
		}
		if method != strings.ToUpper(method) {
			return nil, fmt.Errorf("idemhttp: Options.Methods: method %q is not upper case; clients send %q", method, strings.ToUpper(method))
		}
	}
	stored, err := storedHeaderNames(opts.StoredHeaders)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: Options.StoredHeaders: %w", err)
	}
	m.stored = stored
	return m, nil
}

// storedHeaderNames returns the canonical names of the headers stored and
// replayed: names, or defaultStoredHeaders when it is empty.
func storedHeaderNames(names []string) ([]string, error) {
	if len(names) == 0 {
		names = defaultStoredHeaders
	}
	var stored []string
	for _, name := range names {
		if name == "" || !isToken(name) {
			return nil, fmt.Errorf("invalid header name %q", name)
		}
		name = http.CanonicalHeaderKey(name)
		if name != HeaderReplayed && !slices.Contains(stored, name) {
			stored = append(stored, name)
		}
	}
	return stored, nil
}

func isToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if !keyhdr.IsTchar(s[i]) {
			return false
		}
	}
	return true
}

// errNotStored is what the handler's function returns to roll back a
// response that must not be stored (5xx, 408, 425, 429, and 4xx after
// Invalid).
var errNotStored = errors.New("idemhttp: response not stored")

// invalidOutcome is what the handler's function returns when the handler
// called Invalid and answered status: errNotStored, or for a 2xx or 3xx an
// error that is answered 500.
func invalidOutcome(status int) error {
	if status < 400 {
		return fmt.Errorf("idemhttp: the handler called Invalid but answered %d; Invalid is for 4xx answers", status)
	}
	return errNotStored
}

// stores reports whether a handler response with status is final: stored
// and replayed (2xx, 3xx, and 4xx refusals other than 408, 425 and 429).
func stores(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 500
}

func (m *middleware) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !slices.Contains(m.methods, r.Method) {
		m.next.ServeHTTP(w, r)
		return
	}

	actor, err := authenticate(m.actor, r)
	if err != nil {
		w.Header().Set("WWW-Authenticate", m.challenge)
		writeProblem(w, http.StatusUnauthorized, CodeUnauthenticated, "The request is not authenticated.", 0)
		return
	}

	key, err := ParseKey(r.Header)
	switch {
	case errors.Is(err, ErrMissingKey) && m.keyOptional:
		key, err = "", nil
	case errors.Is(err, ErrMissingKey):
		writeProblem(w, http.StatusBadRequest, CodeKeyMissing,
			"This operation requires an Idempotency-Key header.", 0)
		return
	case err == nil:
		err = m.client.ValidateKey(key)
	}
	if err != nil {
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid, "Invalid Idempotency-Key header: "+errorText(err), 0)
		return
	}

	body, status, detail := m.readBody(w, r)
	if status != 0 {
		code := CodeBodyUnreadable
		if status == http.StatusRequestEntityTooLarge {
			code = CodeBodyTooLarge
		}
		writeProblem(w, status, code, detail, 0)
		return
	}

	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.timeout)
	defer cancel()
	if key == "" {
		m.serveUnkeyed(ctx, w, r, body)
		return
	}

	fp, operation, err := m.target(r, body)
	if err != nil {
		writeProblem(w, http.StatusBadRequest, CodeBadRequest, errorText(err), 0)
		return
	}
	scope := idem.Scope{Actor: actor, Operation: operation}
	if err := idem.ValidateScope(scope); err != nil {
		m.fail(ctx, w, r, key, err) // ErrInvalidScope: 500
		return
	}
	m.serveKeyed(ctx, w, r, body, scope, key, fp)
}

// target returns the fingerprint (Options.Fingerprint) and the operation
// (Options.Operation) of r, whose body readBody read. Both get a shallow
// copy of r whose Body reads body again, so that a function that reads
// the request's form (r.ParseMultipartForm, r.FormValue) sees the fields
// the handler will, and does not leave the handler's request with a form
// parsed from a spent body; files that parsing spilled to disk are removed
// afterwards.
func (m *middleware) target(r *http.Request, body []byte) (idem.Fingerprint, string, error) {
	fr := r.WithContext(r.Context())
	fr.Form, fr.PostForm = cloneValues(r.Form), cloneValues(r.PostForm) // a parse adds to them
	fr.Body = io.NopCloser(bytes.NewReader(body))
	fr.ContentLength = int64(len(body))
	defer func() {
		if fr.MultipartForm != nil && fr.MultipartForm != r.MultipartForm {
			_ = fr.MultipartForm.RemoveAll()
		}
	}()
	fp, err := m.fingerprint(fr, body)
	if err != nil {
		return fp, "", err
	}
	fr.Body = io.NopCloser(bytes.NewReader(body))
	return fp, m.operation(fr), nil
}

// cloneValues is a deep copy of v (nil stays nil).
func cloneValues(v url.Values) url.Values {
	if v == nil {
		return nil
	}
	out := make(url.Values, len(v))
	for k, vs := range v {
		out[k] = slices.Clone(vs)
	}
	return out
}

// readBody reads the whole request body, up to m.maxBody bytes. On failure
// it returns the status and the detail to answer with.
func (m *middleware) readBody(w http.ResponseWriter, r *http.Request) (body []byte, status int, detail string) {
	tooLarge := fmt.Sprintf("The request body is larger than %d bytes.", m.maxBody)
	if r.ContentLength > m.maxBody {
		return nil, http.StatusRequestEntityTooLarge, tooLarge
	}
	if r.Body == nil {
		return nil, 0, ""
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.maxBody))
	var maxErr *http.MaxBytesError
	switch {
	case errors.As(err, &maxErr):
		return nil, http.StatusRequestEntityTooLarge, tooLarge
	case err != nil:
		return nil, http.StatusBadRequest, "The request body could not be read."
	}
	return body, 0, ""
}

// run runs the handler once with a fresh buffer and request body, in the
// transaction that ctx carries (the store put it there), and returns the
// buffer. A panic of the handler goes on to the caller. (A serialization
// failure or deadlock met by the handler's statements is the store's to
// see: it runs the handler again in a new transaction.)
func (m *middleware) run(ctx context.Context, r *http.Request, base http.Header, body []byte) *bufferWriter {
	buf := newBufferWriter(base, m.maxResponse)
	req := r.WithContext(context.WithValue(ctx, runKey{}, buf))
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	m.next.ServeHTTP(buf, req)
	return buf
}

// serveKeyed runs the handler under idem for a request with a key.
func (m *middleware) serveKeyed(ctx context.Context, w http.ResponseWriter, r *http.Request, body []byte,
	scope idem.Scope, key string, fp idem.Fingerprint) {
	base := w.Header().Clone()
	var buf *bufferWriter // the buffer of the last run of the handler
	var res idem.Result
	err := m.guard(ctx, w, r, key, func() error {
		var err error
		res, err = m.store.DoInTx(ctx, scope, key, fp, func(ctx context.Context) (idem.Response, error) {
			buf = m.run(ctx, r, base, body)
			if buf.tooBig {
				return idem.Response{}, fmt.Errorf("%w: the handler wrote more than %d bytes", idem.ErrResponseTooLarge, m.maxResponse)
			}
			status, header := buf.result()
			resp := idem.Response{Status: status, Header: m.storedHeader(header, base), Body: buf.body.Bytes()}
			switch {
			case buf.invalid.Load():
				return idem.Response{}, invalidOutcome(status)
			case !stores(status):
				return idem.Response{}, errNotStored
			case status >= 400:
				return idem.Response{}, idem.Reject(resp)
			}
			return resp, nil
		})
		return err
	})
	var inProgress *idem.InProgressError
	switch {
	case errors.Is(err, errPanicked):
		// guard answered already.
	case err == nil && res.Replayed:
		w.Header().Set(HeaderKeyLifetime, m.lifetime(scope.Operation))
		writeReplay(w, res.Response, m.stored)
	case errors.Is(err, errNotStored) && timedOut(ctx, buf):
		m.fail(ctx, w, r, key, context.Cause(ctx))
	case err == nil:
		writeBuffered(w, buf, m.lifetime(scope.Operation))
	case errors.Is(err, errNotStored):
		writeBuffered(w, buf, "")
	case errors.Is(err, idem.ErrKeyReused):
		writeProblem(w, http.StatusUnprocessableEntity, CodeKeyReused,
			"This Idempotency-Key was used for a different request.", 0)
	case errors.As(err, &inProgress) && m.statusURL != "":
		writeAccepted(w, statusLocation(m.statusURL, scope.Operation, key), inProgress.RetryAfter)
	case errors.As(err, &inProgress):
		writeProblem(w, http.StatusConflict, CodeInProgress,
			"A request with this Idempotency-Key is in progress; retry later with the same key.", inProgress.RetryAfter)
	case errors.Is(err, idem.ErrInvalidKey):
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid, "Invalid Idempotency-Key header: "+errorText(err), 0)
	case errors.Is(err, idem.ErrOutcomeUnknown):
		writeProblem(w, http.StatusConflict, CodeOutcomeUnknown,
			"The outcome of the request with this Idempotency-Key is unknown; it will not run again until it is reconciled.", 0)
	case errors.Is(err, idem.ErrResponseGone):
		w.Header().Set(HeaderKeyLifetime, m.lifetime(scope.Operation))
		writeResponseExpired(w, res.Status)
	default:
		m.fail(ctx, w, r, key, err)
	}
}

// serveUnkeyed runs the handler in a transaction of its own for a request
// without a key (Options.KeyOptional): the same outcomes, nothing stored.
func (m *middleware) serveUnkeyed(ctx context.Context, w http.ResponseWriter, r *http.Request, body []byte) {
	base := w.Header().Clone()
	var buf *bufferWriter
	err := m.guard(ctx, w, r, "", func() error {
		return m.store.InTx(ctx, func(ctx context.Context) error {
			buf = m.run(ctx, r, base, body)
			if buf.tooBig {
				return fmt.Errorf("%w: the handler wrote more than %d bytes", idem.ErrResponseTooLarge, m.maxResponse)
			}
			status, _ := buf.result()
			switch {
			case buf.invalid.Load():
				return invalidOutcome(status)
			case status >= 400:
				return errNotStored
			}
			return nil
		})
	})
	switch {
	case errors.Is(err, errPanicked):
	case errors.Is(err, errNotStored) && timedOut(ctx, buf):
		m.fail(ctx, w, r, "", context.Cause(ctx))
	case err == nil, errors.Is(err, errNotStored):
		writeBuffered(w, buf, "")
	default:
		m.fail(ctx, w, r, "", err)
	}
}

// errPanicked is what guard returns after it answered a handler panic.
var errPanicked = errors.New("idemhttp: handler panicked")

// guard calls f, which runs the handler in a transaction. If the handler
// panics, the transaction has been rolled back by the time the panic
// reaches guard (or, had the handler committed it, its claim marked
// unknown), which answers 500 and returns errPanicked.
// http.ErrAbortHandler is passed on.
func (m *middleware) guard(ctx context.Context, w http.ResponseWriter, r *http.Request, key string, f func() error) (err error) {
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		if v == http.ErrAbortHandler {
			panic(v)
		}
		// No response was stored; the transaction was rolled back, unless
		// the handler had committed it itself (then its writes stand and
		// the key is unknown: the retry gets 409 IDEMPOTENCY_OUTCOME_UNKNOWN).
		m.log.LogAttrs(ctx, slog.LevelError, "idemhttp: handler panicked; no response stored",
			append(m.logAttrs(r, key), slog.Any("panic", v), slog.String("stack", string(debug.Stack())))...)
		writeProblem(w, http.StatusInternalServerError, CodeInternal, "The request failed; no response was stored.", 0)
		err = errPanicked
	}()
	return f()
}

// timedOut reports whether the handler answered 5xx after Options.Timeout
// ended its context: most likely because its statements failed on the
// deadline, so the client is told that, with the advice to retry.
func timedOut(ctx context.Context, buf *bufferWriter) bool {
	status, _ := buf.result()
	return ctx.Err() != nil && status >= 500
}

// fail logs err, which ended the transaction of a request, and answers it
// with a problem: 503 when the request ran out of time (ctx, which carries
// Options.Timeout, is done) or the store failed, 500 otherwise.
func (m *middleware) fail(ctx context.Context, w http.ResponseWriter, r *http.Request, key string, err error) {
	attrs := append(m.logAttrs(r, key), slog.Any("error", err))
	status := storeStatus(err)
	switch {
	case ctx.Err() != nil && status == http.StatusServiceUnavailable:
		m.log.LogAttrs(ctx, slog.LevelError, "idemhttp: request timed out", attrs...)
		writeProblem(w, http.StatusServiceUnavailable, CodeTimeout,
			"The request did not finish in time; retry later with the same key.", time.Second)
	case errors.Is(err, idem.ErrTxAborted):
		// A bug of the handler's: it swallowed a failed statement and
		// answered as though it had not.
		m.log.LogAttrs(ctx, slog.LevelError, "idemhttp: the handler's transaction was aborted by a statement it did not report; nothing stored", attrs...)
		writeProblem(w, http.StatusInternalServerError, CodeInternal, "The request failed; nothing was stored.", 0)
	case status == http.StatusServiceUnavailable:
		m.log.LogAttrs(ctx, slog.LevelError, "idemhttp: store unavailable", attrs...)
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreUnavailable,
			"The idempotency store is unavailable; retry later with the same key.", time.Second)
	default:
		m.log.LogAttrs(ctx, slog.LevelError, "idemhttp: request failed", attrs...)
		writeProblem(w, http.StatusInternalServerError, CodeInternal, "The request failed; nothing was stored.", 0)
	}
}

func (m *middleware) logAttrs(r *http.Request, key string) []slog.Attr {
	return requestAttrs(m.hash, r, key)
}

// requestAttrs are the log attributes of a request with key: its method,
// its path and the keyed hash of the key (key_hash, as in idem's own logs
// under the same Config.LogHashKey), never the key.
func requestAttrs(hash *loghash.Hasher, r *http.Request, key string) []slog.Attr {
	attrs := []slog.Attr{slog.String("method", r.Method), slog.String("path", r.URL.Path)}
	if key != "" {
		attrs = append(attrs, slog.String("key_hash", hash.Sum(key)))
	}
	return attrs
}

// storedHeader returns the headers of h, the handler's response, that are
// stored, or nil. A name h holds is stored with its values (nil stays nil:
// net/http's "present, do not sniff" for Content-Type). A name that base
// (what the outer middleware had set before the handler ran) holds and h
// does not, the handler deleted: it is stored as an empty list, so that a
// replay deletes it too.
func (m *middleware) storedHeader(h, base http.Header) map[string][]string {
	var out map[string][]string
	for _, name := range m.stored {
		v, ok := h[name]
		_, was := base[name]
		if !ok && !was {
			continue
		}
		if out == nil {
			out = make(map[string][]string, len(m.stored))
		}
		if ok {
			out[name] = slices.Clone(v)
		} else {
			out[name] = []string{} // deleted by the handler
		}
	}
	return out
}

// lifetime is the value of HeaderKeyLifetime for a key of operation: its
// TTL (Config.TTLFor, else Config.TTL) in whole seconds, rounded up.
func (m *middleware) lifetime(operation string) string {
	ttl := m.ttl
	if m.ttlFor != nil {
		if t := m.ttlFor(operation); t > 0 {
			ttl = t
		}
	}
	return strconv.FormatInt(ceilSeconds(ttl), 10)
}

// ceilSeconds is d in whole seconds, rounded up, without overflow for the
// largest time.Duration (9223372037).
func ceilSeconds(d time.Duration) int64 {
	s := int64(d / time.Second)
	if d%time.Second > 0 {
		s++
	}
	return s
}

// storeStatus classifies an error of the store with idem.Unavailable: 503
// when the database could not serve (the client should retry with the same
// key), 500 otherwise.
func storeStatus(err error) int {
	if idem.Unavailable(err) {
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// writeBuffered writes the handler's response as it buffered it, with
// HeaderKeyLifetime when lifetime is not "" (the response was stored).
func writeBuffered(w http.ResponseWriter, buf *bufferWriter, lifetime string) {
	status, header := buf.result()
	h := w.Header()
	clear(h)
	for name, v := range header {
		h[name] = v
	}
	if lifetime != "" {
		h.Set(HeaderKeyLifetime, lifetime)
	}
	writeBody(w, status, buf.body.Bytes())
}

// writeReplay writes a stored response: its headers named in stored (a
// record written by other means, Resolve or idem.DoInTx, may hold others)
// and Idempotent-Replayed: true.
func writeReplay(w http.ResponseWriter, resp idem.Response, stored []string) {
	replayHeaders(w.Header(), resp.Header, stored)
	w.Header().Set(HeaderReplayed, "true")
	writeBody(w, resp.Status, resp.Body)
}

// replayHeaders copies the headers of from named in stored into h, in
// place of any values h had for those names (an outer middleware's
// defaults: the stored values are the handler's final ones). A name stored
// as an empty list, which the handler deleted, is deleted from h; a name
// stored as null (nil: present without values) is set so; a name from does
// not hold (a record stored by Do or Resolve, or by the middleware before
// it stored deletions) keeps h's values.
func replayHeaders(h http.Header, from map[string][]string, stored []string) {
	for name, v := range from {
		if name = http.CanonicalHeaderKey(name); !slices.Contains(stored, name) {
			continue
		}
		if v != nil && len(v) == 0 {
			delete(h, name)
		} else {
			h[name] = v
		}
	}
}

func writeBody(w http.ResponseWriter, status int, body []byte) {
	if status == 0 {
		status = http.StatusOK // a row that idem.Do stored without a status
	}
	if bodyAllowed(status) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	} else {
		w.Header().Del("Content-Length")
	}
	w.WriteHeader(status)
	if bodyAllowed(status) && len(body) > 0 {
		_, _ = w.Write(body) // the client may be gone; what was stored stays stored
	}
}

// errorText returns err's message without the package prefixes of idem and
// idemhttp, for a problem's detail.
func errorText(err error) string {
	s := strings.ReplaceAll(err.Error(), "idemhttp: ", "")
	return strings.ReplaceAll(s, "idem: ", "")
}
