package idemgrpc_test

// The test service, without protoc: a file descriptor built in Go
// (idemtest.v1.Ledger/Transfer), its messages as dynamicpb, served by a real
// grpc-go server on 127.0.0.1 and called by a real client.

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

const transferMethod = "/idemtest.v1.Ledger/Transfer"

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

// getString and getInt read a field of a dynamic message.
func getString(m proto.Message, name string) string {
	r := m.ProtoReflect()
	return r.Get(r.Descriptor().Fields().ByName(protoreflect.Name(name))).String()
}

func getInt(m proto.Message, name string) int64 {
	r := m.ProtoReflect()
	return r.Get(r.Descriptor().Fields().ByName(protoreflect.Name(name))).Int()
}

// ledgerHandler is the Transfer method: it runs with the request's
// TransferRequest and answers a TransferReply or an error.
type ledgerHandler func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error)

// serviceDesc serves h as idemtest.v1.Ledger, as generated code would.
func serviceDesc(h ledgerHandler) *grpc.ServiceDesc {
	return &grpc.ServiceDesc{
		ServiceName: "idemtest.v1.Ledger",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Transfer",
			Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
				in := dynamicpb.NewMessage(requestDesc)
				if err := dec(in); err != nil {
					return nil, err
				}
				run := func(ctx context.Context, req any) (any, error) { return h(ctx, req.(*dynamicpb.Message)) }
				if interceptor == nil {
					return run(ctx, in)
				}
				return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: transferMethod}, run)
			},
		}},
		Metadata: "idemtest/v1/ledger.proto",
	}
}

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
	return func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
		runs.Add(1)
		var id int64
		tx := idemgrpc.Tx(ctx)
		if tx == nil {
			return reply(0, "no transaction"), nil
		}
		err := tx.QueryRow(ctx, `INSERT INTO transfers (note, amount) VALUES ($1, $2) RETURNING id`,
			getString(req, "note"), getInt(req, "amount")).Scan(&id)
		if err != nil {
			return nil, err
		}
		return reply(id, getString(req, "note")), nil
	}
}

// serve starts a grpc-go server on 127.0.0.1 with the interceptor and h, and
// returns a client connection to it; both end with the test.
func serve(t testing.TB, db idem.Beginner, opts idemgrpc.Options, h ledgerHandler) *grpc.ClientConn {
	t.Helper()
	if opts.Scope == nil {
		opts.Scope = scopeFromMetadata
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(idemgrpc.UnaryServerInterceptor(db, opts)))
	srv.RegisterService(serviceDesc(h), nil)
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
	return conn
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

// answer is what a client got from one call.
type answer struct {
	body    []byte // the reply's bytes as they came over the wire
	err     error
	header  metadata.MD
	trailer metadata.MD
}

func (a answer) replayed() bool {
	v := a.header.Get(idemgrpc.MetadataReplayed)
	return len(v) == 1 && v[0] == "true"
}

// decode returns the reply.
func (a answer) decode(t *testing.T) *errdetails.ResourceInfo {
	t.Helper()
	m := &errdetails.ResourceInfo{}
	if err := proto.Unmarshal(a.body, m); err != nil {
		t.Fatal(err)
	}
	return m
}

// call calls Transfer as user with key in the metadata (none when key is
// "").
func call(ctx context.Context, conn *grpc.ClientConn, user, key string, req proto.Message) answer {
	md := metadata.Pairs("user", user)
	if key != "" {
		md.Set(idemgrpc.MetadataKey, key)
	}
	return callMD(ctx, conn, md, req)
}

func callMD(ctx context.Context, conn *grpc.ClientConn, md metadata.MD, req proto.Message) answer {
	var a answer
	a.err = conn.Invoke(metadata.NewOutgoingContext(ctx, md), transferMethod, req, &a.body,
		grpc.ForceCodec(rawCodec{}), grpc.Header(&a.header), grpc.Trailer(&a.trailer))
	return a
}
