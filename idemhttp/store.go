package idemhttp

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"reflect"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// store is where the middleware and the status handler keep keys: idem on
// a pgx handle (Middleware, StatusHandler) or idemsql on a *sql.DB
// (MiddlewareSQL, StatusHandlerSQL). Everything else, every outcome and
// answer, is the same code for both. fn gets the request's transaction:
// a pgx.Tx or a *sql.Tx.
type store interface {
	doInTx(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint,
		fn func(ctx context.Context, tx any) (idem.Response, error)) (idem.Result, error)
	inTx(ctx context.Context, fn func(ctx context.Context, tx any) error) error
	lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error)
}

// pgxStore is idem on a pgx handle.
type pgxStore struct {
	db idem.Beginner
	c  *idem.Client
}

func (s pgxStore) doInTx(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx any) (idem.Response, error)) (idem.Result, error) {
	return s.c.DoInTx(ctx, s.db, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) { return fn(ctx, tx) })
}

func (s pgxStore) inTx(ctx context.Context, fn func(ctx context.Context, tx any) error) error {
	return s.c.InTx(ctx, s.db, func(ctx context.Context, tx pgx.Tx) error { return fn(ctx, tx) })
}

func (s pgxStore) lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error) {
	return s.c.Lookup(ctx, s.db, scope, key)
}

// sqlStore is idemsql on a *sql.DB.
type sqlStore struct {
	db *sql.DB
	c  *idemsql.Client
}

func newSQLStore(db *sql.DB, c *idem.Client) (sqlStore, error) {
	sc, err := idemsql.New(c.Config())
	return sqlStore{db: db, c: sc}, err
}

func (s sqlStore) doInTx(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx any) (idem.Response, error)) (idem.Result, error) {
	return s.c.DoInTx(ctx, s.db, scope, key, fp, func(ctx context.Context, tx *sql.Tx) (idem.Response, error) { return fn(ctx, tx) })
}

func (s sqlStore) inTx(ctx context.Context, fn func(ctx context.Context, tx any) error) error {
	return s.c.InTx(ctx, s.db, func(ctx context.Context, tx *sql.Tx) error { return fn(ctx, tx) })
}

func (s sqlStore) lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error) {
	return s.c.Lookup(ctx, s.db, scope, key)
}

// sqlTxKey is the context key of the request's *sql.Tx.
type sqlTxKey struct{}

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
func TxSQL(ctx context.Context) *sql.Tx {
	tx, _ := ctx.Value(sqlTxKey{}).(*sql.Tx)
	return tx
}

// MiddlewareSQL is Middleware for services on database/sql (pgx's stdlib
// driver or lib/pq): the same requests, outcomes and answers, with the
// handler's transaction a *sql.Tx begun on db, which the handler gets from
// TxSQL. It panics on a nil db or invalid opts, as Middleware does. Run
// idemsql.Migrate (or idem.Migrate) once before use.
func MiddlewareSQL(db *sql.DB, opts Options) func(http.Handler) http.Handler {
	m, err := newMiddleware(db, opts)
	if err != nil {
		panic(err)
	}
	return m.wrap
}

// StatusHandlerSQL is StatusHandler on a *sql.DB. It panics on a nil db or
// invalid opts.
func StatusHandlerSQL(db *sql.DB, opts StatusOptions) http.Handler {
	h, err := newStatusHandler(db, opts)
	if err != nil {
		panic(err)
	}
	return h
}

// nilHandle reports whether db is nil or a nil pointer (a nil *sql.DB or
// *pgxpool.Pool).
func nilHandle(db any) bool {
	return db == nil || reflect.ValueOf(db).Kind() == reflect.Pointer && reflect.ValueOf(db).IsNil()
}

// newStore returns the store of db: a *sql.DB or an idem.Beginner.
func newStore(db any, c *idem.Client) (store, error) {
	switch db := db.(type) {
	case *sql.DB:
		return newSQLStore(db, c)
	case idem.Beginner:
		return pgxStore{db: db, c: c}, nil
	}
	return nil, fmt.Errorf("idemhttp: %T is neither an idem.Beginner nor a *sql.DB", db)
}
