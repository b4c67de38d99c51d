package idemsql

import (
	"context"
	"database/sql"
	"github.com/pgidem/idem/internal/core"

	"github.com/pgidem/idem"
)

// Do is idem.Do on a *sql.Tx: it runs fn at most once per key. It claims
// (scope, key) in tx, runs fn in tx, and stores fn's Response in tx, in a
// savepoint of tx that Do ends before it returns; everything commits or
// rolls back with tx, and Do never commits or rolls back tx itself. Every
// case (first call, replay, idem.ErrKeyReused, concurrent twins waiting at
// most Config.Wait then idem.ErrInProgress, Reject, fn's errors and panics
// undone, expired keys, keys held by reservations) is decided by package
// idem's own state machine and behaves as idem.Do documents.
//
// tx may come from database/sql directly or from an ORM that hands one out
// (Bun's and sqlx's transactions embed a *sql.Tx; GORM and ent can run on
// one): the examples module shows each.
//
// After a serialization failure (40001) or a deadlock (40P01) the whole
// transaction must be run again (InTx and DoInTx do so). A tx that is
// closed (committed or rolled back) or aborted (a statement failed in it)
// is idem.ErrInvalidArgument, as in idem.Do.
//
// Do uses the package defaults; see Client.Do.
func Do(ctx context.Context, tx *sql.Tx, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) (idem.Result, error) {
	return defaultClient.Do(ctx, tx, scope, key, fp, fn)
}

// Do is the package-level Do with this client's configuration.
func (c *Client) Do(ctx context.Context, tx *sql.Tx, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) (idem.Result, error) {
	res, err := c.c.Do(ctx, tx, core.Scope(scope), key, core.Fingerprint(fp), coreFn(fn))
	return result(res), publicErr(err)
}

// DoInTx is idem.DoInTx on a *sql.DB: Do in a transaction of its own begun
// on db (at Config.IsolationLevel), committed when Do returns a nil error:
// the claim, fn's writes and the stored response commit together. fn runs
// directly in the transaction (no savepoint): when fn fails the transaction
// is rolled back whole, and a refusal (Reject) is stored in a transaction
// of its own that claims the key again and runs nothing. Serialization
// failures and deadlocks are retried (Config.MaxRetries), and a retry of a
// duplicate replays the winner's response; under SERIALIZABLE such a
// failure can surface after fn ran, and then fn runs again and only one
// run's writes commit. A lost connection, or a COMMIT whose answer never
// came, is idem.ErrUnavailable: retry with the same key, which replays if
// the first attempt committed.
//
// fn must not commit or roll back tx: as idem.DoInTx, DoInTx then returns
// an error wrapping idem.ErrInvalidArgument that says which, and after a
// COMMIT turns the key's record unknown (idem.ErrOutcomeUnknown to
// retries; ListUnknown, Resolve). (A *sql.Tx is never a savepoint of
// another transaction, so Do's and DoInTx's fn cannot leave its writes
// pending in an enclosing one, as fn can with pgx's nested transactions.)
//
// Unlike idem.DoInTx on a pgx pool, concurrent duplicates in one process
// are not coalesced: they meet at the primary key (the first runs fn, the
// others wait at most Config.Wait and replay).
func DoInTx(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) (idem.Result, error) {
	return defaultClient.DoInTx(ctx, db, scope, key, fp, fn)
}

// DoInTx is the package-level DoInTx with this client's configuration.
func (c *Client) DoInTx(ctx context.Context, db *sql.DB, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) (idem.Result, error) {
	res, err := c.c.DoInTx(ctx, db, core.Scope(scope), key, core.Fingerprint(fp), coreFn(fn))
	return result(res), publicErr(err)
}
