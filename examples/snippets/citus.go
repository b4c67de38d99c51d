//go:build ignore

// What the blocks of docs/citus.md use. Compiled only with those blocks, by
// TestDocsCompile.
package snippets

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

var (
	ctx  = context.Background()
	pool *pgxpool.Pool // a pool on the Citus coordinator
)
