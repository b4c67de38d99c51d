package rpcidem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/front"
	"github.com/pgidem/idem/internal/keyhdr"
	"github.com/pgidem/idem/internal/loghash"
)

// The gRPC status codes (Connect's codes are the same numbers) that the
// decisions here name.
const (
	CodeCanceled           uint32 = 1
	CodeInvalidArgument    uint32 = 3
	CodeDeadlineExceeded   uint32 = 4
	CodeFailedPrecondition uint32 = 9
	CodeAborted            uint32 = 10
	CodeUnimplemented      uint32 = 12
	CodeInternal           uint32 = 13
	CodeUnavailable        uint32 = 14
	CodeUnauthenticated    uint32 = 16
)

// Failure is an error that the interceptor answers itself, before its
// transport shapes it: a gRPC status code, a message, and for the
// interceptor's own errors an ErrorInfo reason and perhaps a RetryInfo.
type Failure struct {
	Code    uint32
	Message string

	// Reason is the ErrorInfo reason (ErrorDomain); "" for none.
	Reason string

	// Retry asks for a RetryInfo detail with RetryDelay.
	Retry      bool
	RetryDelay time.Duration

	// Cause is the error Message comes from, for a transport whose errors
	// wrap one (connect-go's); nil for none.
	Cause error
}

// FailureError is an error of a Call's Reply that answers the call with
// Failure as it is: the handler's writes roll back and nothing is stored,
// as for any error of Reply, but the client gets Failure, not INTERNAL.
type FailureError struct{ Failure *Failure }

func (e *FailureError) Error() string { return e.Failure.Message }
func (e *FailureError) Unwrap() error { return e.Failure.Cause }

// Transport is what Core knows of an interceptor's transport: the same for
// every interceptor of a package.
type Transport struct {
	// Name is the interceptor's package name ("idemgrpc"): the prefix of
	// its errors and log messages.
	Name string

	// ProcedureAttr is the name of the log attribute of the procedure
	// ("method", "procedure").
	ProcedureAttr string

	// KeySource names where the key travels ("idempotency-key metadata"),
	// in messages; KeyMissing is the message of a missing required key.
	KeySource  string
	KeyMissing string

	// Reserved are the prefixes no stored name may start with (the
	// transport's own: "grpc-"), and NameKind what a stored name is
	// called in errors ("metadata key").
	Reserved []string
	NameKind string

	// RawBinary says that the transport hands binary ("-bin") values over
	// raw (gRPC's metadata): Stored encodes them in base64.
	RawBinary bool
}

// Options are what Core needs of an interceptor's options: its
// transport's, and the user's options of the same names (ScopeSet: Scope
// is not nil; RefusalCodes: the codes, not nil).
type Options struct {
	Transport
	ScopeSet       bool
	RequireKey     bool
	KeyField       string
	RefusalCodes   []uint32
	StoredHeaders  []string
	StoredTrailers []string
	Logger         *slog.Logger
	Config         idem.Config
}

// Core is the part of an interceptor that depends on no transport: its
// options, the rules of the key, the scope and the stored names, the run
// of the handler in the store's DoInTx and the mapping of idem's errors to
// statuses.
type Core struct {
	opts      Options
	store     front.Store
	client    *idem.Client
	headers   []string // stored names, lower case, each once
	trailers  []string
	log       *slog.Logger
	hash      *loghash.Hasher // of keys in log records
	notStored error
}

