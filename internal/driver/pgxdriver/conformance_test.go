package pgxdriver_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/driver/drivertest"
	"github.com/pgidem/idem/internal/driver/pgxdriver"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// The driver conformance suite, on a pgx pool.
func TestConformance(t *testing.T) {
	drivertest.Exercise(t, drivertest.Harness[pgx.Tx, pgxdriver.Beginner]{
		New: pgxdriver.New,
		DB:  func(t *testing.T) pgxdriver.Beginner { return pgtest.Pool(t, idem.Migrate) },
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
}
