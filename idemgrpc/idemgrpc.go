// Package idemgrpc is a grpc-go unary server interceptor that makes calls
// idempotent by their idempotency key, with the handler's own database
// writes in the same PostgreSQL transaction as the key and the stored reply.
//
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
//		auth, // puts the authenticated user in the context
//		idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scopeOf}),
//	))
//
//	func (s *orders) PlaceOrder(ctx context.Context, req *pb.PlaceOrderRequest) (*pb.Order, error) {
//		tx := idemgrpc.Tx(ctx) // writes here commit with the key and the reply; nil without a key
//		...
//	}
//
// A client sends a new key (a UUID, say) in the metadata entry
// idempotency-key with each new intent, and the same key with every retry of
// it (or in a request field, AIP-155's request_id: Options.KeyField). The
// first call runs the handler in a transaction; its reply, or its refusal,
// commits with the key. A retry gets the same reply (the same message bytes,
// with the metadata idempotent-replayed: true) and the handler does not run.
// See UnaryServerInterceptor for the whole contract, and docs/rpc.md in the
// repository.
//
// Run idem.Migrate once before use.
package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/rpcidem"
)

// MetadataKey is the request metadata entry that carries the idempotency
// key: a bare key or an RFC 8941 string, as the HTTP header
// Idempotency-Key (see idemhttp).
const MetadataKey = "idempotency-key"

// MetadataReplayed is the response header set to "true" on a replay.
const MetadataReplayed = "idempotent-replayed"

// ErrorDomain is the domain of the ErrorInfo detail of the interceptor's
// own errors, whose reason is one of the Reason constants.
const ErrorDomain = rpcidem.ErrorDomain

// The reasons of the ErrorInfo detail of the interceptor's own errors.
const (
	ReasonKeyMissing       = rpcidem.ReasonKeyMissing       // INVALID_ARGUMENT: Options.RequireKey and no key
	ReasonKeyInvalid       = rpcidem.ReasonKeyInvalid       // INVALID_ARGUMENT: a malformed key, two keys, or one idem.ValidateKey refuses
	ReasonKeyReused        = rpcidem.ReasonKeyReused        // FAILED_PRECONDITION: the same key with a different request
	ReasonInProgress       = rpcidem.ReasonInProgress       // ABORTED, with RetryInfo: a call with the key is still running
	ReasonOutcomeUnknown   = rpcidem.ReasonOutcomeUnknown   // FAILED_PRECONDITION: a reservation's outcome must be reconciled first
	ReasonStoreUnavailable = rpcidem.ReasonStoreUnavailable // UNAVAILABLE, with RetryInfo: the database could not serve
)

// DefaultRefusalCodes are the status codes stored as deterministic refusals
// when Options.RefusalCodes is nil.
var DefaultRefusalCodes = []codes.Code{codes.FailedPrecondition, codes.InvalidArgument, codes.OutOfRange, codes.NotFound}

// Options configures UnaryServerInterceptor. Scope is required; every other
// field's zero value means its default.
type Options struct {
	// Scope returns the scope of a call with a key: the actor, from
	// authentication (an interceptor before this one, the peer's
	// certificate), never from the request; and the operation, usually
	// fullMethod itself. An error is returned to the client as it is when it
	// carries a gRPC status, as UNAUTHENTICATED otherwise, and so is an
	// actor that idem.ValidateScope refuses; an operation it refuses is
	// INTERNAL. Nothing runs then. Required.
	Scope func(ctx context.Context, fullMethod string) (idem.Scope, error)

	// Methods are the full methods ("/pkg.Service/Method") the interceptor
	// covers. Calls of other methods pass straight to the handler, without
	// a transaction, whatever key they carry. Default: every unary method.
	Methods []string

	// RequireKey refuses a covered call without a key with INVALID_ARGUMENT
	// (reason IDEMPOTENCY_KEY_MISSING). Default false: such a call runs as
	// if the interceptor were not there, without a transaction (Tx returns
	// nil), and nothing is stored.
	RequireKey bool

	// KeyField names a string field of request messages that carries the
	// key (AIP-155's "request_id"), by its name in the .proto file. A
	// request whose message has the field set takes its key from it; the
	// metadata entry, if sent too, must hold the same key (INVALID_ARGUMENT
	// otherwise). Requests without the field, or with it empty, take the key
	// from the metadata. Default "": metadata only.
	KeyField string

	// RefusalCodes are the status codes that, returned by the handler, are
	// deterministic refusals: the handler's writes are rolled back, and the
	// status (code, message, details) is stored with the key and returned to
	// every retry. A handler error with another code stores nothing, so a
	// retry runs again. Default: DefaultRefusalCodes (FAILED_PRECONDITION,
	// INVALID_ARGUMENT, OUT_OF_RANGE, NOT_FOUND). OK is not a refusal.
	RefusalCodes []codes.Code

	// StoredHeaders and StoredTrailers are the response metadata keys that
	// are stored with the outcome and sent again on a replay (set by the
	// handler with grpc.SetHeader, grpc.SendHeader and grpc.SetTrailer). The
	// first call sends everything the handler set; a replay only these, plus
	// idempotent-replayed: true. Keep secrets out. Each must be an HTTP
	// token (RFC 9110: letters, digits and !#$%&'*+-.^_`|~) that does not
	// start with "grpc-"; UnaryServerInterceptor panics otherwise.
	// Default: none.
	StoredHeaders  []string
	StoredTrailers []string

	// Logger receives a record for every error the interceptor answers
	// itself as UNAVAILABLE or INTERNAL (a store that failed, an outcome
	// that could not be stored), with the method and the keyed hash of the
	// key (key_hash, HMAC-SHA256 under Config.LogHashKey, as in idem's own
	// records), never the key. Default: slog.Default().
	Logger *slog.Logger

	// Config configures the idempotency store (see idem.Config): the key's
	// TTL (default 24 h), how long a duplicate waits for the call that holds
	// its key before it gets ABORTED (Wait, default 2 s), the key length
	// bounds, the largest stored outcome (MaxResponseBytes, default 1 MiB),
	// the isolation level and the retries after serialization failures.
	Config idem.Config
}

