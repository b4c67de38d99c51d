package idemsql_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// DoInTx runs fn once per key in a transaction of its own on a *sql.DB; the
// retry with the same key replays the stored response and does not run fn.
func Example() {
	ctx := context.Background()
	db, closeDB := exampleDB() // the application's *sql.DB, migrated with idemsql.Migrate
	defer closeDB()

	scope := idem.Scope{Actor: "alice", Operation: "order.create"}
	fp := idem.FingerprintParts([]byte(`{"item":"tea","quantity":2}`))
	for range 2 { // the first request and its retry
		res, err := idemsql.DoInTx(ctx, db, scope, "key-1", fp,
			func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				// the business writes go here, with tx
				return idem.Response{Status: 201, Body: []byte(`{"order":1}`)}, nil
			})
		if err != nil {
			panic(err)
		}
		fmt.Println(res.Status, string(res.Body), res.Replayed)
	}
	// Output:
	// 201 {"order":1} false
	// 201 {"order":1} true
}

// exampleDB opens a database/sql handle on a schema of its own and migrates
// it; the function it returns drops the schema.
func exampleDB() (*sql.DB, func()) {
	ctx := context.Background()
	dsn := os.Getenv("DATABASE_URL")
	if dsn == "" {
		dsn = "postgres://postgres@localhost:5432/postgres"
	}
	u, err := url.Parse(dsn)
	if err != nil {
		panic(err)
	}
	schema := fmt.Sprintf("example_%x", rand.Uint64())
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	db, err := sql.Open("pgx", u.String())
	if err == nil {
		_, err = db.ExecContext(ctx, "CREATE SCHEMA "+schema)
		if err == nil {
			err = idemsql.Migrate(ctx, db)
		}
	}
	if err != nil {
		panic(err)
	}
	return db, func() {
		_, _ = db.ExecContext(ctx, "DROP SCHEMA "+schema+" CASCADE")
		_ = db.Close()
	}
}
