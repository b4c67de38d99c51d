package idemhttp_test

import (
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgtest"
)

// examplePool stands in for the application's own pool in the examples: a
// pool on a fresh database that idem.Migrate has prepared, and a function
// that closes the pool and drops the database.
func examplePool() (*pgxpool.Pool, func()) { return pgtest.ExamplePool(idem.Migrate, 0) }