// txKey is the context key of the call's transaction.
type txKey struct{}

// Tx returns the transaction of the covered call with a key that ctx
// belongs to (the handler's context), or nil for a call without a key or a
// method the interceptor does not cover.
//
// The handler's writes through it commit together with the stored reply
// when the handler returns a reply, and are rolled back when it returns an
// error. The handler must not commit or roll it back, nor keep it after
// returning. After a serialization failure or a deadlock, met by one of the
// handler's statements or at COMMIT, the handler runs again in a new
// transaction (Config.MaxRetries), so it must not have effects outside the
// transaction.
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := ctx.Value(txKey{}).(pgx.Tx)
	return tx
}

// UnaryServerInterceptor returns an interceptor that makes covered unary
// calls (Options.Methods) that carry a key idempotent, with the handler's
// writes in the transaction of the key.
//
// The key comes from the metadata entry idempotency-key (or
// Options.KeyField) and is read and checked as idemhttp reads the
// Idempotency-Key header: a bare key or an RFC 8941 string, 1 to 255 bytes
// of visible ASCII (Config's bounds). The fingerprint is the full method and
// the request message marshalled deterministically (protobuf's
// Deterministic option), versioned ("idemrpc/1"). The handler then runs in
// idem.DoInTx on db, and its outcome decides what is stored:
//
//   - a reply: the handler's writes, the key and the reply (its bytes, and
//     the chosen headers and trailers) commit together; the client gets the
//     reply after the commit.
//   - an error whose code Options.RefusalCodes holds: a deterministic
//     refusal. The handler's writes are rolled back; the status (code,
//     message, details) is stored and returned to every retry.
//   - any other error, or a panic: everything is rolled back and nothing is
//     stored; the error (or panic) goes to the client as it is, and a retry
//     runs again.
//
// A later call with the same scope, key and request gets the stored outcome
// and the handler does not run: the reply is the stored bytes decoded into a
// new message of the method's reply type, which the server's codec encodes
// again (byte for byte the first reply's bytes, except that map entries go in
// the codec's order), or the stored status; with the stored headers and
// trailers and idempotent-replayed: true. The reply type is looked up once
// per method in protoregistry.GlobalFiles (where generated code registers
// every service) and protoregistry.GlobalTypes (a dynamicpb message when
// the Go type is not registered); a method that is not there is refused
// with INTERNAL before anything runs.
//
// The interceptor's own errors change nothing, and carry an ErrorInfo
// detail (ErrorDomain, a Reason constant):
//
//	no key, Options.RequireKey        INVALID_ARGUMENT     IDEMPOTENCY_KEY_MISSING
//	malformed or invalid key          INVALID_ARGUMENT     IDEMPOTENCY_KEY_INVALID
//	same key, different request       FAILED_PRECONDITION  IDEMPOTENCY_KEY_REUSED
//	a call with the key in progress   ABORTED + RetryInfo  REQUEST_IN_PROGRESS
//	a reservation's outcome unknown   FAILED_PRECONDITION  IDEMPOTENCY_OUTCOME_UNKNOWN
//	store down (idem.Unavailable)     UNAVAILABLE + RetryInfo  STORE_UNAVAILABLE
//
// An unknown outcome is FAILED_PRECONDITION because retrying does not help:
// the key was used through idem.Reserve for work outside the database,
// which an operator must reconcile first (idem.Resolve). UNAVAILABLE includes
// a connection lost at COMMIT: the client retries with the same key, and the
// retry replays if the commit happened and runs otherwise. A call whose
// context ends first gets CANCELLED or DEADLINE_EXCEEDED; nothing of it
// commits unless the commit went through, and the retry tells. An outcome
// that cannot be stored (a reply over Config.MaxResponseBytes, a reply that
// is not a protobuf message) is INTERNAL, with the handler's writes rolled
// back.
//
// UnaryServerInterceptor panics if db is nil (a typed nil *pgxpool.Pool
// too) or opts is invalid (nil Scope, a stored name that is not a token,
// a Config that idem.New refuses): a programming error to find at start-up.
func UnaryServerInterceptor(db idem.Beginner, opts Options) grpc.UnaryServerInterceptor {
	in, err := newInterceptor(db, opts)
	if err != nil {
		panic(err)
	}
	return in.intercept
}

