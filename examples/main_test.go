package examples_test

import (
	"context"
	"database/sql"
	"os"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// migrate installs idem's table (idem.Migrate and idemsql.Migrate are the
// same migrations) and the examples' orders table.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL, quantity int NOT NULL)`)
	return err
}

// openDB is a *sql.DB with pgx's stdlib driver on a fresh database.
func openDB(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", pgtest.URL(t, migrate))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
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
