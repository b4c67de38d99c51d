// Package idemgrpc is a grpc-go unary server interceptor that makes calls
// idempotent by their idempotency key, with the handler's own database
// writes in the same PostgreSQL transaction as the key and the stored reply.
//
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
//		auth, // puts the authenticated user in the context
//		idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scopeOf}),
//	))
//
//	func (s *orders) PlaceOrder(ctx context.Context, req *pb.PlaceOrderRequest) (*pb.Order, error) {
//		tx := idemgrpc.Tx(ctx) // writes here commit with the key and the reply; nil without a key
//		...
//	}
//
// A client sends a new key (a UUID, say) in the metadata entry
// idempotency-key with each new intent, and the same key with every retry of
// it (or in a request field, AIP-155's request_id: Options.KeyField). The
// first call runs the handler in a transaction; its reply, or its refusal,
// commits with the key. A retry gets the same reply (the same message bytes,
// with the metadata idempotent-replayed: true) and the handler does not run.
// See UnaryServerInterceptor for the whole contract, and docs/rpc.md in the
// repository.
//
// Services on database/sql (pgx's stdlib driver, lib/pq, or an ORM over
// them) use UnaryServerInterceptorSQL on a *sql.DB instead: the same calls,
// outcomes and answers, kept by package idemsql, with the handler's
// transaction a *sql.Tx from TxSQL.
//
//	idemgrpc.UnaryServerInterceptorSQL(db, idemgrpc.Options{Scope: scopeOf})
//
// The layers a call goes through:
//
//	idemgrpc               this package: metadata, status errors (an adapter)
//	idem, idemsql          the public fronts: DoInTx on a pgx pool or a *sql.DB
//	the core               the protocol (claim, store, replay) and its drivers
//
// The interceptor asks the front, never the database; the handler's
// transaction reaches it only through Tx or TxSQL. idemconnect shares all
// but the transport's glue with this package, and stores a call's outcome
// alike: a key used through one replays through the other.
//
// The client side is UnaryClientInterceptor: it sends one idempotency-key
// with every attempt of a call (the call's own idempotency-key metadata, the
// context's call key, idem.WithCallKey, the request's AIP-155 request_id
// field, or one it mints once per call) and retries what another attempt
// may fix (see docs/calling.md in the repository).
//
// Run idem.Migrate (or idemsql.Migrate) once before use.
package idemgrpc
