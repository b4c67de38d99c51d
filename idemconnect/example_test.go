package idemconnect_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
)

// An order service over Connect: the handler's INSERT commits with the key
// and the stored reply, and a retry of the same call gets the same order
// back instead of a second one. An out-of-stock refusal is stored and
// replayed, and its writes are undone.
func ExampleNewInterceptor() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, customer text NOT NULL, item text NOT NULL)`); err != nil {
		panic(err)
	}

	// The actor comes from authentication; here, a User header that an
	// authentication interceptor would have verified.
	scope := func(ctx context.Context, procedure string) (idem.Scope, error) {
		if info, ok := connect.CallInfoForHandlerContext(ctx); ok && info.RequestHeader().Get("User") != "" {
			return idem.Scope{Actor: info.RequestHeader().Get("User"), Operation: procedure}, nil
		}
		return idem.Scope{}, errors.New("not authenticated")
	}

	placeOrder := func(ctx context.Context, req *connect.Request[wrapperspb.StringValue]) (*connect.Response[wrapperspb.Int64Value], error) {
		tx := idemconnect.Tx(ctx) // the call's transaction: writes commit with the key and the reply
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO orders (customer, item) VALUES ($1, $2) RETURNING id`,
			req.Header().Get("User"), req.Msg.Value).Scan(&id)
		if err != nil {
			return nil, connect.NewError(connect.CodeInternal, errors.New("database error")) // rolled back, not stored
		}
		if req.Msg.Value == "unicorn" {
			// A deterministic refusal: the INSERT is undone, the error is
			// stored and returned to every retry.
			return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("out of stock"))
		}
		return connect.NewResponse(wrapperspb.Int64(id)), nil
	}

	interceptor := idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scope, RequireKey: true})
	mux := http.NewServeMux()
	mux.Handle(placeOrderProcedure, connect.NewUnaryHandler(placeOrderProcedure, placeOrder,
		connect.WithSchema(placeOrderSchema), // as generated handlers do
		connect.WithInterceptors(interceptor)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	client := connect.NewClient[wrapperspb.StringValue, wrapperspb.Int64Value](srv.Client(), srv.URL+placeOrderProcedure)
	order := func(key, item string) {
		req := connect.NewRequest(wrapperspb.String(item))
		req.Header().Set("User", "alice")
		req.Header().Set(idemconnect.HeaderKey, key)
		resp, err := client.CallUnary(ctx, req)
		var cerr *connect.Error
		switch {
		case errors.As(err, &cerr):
			fmt.Printf("%s: %s %q, replayed %q\n", item, cerr.Code(), cerr.Message(), cerr.Meta().Get(idemconnect.HeaderReplayed))
		case err != nil:
			panic(err)
		default:
			fmt.Printf("%s: order %d, replayed %q\n", item, resp.Msg.Value, resp.Header().Get(idemconnect.HeaderReplayed))
		}
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
	// coffee: order 1, replayed ""
	// coffee: order 1, replayed "true"
	// tea: failed_precondition "this idempotency key was used for a different request", replayed ""
	// unicorn: failed_precondition "out of stock", replayed ""
	// unicorn: failed_precondition "out of stock", replayed "true"
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
