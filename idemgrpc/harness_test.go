package idemgrpc_test

// The test service (rpctest's idemtest.v1.Ledger/Transfer, without protoc)
// served by a real grpc-go server on 127.0.0.1 and called by a real client,
// as rpctest's suite asks.

import (
	"context"
	"net"
	"os"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/rpcproto/rpctest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// transport is idemgrpc as rpctest's suite runs it.
type transport struct{}

func (transport) Name() string { return "idemgrpc" }

func (transport) BadKeys() [][]string { return nil }

func (transport) Binary(raw string) string { return raw }

func (transport) Build(db rpctest.DB, o rpctest.Options) { interceptor(db, o) }

// interceptor is the interceptor on db with o.
func interceptor(db rpctest.DB, o rpctest.Options) grpc.UnaryServerInterceptor {
	deny := func(context.Context, string) (idem.Scope, error) {
		return idem.Scope{}, status.Error(codes.PermissionDenied, "not yours")
	}
	return rpctest.Build(db, idemgrpc.Options{Scope: rpctest.Scope(o, scopeFromMetadata, deny),
		StoredHeaders: o.StoredHeaders, StoredTrailers: o.StoredTrailers, RequireKey: o.RequireKey, KeyField: o.KeyField,
		Methods: o.Covered, RefusalCodes: rpctest.Codes[codes.Code](o.RefusalCodes), Config: o.Config, Logger: o.Logger, Citus: o.Citus},
		idemgrpc.UnaryServerInterceptor, idemgrpc.UnaryServerInterceptorSQL)
}

// scopeFromMetadata is the tests' authentication: the actor is the metadata
// entry "user" (a real service verifies a token first).
func scopeFromMetadata(ctx context.Context, fullMethod string) (idem.Scope, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	user := md.Get("user")
	if len(user) != 1 {
		return idem.Scope{}, errNoUser
	}
	return idem.Scope{Actor: user[0], Operation: fullMethod}, nil
}

var errNoUser = errorString("no user")

type errorString string

func (e errorString) Error() string { return string(e) }

// Serve starts a grpc-go server on 127.0.0.1 with the interceptor and h,
// and returns a client of it; both end with the test.
func (transport) Serve(t testing.TB, db rpctest.DB, o rpctest.Options, h rpctest.Handler) rpctest.Server {
	t.Helper()
	procedure := o.Procedure
	if procedure == "" {
		procedure = rpctest.Transfer
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(recoverPanic, interceptor(db, o)))
	srv.RegisterService(serviceDesc(procedure, h), nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return client{conn: conn, procedure: procedure}
}

// recoverPanic answers a handler's panic, which the idempotency
// interceptor lets go on, with INTERNAL, as a service's recovery
// interceptor would (grpc-go's server would crash).
func recoverPanic(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if v := recover(); v != nil {
			resp, err = nil, status.Errorf(codes.Internal, "panic: %v", v)
		}
	}()
	return next(ctx, req)
}

// serviceDesc serves h as procedure, as generated code would.
func serviceDesc(procedure string, h rpctest.Handler) *grpc.ServiceDesc {
	service, method, _ := strings.Cut(strings.TrimPrefix(procedure, "/"), "/")
	run := func(ctx context.Context, req any) (any, error) {
		out := h(ctx, rpctest.TxOf(idemgrpc.Tx(ctx), idemgrpc.TxSQL(ctx)), req.(*dynamicpb.Message))
		if len(out.Header) > 0 {
			_ = grpc.SetHeader(ctx, metadata.New(out.Header))
		}
		if len(out.Trailer) > 0 {
			_ = grpc.SetTrailer(ctx, metadata.New(out.Trailer))
		}
		if out.Status != nil {
			return nil, status.ErrorProto(out.Status)
		}
		return out.Reply, nil
	}
	return &grpc.ServiceDesc{
		ServiceName: service,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: method,
			Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
				in := dynamicpb.NewMessage(rpctest.RequestDesc)
				if err := dec(in); err != nil {
					return nil, err
				}
				if interceptor == nil {
					return run(ctx, in)
				}
				return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: procedure}, run)
			},
		}},
	}
}

// client calls one procedure.
type client struct {
	conn      *grpc.ClientConn
	procedure string
}

// Call calls the procedure as user (none: "") with keys in the metadata.
func (c client) Call(ctx context.Context, user string, keys []string, req proto.Message) rpctest.Answer {
	md := metadata.MD{}
	if user != "" {
		md.Set("user", user)
	}
	md.Append(idemgrpc.MetadataKey, keys...)
	var header, trailer metadata.MD
	a := rpctest.Answer{Header: header.Get, Trailer: trailer.Get}
	a.Err = c.conn.Invoke(metadata.NewOutgoingContext(ctx, md), c.procedure, req, &a.Body,
		grpc.ForceCodec(rawCodec{}), grpc.Header(&header), grpc.Trailer(&trailer))
	a.Header, a.Trailer = header.Get, trailer.Get
	if a.Err != nil {
		a.Status = status.Convert(a.Err).Proto()
	}
	return a
}

// rawCodec sends messages as the proto codec does and hands replies over as
// their raw bytes when the reply is a *[]byte, so that tests compare what
// went over the wire.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

func (rawCodec) Marshal(v any) ([]byte, error) {
	if b, ok := v.(*[]byte); ok {
		return *b, nil
	}
	return proto.Marshal(v.(proto.Message))
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	if b, ok := v.(*[]byte); ok {
		*b = append([]byte(nil), data...)
		return nil
	}
	return proto.Unmarshal(data, v.(proto.Message))
}
