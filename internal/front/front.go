// Package front is the public fronts, idem on a pgx handle and idemsql on a
// *sql.DB, as the adapters (idemhttp, idemgrpc, idemconnect) use them:
//
//	adapter (idemhttp, idemgrpc, idemconnect)
//	   │  Store: DoInTx, InTx, Lookup; fn gets a context that carries the transaction
//	   ▼
//	front (this package): Pgx or SQL, the transaction put in the adapter's Txs
//	   │  idem.Client.DoInTx / idemsql.Client.DoInTx (their public API only)
//	   ▼
//	core (the protocol) and its drivers
//
// A Store is opened for one transaction type (Txs.Pgx, Txs.SQL), and puts
// the transaction in the adapter's Txs before it calls the adapter's
// function; the handler reads it back with the adapter's typed accessor
// (Tx, TxSQL, which call Txs.PgxTx and Txs.SQLTx). The adapters themselves
// never hold a transaction, so nothing asserts one back from an interface.
package front

import (
	"context"
	"database/sql"
	"errors"
	"reflect"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/watchtx"
)

// slot is the context slot of an adapter's transaction of type TTx.
type slot[TTx any] struct {
	_ byte // not zero-sized: each Slot has its own address, the context key
}

// With returns ctx with tx in s.
func (s *slot[TTx]) With(ctx context.Context, tx TTx) context.Context {
	return context.WithValue(ctx, s, tx)
}

// Get returns the transaction in s, or the zero TTx (nil) when ctx has none.
func (s *slot[TTx]) Get(ctx context.Context) TTx {
	tx, _ := ctx.Value(s).(TTx)
	return tx
}

// Txs are an adapter's transactions in its handler's context: each adapter
// has its own (a package-level variable), so that one adapter's accessor
// never returns another's transaction. Pgx and SQL open the adapter's
// stores, PgxTx and SQLTx are its accessors (Tx and TxSQL).
type Txs struct {
	pgxTx slot[pgx.Tx]
	sqlTx slot[*sql.Tx]
}

// PgxTx returns the pgx.Tx that a store of Pgx put in ctx, or nil.
func (t *Txs) PgxTx(ctx context.Context) pgx.Tx { return t.pgxTx.Get(ctx) }

// SQLTx returns the *sql.Tx that a store of SQL put in ctx, or nil.
func (t *Txs) SQLTx(ctx context.Context) *sql.Tx { return t.sqlTx.Get(ctx) }

// Open returns the Store of an adapter's configured client, or the error
// of its handle (ErrNilHandle).
type Open func(c *idem.Client) (Store, error)

// Pgx opens the Store of a client on db: idem's DoInTx, InTx and Lookup,
// the transaction in t (PgxTx). The pgx.Tx there is watched (see watchtx):
// when one of fn's statements met a serialization failure or a deadlock,
// the transaction is lost whatever fn returned, and the Store returns that
// error instead of fn's result, so that idem runs fn again in a new
// transaction.
func (t *Txs) Pgx(db idem.Beginner) Open {
	return func(c *idem.Client) (Store, error) {
		if isNil(db) {
			return nil, ErrNilHandle
		}
		return pgxStore{db: db, c: c, slot: &t.pgxTx}, nil
	}
}

// SQL opens the Store of a client's configuration on db: idemsql's
// DoInTx, InTx and Lookup, the transaction in t (SQLTx), of a Client of
// idemsql.New, or with citus (db is a Citus coordinator) of
// idemsql.NewCitus. A *sql.Tx cannot be watched: a serialization failure or
// deadlock that fn's own statements met is seen only if fn returns it.
func (t *Txs) SQL(db *sql.DB, citus bool) Open {
	return func(c *idem.Client) (Store, error) {
		if db == nil {
			return nil, ErrNilHandle
		}
		newClient := idemsql.New
		if citus {
			newClient = idemsql.NewCitus
		}
		sc, err := newClient(c.Config())
		if err != nil {
			return nil, err
		}
		return sqlStore{db: db, c: sc, slot: &t.sqlTx}, nil
	}
}

// Store is where an adapter keeps keys and runs its handler: DoInTx, InTx
// and Lookup of idem (Txs.Pgx) or idemsql (Txs.SQL). fn's context carries
// the transaction, in the adapter's Txs.
type Store interface {
	DoInTx(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint,
		fn func(ctx context.Context) (idem.Response, error)) (idem.Result, error)
	InTx(ctx context.Context, fn func(ctx context.Context) error) error
	Lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error)
}

// ErrNilHandle is the error of a Store's Open for a nil database handle (a
// typed nil pointer too).
var ErrNilHandle = errors.New("nil database handle")

type pgxStore struct {
	db   idem.Beginner
	c    *idem.Client
	slot *slot[pgx.Tx]
}

func (s pgxStore) DoInTx(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context) (idem.Response, error)) (idem.Result, error) {
	return s.c.DoInTx(ctx, s.db, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return watched(ctx, s.slot, tx, fn)
	})
}

func (s pgxStore) InTx(ctx context.Context, fn func(ctx context.Context) error) error {
	return s.c.InTx(ctx, s.db, func(ctx context.Context, tx pgx.Tx) error {
		_, err := watched(ctx, s.slot, tx, func(ctx context.Context) (struct{}, error) { return struct{}{}, fn(ctx) })
		return err
	})
}

// watched runs fn with tx, watched (watchtx), in slot of its context, and
// returns its result, or the retryable error of a connection that tx lost
// while fn ran.
func watched[T any](ctx context.Context, slot *slot[pgx.Tx], tx pgx.Tx, fn func(ctx context.Context) (T, error)) (T, error) {
	wt := watchtx.New(tx)
	v, err := fn(slot.With(ctx, wt))
	if lost := wt.Retryable(); lost != nil {
		var zero T
		return zero, lost
	}
	return v, err
}

func (s pgxStore) Lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error) {
	return s.c.Lookup(ctx, s.db, scope, key)
}

type sqlStore struct {
	db   *sql.DB
	c    *idemsql.Client
	slot *slot[*sql.Tx]
}

func (s sqlStore) DoInTx(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context) (idem.Response, error)) (idem.Result, error) {
	return s.c.DoInTx(ctx, s.db, scope, key, fp, func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		return fn(s.slot.With(ctx, tx))
	})
}

func (s sqlStore) InTx(ctx context.Context, fn func(ctx context.Context) error) error {
	return s.c.InTx(ctx, s.db, func(ctx context.Context, tx *sql.Tx) error { return fn(s.slot.With(ctx, tx)) })
}

func (s sqlStore) Lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error) {
	return s.c.Lookup(ctx, s.db, scope, key)
}

// isNil reports whether db is nil or a nil pointer (a nil *pgxpool.Pool).
func isNil(db any) bool {
	if db == nil {
		return true
	}
	v := reflect.ValueOf(db)
	return v.Kind() == reflect.Pointer && v.IsNil()
}