// New returns the Core of an interceptor whose store open returns for the
// configured client (front.Pgx or front.SQL on the application's handle),
// or the error of invalid options (no Scope, a stored name that HeaderName
// refuses, a Config that idem.New refuses) or of open (a nil handle).
func New(opts Options, open front.Open) (*Core, error) {
	if !opts.ScopeSet {
		return nil, errors.New(opts.Name + ": Options.Scope is required")
	}
	if len(opts.Config.LogHashKey) == 0 {
		// The process's random secret, for idem's logs and the
		// interceptor's: both hash a key alike.
		opts.Config.LogHashKey = loghash.Default()
	}
	client, err := idem.New(opts.Config)
	if err != nil {
		return nil, fmt.Errorf("%s: Options.Config: %w", opts.Name, err)
	}
	store, err := open(client)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", opts.Name, err)
	}
	c := &Core{
		opts:      opts,
		store:     store,
		client:    client,
		log:       opts.Logger,
		hash:      loghash.New(opts.Config.LogHashKey),
		notStored: errors.New(opts.Name + ": the handler's error is not stored"),
	}
	c.opts.RefusalCodes = slices.Clone(opts.RefusalCodes)
	if c.log == nil {
		c.log = slog.Default()
	}
	for _, list := range []struct {
		in  []string
		out *[]string
	}{{opts.StoredHeaders, &c.headers}, {opts.StoredTrailers, &c.trailers}} {
		for _, name := range list.in {
			if !HeaderName(name, opts.Reserved...) {
				return nil, fmt.Errorf("%s: Options.StoredHeaders, StoredTrailers: invalid %s %q", opts.Name, opts.NameKind, name)
			}
			if name = strings.ToLower(name); !slices.Contains(*list.out, name) {
				*list.out = append(*list.out, name)
			}
		}
	}
	return c, nil
}

// Name is the interceptor's package name, the prefix of its errors.
func (c *Core) Name() string { return c.opts.Name }

// HeaderName reports whether name can be stored as the name of a header or
// trailer: an RFC 9110 token, as idemhttp's stored header names (idem
// refuses to store any other name), without '~' (which marks idem's own
// entries, TrailerPrefix and ReplyType), that starts with none of reserved,
// the transport's own prefixes ("grpc-"), compared without case.
func HeaderName(name string, reserved ...string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		if !keyhdr.IsTchar(name[i]) || name[i] == '~' {
			return false
		}
	}
	lower := strings.ToLower(name)
	for _, prefix := range reserved {
		if strings.HasPrefix(lower, prefix) {
			return false
		}
	}
	return true
}

// ProcedureName reports whether name is a procedure's full name as gRPC's
// full methods and Connect's procedures spell it, "/pkg.Service/Method": a
// slash, a service and a method, neither empty nor holding a slash. A name
// of another form matches no call.
func ProcedureName(name string) bool {
	rest, ok := strings.CutPrefix(name, "/")
	service, method, ok2 := strings.Cut(rest, "/")
	return ok && ok2 && service != "" && method != "" && !strings.Contains(method, "/")
}

// Codes returns codes as numbers.
func Codes[C ~uint32](codes []C) []uint32 {
	out := make([]uint32, len(codes))
	for i, c := range codes {
		out[i] = uint32(c)
	}
	return out
}

// Key returns the call's key ("" for none) from the values of its key
// metadata or header, and field, the value of the request's key field (""
// for none), or the failure to answer. Either place may carry the key; both
// must then hold the same one.
func (c *Core) Key(values []string, field string) (string, *Failure) {
	present := len(values) > 0 // an empty value is an invalid key, not none
	key, err := keyhdr.Parse(values)
	if err != nil && present {
		return "", invalid(ReasonKeyInvalid, "invalid "+c.opts.KeySource+": "+err.Error())
	}
	if field != "" {
		if key != "" && key != field {
			return "", invalid(ReasonKeyInvalid,
				fmt.Sprintf("the %s and the request field %s hold different keys", c.opts.KeySource, c.opts.KeyField))
		}
		key, present = field, true
	}
	if !present {
		if c.opts.RequireKey {
			return "", invalid(ReasonKeyMissing, c.opts.KeyMissing)
		}
		return "", nil
	}
	if err := c.client.ValidateKey(key); err != nil {
		return "", invalid(ReasonKeyInvalid, errorText(err)) // "invalid idempotency key: why"
	}
	return key, nil
}

func invalid(reason, msg string) *Failure {
	return &Failure{Code: CodeInvalidArgument, Reason: reason, Message: msg}
}

