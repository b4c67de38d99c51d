package idemsql_test

import (
	"context"
	"database/sql"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver
	_ "github.com/lib/pq"              // the "postgres" driver

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// drivers are the database/sql drivers idemsql is tested with: pgx's
// stdlib driver and lib/pq, by their registered names.
var drivers = []string{"pgx", "postgres"}

// eachDriver runs f as a parallel subtest per driver.
func eachDriver(t *testing.T, f func(t *testing.T, driver string)) {
	for _, d := range drivers {
		t.Run(d, func(t *testing.T) {
			t.Parallel()
			f(t, d)
		})
	}
}

// open opens url with driver; closed when the test ends.
func open(t testing.TB, driver, url string) *sql.DB {
	t.Helper()
	db, err := sql.Open(driver, url)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// migrated is a fresh database migrated by idem, opened with driver, and a
// pgx pool on it for checks.
func migrated(t *testing.T, driver string) (*sql.DB, *pgxpool.Pool) {
	t.Helper()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return open(t, driver, url), pool
}

// keyCount counts the rows of idem_keys.
func keyCount(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_keys`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

type pgxTx = pgx.Tx
