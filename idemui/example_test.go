package idemui_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
)

// The console is one http.Handler, mounted under a prefix of the service's
// own server; Authorize decides who may do what, and names the operator
// for the audit trail.
func Example() {
	pool, closeDB := examplePool() // the application's *pgxpool.Pool, migrated with idem.Migrate
	defer closeDB()

	console, err := idemui.New(idemui.Options{
		DB:     pool,
		Prefix: "/idem",
		Authorize: func(r *http.Request, a idemui.Action) (string, error) {
			// check the service's own session here; the name goes to the audit trail
			return "operator@example.com", nil
		},
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/idem/", console)

	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/idem/", nil))
	fmt.Println(rec.Code, rec.Header().Get("Content-Type"))
	// Output: 200 text/html; charset=utf-8
}

// examplePool opens a pool on a schema of its own and migrates it; the
// function it returns drops the schema.
func examplePool() (*pgxpool.Pool, func()) {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@localhost:5432/postgres"
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		panic(err)
	}
	schema := fmt.Sprintf("example_%x", rand.Uint64())
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		_, err = pool.Exec(ctx, "CREATE SCHEMA "+schema)
		if err == nil {
			err = idem.Migrate(ctx, pool)
		}
	}
	if err != nil {
		panic(err)
	}
	return pool, func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	}
}
