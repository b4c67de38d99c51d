package pgxdriver

import (
	"context"
	"sync"

	"github.com/jackc/pgx/v5"
)

// Citus (a distributed PostgreSQL) shards idem_keys by actor; every call
// then goes through the coordinator, which routes each statement to the
// worker that holds the actor's shard. The statements are the same on both
// engines wherever Citus accepts them at no cost to PostgreSQL. Where they
// differ, this driver picks per connection (whether its database has the
// citus extension, asked once per Client and database, and kept in the
// driver's state of the connection, span.go):
//   - the claim: Citus waits for a twin on the worker, which set_config
//     never reaches; SET LOCAL lock_timeout statements around a plain claim
//     bound the wait there (KeyClaimCitus, KeyTakeOverCitus). Reserve uses
//     that statement on both engines;
//   - Prune and ExpireLeases: Citus refuses FOR UPDATE SKIP LOCKED over a
//     distributed table (KeyPruneCitus, ReserveExpireLeasesCitus);
//   - ReadStats: the sizes come from citus_table_size (asked on every call:
//     ReadStats is off the request path).

// Statements about Citus. They are not sqlc queries: sqlc's catalog knows
// PostgreSQL's functions and views, not the ones the citus extension adds.
const (
	// sqlWaitDefault ends the Citus claim's bound on waiting: lock_timeout
	// back to its default (the server's, role's, database's or startup
	// parameters' value; a session-level SET or an earlier SET LOCAL of the
	// caller's is not restored).
	sqlWaitDefault = "SET LOCAL lock_timeout TO DEFAULT"
	// The sizes of a distributed idem_keys: the sum over its shards on the
	// workers (the coordinator's own idem_keys is an empty shell).
	sqlCitusTableSize = "SELECT citus_table_size('idem_keys')::bigint, " +
		"(citus_total_relation_size('idem_keys') - citus_table_size('idem_keys'))::bigint"
	// Whether idem_keys is a Citus table (distributed or not), whose size
	// citus_table_size knows.
	sqlIsCitusTable = "SELECT EXISTS (SELECT FROM citus_tables WHERE table_name = 'idem_keys'::regclass)"
)

// citusCache remembers, per database, whether it runs Citus (a bool by
// citusKey): one question per Client and database.
type citusCache struct{ sync.Map }

// citusKey names a database by the host, port and database name of a
// connection's configuration.
type citusKey struct {
	host     string
	port     uint16
	database string
}

// txCitus is isCitus for the connection of tx; a pgx.Tx of another making
// that has no *pgx.Conn is plain PostgreSQL.
func (d *Driver) txCitus(ctx context.Context, tx pgx.Tx) (bool, error) {
	conn := tx.Conn()
	if conn == nil {
		return false, nil
	}
	return d.isCitus(ctx, d.state(conn), tx)
}

// isCitusTable reports whether idem_keys is a Citus table in the database
// of tx.
func isCitusTable(ctx context.Context, tx pgx.Tx) (bool, error) {
	citus, err := HasCitus(ctx, tx)
	if err != nil || !citus {
		return false, err
	}
	err = tx.QueryRow(ctx, sqlIsCitusTable).Scan(&citus)
	return citus, err
}
