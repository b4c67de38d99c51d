// Package pgxdriver is idem's driver for pgx (github.com/jackc/pgx/v5), the
// driver of package idem: it sends a call's steps pipelined in pgx batches,
// each step in the round trip that BEGIN or SAVEPOINT, COMMIT or RELEASE
// already cost.
//
//	Span.Claim     SAVEPOINT (or BEGIN) + the claim          1 round trip
//	Span.Complete  the completion + RELEASE (or COMMIT)      1 round trip
//	Span.Read      SET LOCAL + the read + ROLLBACK TO,
//	               RELEASE (or COMMIT)                       1 round trip
//
// Every table statement is a method sqlc generates into internal/db from
// queries/. The statements a batch sends together are queued by calling the
// method on a queuer and read back by calling it again on a batchRead
// (batch.go); the others run through planned (planned anew on every
// execution, never a cached generic plan).
//
// Before pgx sends a batch in its exec modes cache_statement, cache_describe
// and describe_exec, it prepares or describes the statements it has not
// cached, in a round trip of their own: in the caller's transaction, where a
// lock wait or a cancelled statement there would abort it. pgx caches a
// batch's statements when the batch succeeds and drops them all when it
// fails. So unless the last claim batch of the same form succeeded on the
// connection, Do sends its SAVEPOINT alone first (and asks whether the
// database is Citus inside it), then the claim; otherwise SAVEPOINT and the
// claim go together, and pgx may prepare the statement SAVEPOINT itself
// before them (it takes no lock). span.go (Claim) says exactly what runs
// where. Citus's statement forms are chosen here (citus.go), per connection.
package pgxdriver

import (
	"context"
	"errors"
	"reflect"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// Beginner starts transactions. *pgxpool.Pool, *pgx.Conn and pgx.Tx (which
// begins a savepoint) satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// txBeginner is the richer form that *pgxpool.Pool and *pgx.Conn offer;
// Begin uses it to set the isolation level in the BEGIN statement itself.
type txBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// Driver is the pgx driver of one Client.
type Driver struct {
	ttl         driver.Settings // TTL and TTLFor: ttl.TTL(operation) is a key's TTL
	lockTimeout string
	txOptions   pgx.TxOptions
	// sqlSetWait is SET LOCAL lock_timeout = Wait: Reserve's bound, where
	// set_config would not reach Citus's workers.
	sqlSetWait string
	// sqlClaimWait is the same setting for Citus's claim, spelt apart
	// (TO, not =) so that pgx caches it as a statement of claim batches
	// only: a Reserve batch that fails makes pgx drop its own statements
	// from its caches, never the claim's (see connState.sent).
	sqlClaimWait string
	// claimForms names the statements of each claim batch (by Citus, then
	// take-over), to remember per connection which ones pgx has cached.
	claimForms [2][2]string
	citus      citusCache
}

var _ driver.Driver[pgx.Tx, Beginner] = (*Driver)(nil)

// New returns the pgx driver for a Client's settings.
func New(s driver.Settings) driver.Driver[pgx.Tx, Beginner] {
	d := &Driver{
		ttl:          driver.Settings{TTLMicros: s.TTLMicros, TTLFor: s.TTLFor, BodyTTLMicros: s.BodyTTLMicros, BodyTTLFor: s.BodyTTLFor},
		lockTimeout:  s.LockTimeout,
		txOptions:    pgx.TxOptions{IsoLevel: pgx.TxIsoLevel(s.IsolationLevel)},
		sqlSetWait:   "SET LOCAL lock_timeout = '" + s.LockTimeout + "'",
		sqlClaimWait: "SET LOCAL lock_timeout TO '" + s.LockTimeout + "'",
	}
	d.claimForms = [2][2]string{{"claim", "take-over"}, {"citus claim " + s.LockTimeout, "citus take-over " + s.LockTimeout}}
	return d
}

var queries = db.New()

var (
	errConnInTx = errors.New("the connection is in a transaction; pass that pgx.Tx instead")
	errCommits  = errors.New("the call commits a transaction of its own before the work starts (Reserve): pass a pool or a connection, not a pgx.Tx")
	errNilDB    = errors.New("nil database handle")
)

// CheckDB refuses a nil handle, a *pgx.Conn or *pgxpool.Conn already in a
// transaction (BEGIN would only warn, and COMMIT would end the caller's
// transaction), and, for a call that commits, a pgx.Tx.
func (d *Driver) CheckDB(db Beginner, commits bool) error {
	if isNil(db) {
		return errNilDB
	}
	if conn, ok := db.(*pgx.Conn); ok && conn.PgConn().TxStatus() != 'I' {
		return errConnInTx
	}
	if pooled, ok := db.(*pgxpool.Conn); ok && pooled.Conn().PgConn().TxStatus() != 'I' {
		return errConnInTx
	}
	if _, ok := db.(pgx.Tx); ok && commits {
		return errCommits
	}
	return nil
}

// Nested reports whether db is a transaction, on which Begin begins a
// savepoint.
func (d *Driver) Nested(db Beginner) bool {
	_, nested := db.(pgx.Tx)
	return nested
}

// NilTx reports whether tx is nil, or an interface holding a nil pointer.
func (d *Driver) NilTx(tx pgx.Tx) bool { return isNil(tx) }

// TxClosed reports pgx's error of a transaction already ended.
func (d *Driver) TxClosed(err error) bool { return errors.Is(err, pgx.ErrTxClosed) }

// CtxEndsTx is false: pgx never ends a transaction for its context.
func (d *Driver) CtxEndsTx() bool { return false }

// Interpret translates pgx's errors into the driver package's terms.
func (d *Driver) Interpret(err error) error { return dberr.Interpret(err) }

// PreparedStatementsFix adds nothing: the core's words are pgx's.
func (d *Driver) PreparedStatementsFix() string { return "" }

// isNil reports whether v is nil or an interface holding a nil pointer (a
// nil *pgxpool.Pool passed as a Beginner, say), which would panic on use.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Chan, reflect.Func, reflect.Interface, reflect.Slice:
		return rv.IsNil()
	}
	return false
}
