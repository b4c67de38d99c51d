// Package idemconnect is a connect-go interceptor that makes unary calls
// idempotent by their Idempotency-Key header, with the handler's own
// database writes in the same PostgreSQL transaction as the key and the
// stored reply.
//
//	interceptor := idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scopeOf})
//	mux.Handle(ordersv1connect.NewOrderServiceHandler(svc, connect.WithInterceptors(auth, interceptor)))
//
//	func (s *orders) PlaceOrder(ctx context.Context, req *connect.Request[pb.PlaceOrderRequest]) (*connect.Response[pb.Order], error) {
//		tx := idemconnect.Tx(ctx) // writes here commit with the key and the reply; nil without a key
//		...
//	}
//
// It serves the Connect, gRPC and gRPC-Web protocols alike: a client sends
// a new key (a UUID, say) in the Idempotency-Key header with each new
// intent, and the same key with every retry of it (or in a request field,
// AIP-155's request_id: Options.KeyField). The first call runs the handler
// in a transaction; its reply, or its refusal, commits with the key. A retry
// gets the same reply with Idempotent-Replayed: true and the handler does
// not run. See NewInterceptor for the whole contract, and docs/rpc.md in the
// repository.
//
// Services on database/sql (pgx's stdlib driver, lib/pq, or an ORM over
// them) use NewInterceptorSQL on a *sql.DB instead: the same calls,
// outcomes and answers, kept by package idemsql, with the handler's
// transaction a *sql.Tx from TxSQL.
//
//	interceptor := idemconnect.NewInterceptorSQL(db, idemconnect.Options{Scope: scopeOf})
//
// A handler needs no schema (connect.WithSchema) to replay: the reply is
// stored with the full name of its message type, which a replay finds in
// protoregistry.GlobalTypes.
//
// The layers a call goes through:
//
//	idemconnect            this package: headers, *connect.Error (an adapter)
//	idem, idemsql          the public fronts: DoInTx on a pgx pool or a *sql.DB
//	the core               the protocol (claim, store, replay) and its drivers
//
// The interceptor asks the front, never the database; the handler's
// transaction reaches it only through Tx or TxSQL. idemgrpc shares all but
// the transport's glue with this package, and stores a call's outcome
// alike: a key used through one replays through the other.
//
// The client side is NewClientInterceptor: it sends one Idempotency-Key
// with every attempt of a call (the call's own Idempotency-Key header, the
// context's call key, idem.WithCallKey, the request's AIP-155 request_id
// field, or one it mints once per call) and retries what another attempt
// may fix (see docs/calling.md in the repository).
//
// Run idem.Migrate (or idemsql.Migrate) once before use.
package idemconnect
