// Package idemconnect is a connect-go interceptor that makes unary calls
// idempotent by their Idempotency-Key header, with the handler's own
// database writes in the same PostgreSQL transaction as the key and the
// stored reply.
//
//	interceptor := idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scopeOf})
//	mux.Handle(ordersv1connect.NewOrderServiceHandler(svc, connect.WithInterceptors(auth, interceptor)))
//
//	func (s *orders) PlaceOrder(ctx context.Context, req *connect.Request[pb.PlaceOrderRequest]) (*connect.Response[pb.Order], error) {
//		tx := idemconnect.Tx(ctx) // writes here commit with the key and the reply; nil without a key
//		...
//	}
//
// It serves the Connect, gRPC and gRPC-Web protocols alike: a client sends
// a new key (a UUID, say) in the Idempotency-Key header with each new
// intent, and the same key with every retry of it (or in a request field,
// AIP-155's request_id: Options.KeyField). The first call runs the handler
// in a transaction; its reply, or its refusal, commits with the key. A retry
// gets the same reply with Idempotent-Replayed: true and the handler does
// not run. See NewInterceptor for the whole contract, and docs/rpc.md in the
// repository.
//
// Run idem.Migrate once before use.
package idemconnect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/rpcidem"
)

// HeaderKey is the request header that carries the idempotency key: a bare
// key or an RFC 8941 string, as for idemhttp.
const HeaderKey = "Idempotency-Key"

// HeaderReplayed is the response header set to "true" on a replay.
const HeaderReplayed = "Idempotent-Replayed"

// ErrorDomain is the domain of the ErrorInfo detail of the interceptor's
// own errors, whose reason is one of the Reason constants.
const ErrorDomain = rpcidem.ErrorDomain

// The reasons of the ErrorInfo detail of the interceptor's own errors.
const (
	ReasonKeyMissing       = rpcidem.ReasonKeyMissing       // invalid_argument: Options.RequireKey and no key
	ReasonKeyInvalid       = rpcidem.ReasonKeyInvalid       // invalid_argument: a malformed key, two keys, or one idem.ValidateKey refuses
	ReasonKeyReused        = rpcidem.ReasonKeyReused        // failed_precondition: the same key with a different request
	ReasonInProgress       = rpcidem.ReasonInProgress       // aborted, with RetryInfo: a call with the key is still running
	ReasonOutcomeUnknown   = rpcidem.ReasonOutcomeUnknown   // failed_precondition: a reservation's outcome must be reconciled first
	ReasonStoreUnavailable = rpcidem.ReasonStoreUnavailable // unavailable, with RetryInfo: the database could not serve
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

	// Procedures are the procedures the interceptor covers. Calls of
	// other procedures pass straight to the handler, without a
	// transaction, whatever key they carry. Default: every unary procedure.
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
	// *connect.Error's Meta (stored as headers). The first call sends
	// everything the handler set; a replay only these, plus
	// Idempotent-Replayed: true. Keep secrets out. Each must be an HTTP
	// token (RFC 9110: letters, digits and !#$%&'*+-.^_`|~) that does not
	// start with "connect-" or "grpc-"; NewInterceptor panics otherwise.
	// Default: none.
	StoredHeaders  []string
	StoredTrailers []string

	// Logger receives a record for every error the interceptor answers
	// itself as UNAVAILABLE or INTERNAL (a store that failed, an outcome
	// that could not be stored), with the procedure and the keyed hash of the
	// key (key_hash, HMAC-SHA256 under Config.LogHashKey, as in idem's own
	// records), never the key. Default: slog.Default().
	Logger *slog.Logger

	// Config configures the idempotency store (see idem.Config): the key's
	// TTL (default 24 h), how long a duplicate waits for the call that holds
	// its key before it gets aborted (Wait, default 2 s), the key length
	// bounds, the largest stored outcome (MaxResponseBytes, default 1 MiB),
	// the isolation level and the retries after serialization failures.
	Config idem.Config
}

