// Package sqldriver is idem's driver for database/sql (pgx's stdlib driver
// or lib/pq), the driver of package idemsql. database/sql sends one
// statement per round trip and cannot pipeline, so it runs the steps pgx's
// driver sends together one at a time:
//
//	Span.Claim     SAVEPOINT (or BEGIN), the claim           2 round trips
//	Span.Complete  the completion, RELEASE (or COMMIT)       2 round trips
//	Span.Read      SET LOCAL, the read, ROLLBACK TO and
//	               RELEASE in one message (or ROLLBACK)      3 round trips
//
// Every table statement is a method sqlc generates into internal/dbsql
// from the same query files as pgx's internal/db. A *sql.Tx does not say
// which connection it is on, so whether the database is a Citus
// coordinator is not asked: it is a setting (New's citus), which picks
// Citus's statement forms without a statement per call.
package sqldriver

import (
	"database/sql"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/dbsql"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// Driver is the database/sql driver of one Client.
type Driver struct {
	ttl         driver.Settings // TTL and TTLFor: ttl.TTL(operation) is a key's TTL
	lockTimeout string
	txOptions   *sql.TxOptions
	// sqlSetWait is SET LOCAL lock_timeout = Wait: Reserve's bound, and
	// Citus's claim's, where set_config would not reach the workers.
	sqlSetWait string
	citus      bool
}

var _ driver.Driver[*sql.Tx, *sql.DB] = (*Driver)(nil)

// New returns the database/sql driver for a Client's settings; with citus,
// its statements take the forms a Citus coordinator accepts and bounds
// waits on its workers.
func New(s driver.Settings, citus bool) *Driver {
	d := &Driver{
		ttl:         driver.Settings{TTLMicros: s.TTLMicros, TTLFor: s.TTLFor, BodyTTLMicros: s.BodyTTLMicros, BodyTTLFor: s.BodyTTLFor},
		lockTimeout: s.LockTimeout,
		sqlSetWait:  "SET LOCAL lock_timeout = '" + s.LockTimeout + "'",
		citus:       citus,
	}
	if level, ok := isolationLevels[pgx.TxIsoLevel(s.IsolationLevel)]; ok {
		d.txOptions = &sql.TxOptions{Isolation: level}
	}
	return d
}

// isolationLevels maps idem.Config.IsolationLevel to database/sql's levels
// ("" is the server's default: no level in BEGIN).
var isolationLevels = map[pgx.TxIsoLevel]sql.IsolationLevel{
	pgx.ReadUncommitted: sql.LevelReadUncommitted,
	pgx.ReadCommitted:   sql.LevelReadCommitted,
	pgx.RepeatableRead:  sql.LevelRepeatableRead,
	pgx.Serializable:    sql.LevelSerializable,
}

var queries = dbsql.New()

var errNilDB = errors.New("nil database handle")

// CheckDB refuses a nil *sql.DB.
func (d *Driver) CheckDB(db *sql.DB, _ bool) error {
	if db == nil {
		return errNilDB
	}
	return nil
}

// Nested is false: transactions begun on a *sql.DB are its own.
func (d *Driver) Nested(*sql.DB) bool { return false }

// NilTx reports whether tx is nil.
func (d *Driver) NilTx(tx *sql.Tx) bool { return tx == nil }

// TxClosed reports database/sql's error of a transaction already ended.
func (d *Driver) TxClosed(err error) bool { return errors.Is(err, sql.ErrTxDone) }

// CtxEndsTx is true: database/sql rolls a transaction back when the
// context given to BeginTx ends.
func (d *Driver) CtxEndsTx() bool { return true }

// Interpret translates the errors of database/sql and its driver (pgx's
// stdlib, lib/pq) into the driver package's terms.
func (d *Driver) Interpret(err error) error { return dberr.Interpret(err) }

// PreparedStatementsFix names the fix in pgx's connection string.
func (d *Driver) PreparedStatementsFix() string {
	return " (on database/sql: default_query_exec_mode=exec, cache_describe or simple_protocol in pgx's connection string)"
}

// Executor runs statements in tx.
func (d *Driver) Executor(tx *sql.Tx) driver.Executor { return &executor{d: d, tx: tx} }

// firstPage is before every timestamp PostgreSQL stores (database/sql has no
// -infinity): where ListUnknown's first page begins.
var firstPage = time.Date(-4713, time.November, 24, 0, 0, 0, 0, time.UTC)
