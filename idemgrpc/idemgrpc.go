package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/jackc/pgx/v5"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/front"
	"github.com/pgidem/idem/internal/rpcidem"
	"github.com/pgidem/idem/internal/rpcproto"
)

// MetadataKey is the request metadata entry that carries the idempotency
// key: a bare key or an RFC 8941 string, as the HTTP header
// Idempotency-Key (see idemhttp).
const MetadataKey = "idempotency-key"

// MetadataReplayed is the response header set to "true" on a replay.
const MetadataReplayed = "idempotent-replayed"

// ErrorDomain is the domain of the ErrorInfo detail of the interceptor's
// own errors, whose reason is one of the Reason constants.
const ErrorDomain = "github.com/pgidem/idem"

// The reasons of the ErrorInfo detail of the interceptor's own errors.
const (
	ReasonKeyMissing       = "IDEMPOTENCY_KEY_MISSING"      // INVALID_ARGUMENT: Options.RequireKey and no key
	ReasonKeyInvalid       = "IDEMPOTENCY_KEY_INVALID"      // INVALID_ARGUMENT: a malformed key, two keys, or one idem.ValidateKey refuses
	ReasonKeyReused        = "IDEMPOTENCY_KEY_REUSED"       // FAILED_PRECONDITION: the same key with a different request
	ReasonInProgress       = "REQUEST_IN_PROGRESS"          // ABORTED, with RetryInfo: a call with the key is still running
	ReasonOutcomeUnknown   = "IDEMPOTENCY_OUTCOME_UNKNOWN"  // FAILED_PRECONDITION: a reservation's outcome must be reconciled first
	ReasonResponseExpired  = "IDEMPOTENCY_RESPONSE_EXPIRED" // FAILED_PRECONDITION: the call ran, its stored response was dropped (idem.Config.BodyTTL); it does not run again
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"            // UNAVAILABLE, with RetryInfo: the database could not serve
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
	// a transaction, whatever key they carry. UnaryServerInterceptor panics
	// on a name of another form, which would match no call. Default: every
	// unary method.
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
	// token (RFC 9110: letters, digits and !#$%&'*+-.^_`|) without '~' (as
	// gRPC metadata keys are; idem marks its own stored entries with it)
	// that does not start with "grpc-"; UnaryServerInterceptor panics
	// otherwise. Default: none.
	StoredHeaders  []string
	StoredTrailers []string

	// Logger receives a record for every error the interceptor answers
	// itself as UNAVAILABLE or INTERNAL (a store that failed, an outcome
	// that could not be stored), with the method and the keyed hash of the
	// key (key_hash, HMAC-SHA256 under Config.LogHashKey, as in idem's own
	// records), never the key. Default: slog.Default().
	Logger *slog.Logger

	// Citus says that the *sql.DB of UnaryServerInterceptorSQL is a Citus
	// coordinator with idem_keys distributed by actor (idem.Distribute): the
	// store's statements then take the forms Citus accepts, those of an
	// idemsql.NewCitus Client (a *sql.DB does not say what it is connected
	// to). Without it, UnaryServerInterceptorSQL on a coordinator answers
	// every call with a key INTERNAL (idem.ErrUnsupported, logged). The pgx
	// form ignores it: a pgx handle finds out by itself. Default false.
	Citus bool

	// Config configures the idempotency store (see idem.Config): the key's
	// TTL (default 24 h), how long a duplicate waits for the call that holds
	// its key before it gets ABORTED (Wait, default 2 s), the key length
	// bounds, the largest stored outcome (MaxResponseBytes, default 1 MiB),
	// the isolation level and the retries after serialization failures.
	Config idem.Config
}

// txs holds the call's transaction in the handler's context: a pgx.Tx or
// a *sql.Tx.
var txs front.Txs

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
func Tx(ctx context.Context) pgx.Tx { return txs.PgxTx(ctx) }

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
//   - a reply: the handler's writes, the key and the reply (its bytes, the
//     full name of its message type, and the chosen headers and trailers)
//     commit together; the client gets the reply after the commit.
//   - an error whose code Options.RefusalCodes holds: a deterministic
//     refusal. The handler's writes are rolled back; the status (code,
//     message, details) is stored and returned to every retry.
//   - any other error, or a panic: everything is rolled back and nothing is
//     stored; the error (or panic) goes to the client as it is, and a retry
//     runs again.
//
// A later call with the same scope, key and request gets the stored outcome
// and the handler does not run: the reply is the stored bytes decoded into a
// new message of the stored type, which the server's codec encodes again
// (byte for byte the first reply's bytes, except that map entries go in the
// codec's order), or the stored status; with the stored headers and
// trailers and idempotent-replayed: true. The type is the one registered
// under the stored name in protoregistry.GlobalTypes (generated code
// registers every message), or else, for a reply of the method's own reply
// type that is not registered there, a dynamicpb message of the type that
// protoregistry.GlobalFiles gives the method. A reply that is neither could
// not be replayed: the call that returns it fails with UNIMPLEMENTED (the
// method cannot be served idempotently until its reply type is registered),
// saying which type, and nothing of it commits.
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
// is not a protobuf message) is INTERNAL, and one whose type a replay could
// not find UNIMPLEMENTED, both with the handler's writes rolled back.
//
// A covered call with a key runs the handler with a server transport stream
// of the interceptor's own, which keeps what the handler sets through
// grpc.SetHeader, grpc.SendHeader and grpc.SetTrailer until the outcome is
// known (headers go out with the reply, never before). grpc-go's functions
// that need its own stream, grpc.SetSendCompressor and
// grpc.ClientSupportedCompressors, fail in such a handler.
//
// UnaryServerInterceptor panics if db is nil (a typed nil *pgxpool.Pool
// too) or opts is invalid (nil Scope, a stored name that is not a token,
// a Config that idem.New refuses, a method that is not a full method name):
// a programming error to find at start-up.
func UnaryServerInterceptor(db idem.Beginner, opts Options) grpc.UnaryServerInterceptor {
	return mustIntercept(opts, txs.Pgx(db))
}