// txKey is the context key of the call's transaction.
type txKey struct{}

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
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := ctx.Value(txKey{}).(pgx.Tx)
	return tx
}

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
//     and the chosen headers and trailers) commit together; the client gets
//     the response after the commit.
//   - an error whose code Options.RefusalCodes holds: a deterministic
//     refusal. The handler's writes are rolled back; the error (code,
//     message, details) is stored and returned to every retry.
//   - any other error, or a panic: everything is rolled back and nothing is
//     stored; the error (or panic) goes on as it is, and a retry runs again.
//
// A later call with the same scope, key and request gets the stored outcome
// and the handler does not run: a response whose message is the stored
// bytes decoded into the procedure's reply type, which the codec of the
// retry encodes (in the binary codec byte for byte the first reply's
// bytes, except that map entries go in the codec's order), or the stored
// error; with the stored headers and trailers and Idempotent-Replayed: true.
// The reply type comes from the handler's Spec().Schema (generated code sets
// it) or else protoregistry.GlobalFiles, and is the registered Go type (a
// dynamicpb message when it is not registered); a procedure that is in
// neither is refused with internal before anything runs. A replayed
// response is not a *connect.Response of the handler's type: interceptors
// outside this one that read it should use Any() and proto.Message.
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
// that is not protobuf) is internal, with the handler's writes rolled back.
//
// NewInterceptor panics if db is nil (a typed nil *pgxpool.Pool too) or
// opts is invalid (nil Scope, a stored name that is not a token, a Config
// that idem.New refuses): a programming error to find at start-up.
func NewInterceptor(db idem.Beginner, opts Options) connect.Interceptor {
	in, err := newInterceptor(db, opts)
	if err != nil {
		panic(err)
	}
	return in
}

// interceptor is the configured interceptor.
type interceptor struct {
	core       *rpcidem.Core
	scope      func(ctx context.Context, procedure string) (idem.Scope, error)
	procedures []string
	keyField   protoreflect.Name
	headers    []string // canonical
	trailers   []string // canonical
	replies    sync.Map // procedure -> protoreflect.MessageType
}

func newInterceptor(db idem.Beginner, opts Options) (*interceptor, error) {
	refusals := opts.RefusalCodes
	if refusals == nil {
		refusals = DefaultRefusalCodes
	}
	core, err := rpcidem.New(db, rpcidem.Options{
		Name:          "idemconnect",
		ProcedureAttr: "procedure",
		KeySource:     "Idempotency-Key header",
		KeyMissing:    "this procedure requires an Idempotency-Key header",
		ScopeSet:      opts.Scope != nil,
		RequireKey:    opts.RequireKey,
		KeyField:      opts.KeyField,
		RefusalCodes:  rpcidem.Codes(refusals),
		Logger:        opts.Logger,
		Config:        opts.Config,
	})
	if err != nil {
		return nil, err
	}
	in := &interceptor{
		core:       core,
		scope:      opts.Scope,
		procedures: slices.Clone(opts.Procedures),
		keyField:   protoreflect.Name(opts.KeyField),
	}
	if in.keyField != "" && !in.keyField.IsValid() {
		return nil, fmt.Errorf("idemconnect: Options.KeyField: %q is not a field name", opts.KeyField)
	}
	for _, list := range []struct {
		in  []string
		out *[]string
	}{{opts.StoredHeaders, &in.headers}, {opts.StoredTrailers, &in.trailers}} {
		for _, name := range list.in {
			if !rpcidem.HeaderName(name, "connect-", "grpc-") {
				return nil, fmt.Errorf("idemconnect: Options.StoredHeaders, StoredTrailers: invalid header name %q", name)
			}
			*list.out = append(*list.out, http.CanonicalHeaderKey(name))
		}
	}
	return in, nil
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
		msg, isProto := req.Any().(proto.Message)
		key, f := in.core.Key(req.Header().Values(HeaderKey), keyField(msg, in.keyField))
		if f != nil {
			return nil, errorOf(f)
		}
		if key == "" {
			return next(ctx, req)
		}
		if !isProto {
			return nil, connect.NewError(connect.CodeInternal,
				fmt.Errorf("idemconnect: the request of %s is a %T, not a protobuf message", spec.Procedure, req.Any()))
		}
		scope, err := in.scope(ctx, spec.Procedure)
		if ce := (*connect.Error)(nil); errors.As(err, &ce) {
			return nil, ce
		}
		if f := in.core.Scope(scope, err); f != nil {
			return nil, errorOf(f)
		}
		replyType, err := in.replyType(spec)
		if err != nil {
			return nil, connect.NewError(connect.CodeInternal, err)
		}
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
		if err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("idemconnect: marshal the request: %w", err))
		}
		c := &call{in: in, req: req, next: next}
		if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
			// What is set before the handler runs (by interceptors before
			// this one): each run starts from it, and a replay or a failure
			// goes out with it only.
			c.info, c.header, c.trailer = info, info.ResponseHeader().Clone(), info.ResponseTrailer().Clone()
		}
		stored, replayed, f := in.core.Do(ctx, spec.Procedure, scope, key, rpcidem.Fingerprint(spec.Procedure, b), c)
		switch {
		case f != nil:
			c.restore()
			return nil, errorOf(f)
		case replayed:
			c.restore()
			return in.replay(stored, replyType)
		}
		return c.resp, c.err // the handler's own answer, with what its last run set
	}
}