// Scope checks scope and err, what Options.Scope returned (err, when not
// nil, is not one the transport passes on as it is), and returns nil or the
// failure to answer: UNAUTHENTICATED for an error or an actor that
// idem.ValidateScope refuses, INTERNAL for an operation it refuses.
func (c *Core) Scope(scope idem.Scope, err error) *Failure {
	if err != nil || idem.ValidateScope(idem.Scope{Actor: scope.Actor, Operation: "-"}) != nil {
		return &Failure{Code: CodeUnauthenticated, Message: "the call is not authenticated"}
	}
	if err := idem.ValidateScope(scope); err != nil {
		cause := fmt.Errorf("%s: Options.Scope: %w", c.opts.Name, err)
		return &Failure{Code: CodeInternal, Message: cause.Error(), Cause: cause}
	}
	return nil
}

// Stored returns the stored form of the chosen headers and trailers (see
// the package doc), or nil for none; header and trailer return the values
// of a name (in lower case) that the handler set.
func (c *Core) Stored(header, trailer func(name string) []string) map[string][]string {
	var out map[string][]string
	add := func(prefix string, names []string, get func(string) []string) {
		for _, name := range names {
			values := get(name)
			if len(values) == 0 {
				continue
			}
			if out == nil {
				out = map[string][]string{}
			}
			stored := make([]string, len(values))
			for i, v := range values {
				if c.opts.RawBinary && IsBinary(name) {
					v = EncodeBinary(v)
				}
				stored[i] = v
			}
			out[prefix+name] = stored
		}
	}
	add("", c.headers, header)
	add(TrailerPrefix, c.trailers, trailer)
	return out
}

// Raw turns stored metadata (a map of Entries) back into what the
// transport hands over: with Options.RawBinary, each binary value decoded
// (Stored's inverse), in place. A value that does not decode is an error
// naming its entry.
func (c *Core) Raw(stored map[string][]string) error {
	if !c.opts.RawBinary {
		return nil
	}
	for name, values := range stored {
		if !IsBinary(name) {
			continue
		}
		for i, v := range values {
			raw, err := DecodeBinary(v)
			if err != nil {
				return fmt.Errorf("stored metadata %s: %w", name, err)
			}
			values[i] = raw
		}
	}
	return nil
}

// Call is the transport's side of one call with a key, as Core.Do runs it.
type Call interface {
	// Handle runs the handler once, in the transaction that ctx carries
	// (which the interceptor's Tx or TxSQL returns), keeps its answer and
	// returns its error.
	Handle(ctx context.Context) error

	// Code is the status code of err, an error Handle returned.
	Code(err error) uint32

	// Reply is the stored form of the last Handle's reply: the chosen
	// headers and trailers (see the package doc) and the marshalled
	// message, or an error, a *FailureError for one the call answers as
	// it says. Refusal is the same for err, the last Handle's error, a
	// refusal: its Body is the marshalled google.rpc.Status.
	Reply() (header map[string][]string, body []byte, err error)
	Refusal(err error) (header map[string][]string, body []byte, err2 error)
}

// Do runs the call of procedure with scope, key and fp in the store's
// DoInTx and decides its outcome: a reply commits with the key; an error
// whose code Options.RefusalCodes holds is a refusal, stored, the handler's
// writes rolled back; any other error stores nothing. A transaction lost
// under the handler runs it again (the store sees it).
//
// It returns the stored outcome to replay (replayed true), or the failure
// to answer, or neither: then the last Handle's own answer goes to the
// client.
func (c *Core) Do(ctx context.Context, procedure string, scope idem.Scope, key string, fp idem.Fingerprint, call Call) (stored idem.Response, replayed bool, f *Failure) {
	res, err := c.store.DoInTx(ctx, scope, key, fp, func(ctx context.Context) (idem.Response, error) {
		if herr := call.Handle(ctx); herr != nil {
			code := call.Code(herr)
			if !slices.Contains(c.opts.RefusalCodes, code) {
				return idem.Response{}, c.notStored
			}
			header, body, err := call.Refusal(herr)
			if err != nil {
				return idem.Response{}, err
			}
			return idem.Response{}, idem.Reject(idem.Response{Status: HTTPStatus(code), Header: header, Body: body})
		}
		header, body, err := call.Reply()
		if err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: StatusReply, Header: header, Body: body}, nil
	})
	switch {
	case err == nil && res.Replayed:
		return res.Response, true, nil
	case err == nil, errors.Is(err, c.notStored) && !idem.Unavailable(err):
		return idem.Response{}, false, nil
	}
	if fe := (*FailureError)(nil); errors.As(err, &fe) && !idem.Unavailable(err) {
		return idem.Response{}, false, fe.Failure
	}
	return idem.Response{}, false, c.storeError(ctx, procedure, key, err)
}

