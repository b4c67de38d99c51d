package idemconnect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/front"
	"github.com/pgidem/idem/internal/rpcidem"
	"github.com/pgidem/idem/internal/rpcproto"
)

// HeaderKey is the request header that carries the idempotency key: a bare
// key or an RFC 8941 string, as for idemhttp.
const HeaderKey = "Idempotency-Key"

// HeaderReplayed is the response header set to "true" on a replay.
const HeaderReplayed = "Idempotent-Replayed"

// ErrorDomain is the domain of the ErrorInfo detail of the interceptor's
// own errors, whose reason is one of the Reason constants.
const ErrorDomain = "github.com/pgidem/idem"

// The reasons of the ErrorInfo detail of the interceptor's own errors.
const (
	ReasonKeyMissing       = "IDEMPOTENCY_KEY_MISSING"      // invalid_argument: Options.RequireKey and no key
	ReasonKeyInvalid       = "IDEMPOTENCY_KEY_INVALID"      // invalid_argument: a malformed key, two keys, or one idem.ValidateKey refuses
	ReasonKeyReused        = "IDEMPOTENCY_KEY_REUSED"       // failed_precondition: the same key with a different request
	ReasonInProgress       = "REQUEST_IN_PROGRESS"          // aborted, with RetryInfo: a call with the key is still running
	ReasonOutcomeUnknown   = "IDEMPOTENCY_OUTCOME_UNKNOWN"  // failed_precondition: a reservation's outcome must be reconciled first
	ReasonResponseExpired  = "IDEMPOTENCY_RESPONSE_EXPIRED" // failed_precondition: the call ran, its stored response was dropped (idem.Config.BodyTTL); it does not run again
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"            // unavailable, with RetryInfo: the database could not serve
)

// DefaultRefusalCodes are the codes stored as deterministic refusals when
// Options.RefusalCodes is nil.
var DefaultRefusalCodes = []connect.Code{connect.CodeFailedPrecondition, connect.CodeInvalidArgument,
	connect.CodeOutOfRange, connect.CodeNotFound}