// interceptor is the configured interceptor.
type interceptor struct {
	core     *rpcidem.Core
	scope    func(ctx context.Context, fullMethod string) (idem.Scope, error)
	methods  []string
	keyField protoreflect.Name
	headers  []string
	trailers []string
	replies  sync.Map // full method -> replyType
}

func newInterceptor(db idem.Beginner, opts Options) (*interceptor, error) {
	refusals := opts.RefusalCodes
	if refusals == nil {
		refusals = DefaultRefusalCodes
	}
	core, err := rpcidem.New(db, rpcidem.Options{
		Name:          "idemgrpc",
		ProcedureAttr: "method",
		KeySource:     "idempotency-key metadata",
		KeyMissing:    "this method requires an idempotency key",
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
		core:     core,
		scope:    opts.Scope,
		methods:  slices.Clone(opts.Methods),
		keyField: protoreflect.Name(opts.KeyField),
	}
	if slices.Contains(refusals, codes.OK) {
		return nil, errors.New("idemgrpc: Options.RefusalCodes: OK is not a refusal")
	}
	if in.keyField != "" && !in.keyField.IsValid() {
		return nil, fmt.Errorf("idemgrpc: Options.KeyField: %q is not a field name", opts.KeyField)
	}
	for _, list := range []struct {
		in  []string
		out *[]string
	}{{opts.StoredHeaders, &in.headers}, {opts.StoredTrailers, &in.trailers}} {
		for _, name := range list.in {
			name = strings.ToLower(name)
			if !rpcidem.HeaderName(name, "grpc-") {
				return nil, fmt.Errorf("idemgrpc: Options.StoredHeaders, StoredTrailers: invalid metadata key %q", name)
			}
			*list.out = append(*list.out, name)
		}
	}
	return in, nil
}

func (in *interceptor) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if len(in.methods) > 0 && !slices.Contains(in.methods, info.FullMethod) {
		return handler(ctx, req)
	}
	msg, isProto := req.(proto.Message)
	md, _ := metadata.FromIncomingContext(ctx)
	key, f := in.core.Key(md.Get(MetadataKey), keyField(msg, in.keyField))
	if f != nil {
		return nil, statusOf(f)
	}
	if key == "" {
		return handler(ctx, req)
	}
	if !isProto {
		return nil, status.Errorf(codes.Internal, "idemgrpc: the request of %s is a %T, not a protobuf message", info.FullMethod, req)
	}
	scope, err := in.scope(ctx, info.FullMethod)
	if st, ok := status.FromError(err); err != nil && ok {
		return nil, st.Err()
	}
	if f := in.core.Scope(scope, err); f != nil {
		return nil, statusOf(f)
	}
	reply, err := in.replyType(info.FullMethod)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: marshal the request: %v", err)
	}
	stream := grpc.ServerTransportStreamFromContext(ctx)
	c := &call{in: in, req: req, info: info, handler: handler}
	stored, replayed, f := in.core.Do(ctx, info.FullMethod, scope, key, rpcidem.Fingerprint(info.FullMethod, b), c)
	switch {
	case f != nil:
		return nil, statusOf(f)
	case replayed:
		return in.replay(ctx, stored, reply)
	}
	// The handler's own answer, with everything it set.
	c.last.forward(stream)
	if c.err != nil {
		return nil, c.err
	}
	return c.reply, nil
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

// replyType returns the reply message type of fullMethod, from the global
// registries.
func (in *interceptor) replyType(fullMethod string) (protoreflect.MessageType, error) {
	if t, ok := in.replies.Load(fullMethod); ok {
		return t.(protoreflect.MessageType), nil
	}
	name := protoreflect.FullName(strings.ReplaceAll(strings.TrimPrefix(fullMethod, "/"), "/", "."))
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(name)
	md, ok := d.(protoreflect.MethodDescriptor)
	if err != nil || !ok {
		return nil, fmt.Errorf("idemgrpc: method %s is not in protoregistry.GlobalFiles: its reply type is needed to replay (register the service's file descriptor)", fullMethod)
	}
	var t protoreflect.MessageType
	if t, err = protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName()); err != nil {
		t = dynamicpb.NewMessageType(md.Output())
	}
	in.replies.Store(fullMethod, t)
	return t, nil
}