// storeError is the failure to answer for err, an error of idem (or of the
// store under it) for a call of procedure with key. Those answered
// UNAVAILABLE or INTERNAL are logged.
func (c *Core) storeError(ctx context.Context, procedure, key string, err error) *Failure {
	var inProgress *idem.InProgressError
	switch {
	case errors.Is(err, idem.ErrKeyReused):
		return &Failure{Code: CodeFailedPrecondition, Reason: ReasonKeyReused,
			Message: "this idempotency key was used for a different request"}
	case errors.As(err, &inProgress):
		return &Failure{Code: CodeAborted, Reason: ReasonInProgress,
			Message: "a call with this idempotency key is in progress; retry later with the same key",
			Retry:   true, RetryDelay: inProgress.RetryAfter}
	case errors.Is(err, idem.ErrOutcomeUnknown):
		return &Failure{Code: CodeFailedPrecondition, Reason: ReasonOutcomeUnknown,
			Message: "the outcome of the call with this idempotency key is unknown; it will not run again until it is reconciled"}
	case errors.Is(err, idem.ErrResponseGone):
		return &Failure{Code: CodeFailedPrecondition, Reason: ReasonResponseExpired,
			Message: "the call with this idempotency key ran and finished; its stored response has expired and it will not run again"}
	case errors.Is(err, idem.ErrInvalidKey):
		return invalid(ReasonKeyInvalid, errorText(err)) // "invalid idempotency key: why"
	case ctx.Err() != nil:
		code := CodeCanceled
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			code = CodeDeadlineExceeded
		}
		return &Failure{Code: code, Message: ctx.Err().Error(), Cause: ctx.Err()}
	case errors.Is(err, idem.ErrTxAborted):
		// A bug of the handler's: it swallowed a failed statement and
		// answered as though it had not.
		c.logFailure(ctx, c.opts.Name+": the handler's transaction was aborted by a statement it did not report; nothing stored", procedure, key, err)
		return &Failure{Code: CodeInternal, Message: c.opts.Name + ": the call failed; nothing was stored: " + errorText(err)}
	case idem.Unavailable(err):
		c.logFailure(ctx, c.opts.Name+": store unavailable", procedure, key, err)
		return &Failure{Code: CodeUnavailable, Reason: ReasonStoreUnavailable,
			Message: "the idempotency store is unavailable; retry later with the same key",
			Retry:   true, RetryDelay: time.Second}
	}
	c.logFailure(ctx, c.opts.Name+": call failed", procedure, key, err)
	return &Failure{Code: CodeInternal, Message: c.opts.Name + ": the call failed; nothing was stored: " + errorText(err)}
}

// LogInternal logs f, a failure that the interceptor answers itself as
// INTERNAL outside Do (a scope, a request or a stored outcome it cannot
// use), for a call of procedure with key, as Do logs its own INTERNAL.
// Other failures are not.
func (c *Core) LogInternal(ctx context.Context, procedure, key string, f *Failure) {
	if f.Code != CodeInternal {
		return
	}
	var err error = f.Cause
	if err == nil {
		err = errors.New(f.Message)
	}
	c.logFailure(ctx, c.opts.Name+": call failed", procedure, key, err)
}

// logFailure logs err, which the interceptor answers itself, with the
// keyed hash of key.
func (c *Core) logFailure(ctx context.Context, msg, procedure, key string, err error) {
	c.log.LogAttrs(ctx, slog.LevelError, msg, slog.String(c.opts.ProcedureAttr, procedure),
		slog.String("key_hash", c.hash.Sum(key)), slog.Any("error", err))
}

// errorText returns err's message without the package prefixes of idem.
func errorText(err error) string {
	return strings.ReplaceAll(err.Error(), "idem: ", "")
}