// Options configures NewInterceptor. Scope is required; every other field's
// zero value means its default.
type Options struct {
	// Scope returns the scope of a call with a key: the actor, from
	// authentication (an interceptor before this one), never from the
	// request; and the operation, usually procedure itself
	// ("/pkg.Service/Method"). An error is returned to the client as it is
	// when it is a *connect.Error, as unauthenticated otherwise, and so is
	// an actor that idem.ValidateScope refuses; an operation it refuses is
	// internal. Nothing runs then. Required.
	Scope func(ctx context.Context, procedure string) (idem.Scope, error)

	// Procedures are the procedures the interceptor covers
	// ("/pkg.Service/Method"). Calls of other procedures pass straight to
	// the handler, without a transaction, whatever key they carry.
	// NewInterceptor panics on a name of another form, which would match no
	// call. Default: every unary procedure.
	Procedures []string

	// RequireKey refuses a covered call without a key with
	// invalid_argument (reason IDEMPOTENCY_KEY_MISSING). Default false:
	// such a call runs as if the interceptor were not there, without a
	// transaction (Tx returns nil), and nothing is stored.
	RequireKey bool

	// KeyField names a string field of request messages that carries the
	// key (AIP-155's "request_id"), by its name in the .proto file. A
	// request whose message has the field set takes its key from it; the
	// header, if sent too, must hold the same key (invalid_argument
	// otherwise). Requests without the field, or with it empty, take the
	// key from the header. Default "": the header only.
	KeyField string

	// RefusalCodes are the codes that, returned by the handler, are
	// deterministic refusals: the handler's writes are rolled back, and the
	// error (code, message, details, chosen metadata) is stored with the key
	// and returned to every retry. A handler error with another code stores
	// nothing, so a retry runs again. Default: DefaultRefusalCodes
	// (failed_precondition, invalid_argument, out_of_range, not_found).
	RefusalCodes []connect.Code

	// StoredHeaders and StoredTrailers are the response headers and
	// trailers that are stored with the outcome and sent again on a replay:
	// those of the handler's *connect.Response, those it set through
	// connect.CallInfoForHandlerContext, and for a refusal the
	// *connect.Error's Meta (stored as headers); not those an interceptor
	// before this one set, which it sets again on a replay (so a name the
	// handler replaced or deleted after such an interceptor set it comes
	// back on a replay with that interceptor's values too, the handler's
	// stored ones added after them). The first call sends
	// everything the handler set; a replay only these, plus
	// Idempotent-Replayed: true. Keep secrets out. Each must be an HTTP
	// token (RFC 9110: letters, digits and !#$%&'*+-.^_`|) without '~'
	// (idem marks its own stored entries with it) that does not start with
	// "connect-" or "grpc-"; NewInterceptor panics otherwise. Default: none.
	StoredHeaders  []string
	StoredTrailers []string

	// Logger receives a record for every error the interceptor answers
	// itself as UNAVAILABLE or INTERNAL (a store that failed, an outcome
	// that could not be stored), with the procedure and the keyed hash of the
	// key (key_hash, HMAC-SHA256 under Config.LogHashKey, as in idem's own
	// records), never the key. Default: slog.Default().
	Logger *slog.Logger

	// Citus says that the *sql.DB of NewInterceptorSQL is a Citus coordinator
	// with idem_keys distributed by actor (idem.Distribute): the store's
	// statements then take the forms Citus accepts, those of an
	// idemsql.NewCitus Client (a *sql.DB does not say what it is connected
	// to). Without it, NewInterceptorSQL on a coordinator answers every call
	// with a key internal (idem.ErrUnsupported, logged). The pgx form ignores
	// it: a pgx handle finds out by itself. Default false.
	Citus bool

	// Config configures the idempotency store (see idem.Config): the key's
	// TTL (default 24 h), how long a duplicate waits for the call that holds
	// its key before it gets aborted (Wait, default 2 s), the key length
	// bounds, the largest stored outcome (MaxResponseBytes, default 1 MiB),
	// the isolation level and the retries after serialization failures.
	Config idem.Config
}

// txs holds the call's transaction in the handler's context: a pgx.Tx or
// a *sql.Tx.
var txs front.Txs

// Tx returns the transaction of the covered call with a key that ctx
// belongs to (the handler's context), or nil for a call without a key or a
// procedure the interceptor does not cover.
//
// The handler's writes through it commit together with the stored reply
// when the handler returns a response, and are rolled back when it returns
// an error. The handler must not commit or roll it back, nor keep it after
// returning. After a serialization failure or a deadlock, met by one of the
// handler's statements or at COMMIT, the handler runs again in a new
// transaction (Config.MaxRetries), so it must not have effects outside the
// transaction. The response headers and trailers a run that is rolled back
// set through connect.CallInfoForHandlerContext are dropped: the client gets
// those of the last run only (or, when that run finds the key's outcome
// stored by another call, the stored ones).
func Tx(ctx context.Context) pgx.Tx { return txs.PgxTx(ctx) }

