package sqldriver_test

import (
	"context"
	"database/sql"
	"os"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/drivertest"
	"github.com/pgidem/idem/internal/driver/sqldriver"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// The driver conformance suite, on database/sql with pgx's stdlib driver
// and with lib/pq.
func TestConformance(t *testing.T) {
	for _, c := range []struct{ name, driver, params string }{
		{"pgx", "pgx", ""},
		{"postgres", "postgres", ""},
		// lib/pq with its parameters sent in binary (as docs/sql.md
		// advises) reads results as text; in bytea's escape format an
		// empty bytea then reads as nil, not as an empty slice.
		{"postgres_escape", "postgres", "binary_parameters=yes&options=-c%20bytea_output%3Descape"},
	} {
		name := c.name
		t.Run(name, func(t *testing.T) {
			drivertest.Exercise(t, drivertest.Harness[*sql.Tx, *sql.DB]{
				New: func(s driver.Settings) driver.Driver[*sql.Tx, *sql.DB] { return sqldriver.New(s, false) },
				DB: func(t *testing.T) *sql.DB {
					db, err := sql.Open(c.driver, pgtest.WithParams(t, pgtest.URL(t, idem.Migrate), c.params))
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { _ = db.Close() })
					return db
				},
				Exec: func(ctx context.Context, tx *sql.Tx, sql string) error {
					_, err := tx.ExecContext(ctx, sql)
					return err
				},
				Commit: func(_ context.Context, tx *sql.Tx) error { return tx.Commit() },
				InUse:  func(db *sql.DB) int { return db.Stats().InUse },
				Count: func(t *testing.T, db *sql.DB, query string) int {
					var n int
					if err := db.QueryRowContext(t.Context(), query).Scan(&n); err != nil {
						t.Fatal(err)
					}
					return n
				},
			})
		})
	}
}