// keyField returns the value of msg's string field name, or "" (no
// name, no such field, or not set).
func keyField(msg proto.Message, name protoreflect.Name) string {
	if name == "" || msg == nil {
		return ""
	}
	m := msg.ProtoReflect()
	if fd := m.Descriptor().Fields().ByName(name); fd != nil && fd.Kind() == protoreflect.StringKind && !fd.IsList() {
		return m.Get(fd).String()
	}
	return ""
}

// replyType returns the reply message type of the procedure of spec.
func (in *interceptor) replyType(spec connect.Spec) (protoreflect.MessageType, error) {
	if t, ok := in.replies.Load(spec.Procedure); ok {
		return t.(protoreflect.MessageType), nil
	}
	md, ok := spec.Schema.(protoreflect.MethodDescriptor)
	if !ok {
		name := protoreflect.FullName(strings.ReplaceAll(strings.TrimPrefix(spec.Procedure, "/"), "/", "."))
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(name)
		if md, ok = d.(protoreflect.MethodDescriptor); err != nil || !ok {
			return nil, fmt.Errorf("idemconnect: procedure %s has no schema and is not in protoregistry.GlobalFiles: its reply type is needed to replay", spec.Procedure)
		}
	}
	t, err := protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName())
	if err != nil {
		t = dynamicpb.NewMessageType(md.Output())
	}
	in.replies.Store(spec.Procedure, t)
	return t, nil
}

// call is one call with a key, as rpcidem.Core.Do runs it.
type call struct {
	in   *interceptor
	req  connect.AnyRequest
	next connect.UnaryFunc
	info connect.CallInfo // nil outside a handler

	// header and trailer are info's response header and trailer before
	// the first run: a run that is rolled back leaves nothing it set there.
	header, trailer http.Header

	resp connect.AnyResponse // of the last run of the handler
	err  error
}

func (c *call) Handle(ctx context.Context, tx pgx.Tx) error {
	c.restore()
	c.resp, c.err = c.next(context.WithValue(ctx, txKey{}, tx), c.req)
	return c.err
}