// NewInterceptor returns an interceptor that makes covered unary calls
// (Options.Procedures) that carry a key idempotent, with the handler's
// writes in the transaction of the key. Streaming calls and clients pass
// through.
//
// The key comes from the Idempotency-Key header (or Options.KeyField) and
// is read and checked as idemhttp reads it: a bare key or an RFC 8941
// string, 1 to 255 bytes of visible ASCII (Config's bounds). The
// fingerprint is the procedure and the request message marshalled
// deterministically (protobuf's Deterministic option), versioned
// ("idemrpc/1", as idemgrpc's: the same call through either replays the
// other's outcome); the codec the client used does not count. The handler
// then runs in idem.DoInTx on db, and its outcome decides what is stored:
//
//   - a response: the handler's writes, the key and the reply (its message,
//     the full name of its type, and the chosen headers and trailers)
//     commit together; the client gets the response after the commit.
//   - an error whose code Options.RefusalCodes holds: a deterministic
//     refusal. The handler's writes are rolled back; the error (code,
//     message, details) is stored and returned to every retry.
//   - any other error, or a panic: everything is rolled back and nothing is
//     stored; the error (or panic) goes on as it is, and a retry runs again.
//
// A later call with the same scope, key and request gets the stored outcome
// and the handler does not run: a response whose message is the stored
// bytes decoded into the stored type, which the codec of the retry encodes
// (in the binary codec byte for byte the first reply's bytes, except that
// map entries go in the codec's order), or the stored error; with the
// stored headers and trailers and Idempotent-Replayed: true. The type is
// the one registered under the stored name in protoregistry.GlobalTypes
// (generated code registers every message), so a handler built without
// connect.WithSchema replays too; or else, for a reply of the procedure's
// own reply type that is not registered there, a dynamicpb message of the
// type that the handler's Spec().Schema (or protoregistry.GlobalFiles)
// gives the procedure. A reply that is neither could not be replayed: the
// call that returns it fails with unimplemented (the procedure cannot be
// served idempotently until its reply type is registered), saying which
// type, and nothing of it commits. A replayed response is not a *connect.Response of the handler's
// type: interceptors outside this one that read it should use Any() and
// proto.Message.
//
// The interceptor's own errors change nothing, and carry an ErrorInfo
// detail (ErrorDomain, a Reason constant):
//
//	no key, Options.RequireKey        invalid_argument     IDEMPOTENCY_KEY_MISSING
//	malformed or invalid key          invalid_argument     IDEMPOTENCY_KEY_INVALID
//	same key, different request       failed_precondition  IDEMPOTENCY_KEY_REUSED
//	a call with the key in progress   aborted + RetryInfo  REQUEST_IN_PROGRESS
//	a reservation's outcome unknown   failed_precondition  IDEMPOTENCY_OUTCOME_UNKNOWN
//	store down (idem.Unavailable)     unavailable + RetryInfo  STORE_UNAVAILABLE
//
// An unknown outcome is failed_precondition because retrying does not help:
// the key was used through idem.Reserve for work outside the database,
// which an operator must reconcile first (idem.Resolve). unavailable
// includes a connection lost at COMMIT: the client retries with the same
// key, and the retry replays if the commit happened and runs otherwise. A
// call whose context ends first gets canceled or deadline_exceeded. An
// outcome that cannot be stored (over Config.MaxResponseBytes, a message
// that is not protobuf) is internal, and one whose type a replay could not
// find unimplemented, both with the handler's writes rolled back.
//
// NewInterceptor panics if db is nil (a typed nil *pgxpool.Pool too) or
// opts is invalid (nil Scope, a stored name that is not a token, a Config
// that idem.New refuses, a procedure that is not a procedure name): a
// programming error to find at start-up.
func NewInterceptor(db idem.Beginner, opts Options) connect.Interceptor {
	return mustInterceptor(opts, txs.Pgx(db))
}

// connectTransport is what the interceptor's core knows of Connect.
var connectTransport = rpcidem.Transport{Name: "idemconnect", ProcedureAttr: "procedure",
	KeySource: "Idempotency-Key header", KeyMissing: "this procedure requires an Idempotency-Key header",
	Reserved: []string{"connect-", "grpc-"}, NameKind: "header name"}

// mustInterceptor returns the interceptor with opts on the store open
// returns, and panics on invalid options.
func mustInterceptor(opts Options, open front.Open) *interceptor {
	refusals := opts.RefusalCodes
	if refusals == nil {
		refusals = DefaultRefusalCodes
	}
	srv, err := rpcproto.New(rpcidem.Options{Transport: connectTransport, ScopeSet: opts.Scope != nil,
		RequireKey: opts.RequireKey, KeyField: opts.KeyField, RefusalCodes: rpcidem.Codes(refusals),
		StoredHeaders: opts.StoredHeaders, StoredTrailers: opts.StoredTrailers, Logger: opts.Logger, Config: opts.Config}, open)
	if err != nil {
		panic(err)
	}
	for _, p := range opts.Procedures {
		if !rpcidem.ProcedureName(p) {
			panic(fmt.Errorf("idemconnect: Options.Procedures: %q is not a procedure name (/pkg.Service/Method)", p))
		}
	}
	return &interceptor{srv: srv, scope: opts.Scope, procedures: slices.Clone(opts.Procedures)}
}

