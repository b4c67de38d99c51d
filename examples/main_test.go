package examples_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"strings"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// serverURL is the PostgreSQL server the examples run on: DATABASE_URL, or
// the local server.
var serverURL = "postgres://postgres@localhost:5432/postgres?sslmode=disable"

// TestMain stops the package at once, with one line and exit status 1, when
// no server answers: no test could run.
func TestMain(m *testing.M) {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		serverURL = u
	}
	db, err := sql.Open("pgx", serverURL)
	if err == nil {
		err = db.Ping()
		_ = db.Close()
	}
	if err != nil {
		// One line: the driver's message spans several.
		reason := strings.Join(strings.Fields(err.Error()), " ")
		fmt.Fprintf(os.Stderr, "examples: no PostgreSQL server at DATABASE_URL or localhost:5432; stopping (%s)\n", reason)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// openDB is a *sql.DB with pgx's stdlib driver on a database of its own,
// with idem's table (idemsql.Migrate) and the examples' orders table,
// dropped when the test ends. A service opens its database once and runs
// idemsql.Migrate at startup.
func openDB(t *testing.T) *sql.DB {
	t.Helper()
	ctx := context.Background()
	admin, err := sql.Open("pgx", serverURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	name := "idem_examples_" + strings.ToLower(rand.Text()) // random: tests run in parallel
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.ExecContext(ctx, "DROP DATABASE "+name+" WITH (FORCE)") })

	u, err := url.Parse(serverURL)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	db, err := sql.Open("pgx", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if err := idemsql.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL, quantity int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return db
}

var scope = idem.Scope{Actor: "customer-7", Operation: "orders.create"}

// fp is the fingerprint of an order request.
func fp(t *testing.T, item string, quantity int) idem.Fingerprint {
	t.Helper()
	f, err := idem.FingerprintJSON(map[string]any{"item": item, "quantity": quantity})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// checkOnce asserts that two calls with the same key gave the same answer,
// the second a replay, and that one order was written.
func checkOnce(t *testing.T, db *sql.DB, first, second idem.Result, item string) {
	t.Helper()
	if first.Replayed || !second.Replayed || string(first.Body) != string(second.Body) {
		t.Fatalf("first %+v, second %+v", first, second)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM orders WHERE item = $1`, item).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d orders of %s, want 1 (%v)", n, item, err)
	}
}
