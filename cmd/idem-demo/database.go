package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/internal/pgadvice"
	"github.com/pgidem/idem/internal/demo/draw"
	"github.com/pgidem/idem/internal/testkit/pgserver"
)

// defaultDatabase is the database run and serve use unless -db names
// another.
const defaultDatabase = "idem_demo"

// markerTable marks a database as the demo's: every table in it is reset by
// the next run.
const markerTable = "idem_demo"

// lockID is the advisory lock (in the demo's database) that a run or serve
// holds from before it resets the tables until it ends: "idemdemo" in
// ASCII.
const lockID int64 = 0x6964656d64656d6f

// lockPoll is how often a run waiting for the database tries the lock
// again.
const lockPoll = 200 * time.Millisecond

// setting names where the demo's connection string comes from, for the
// advice of pgadvice.Explain.
const setting = "DATABASE_URL"

// olderDemoTables are the relations an idem-demo before the marker table
// created (it dropped and recreated its database on every run): a database
// holding nothing else is one of those, and is the demo's.
var olderDemoTables = []string{
	"boxes", "draw_batches", "draw_batches_id_seq", "idem_goose_db_version", "idem_goose_db_version_id_seq",
	"idem_goose_lock", "idem_keys", "idem_keys_token_seq", "inventory", "payments", "point_ledger",
	"point_ledger_id_seq", "prizes", "wallets",
}

// checkDatabaseName accepts the names -db takes: idem, then a-z, 0-9 and _
// (no quoting surprises, and never an application's or an admin database).
func checkDatabaseName(name string) error {
	if !strings.HasPrefix(name, "idem") || len(name) > 63 || strings.Trim(name, "abcdefghijklmnopqrstuvwxyz0123456789_") != "" {
		return usageError{fmt.Sprintf("-db %q: the name must start with idem and hold only a-z, 0-9 and _ (63 at most)", name)}
	}
	return nil
}

// demoDB is the demo's database, held by one run or serve: while it is
// open, no other idem-demo resets it.
type demoDB struct {
	pool *pgxpool.Pool
	lock *pgx.Conn // its open transaction holds lockID; nil until taken
}

// Close releases the database to the next run.
func (d *demoDB) Close() {
	d.pool.Close()
	if d.lock != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, _ = d.lock.Exec(ctx, "ROLLBACK")
		_ = d.lock.Close(ctx)
	}
}

// openDatabase creates the database called name on srv if it is missing,
// waits until no other idem-demo holds it, resets the demo's tables in it
// (refusing a database that holds tables the demo did not create; with
// keep, a database the demo marked as its own keeps its tables and rows),
// installs
// idem's migrations and the draw tables and seeds, and returns it with a
// pool with enough connections for the concurrent scenario. Progress that
// makes it wait goes to out.
//
// A connection string whose exec mode loses prepared statements on the way
// to the server (a transaction pooler) fails here with the fix
// (pgadvice.PreparedStatementsError), before anything is changed.
func openDatabase(ctx context.Context, srv *pgserver.Server, name string, out io.Writer, keep bool) (*demoDB, error) {
	if err := createDatabase(ctx, srv, name); err != nil {
		return nil, pgadvice.Explain(err, setting)
	}
	url := srv.DatabaseURL(name)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = duplicates + 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	d := &demoDB{pool: pool}
	if err := d.prepare(ctx, url, name, out, keep); err != nil {
		d.Close()
		return nil, pgadvice.Explain(err, setting)
	}
	return d, nil
}

func (d *demoDB) prepare(ctx context.Context, url, name string, out io.Writer, keep bool) error {
	if err := checkExecMode(ctx, d.pool); err != nil {
		return err
	}
	if err := d.takeLock(ctx, url, name, out); err != nil {
		return err
	}
	if err := reset(ctx, d.pool, name, keep); err != nil {
		return err
	}
	if err := idem.Migrate(ctx, d.pool); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return draw.Setup(ctx, d.pool)
}

// simpleConn connects to url with the simple protocol: the demo's own
// bookkeeping never depends on the exec mode (checkExecMode judges that).
func simpleConn(ctx context.Context, url string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	return pgx.ConnectConfig(ctx, cfg)
}

// createDatabase creates the database called name unless it exists (or
// another run creates it at the same time).
func createDatabase(ctx context.Context, srv *pgserver.Server, name string) error {
	admin, err := simpleConn(ctx, srv.URL)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", srv.Source, err)
	}
	defer admin.Close(context.Background())
	var exists bool
	if err := admin.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return err
	}
	if exists {
		return nil
	}
	_, err = admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok &&
		(pgErr.Code == pgerrcode.DuplicateDatabase || pgErr.Code == pgerrcode.UniqueViolation) {
		return nil // created by another run meanwhile
	}
	if err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// checkExecMode runs one query on two connections of pool in turn, three
