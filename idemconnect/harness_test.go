package idemconnect_test

// The test service, without protoc: a file descriptor built in Go
// (idemtest.v1.Ledger/Transfer), the request as dynamicpb, served by
// connect-go's NewUnaryHandler over httptest (HTTP/2 with TLS, so that the
// Connect, gRPC and gRPC-Web protocols all work) and called by connect-go
// clients.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
	"github.com/pgidem/idem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

const transferProcedure = "/idemtest.v1.Ledger/Transfer"

// ledgerFile is idemtest/v1/ledger.proto:
//
//	message TransferRequest { string request_id = 1; string note = 2; int64 amount = 3; }
//	service Ledger { rpc Transfer(TransferRequest) returns (google.rpc.ResourceInfo); }
//
// The reply is a generated type (errdetails.ResourceInfo: resource_type
// "transfer", resource_name "transfers/<id>", owner, description the
// note), as a service's replies are: protobuf-go marshals those in field
// number order, so a decoded reply goes out with the same bytes. (A
// dynamicpb message goes out with its fields in a random order.)
var ledgerFile = func() protoreflect.FileDescriptor {
	field := func(name string, n int32, typ descriptorpb.FieldDescriptorProto_Type, label descriptorpb.FieldDescriptorProto_Label) *descriptorpb.FieldDescriptorProto {
		return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(n), Type: typ.Enum(),
			Label: label.Enum(), JsonName: proto.String(name)}
	}
	opt := descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL
	fdp := &descriptorpb.FileDescriptorProto{
		Name:       proto.String("idemtest/v1/ledger.proto"),
		Package:    proto.String("idemtest.v1"),
		Syntax:     proto.String("proto3"),
		Dependency: []string{"google/rpc/error_details.proto"},
		MessageType: []*descriptorpb.DescriptorProto{
			{Name: proto.String("TransferRequest"), Field: []*descriptorpb.FieldDescriptorProto{
				field("request_id", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING, opt),
				field("note", 2, descriptorpb.FieldDescriptorProto_TYPE_STRING, opt),
				field("amount", 3, descriptorpb.FieldDescriptorProto_TYPE_INT64, opt),
			}},
		},
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Ledger"),
			Method: []*descriptorpb.MethodDescriptorProto{{
				Name: proto.String("Transfer"), InputType: proto.String(".idemtest.v1.TransferRequest"),
				OutputType: proto.String(".google.rpc.ResourceInfo"),
			}},
		}},
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	if err != nil {
		panic(err)
	}
	// Registered as generated code registers it: the interceptor finds the
	// reply type there.
	if err := protoregistry.GlobalFiles.RegisterFile(fd); err != nil {
		panic(err)
	}
	return fd
}()

var requestDesc = ledgerFile.Messages().ByName("TransferRequest")

// request returns a TransferRequest.
func request(note string, amount int64) *dynamicpb.Message {
	m := dynamicpb.NewMessage(requestDesc)
	m.Set(requestDesc.Fields().ByName("note"), protoreflect.ValueOfString(note))
	m.Set(requestDesc.Fields().ByName("amount"), protoreflect.ValueOfInt64(amount))
	return m
}

// reply returns the reply for transfer id.
func reply(id int64, note string) *errdetails.ResourceInfo {
	return &errdetails.ResourceInfo{ResourceType: "transfer", ResourceName: fmt.Sprintf("transfers/%d", id),
		Owner: "ledger", Description: note}
}

var transferMethod = ledgerFile.Services().ByName("Ledger").Methods().ByName("Transfer")

// getString and getInt read a field of a dynamic message.
func getString(m proto.Message, name string) string {
	r := m.ProtoReflect()
	return r.Get(r.Descriptor().Fields().ByName(protoreflect.Name(name))).String()
}

func getInt(m proto.Message, name string) int64 {
	r := m.ProtoReflect()
	return r.Get(r.Descriptor().Fields().ByName(protoreflect.Name(name))).Int()
}