// call is one call with a key, as rpcidem.Core.Do runs it.
type call struct {
	in      *interceptor
	req     any
	info    *grpc.UnaryServerInfo
	handler grpc.UnaryHandler

	last  *recorder // of the last run of the handler
	reply any
	err   error
}

func (c *call) Handle(ctx context.Context, tx pgx.Tx) error {
	c.last = &recorder{method: c.info.FullMethod}
	hctx := grpc.NewContextWithServerTransportStream(context.WithValue(ctx, txKey{}, tx), c.last)
	c.reply, c.err = c.handler(hctx, c.req)
	return c.err
}

func (c *call) Code(err error) uint32 { return uint32(status.Convert(err).Code()) }

func (c *call) Refusal(err error) (map[string][]string, []byte, error) {
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(status.Convert(err).Proto())
	if err != nil {
		return nil, nil, fmt.Errorf("idemgrpc: marshal the status: %w", err)
	}
	return c.in.stored(c.last), body, nil
}

func (c *call) Reply() (map[string][]string, []byte, error) {
	msg, ok := c.reply.(proto.Message)
	if !ok {
		return nil, nil, fmt.Errorf("idemgrpc: the reply of %s is a %T, not a protobuf message", c.info.FullMethod, c.reply)
	}
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return nil, nil, fmt.Errorf("idemgrpc: marshal the reply: %w", err)
	}
	return c.in.stored(c.last), body, nil
}

// replay answers with a stored outcome.
func (in *interceptor) replay(ctx context.Context, resp idem.Response, replyType protoreflect.MessageType) (any, error) {
	header := metadata.Pairs(MetadataReplayed, "true")
	trailer := metadata.MD{}
	for name, values := range resp.Header {
		md := header
		if n, ok := strings.CutPrefix(name, rpcidem.TrailerPrefix); ok {
			name, md = n, trailer
		}
		for _, v := range values {
			if rpcidem.IsBinary(name) {
				raw, err := rpcidem.DecodeBinary(v)
				if err != nil {
					return nil, status.Errorf(codes.Internal, "idemgrpc: stored metadata %s: %v", name, err)
				}
				v = raw
			}
			md.Append(name, v)
		}
	}
	_ = grpc.SetHeader(ctx, header) // fails only outside a server, or after headers went out
	if len(trailer) > 0 {
		_ = grpc.SetTrailer(ctx, trailer)
	}
	if resp.Status != rpcidem.StatusReply {
		var st spb.Status
		if err := proto.Unmarshal(resp.Body, &st); err != nil {
			return nil, status.Errorf(codes.Internal, "idemgrpc: stored status: %v", err)
		}
		return nil, status.ErrorProto(&st)
	}
	reply := replyType.New().Interface()
	if err := proto.Unmarshal(resp.Body, reply); err != nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: stored reply: %v", err)
	}
	return reply, nil
}

// stored returns the metadata of r that is stored, or nil.
func (in *interceptor) stored(r *recorder) map[string][]string {
	var out map[string][]string
	add := func(prefix string, names []string, md metadata.MD) {
		for _, name := range names {
			values := md.Get(name)
			if len(values) == 0 || out[prefix+name] != nil {
				continue // absent, or listed twice
			}
			if out == nil {
				out = map[string][]string{}
			}
			for _, v := range values {
				if rpcidem.IsBinary(name) {
					v = rpcidem.EncodeBinary(v)
				}
				out[prefix+name] = append(out[prefix+name], v)
			}
		}
	}
	add("", in.headers, r.header)
	add(rpcidem.TrailerPrefix, in.trailers, r.trailer)
	return out
}

// statusOf is the status of f.
func statusOf(f *rpcidem.Failure) error {
	if f.Reason == "" {
		return status.Error(codes.Code(f.Code), f.Message)
	}
	var more []proto.Message
	if f.Retry {
		more = append(more, &errdetails.RetryInfo{RetryDelay: durationpb.New(f.RetryDelay)})
	}
	return withDetails(codes.Code(f.Code), f.Reason, f.Message, more...)
}

// withDetails is a status with an ErrorInfo detail, and more details.
func withDetails(code codes.Code, reason, msg string, more ...proto.Message) error {
	details := append([]proto.Message{&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}}, more...)
	p := &spb.Status{Code: int32(code), Message: msg}
	for _, d := range details {
		if a, err := anypb.New(d); err == nil {
			p.Details = append(p.Details, a)
		}
	}
	return status.ErrorProto(p)
}
