package idemhttp

import (
	"context"
	"database/sql"
	"net/http"
)

// TxSQL is Tx for MiddlewareSQL: the *sql.Tx of the covered request that
// ctx belongs to (the handler's r.Context()), or nil outside one. The same
// rules hold: its writes commit with the stored response when the handler
// answers 2xx or 3xx and are rolled back otherwise, and the handler must
// not commit or roll it back, nor keep it after returning. An ORM can run
// on it (Bun: bun.Tx{Tx: tx}; sqlx: wrap it with sqlx.Tx; GORM: open a
// session on it; ent: a client over it).
//
// A serialization failure or deadlock met at the claim or at COMMIT runs
// the handler again in a new transaction, as with Middleware. One met by
// the handler's own statements is not seen by the middleware (a *sql.Tx
// cannot be watched): the handler should answer 503 (not stored, so the
// client's retry runs again).
func TxSQL(ctx context.Context) *sql.Tx { return txs.SQLTx(ctx) }

// MiddlewareSQL is Middleware for services on database/sql (pgx's stdlib
// driver or lib/pq): the same requests, outcomes and answers, with the
// handler's transaction a *sql.Tx begun on db, which the handler gets from
// TxSQL. It panics on a nil db or invalid opts, as Middleware does. Run
// idemsql.Migrate (or idem.Migrate) once before use. On a Citus
// coordinator, set Options.Citus.
func MiddlewareSQL(db *sql.DB, opts Options) func(http.Handler) http.Handler {
	m, err := newMiddleware(opts, txs.SQL(db, opts.Citus))
	if err != nil {
		panic(err)
	}
	return m.wrap
}

// StatusHandlerSQL is StatusHandler on a *sql.DB. It panics on a nil db or
// invalid opts. On a Citus coordinator, set StatusOptions.Citus.
func StatusHandlerSQL(db *sql.DB, opts StatusOptions) http.Handler {
	h, err := newStatusHandler(opts, txs.SQL(db, opts.Citus))
	if err != nil {
		panic(err)
	}
	return h
}
