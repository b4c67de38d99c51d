package idemconnect_test

// The test service (rpctest's idemtest.v1.Ledger/Transfer, without protoc)
// served by connect-go's NewUnaryHandler over httptest (HTTP/2 with TLS, so
// that the Connect, gRPC and gRPC-Web protocols all work) and called by
// connect-go clients, as rpctest's suite asks.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"

	"connectrpc.com/connect"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
	"github.com/pgidem/idem/internal/rpcproto/rpctest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// transport is idemconnect as rpctest's suite runs it.
type transport struct{}

func (transport) Name() string { return "idemconnect" }

func (transport) BadKeys() [][]string { return [][]string{{""}, {"caf\u00e9"}} }

func (transport) Binary(raw string) string { return connect.EncodeBinaryHeader([]byte(raw)) }

func (transport) Build(db rpctest.DB, o rpctest.Options) { interceptor(db, o) }

func (transport) Serve(t testing.TB, db rpctest.DB, o rpctest.Options, h rpctest.Handler) rpctest.Server {
	return serve(t, db, o, nil, h)
}

// interceptor is the interceptor on db with o.
func interceptor(db rpctest.DB, o rpctest.Options) connect.Interceptor {
	deny := func(context.Context, string) (idem.Scope, error) {
		return idem.Scope{}, connect.NewError(connect.CodePermissionDenied, errors.New("not yours"))
	}
	return rpctest.Build(db, idemconnect.Options{Scope: rpctest.Scope(o, scopeFromHeader, deny),
		StoredHeaders: o.StoredHeaders, StoredTrailers: o.StoredTrailers, RequireKey: o.RequireKey, KeyField: o.KeyField,
		Procedures: o.Covered, RefusalCodes: rpctest.Codes[connect.Code](o.RefusalCodes), Config: o.Config, Logger: o.Logger, Citus: o.Citus},
		idemconnect.NewInterceptor, idemconnect.NewInterceptorSQL)
}

// scopeFromHeader is the tests' authentication: the actor is the header
// User (a real service verifies a token first).
func scopeFromHeader(ctx context.Context, procedure string) (idem.Scope, error) {
	info, ok := connect.CallInfoForHandlerContext(ctx)
	if !ok || info.RequestHeader().Get("User") == "" {
		return idem.Scope{}, fmt.Errorf("no user")
	}
	return idem.Scope{Actor: info.RequestHeader().Get("User"), Operation: procedure}, nil
}

// reply is the handler's response message: any message (the interceptor
// stores the one it embeds, and the codec encodes that).
type reply struct{ proto.Message }

// serve mounts h as o.Procedure (with its schema, WithSchema, as generated
// code mounts a handler, when it is Transfer), with the interceptors outer
// before idemconnect's, on an httptest server (HTTP/2, TLS), and returns a
// client of it; both end with the test.
func serve(t testing.TB, db rpctest.DB, o rpctest.Options, outer []connect.Interceptor, h rpctest.Handler) *server {
	t.Helper()
	procedure := o.Procedure
	if procedure == "" {
		procedure = rpctest.Transfer
	}
	opts := []connect.HandlerOption{connect.WithRequestInitializer(initRequest),
		// A handler's panic, which the idempotency interceptor lets go
		// on, answered INTERNAL, as a service's recovery would: outside
		// every other interceptor (the first added is the outermost).
		connect.WithRecover(func(_ context.Context, _ connect.Spec, _ http.Header, v any) error {
			return connect.NewError(connect.CodeInternal, fmt.Errorf("panic: %v", v))
		}),
		connect.WithInterceptors(append(outer, interceptor(db, o))...)}
	if procedure == rpctest.Transfer {
		opts = append(opts, connect.WithSchema(rpctest.Method))
	}
	mux := http.NewServeMux()
	mux.Handle(procedure, connect.NewUnaryHandler(procedure, handler(h), opts...))
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return &server{url: srv.URL + procedure, hc: srv.Client()}
}

// initRequest makes the handler's request a dynamicpb TransferRequest.
func initRequest(_ connect.Spec, msg any) error {
	if m, ok := msg.(*dynamicpb.Message); ok {
		*m = *dynamicpb.NewMessage(rpctest.RequestDesc)
	}
	return nil
}

// handler is h as a connect-go unary handler.
func handler(h rpctest.Handler) func(context.Context, *connect.Request[dynamicpb.Message]) (*connect.Response[reply], error) {
	return func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[reply], error) {
		out := h(ctx, rpctest.TxOf(idemconnect.Tx(ctx), idemconnect.TxSQL(ctx)), req.Msg)
		if out.Status != nil {
			ce := connect.NewError(connect.Code(out.Status.Code), errors.New(out.Status.Message))
			for _, d := range out.Status.Details {
				if detail, err := connect.NewErrorDetail(d); err == nil {
					ce.AddDetail(detail)
				}
			}
			for name, v := range out.Header {
				ce.Meta().Set(name, v)
			}
			return nil, ce
		}
		resp := connect.NewResponse(&reply{out.Reply})
		for name, v := range out.Header {
			resp.Header().Set(name, v)
		}
		for name, v := range out.Trailer {
			resp.Trailer().Set(name, v)
		}
		return resp, nil
	}
}

// server is a client of one procedure.
type server struct {
	url string
	hc  *http.Client
}

// Call calls the procedure over the Connect protocol.
func (s *server) Call(ctx context.Context, user string, keys []string, req proto.Message) rpctest.Answer {
	return s.call(ctx, user, keys, req)
}

// rawReply is a reply as the bytes that came over the wire.
type rawReply []byte

// call calls the procedure as user (none: "") with keys in the header
// (none: nil), over the Connect protocol unless options say otherwise.
func (s *server) call(ctx context.Context, user string, keys []string, req proto.Message, options ...connect.ClientOption) rpctest.Answer {
	client := connect.NewClient[dynamicpb.Message, rawReply](s.hc, s.url,
		append([]connect.ClientOption{connect.WithCodec(rawCodec{})}, options...)...)
	r := connect.NewRequest(req.(*dynamicpb.Message))
	if user != "" {
		r.Header().Set("User", user)
	}
	for _, k := range keys {
		r.Header().Add(idemconnect.HeaderKey, k)
	}
	resp, err := client.CallUnary(ctx, r)
	if err != nil {
		a := rpctest.Answer{Err: err, Header: http.Header{}.Values, Trailer: http.Header{}.Values}
		a.Status = &spb.Status{Code: int32(connect.CodeOf(err)), Message: err.Error()}
		if ce := (*connect.Error)(nil); errors.As(err, &ce) {
			a.Status.Message, a.Header = ce.Message(), ce.Meta().Values
			for _, d := range ce.Details() {
				a.Status.Details = append(a.Status.Details, &anypb.Any{TypeUrl: "type.googleapis.com/" + d.Type(), Value: d.Bytes()})
			}
		}
		return a
	}
	return rpctest.Answer{Body: *resp.Msg, Header: resp.Header().Values, Trailer: resp.Trailer().Values}
}

// rawCodec sends messages as connect's proto codec does and hands replies
// over as their raw bytes.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

func (rawCodec) Marshal(v any) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }

func (rawCodec) Unmarshal(data []byte, v any) error {
	if r, ok := v.(*rawReply); ok {
		*r = append(rawReply(nil), data...)
		return nil
	}
	return proto.Unmarshal(data, v.(proto.Message)) // a gRPC status, say
}