// restore sets info's response header and trailer back to what they were
// before the first run.
func (c *call) restore() {
	if c.info == nil {
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

func (c *call) Reply() (map[string][]string, []byte, error) {
	msg, ok := c.resp.Any().(proto.Message)
	if !ok {
		return nil, nil, fmt.Errorf("idemconnect: the reply of %s is a %T, not a protobuf message", c.req.Spec().Procedure, c.resp.Any())
	}
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return nil, nil, fmt.Errorf("idemconnect: marshal the reply: %w", err)
	}
	header, trailer := c.resp.Header(), c.resp.Trailer()
	if c.info != nil {
		header, trailer = merged(header, c.info.ResponseHeader()), merged(trailer, c.info.ResponseTrailer())
	}
	return c.in.stored(header, trailer), body, nil
}

// Refusal is the stored form of herr, the handler's error, a refusal.
func (c *call) Refusal(herr error) (map[string][]string, []byte, error) {
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
		meta = merged(merged(meta, c.info.ResponseHeader()), c.info.ResponseTrailer())
	}
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(st)
	if err != nil {
		return nil, nil, fmt.Errorf("idemconnect: marshal the error: %w", err)
	}
	// An error's metadata travels as one set (headers or trailers,
	// depending on the protocol): it is stored as headers.
	stored := c.in.stored(meta, nil)
	for name, values := range c.in.stored(nil, meta) {
		name = strings.TrimPrefix(name, rpcidem.TrailerPrefix)
		if _, dup := stored[name]; !dup {
			if stored == nil {
				stored = map[string][]string{}
			}
			stored[name] = values
		}
	}
	return stored, body, nil
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

// stored returns the chosen headers and trailers, or nil.
func (in *interceptor) stored(header, trailer http.Header) map[string][]string {
	var out map[string][]string
	add := func(prefix string, names []string, h http.Header) {
		for _, name := range names {
			values := h.Values(name)
			if len(values) == 0 {
				continue
			}
			if out == nil {
				out = map[string][]string{}
			}
			out[prefix+strings.ToLower(name)] = slices.Clone(values)
		}
	}
	add("", in.headers, header)
	add(rpcidem.TrailerPrefix, in.trailers, trailer)
	return out
}

// replayed is the response message of a replay: the stored reply, as the
// procedure's reply type. It is a proto.Message through the one it embeds,
// so every codec encodes it as that message.
type replayed struct{ proto.Message }

// replay answers with a stored outcome.
func (in *interceptor) replay(resp idem.Response, replyType protoreflect.MessageType) (connect.AnyResponse, error) {
	header, trailer := http.Header{}, http.Header{}
	for name, values := range resp.Header {
		h := header
		if n, ok := strings.CutPrefix(name, rpcidem.TrailerPrefix); ok {
			name, h = n, trailer
		}
		// Binary ("-bin") values are stored as they travel, base64
		// (connect.DecodeBinaryHeader reads them padded or not).
		for _, v := range values {
			h.Add(name, v)
		}
	}
	header.Set(HeaderReplayed, "true")
	if resp.Status != rpcidem.StatusReply {
		var st spb.Status
		if err := proto.Unmarshal(resp.Body, &st); err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("idemconnect: stored status: %w", err))
		}
		ce := connect.NewError(connect.Code(st.Code), errors.New(st.Message))
		for _, d := range st.Details {
			if detail, err := connect.NewErrorDetail(d); err == nil {
				ce.AddDetail(detail)
			}
		}
		for _, h := range []http.Header{header, trailer} {
			for name, values := range h {
				ce.Meta()[name] = append(ce.Meta()[name], values...)
			}
		}
		return nil, ce
	}
	msg := replyType.New().Interface()
	if err := proto.Unmarshal(resp.Body, msg); err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("idemconnect: stored reply: %w", err))
	}
	r := connect.NewResponse(&replayed{msg})
	for name, values := range header {
		r.Header()[name] = values
	}
	for name, values := range trailer {
		r.Trailer()[name] = values
	}
	return r, nil
}

// errorOf is the error to answer for f.
func errorOf(f *rpcidem.Failure) error {
	if f.Reason == "" {
		cause := f.Cause
		if cause == nil {
			cause = errors.New(f.Message)
		}
		return connect.NewError(connect.Code(f.Code), cause)
	}
	var more []proto.Message
	if f.Retry {
		more = append(more, &errdetails.RetryInfo{RetryDelay: durationpb.New(f.RetryDelay)})
	}
	return withInfo(connect.Code(f.Code), f.Reason, f.Message, more...)
}

// withInfo is a *connect.Error with an ErrorInfo detail, and more.
func withInfo(code connect.Code, reason, msg string, more ...proto.Message) *connect.Error {
	ce := connect.NewError(code, errors.New(msg))
	for _, d := range append([]proto.Message{&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}}, more...) {
		if detail, err := connect.NewErrorDetail(d); err == nil {
			ce.AddDetail(detail)
		}
	}
	return ce
}