// times. A transaction pooler that hands each transaction the server
// connection used last, without carrying prepared statements across,
// answers the second connection's prepare with 42P05 (or an execution with
// 26000) in pgx's default exec mode: the error pgadvice.Explain turns into
// the fix, found here before anything runs rather than in some of the
// scenarios' calls.
func checkExecMode(ctx context.Context, pool *pgxpool.Pool) error {
	var conns [2]*pgxpool.Conn
	for i := range conns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return err
		}
		defer c.Release()
		conns[i] = c
	}
	for range 3 {
		for _, c := range conns {
			var n int
			if err := c.QueryRow(ctx, "SELECT $1::int /* idem-demo exec mode check */", 1).Scan(&n); err != nil {
				return err
			}
		}
	}
	return nil
}

// takeLock waits until the database's advisory lock lockID is free and
// takes it in a transaction that stays open until Close: a lock of the
// transaction, not of the session, so that it also holds through a
// transaction pooler. It tries again every lockPoll instead of waiting in
// one statement, so that the waiting transaction holds no snapshot that the
// holder's CREATE INDEX CONCURRENTLY (a migration) would wait for.
func (d *demoDB) takeLock(ctx context.Context, url, name string, out io.Writer) error {
	conn, err := simpleConn(ctx, url)
	if err != nil {
		return err
	}
	d.lock = conn
	if _, err := conn.Exec(ctx, "BEGIN; SET LOCAL idle_in_transaction_session_timeout = 0"); err != nil {
		return err
	}
	for waited := false; ; waited = true {
		var taken bool
		if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock($1)", lockID).Scan(&taken); err != nil {
			return fmt.Errorf("lock database %s: %w", name, err)
		}
		if taken {
			if waited {
				fmt.Fprintf(out, "Database %s is free now.\n", name)
			}
			return nil
		}
		if !waited {
			fmt.Fprintf(out, "Database %s is in use by another idem-demo; waiting until it ends (Ctrl-C to stop; -db names another database)...\n", name)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(lockPoll):
		}
	}
}

// relation is a table, view or sequence found in the demo's database.
type relation struct {
	schema, name string
	kind         byte // pg_class.relkind
}

// NotDemoDatabaseError is a database that holds tables idem-demo did not
// create: the demo refuses it and changes nothing in it.
type NotDemoDatabaseError struct {
	Database string
	Tables   []string // a few of them
}

func (e *NotDemoDatabaseError) Error() string {
	return fmt.Sprintf("database %s holds tables idem-demo did not create (%s): the demo only resets a database of its own; "+
		"pass -db with another name (a new database is created)", e.Database, strings.Join(e.Tables, ", "))
}

// reset drops every relation and function in the database called name and marks it as
// the demo's, if it is the demo's: marked as such (markerTable), empty, or
// holding only olderDemoTables. Otherwise it changes nothing and returns a
// *NotDemoDatabaseError. With keep, a database marked as the demo's is left
// as it is.
func reset(ctx context.Context, pool *pgxpool.Pool, name string, keep bool) error {
	rows, err := pool.Query(ctx, `
		SELECT n.nspname, c.relname, c.relkind::text
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'p', 'v', 'm', 'S')
		  AND n.nspname <> 'information_schema' AND n.nspname NOT LIKE 'pg\_%'
		ORDER BY 1, 2`)
	if err != nil {
		return err
	}
	rels, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (relation, error) {
		var r relation
		var kind string
		err := row.Scan(&r.schema, &r.name, &kind)
		r.kind = kind[0]
		return r, err
	})
	if err != nil {
		return err
	}
	marked := slices.ContainsFunc(rels, func(r relation) bool { return r.name == markerTable && r.kind == 'r' })
	var foreign []string
	for _, r := range rels {
		if r.schema != "public" || !slices.Contains(olderDemoTables, r.name) {
			foreign = append(foreign, r.schema+"."+r.name)
		}
	}
	if !marked && len(foreign) > 0 {
		return &NotDemoDatabaseError{Database: name, Tables: foreign[:min(len(foreign), 5)]}
	}
	if keep && marked {
		return nil
	}

	kinds := map[byte]string{'r': "TABLE", 'p': "TABLE", 'v': "VIEW", 'm': "MATERIALIZED VIEW", 'S': "SEQUENCE"}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, r := range rels {
			sql := "DROP " + kinds[r.kind] + " IF EXISTS " + pgx.Identifier{r.schema, r.name}.Sanitize() + " CASCADE"
			if _, err := tx.Exec(ctx, sql); err != nil {
				return fmt.Errorf("reset: %w", err)
			}
		}
		// The functions of idem's migrations (idem_refuse, 00008) too, or
		// the next run's migrations fail to create them again. Not an
		// extension's.
		rows, err := tx.Query(ctx, `
			SELECT p.oid::regprocedure::text
			FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
			WHERE n.nspname = 'public'
			  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e')`)
		if err != nil {
			return fmt.Errorf("reset: %w", err)
		}
		routines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return fmt.Errorf("reset: %w", err)
		}
		for _, r := range routines {
			if _, err := tx.Exec(ctx, "DROP ROUTINE IF EXISTS "+r+" CASCADE"); err != nil {
				return fmt.Errorf("reset: %w", err)
			}
		}
		_, err = tx.Exec(ctx, `CREATE TABLE `+markerTable+` (note text NOT NULL);
			INSERT INTO `+markerTable+` VALUES ('This database is idem-demo''s: every run drops and recreates every table in it.')`)
		return err
	})
}
