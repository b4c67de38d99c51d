//go:build ignore

// What the blocks of docs/sql.md use: what a database/sql service has at
// hand when it calls idemsql. Compiled only with those blocks, by
// TestDocsCompile.
package snippets

import (
	"context"
	"database/sql"
	"fmt"
	"log"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver; or github.com/lib/pq, "postgres"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

var (
	ctx            = context.Background()
	url            string           // the database's URL
	coordinatorURL string           // the URL of a Citus coordinator's database
	userID         string           // the authenticated user: the key's actor
	key            string           // the client's Idempotency-Key
	fp             idem.Fingerprint // idem.FingerprintJSON of the request's body
	body           []byte           // the response's body
)