// grpcTransport is what the interceptor's core knows of gRPC.
var grpcTransport = rpcidem.Transport{Name: "idemgrpc", ProcedureAttr: "method", KeySource: "idempotency-key metadata",
	KeyMissing: "this method requires an idempotency key", Reserved: []string{"grpc-"}, NameKind: "metadata key",
	RawBinary: true}

// mustIntercept returns the interceptor with opts on the store open
// returns, and panics on invalid options.
func mustIntercept(opts Options, open front.Open) grpc.UnaryServerInterceptor {
	refusals := opts.RefusalCodes
	if refusals == nil {
		refusals = DefaultRefusalCodes
	}
	if slices.Contains(refusals, codes.OK) {
		panic(errors.New("idemgrpc: Options.RefusalCodes: OK is not a refusal"))
	}
	srv, err := rpcproto.New(rpcidem.Options{Transport: grpcTransport, ScopeSet: opts.Scope != nil,
		RequireKey: opts.RequireKey, KeyField: opts.KeyField, RefusalCodes: rpcidem.Codes(refusals),
		StoredHeaders: opts.StoredHeaders, StoredTrailers: opts.StoredTrailers, Logger: opts.Logger, Config: opts.Config}, open)
	if err != nil {
		panic(err)
	}
	methods := slices.Clone(opts.Methods)
	for _, m := range methods {
		if !rpcidem.ProcedureName(m) {
			panic(fmt.Errorf("idemgrpc: Options.Methods: %q is not a full method name (/pkg.Service/Method)", m))
		}
	}
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if len(methods) > 0 && !slices.Contains(methods, info.FullMethod) {
			return handler(ctx, req)
		}
		md, _ := metadata.FromIncomingContext(ctx)
		c := &call{srv: srv, scope: opts.Scope, req: req, info: info, handler: handler,
			stream: grpc.ServerTransportStreamFromContext(ctx)}
		return rpcproto.Serve(ctx, srv, c, rpcproto.Request{Procedure: info.FullMethod, Keys: md.Get(MetadataKey), Message: req})
	}
}

// call is one covered call, as rpcproto.Serve runs it.
type call struct {
	srv     *rpcproto.Server
	scope   func(ctx context.Context, fullMethod string) (idem.Scope, error)
	req     any
	info    *grpc.UnaryServerInfo
	handler grpc.UnaryHandler
	stream  grpc.ServerTransportStream // the call's own, nil outside a server

	last  *recorder // of the last run of the handler
	reply any
	err   error
}

func (c *call) Pass(ctx context.Context) (any, error) { return c.handler(ctx, c.req) }

func (c *call) Scope(ctx context.Context) (idem.Scope, error) { return c.scope(ctx, c.info.FullMethod) }

// AsIs passes on an error of Options.Scope that carries a status.
func (c *call) AsIs(err error) error {
	if st, ok := status.FromError(err); ok {
		return st.Err()
	}
	return nil
}

func (c *call) Fail(f *rpcidem.Failure) error { return status.ErrorProto(rpcproto.Status(f)) }

func (c *call) Handle(ctx context.Context) error {
	c.last = &recorder{method: c.info.FullMethod}
	c.reply, c.err = c.handler(grpc.NewContextWithServerTransportStream(ctx, c.last), c.req)
	return c.err
}

func (c *call) Code(err error) uint32 { return uint32(status.Convert(err).Code()) }

func (c *call) Reply() (any, map[string][]string) { return c.reply, c.stored() }

func (c *call) Refusal(err error) (*spb.Status, map[string][]string) {
	return status.Convert(err).Proto(), c.stored()
}

// stored is the stored form of the metadata the last run set.
func (c *call) stored() map[string][]string {
	return c.srv.Core().Stored(c.last.header.Get, c.last.trailer.Get)
}

func (c *call) Replay(ctx context.Context, r rpcproto.Replay) (any, error) {
	header, trailer := metadata.Pairs(MetadataReplayed, "true"), metadata.MD{}
	for _, set := range []struct {
		stored map[string][]string
		md     metadata.MD
	}{{r.Header, header}, {r.Trailer, trailer}} {
		for name, values := range set.stored {
			set.md.Append(name, values...) // binary values decoded (rpcidem.Core.Raw)
		}
	}
	_ = grpc.SetHeader(ctx, header) // fails only outside a server, or after headers went out
	if len(trailer) > 0 {
		_ = grpc.SetTrailer(ctx, trailer)
	}
	if r.Status != nil {
		return nil, status.ErrorProto(r.Status)
	}
	return r.Reply, nil
}

// Own is the handler's own answer, with everything it set.
func (c *call) Own() (any, error) {
	c.last.forward(c.stream)
	return c.reply, c.err
}
