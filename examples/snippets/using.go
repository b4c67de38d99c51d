//go:build ignore

// What the blocks of docs/using.md (and README.md) use: what a service has
// at hand when it calls idem. Compiled only with those blocks, by
// TestDocsCompile.
package snippets

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

var (
	ctx          = context.Background()
	pool         *pgxpool.Pool       // the service's pool, from pgxpool.New
	userID       string              // the authenticated user: the key's actor
	key          string              // the client's Idempotency-Key
	body         []byte              // the request's JSON body
	points, cost int                 // what fn read with tx before deciding
	problem      []byte              // an application/problem+json body
	hdr          map[string][]string // the response's headers
	out          []byte              // the response's body
)
