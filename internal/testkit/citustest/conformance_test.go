package citustest_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/drivertest"
	"github.com/pgidem/idem/internal/driver/pgxdriver"
	"github.com/pgidem/idem/internal/driver/sqldriver"
	"github.com/pgidem/idem/internal/testkit/citustest"
)

// The driver conformance suite through a Citus coordinator: pgx, and
// database/sql (Citus's statement forms) with pgx's stdlib and lib/pq,
// the three at once (and with the rest of the suite), each test on a
// database of its own.
func TestConformance(t *testing.T) {
	t.Parallel()
	t.Run("pgx", func(t *testing.T) {
		t.Parallel()
		drivertest.Exercise(t, drivertest.Harness[pgx.Tx, pgxdriver.Beginner]{
			New: pgxdriver.New,
			DB:  func(t *testing.T) pgxdriver.Beginner { return pool(t, citustest.New(t, nil).URL) },
			Exec: func(ctx context.Context, tx pgx.Tx, sql string) error {
				_, err := tx.Exec(ctx, sql)
				return err
			},
			Commit: func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) },
			Nest:   func(tx pgx.Tx) pgxdriver.Beginner { return tx },
			InUse:  func(db pgxdriver.Beginner) int { return int(db.(*pgxpool.Pool).Stat().AcquiredConns()) },
			Count: func(t *testing.T, db pgxdriver.Beginner, query string) int {
				var n int
				tx, err := db.Begin(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback(t.Context()) }()
				if err := tx.QueryRow(t.Context(), query).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			},
		})
	})
	for _, name := range []string{"pgx", "postgres"} {
		t.Run("sql-"+name, func(t *testing.T) {
			t.Parallel()
			drivertest.Exercise(t, drivertest.Harness[*sql.Tx, *sql.DB]{
				New: func(s driver.Settings) driver.Driver[*sql.Tx, *sql.DB] { return sqldriver.New(s, true) },
				DB: func(t *testing.T) *sql.DB {
					db, err := sql.Open(name, citustest.New(t, nil).URL)
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
