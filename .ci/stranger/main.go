// The stranger's program: test data for .ci/stranger/run, which copies it
// into a fresh module outside the repository, fetches idem's modules at a
// release version from a throwaway clone, builds this and runs it against
// DATABASE_URL (a database of its own). It uses every public package once:
// idem, idemsql, idemhttp, idemgrpc, idemconnect and idemui, each with a
// call and its retry, and fails unless the retry is a replay.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx", for idemsql
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/idemui"
)

const (
	service   = "stranger.v1.Orders"
	procedure = "/" + service + "/PlaceOrder"
)

func main() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	pool, err := pgxpool.New(ctx, url)
	check(err)
	defer pool.Close()
	check(idem.Migrate(ctx, pool))
	scope := idem.Scope{Actor: "stranger", Operation: "orders.create"}

	// idem
	key := rand.Text()
	for i := range 2 {
		res, err := idem.DoInTx(ctx, pool, scope, key, idem.FingerprintParts([]byte("coffee")),
			func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				return idem.Response{Status: 201, Body: []byte("coffee")}, nil
			})
		check(err)
		expect("idem", i, res.Replayed)
	}

	// idemsql, through pgx's database/sql driver
	db, err := sql.Open("pgx", url)
	check(err)
	defer db.Close()
	key = rand.Text()
	for i := range 2 {
		res, err := idemsql.DoInTx(ctx, db, scope, key, idem.FingerprintParts([]byte("tea")),
			func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				return idem.Response{Status: 201, Body: []byte("tea")}, nil
			})
		check(err)
		expect("idemsql", i, res.Replayed)
	}

	// idemhttp
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, "order")
	})
	actor := func(*http.Request) (string, error) { return "stranger", nil }
	web := httptest.NewServer(idemhttp.Middleware(pool, idemhttp.Options{Actor: actor})(handler))
	defer web.Close()
	key = rand.Text()
	for i := range 2 {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, web.URL+"/orders", bytes.NewBufferString(`{"item":"cake"}`))
		check(err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(idemhttp.HeaderKey, key)
		resp, err := http.DefaultClient.Do(req)
		check(err)
		resp.Body.Close()
		expect("idemhttp", i, resp.Header.Get(idemhttp.HeaderReplayed) == "true")
	}

	// The service both RPC adapters serve, as protoc would generate it:
	// PlaceOrder(StringValue) returns (Int64Value).
	fdp := &descriptorpb.FileDescriptorProto{
		Name:       proto.String("stranger/v1/orders.proto"),
		Package:    proto.String("stranger.v1"),
		Syntax:     proto.String("proto3"),
		Dependency: []string{"google/protobuf/wrappers.proto"},
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Orders"),
			Method: []*descriptorpb.MethodDescriptorProto{{
				Name:       proto.String("PlaceOrder"),
				InputType:  proto.String(".google.protobuf.StringValue"),
				OutputType: proto.String(".google.protobuf.Int64Value"),
			}},
		}},
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	check(err)
	check(protoregistry.GlobalFiles.RegisterFile(fd))
	rpcScope := func(_ context.Context, method string) (idem.Scope, error) {
		return idem.Scope{Actor: "stranger", Operation: method}, nil
	}

	// idemgrpc
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: rpcScope, RequireKey: true})))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: service,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "PlaceOrder",
			Handler: func(_ any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
				in := &wrapperspb.StringValue{}
				if err := dec(in); err != nil {
					return nil, err
				}
				return interceptor(ctx, in, &grpc.UnaryServerInfo{FullMethod: procedure},
					func(context.Context, any) (any, error) { return wrapperspb.Int64(7), nil })
			},
		}},
		Metadata: "stranger/v1/orders.proto",
	}, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	check(err)
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	check(err)
	defer conn.Close()
	key = rand.Text()
	for i := range 2 {
		var header metadata.MD
		out := &wrapperspb.Int64Value{}
		ctx := metadata.AppendToOutgoingContext(ctx, idemgrpc.MetadataKey, key)
		check(conn.Invoke(ctx, procedure, wrapperspb.String("pie"), out, grpc.Header(&header)))
		expect("idemgrpc", i, len(header.Get(idemgrpc.MetadataReplayed)) == 1 && header.Get(idemgrpc.MetadataReplayed)[0] == "true")
	}

	// idemconnect
	method := fd.Services().ByName("Orders").Methods().ByName("PlaceOrder")
	mux := http.NewServeMux()
	mux.Handle(procedure, connect.NewUnaryHandler(procedure,
		func(context.Context, *connect.Request[wrapperspb.StringValue]) (*connect.Response[wrapperspb.Int64Value], error) {
			return connect.NewResponse(wrapperspb.Int64(8)), nil
		},
		connect.WithSchema(method),
		connect.WithInterceptors(idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: rpcScope, RequireKey: true}))))
	rpc := httptest.NewServer(mux)
	defer rpc.Close()
	client := connect.NewClient[wrapperspb.StringValue, wrapperspb.Int64Value](rpc.Client(), rpc.URL+procedure)
	key = rand.Text()
	for i := range 2 {
		req := connect.NewRequest(wrapperspb.String("tart"))
		req.Header().Set(idemconnect.HeaderKey, key)
		resp, err := client.CallUnary(ctx, req)
		check(err)
		expect("idemconnect", i, resp.Header().Get(idemconnect.HeaderReplayed) == "true")
	}

	// idemui
	ui, err := idemui.New(idemui.Options{DB: pool, ReadOnly: true,
		Authorize: func(*http.Request, idemui.Action) (string, error) { return "stranger", nil }})
	check(err)
	rec := httptest.NewRecorder()
	ui.ServeHTTP(rec, httptest.NewRequestWithContext(ctx, http.MethodGet, "/", nil))
	if rec.Code != http.StatusOK {
		log.Fatalf("idemui: GET / answered %d", rec.Code)
	}
	fmt.Println("idemui: the console answers 200")

	var keys int
	check(pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys`).Scan(&keys))
	fmt.Println("keys stored:", keys)
}

// expect checks that the first call ran and the second replayed.
func expect(what string, call int, replayed bool) {
	if replayed != (call == 1) {
		log.Fatalf("%s: call %d replayed=%t", what, call+1, replayed)
	}
	if replayed {
		fmt.Println(what + ": the retry replayed")
	}
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
