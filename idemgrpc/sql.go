package idemgrpc

import (
	"context"
	"database/sql"

	"google.golang.org/grpc"
)

// TxSQL is Tx for UnaryServerInterceptorSQL: the *sql.Tx of the covered
// call with a key that ctx belongs to, or nil. The same rules hold. A
// serialization failure or deadlock met at the claim or at COMMIT runs the
// handler again in a new transaction, as with UnaryServerInterceptor; one
// met by the handler's own statements is not seen by the interceptor (a
// *sql.Tx cannot be watched): the handler should return an error whose
// code is not a refusal (UNAVAILABLE, ABORTED), which stores nothing, so
// that the client's retry runs again.
func TxSQL(ctx context.Context) *sql.Tx { return txs.SQLTx(ctx) }

// UnaryServerInterceptorSQL is UnaryServerInterceptor for services on
// database/sql (pgx's stdlib driver or lib/pq): the same calls, outcomes and
// answers, kept by package idemsql, with the handler's transaction a
// *sql.Tx begun on db, which the handler gets from TxSQL. It panics on a nil
// db or invalid opts, as UnaryServerInterceptor does. Unlike it, concurrent
// duplicates in one process are not coalesced: they meet at the key's row
// (see idemsql.DoInTx), with the same answers. On a Citus coordinator, set
// Options.Citus.
func UnaryServerInterceptorSQL(db *sql.DB, opts Options) grpc.UnaryServerInterceptor {
	return mustIntercept(opts, txs.SQL(db, opts.Citus))
}
