package pgxdriver

import (
	"context"
	"runtime"
	"sync"
	"weak"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem/internal/driver"
)

// connState is what the driver knows of one connection: made once per
// connection, then read on every call. It is safe for concurrent use: Do
// on a caller's transaction reads the state of the transaction's connection
// before it knows whether the transaction is still open, and a pool's
// transaction that was committed or rolled back has given its connection to
// other calls already (pgxpool.Tx.Conn still returns it).
type connState struct {
	db citusKey
	// prepares: pgx prepares or describes a batch's statements that it has
	// not cached in a round trip of its own before the batch (its exec
	// modes cache_statement, cache_describe, describe_exec); caches: and
	// keeps them (not describe_exec).
	prepares, caches bool

	mu    sync.Mutex
	known bool // citus is known
	citus bool
	// warm names the claim batches (Driver.claimForms) whose last run on
	// this connection succeeded: their statements are in pgx's cache
	// unless it evicted them since (see sent).
	warm map[string]bool
}

// citusKnown returns whether the connection's database runs Citus, and
// whether that is known.
func (st *connState) citusKnown() (citus, known bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.citus, st.known
}

// learn records whether the connection's database runs Citus.
func (st *connState) learn(citus bool) {
	st.mu.Lock()
	st.known, st.citus = true, citus
	st.mu.Unlock()
}

// claimState reports, under one lock, whether the connection's database
// runs Citus, whether that is known (from this connection, or else from
// d's Client-wide knowledge, which it then learns), and whether the claim
// batch of c was warm on the connection then.
func (d *Driver) claimState(st *connState, c driver.Claim) (citus, known, warm bool) {
	st.mu.Lock()
	citus, known = st.citus, st.known
	if known {
		warm = st.warm[d.claimForm(citus, c)]
	}
	st.mu.Unlock()
	if known {
		return citus, true, warm
	}
	v, ok := d.citus.Load(st.db)
	if !ok {
		return false, false, false
	}
	citus = v.(bool)
	st.mu.Lock()
	defer st.mu.Unlock()
	st.known, st.citus = true, citus
	return citus, true, st.warm[d.claimForm(citus, c)]
}

// conns holds the state of every connection the driver has seen (of every
// Client: what pgx caches is the connection's), by a weak pointer to its
// pgconn.PgConn. An entry goes when its connection is garbage collected.
// A sync.Map: every call reads it, and its keys live as long as their
// connections, the case sync.Map reads without a lock.
var conns sync.Map // weak.Pointer[pgconn.PgConn] -> *connState

// state returns what the driver knows of conn, sending nothing. It reads
// nothing of conn that changes while another call uses it.
func (d *Driver) state(conn *pgx.Conn) *connState {
	pc := conn.PgConn()
	k := weak.Make(pc)
	v, ok := conns.Load(k)
	if !ok {
		var loaded bool
		v, loaded = conns.LoadOrStore(k, newConnState(conn))
		if !loaded {
			runtime.AddCleanup(pc, forgetConn, k)
		}
	}
	return v.(*connState)
}

// newConnState is the state of a connection the driver has not seen yet.
func newConnState(conn *pgx.Conn) *connState {
	cfg := conn.Config() // a copy: once per connection
	st := &connState{db: citusKey{host: cfg.Host, port: cfg.Port, database: cfg.Database}, warm: map[string]bool{}}
	switch cfg.DefaultQueryExecMode {
	case pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe:
		st.prepares, st.caches = true, true
	case pgx.QueryExecModeDescribeExec:
		st.prepares = true
	}
	return st
}

// forgetConn drops the state of a connection that was garbage collected.
func forgetConn(k weak.Pointer[pgconn.PgConn]) { conns.Delete(k) }

// isCitus reports whether the database of st's connection has the citus
// extension, asking q (the connection, or a transaction on it) when neither
// the connection nor this Client knows.
func (d *Driver) isCitus(ctx context.Context, st *connState, q Querier) (bool, error) {
	if citus, known := st.citusKnown(); known {
		return citus, nil
	}
	if citus, ok := d.citus.Load(st.db); ok {
		st.learn(citus.(bool))
		return citus.(bool), nil
	}
	citus, err := HasCitus(ctx, q)
	if err != nil {
		return false, err
	}
	d.citus.Store(st.db, citus)
	st.learn(citus)
	return citus, nil
}