// interceptor is the configured interceptor.
type interceptor struct {
	srv        *rpcproto.Server
	scope      func(ctx context.Context, procedure string) (idem.Scope, error)
	procedures []string
}

// WrapStreamingClient passes streaming clients through.
func (in *interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

// WrapStreamingHandler passes streaming handlers through.
func (in *interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// WrapUnary makes covered unary handlers idempotent; clients pass through.
func (in *interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		spec := req.Spec()
		if spec.IsClient || len(in.procedures) > 0 && !slices.Contains(in.procedures, spec.Procedure) {
			return next(ctx, req)
		}
		c := &call{in: in, req: req, next: next}
		// What interceptors before this one set goes out with every run, a
		// replay and a failure (see call.restore).
		c.info, _ = connect.CallInfoForHandlerContext(ctx)
		schema, _ := spec.Schema.(protoreflect.MethodDescriptor)
		return rpcproto.Serve(ctx, in.srv, c, rpcproto.Request{Procedure: spec.Procedure,
			Keys: req.Header().Values(HeaderKey), Message: req.Any(), Schema: schema})
	}
}

// call is one covered call, as rpcproto.Serve runs it.
type call struct {
	in   *interceptor
	req  connect.AnyRequest
	next connect.UnaryFunc
	info connect.CallInfo // nil outside a handler

	// header and trailer are info's response header and trailer before
	// the first run (ran): a run that is rolled back leaves nothing it set
	// there.
	ran             bool
	header, trailer http.Header

	resp connect.AnyResponse // of the last run of the handler
	err  error
}

func (c *call) Pass(ctx context.Context) (connect.AnyResponse, error) { return c.next(ctx, c.req) }

func (c *call) Scope(ctx context.Context) (idem.Scope, error) {
	return c.in.scope(ctx, c.req.Spec().Procedure)
}

// AsIs passes on an error of Options.Scope that is a *connect.Error.
func (c *call) AsIs(err error) error {
	if ce := (*connect.Error)(nil); errors.As(err, &ce) {
		return ce
	}
	return nil
}

func (c *call) Fail(f *rpcidem.Failure) error {
	c.restore()
	if f.Reason == "" {
		cause := f.Cause
		if cause == nil {
			cause = errors.New(f.Message)
		}
		return connect.NewError(connect.Code(f.Code), cause)
	}
	return statusError(rpcproto.Status(f))
}

func (c *call) Handle(ctx context.Context) error {
	if !c.ran && c.info != nil {
		c.header, c.trailer = c.info.ResponseHeader().Clone(), c.info.ResponseTrailer().Clone()
	}
	c.ran = true
	c.restore()
	c.resp, c.err = c.next(ctx, c.req)
	return c.err
}

// restore sets info's response header and trailer back to what they were
// before the first run.
func (c *call) restore() {
	if c.info == nil || !c.ran {
		return
	}
	for _, h := range []struct{ now, was http.Header }{{c.info.ResponseHeader(), c.header}, {c.info.ResponseTrailer(), c.trailer}} {
		clear(h.now)
		for name, values := range h.was {
			h.now[name] = slices.Clone(values)
		}
	}
}

func (c *call) Code(err error) uint32 { return uint32(connect.CodeOf(err)) }

func (c *call) Reply() (any, map[string][]string) {
	header, trailer := c.resp.Header(), c.resp.Trailer()
	if c.info != nil {
		header, trailer = merged(header, handlerSet(c.info.ResponseHeader(), c.header)),
			merged(trailer, handlerSet(c.info.ResponseTrailer(), c.trailer))
	}
	return c.resp.Any(), c.in.srv.Core().Stored(header.Values, trailer.Values)
}

// Refusal is the status of herr, the handler's error, a refusal, and its
// stored metadata.
func (c *call) Refusal(herr error) (*spb.Status, map[string][]string) {
	code := connect.CodeOf(herr)
	st := &spb.Status{Code: int32(code), Message: herr.Error()}
	var meta http.Header
	if ce := (*connect.Error)(nil); errors.As(herr, &ce) {
		st.Message = ce.Message()
		for _, d := range ce.Details() {
			st.Details = append(st.Details, &anypb.Any{TypeUrl: "type.googleapis.com/" + d.Type(), Value: d.Bytes()})
		}
		meta = ce.Meta()
	}
	if c.info != nil {
		meta = merged(merged(meta, handlerSet(c.info.ResponseHeader(), c.header)), handlerSet(c.info.ResponseTrailer(), c.trailer))
	}
	// An error's metadata travels as one set (headers or trailers,
	// depending on the protocol): the chosen headers and trailers in it are
	// stored as headers.
	all := c.in.srv.Core().Stored(meta.Values, meta.Values)
	var stored map[string][]string
	for name, values := range all {
		n, isTrailer := strings.CutPrefix(name, rpcidem.TrailerPrefix)
		if _, dup := all[n]; isTrailer && dup {
			continue
		}
		if stored == nil {
			stored = map[string][]string{}
		}
		stored[n] = values
	}
	return st, stored
}

// handlerSet returns what the last run set in now, info's response header
// or trailer, beyond was, its values before the first run (which
// interceptors before this one set, and set again on a replay): the values
// the run added to a name, or all of them when it replaced the name's.
func handlerSet(now, was http.Header) http.Header {
	var out http.Header
	for name, values := range now {
		if before := was[name]; len(values) >= len(before) && slices.Equal(values[:len(before)], before) {
			values = values[len(before):]
		}
		if len(values) == 0 {
			continue
		}
		if out == nil {
			out = http.Header{}
		}
		out[name] = values
	}
	return out
}

// merged returns a and b together (either may be nil; neither changes).
func merged(a, b http.Header) http.Header {
	if len(b) == 0 {
		return a
	}
	out := a.Clone()
	if out == nil {
		out = http.Header{}
	}
	for name, values := range b {
		out[name] = append(out[name], values...)
	}
	return out
}

// replayed is the response message of a replay: the stored reply, as its
// stored type. It is a proto.Message through the one it embeds, so every
// codec encodes it as that message.
type replayed struct{ proto.Message }

// Replay answers with a stored outcome. Binary ("-bin") values are stored
// as they travel, base64 (connect.DecodeBinaryHeader reads them padded or
// not).
func (c *call) Replay(_ context.Context, r rpcproto.Replay) (connect.AnyResponse, error) {
	c.restore()
	header, trailer := http.Header{}, http.Header{}
	for _, set := range []struct {
		stored map[string][]string
		h      http.Header
	}{{r.Header, header}, {r.Trailer, trailer}} {
		for name, values := range set.stored {
			for _, v := range values {
				set.h.Add(name, v)
			}
		}
	}
	header.Set(HeaderReplayed, "true")
	if r.Status != nil {
		ce := statusError(r.Status)
		for _, h := range []http.Header{header, trailer} {
			for name, values := range h {
				ce.Meta()[name] = append(ce.Meta()[name], values...)
			}
		}
		return nil, ce
	}
	resp := connect.NewResponse(&replayed{r.Reply})
	for name, values := range header {
		resp.Header()[name] = values
	}
	for name, values := range trailer {
		resp.Trailer()[name] = values
	}
	return resp, nil
}

// Own is the handler's own answer, with what its last run set.
func (c *call) Own() (connect.AnyResponse, error) { return c.resp, c.err }

// statusError is the *connect.Error of st.
func statusError(st *spb.Status) *connect.Error {
	ce := connect.NewError(connect.Code(st.Code), errors.New(st.Message))
	for _, d := range st.Details {
		if detail, err := connect.NewErrorDetail(d); err == nil {
			ce.AddDetail(detail)
		}
	}
	return ce
}