// ledgerHandler is the Transfer procedure.
type ledgerHandler func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error)

// migrate installs idem's table and the transfers the handlers write.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE transfers (id bigserial PRIMARY KEY, note text NOT NULL, amount bigint NOT NULL)`)
	return err
}

// countRows returns the number of transfers.
func countRows(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM transfers`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// insertHandler writes a transfer in the call's transaction and answers its
// id; it counts its runs.
func insertHandler(runs *atomic.Int64) ledgerHandler {
	return func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
		runs.Add(1)
		tx := idemconnect.Tx(ctx)
		if tx == nil {
			return connect.NewResponse(reply(0, "no transaction")), nil
		}
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO transfers (note, amount) VALUES ($1, $2) RETURNING id`,
			getString(req.Msg, "note"), getInt(req.Msg, "amount")).Scan(&id)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(reply(id, getString(req.Msg, "note"))), nil
	}
}

// initRequest makes the handler's request a dynamicpb TransferRequest.
func initRequest(spec connect.Spec, msg any) error {
	if m, ok := msg.(*dynamicpb.Message); ok {
		*m = *dynamicpb.NewMessage(spec.Schema.(protoreflect.MethodDescriptor).Input())
	}
	return nil
}

// serve mounts h with the interceptor on an httptest server (HTTP/2, TLS),
// as generated code mounts a handler (WithSchema), and returns its URL and
// client; both end with the test.
func serve(t *testing.T, db idem.Beginner, opts idemconnect.Options, h ledgerHandler) (string, *http.Client) {
	t.Helper()
	return serveWith(t, db, opts, nil, h)
}

// serveWith is serve with the interceptors outer before idemconnect's.
func serveWith(t *testing.T, db idem.Beginner, opts idemconnect.Options, outer []connect.Interceptor, h ledgerHandler) (string, *http.Client) {
	t.Helper()
	if opts.Scope == nil {
		opts.Scope = scopeFromHeader
	}
	mux := http.NewServeMux()
	mux.Handle(transferProcedure, connect.NewUnaryHandler(transferProcedure, h,
		connect.WithSchema(transferMethod), connect.WithRequestInitializer(initRequest),
		connect.WithInterceptors(append(outer, idemconnect.NewInterceptor(db, opts))...)))
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv.URL, srv.Client()
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

// rawReply is a reply as the bytes that came over the wire.
type rawReply []byte

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

// answer is what a client got from one call.
type answer struct {
	body    []byte // the reply's bytes as they came over the wire
	err     error
	header  http.Header
	trailer http.Header
}

func (a answer) replayed() bool { return a.header.Get(idemconnect.HeaderReplayed) == "true" }

// decode returns the reply.
func (a answer) decode(t *testing.T) *errdetails.ResourceInfo {
	t.Helper()
	m := &errdetails.ResourceInfo{}
	if err := proto.Unmarshal(a.body, m); err != nil {
		t.Fatal(err)
	}
	return m
}

// call calls Transfer as user with key in the header (none when key is ""),
// over the Connect protocol unless options say otherwise.
func call(ctx context.Context, url string, hc *http.Client, user string, keys []string, req proto.Message, options ...connect.ClientOption) answer {
	client := connect.NewClient[dynamicpb.Message, rawReply](hc, url+transferProcedure,
		append([]connect.ClientOption{connect.WithCodec(rawCodec{})}, options...)...)
	r := connect.NewRequest(req.(*dynamicpb.Message))
	r.Header().Set("User", user)
	for _, k := range keys {
		r.Header().Add(idemconnect.HeaderKey, k)
	}
	resp, err := client.CallUnary(ctx, r)
	if err != nil {
		h := http.Header{}
		var ce *connect.Error
		if errors.As(err, &ce) {
			h = ce.Meta()
		}
		return answer{err: err, header: h}
	}
	return answer{body: *resp.Msg, header: resp.Header(), trailer: resp.Trailer()}
}

// key is a one-key list for call.
func key(k string) []string { return []string{k} }
