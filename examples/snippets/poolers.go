//go:build ignore

// What the blocks of docs/poolers.md use. Compiled only with those blocks,
// by TestDocsCompile.
package snippets

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

var (
	ctx = context.Background()
	url string // the pooler's URL
)
