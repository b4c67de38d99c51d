//go:build ignore

// What the Connect blocks of docs/rpc.md use: a service's pool, mux,
// authentication interceptor and handler constructor. Compiled only with
// those blocks, by TestDocsCompile.
package snippets

import (
	"context"
	"database/sql"
	"errors"
	"net/http"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
)

var (
	pool *pgxpool.Pool // the service's pool, from pgxpool.New
	mux  = http.NewServeMux()
	svc  = &orderService{}
	db   *sql.DB // the service's *sql.DB, from sql.Open("pgx", url) or lib/pq's "postgres"
)

// auth is the service's authentication interceptor: it verifies the call's
// credentials and puts the user in the context.
var auth = connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		user, ok := verify(req.Header().Get("Authorization"))
		if !ok {
			return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("not authenticated"))
		}
		return next(context.WithValue(ctx, userKey{}, user), req)
	}
})

type userKey struct{}

func verify(authorization string) (user string, ok bool) { return "", false }

// scopeOf is the scope of a call: the user auth verified, and the procedure.
func scopeOf(ctx context.Context, procedure string) (idem.Scope, error) {
	user, _ := ctx.Value(userKey{}).(string)
	if user == "" {
		return idem.Scope{}, errors.New("not authenticated")
	}
	return idem.Scope{Actor: user, Operation: procedure}, nil
}

// orderService implements the orders service; PlaceOrder takes an item and
// answers the order's id.
type orderService struct{}

const placeOrderProcedure = "/orders.v1.OrderService/PlaceOrder"

// newOrdersHandler stands for the constructor protoc-gen-connect-go writes
// (ordersv1connect.NewOrderServiceHandler): the path and the handler of the
// service's procedures.
func newOrdersHandler(svc *orderService, opts ...connect.HandlerOption) (string, http.Handler) {
	return placeOrderProcedure, connect.NewUnaryHandler(placeOrderProcedure, svc.PlaceOrder, opts...)
}

func (s *orderService) PlaceOrder(ctx context.Context, req *connect.Request[wrapperspb.StringValue]) (*connect.Response[wrapperspb.Int64Value], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, nil)
}
