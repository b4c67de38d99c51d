package idemgrpc_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
)

// An order service over gRPC: the handler's INSERT commits with the key and
// the stored reply, and a retry of the same call gets the same order back
// instead of a second one. An out-of-stock refusal is stored and replayed,
// and its writes are undone.
func ExampleUnaryServerInterceptor() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, customer text NOT NULL, item text NOT NULL)`); err != nil {
		panic(err)
	}

	// The actor comes from authentication; here, a "user" metadata entry
	// that an authentication interceptor would have verified.
	scope := func(ctx context.Context, fullMethod string) (idem.Scope, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		if users := md.Get("user"); len(users) == 1 {
			return idem.Scope{Actor: users[0], Operation: fullMethod}, nil
		}
		return idem.Scope{}, errors.New("not authenticated")
	}

	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scope, RequireKey: true}),
	))
	registerOrdersServer(srv, func(ctx context.Context, item *wrapperspb.StringValue) (*wrapperspb.Int64Value, error) {
		tx := idemgrpc.Tx(ctx) // the call's transaction: writes commit with the key and the reply
		md, _ := metadata.FromIncomingContext(ctx)
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO orders (customer, item) VALUES ($1, $2) RETURNING id`,
			md.Get("user")[0], item.Value).Scan(&id)
		if err != nil {
			return nil, status.Error(codes.Internal, "database error") // rolled back, not stored
		}
		if item.Value == "unicorn" {
			// A deterministic refusal: the INSERT is undone, the status
			// is stored and returned to every retry.
			return nil, status.Error(codes.FailedPrecondition, "out of stock")
		}
		return wrapperspb.Int64(id), nil
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	order := func(key, item string) {
		ctx := metadata.AppendToOutgoingContext(ctx, "user", "alice", idemgrpc.MetadataKey, key)
		var header metadata.MD
		id, err := placeOrder(ctx, conn, wrapperspb.String(item), grpc.Header(&header))
		replayed := header.Get(idemgrpc.MetadataReplayed)
		if err != nil {
			fmt.Printf("%s: %s %q, replayed %v\n", item, status.Code(err), status.Convert(err).Message(), replayed)
			return
		}
		fmt.Printf("%s: order %d, replayed %v\n", item, id.Value, replayed)
	}
	order("7f3a9c2e-order-1", "coffee")
	order("7f3a9c2e-order-1", "coffee")  // a retry: the same order
	order("7f3a9c2e-order-1", "tea")     // the same key, another request
	order("0b5e1d4f-order-2", "unicorn") // refused
	order("0b5e1d4f-order-2", "unicorn") // the refusal, replayed

	var orders int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		panic(err)
	}
	fmt.Println("orders in the table:", orders)
	// Output:
	// coffee: order 1, replayed []
	// coffee: order 1, replayed [true]
	// tea: FailedPrecondition "this idempotency key was used for a different request", replayed []
	// unicorn: FailedPrecondition "out of stock", replayed []
	// unicorn: FailedPrecondition "out of stock", replayed [true]
	// orders in the table: 1
}

// examplePool connects the way a service does: to DATABASE_URL (here with
// a default for a local PostgreSQL), through a pgxpool, with idem.Migrate at
// start-up. In a service that is all:
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	...
//	err = idem.Migrate(ctx, pool)
//
// Only so that the examples never see each other's rows or those of an
// earlier run, each one gets a schema of its own, first on the pool's
// search_path: idem's table and the example's tables live there, and the
// function returned drops it and closes the pool.
func examplePool() (*pgxpool.Pool, func()) {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@localhost:5432/postgres"
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 10
	schema := fmt.Sprintf("example_%x", rand.Uint64())
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		_, err = pool.Exec(ctx, "CREATE SCHEMA "+schema)
		if err == nil {
			err = idem.Migrate(ctx, pool)
		}
	}
	if err != nil {
		panic(err)
	}
	return pool, func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	}
}
