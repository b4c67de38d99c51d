package main

import (
	"context"
	"errors"
	"io"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/internal/pgadvice"
	"github.com/pgidem/idem/internal/testkit/pgserver"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// emptyDatabase returns the name and URL of a fresh empty database, dropped
// when the test ends (its name starts with idem, as -db wants).
func emptyDatabase(t *testing.T) (name, dbURL string) {
	t.Helper()
	dbURL = pgtest.URL(t, nil)
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	name = strings.TrimPrefix(u.Path, "/")
	if err := checkDatabaseName(name); err != nil {
		t.Fatal(err)
	}
	return name, dbURL
}

// tables lists the tables of the database at dbURL.
func tables(t *testing.T, dbURL string) []string {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	rows, _ := conn.Query(t.Context(), `SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1`)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// Two runs at once on one database both pass: one waits for the other
// (and says so) before it resets the tables. A third run after them resets
// the database again and passes too.
func TestConcurrentRuns(t *testing.T) {
	t.Parallel()
	srv := pgtest.Server(t)
	name, dbURL := emptyDatabase(t)
	var outs [2]strings.Builder
	var errs [2]error
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Go(func() { errs[i] = runOn(t.Context(), &outs[i], srv, name) })
	}
	wg.Wait()
	waited := 0
	for i := range 2 {
		if errs[i] != nil {
			t.Errorf("run %d: %v\n%s", i, errs[i], outs[i].String())
		}
		if strings.Contains(outs[i].String(), "in use by another idem-demo; waiting") {
			waited++
		}
	}
	if waited != 1 {
		t.Errorf("%d runs said they waited, want 1:\n%s\n%s", waited, outs[0].String(), outs[1].String())
	}
	var out strings.Builder
	if err := runOn(t.Context(), &out, srv, name); err != nil {
		t.Errorf("third run: %v\n%s", err, out.String())
	}
	if got := tables(t, dbURL); !strings.Contains(strings.Join(got, " "), markerTable) {
		t.Errorf("tables after the runs: %q, want the marker %s among them", got, markerTable)
	}
}

// A database that holds a table the demo did not create is refused, and
// nothing in it changes; an empty one, or one that holds only an older
// demo's tables, is the demo's.
func TestRunRefusesOthersDatabase(t *testing.T) {
	t.Parallel()
	srv := pgtest.Server(t)
	exec := func(dbURL, sql string) {
		t.Helper()
		conn, err := pgx.Connect(t.Context(), dbURL)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		if _, err := conn.Exec(t.Context(), sql); err != nil {
			t.Fatal(err)
		}
	}

	name, dbURL := emptyDatabase(t)
	exec(dbURL, `CREATE TABLE wallets (user_id text); CREATE TABLE orders (id int); INSERT INTO orders VALUES (1)`)
	err := runOn(t.Context(), io.Discard, srv, name)
	notDemo, ok := errors.AsType[*NotDemoDatabaseError](err)
	if !ok || notDemo.Database != name || strings.Join(notDemo.Tables, ",") != "public.orders" ||
		!strings.Contains(err.Error(), "pass -db with another name") {
		t.Fatalf("run on a database with another table: %v", err)
	}
	if got := tables(t, dbURL); strings.Join(got, ",") != "orders,wallets" {
		t.Errorf("tables after the refusal: %q", got)
	}
	conn, err := pgx.Connect(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(t.Context(), "SELECT count(*) FROM orders").Scan(&n); err != nil || n != 1 {
		t.Errorf("orders after the refusal: %d rows, %v", n, err)
	}

	// An older demo's leftovers (tables of its, no marker): reset.
	older, olderURL := emptyDatabase(t)
	exec(olderURL, `CREATE TABLE wallets (user_id text); CREATE TABLE idem_keys (k text); CREATE SEQUENCE idem_keys_token_seq`)
	if err := runOn(t.Context(), io.Discard, srv, older); err != nil {
		t.Errorf("run on an older demo's database: %v", err)
	}
}

// A -db that does not exist yet is created.
func TestRunCreatesDatabase(t *testing.T) {
	t.Parallel()
	srv := pgtest.Server(t)
	name, _ := emptyDatabase(t)
	name += "_new"
	dropAtEnd(t, srv, name)
	if err := runOn(t.Context(), io.Discard, srv, name); err != nil {
		t.Fatal(err)
	}
}

// Behind PgBouncer in transaction mode, pgx's default exec mode fails at the
// start with idem's diagnosis and the setting that fixes it, before the
// database changes; with that setting the demo passes.
func TestRunBehindPooler(t *testing.T) {
	t.Parallel()
	pooler := os.Getenv(pgtest.PoolerEnv)
	if pooler == "" {
		t.Skip(pgtest.PoolerEnv + " is unset: no PgBouncer to test behind (eval \"$(.ci/pgbouncer)\" starts one)")
	}
	name, dbURL := emptyDatabase(t)
	for range 3 {
		err := runOn(t.Context(), io.Discard, pgserver.Started(pooler, pgserver.SourceDatabaseURL, nil), name)
		if _, ok := errors.AsType[*pgadvice.PreparedStatementsError](err); !ok || !errors.Is(err, idem.ErrPreparedStatements) ||
			!strings.Contains(err.Error(), "add default_query_exec_mode=exec") || !strings.Contains(err.Error(), "DATABASE_URL") {
			t.Fatalf("default exec mode behind PgBouncer: %v", err)
		}
		if got := tables(t, dbURL); len(got) != 0 {
			t.Fatalf("tables after the refusal: %q", got)
		}
	}

	u, err := url.Parse(pooler)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("default_query_exec_mode", "exec")
	u.RawQuery = q.Encode()
	var out strings.Builder
	if err := runOn(t.Context(), &out, pgserver.Started(u.String(), pgserver.SourceDatabaseURL, nil), name); err != nil {
		t.Fatalf("exec mode behind PgBouncer: %v\n%s", err, out.String())
	}
}
