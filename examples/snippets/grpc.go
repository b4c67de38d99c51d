//go:build ignore

// What the gRPC blocks of docs/rpc.md use: a service's pool, listener and
// authentication interceptor. Compiled only with those blocks, by
// TestDocsCompile.
package snippets

import (
	"context"
	"database/sql"
	"errors"
	"log"
	"net"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
)

var (
	pool *pgxpool.Pool // the service's pool, from pgxpool.New
	lis  net.Listener  // from net.Listen("tcp", addr)
	db   *sql.DB       // the service's *sql.DB, from sql.Open("pgx", url) or lib/pq's "postgres"
)

// auth is the service's authentication interceptor: it verifies the call's
// credentials and puts the user in the context.
func auth(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	user, ok := verify(md.Get("authorization"))
	if !ok {
		return nil, status.Error(codes.Unauthenticated, "not authenticated")
	}
	return handler(context.WithValue(ctx, userKey{}, user), req)
}

type userKey struct{}

func verify(authorization []string) (user string, ok bool) { return "", false }

// scopeOf is the scope of a call: the user auth verified, and the method.
func scopeOf(ctx context.Context, fullMethod string) (idem.Scope, error) {
	user, _ := ctx.Value(userKey{}).(string)
	if user == "" {
		return idem.Scope{}, errors.New("not authenticated")
	}
	return idem.Scope{Actor: user, Operation: fullMethod}, nil
}

// registerServices registers the service's generated services on srv
// (ordersv1.RegisterOrdersServer(srv, svc), ...).
func registerServices(srv *grpc.Server) {}

// orderService implements the generated server interface of the orders
// service; PlaceOrder takes an item and answers the order's id.
type orderService struct{}
