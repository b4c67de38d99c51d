package pgtest

import (
	"net/url"
	"os"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// PoolerEnv names the environment variable that holds the URL of a
// connection pooler (PgBouncer in transaction pooling mode) in front of the
// server the tests use. .ci/pgbouncer starts one and prints it:
//
//	eval "$(.ci/pgbouncer)"
const PoolerEnv = "IDEM_PGBOUNCER_URL"

// BehindPooler returns the URL of a fresh database (see [URL]) reached
// through the pooler named by [PoolerEnv]. It skips the test, with one
// line, when that is unset.
func BehindPooler(t testing.TB, migrate MigrateFunc) string {
	t.Helper()
	pooler := os.Getenv(PoolerEnv)
	if pooler == "" {
		t.Skip(PoolerEnv + " is unset: no PgBouncer to test behind (eval \"$(.ci/pgbouncer)\" starts one)")
	}
	direct := URL(t, migrate)
	cfg, err := pgconn.ParseConfig(direct)
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(pooler)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("%s=%q: want a postgres:// URL (%v)", PoolerEnv, pooler, err)
	}
	u.Path, u.RawPath = "/"+cfg.Database, ""
	return u.String()
}

// WithParams returns rawURL (a postgres:// URL) with the query parameters
// of params (as "k=v&k2=v2", URL-encoded) added to its own.
func WithParams(t testing.TB, rawURL, params string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	extra, err := url.ParseQuery(params)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	for k, vs := range extra {
		for _, v := range vs {
			q.Add(k, v)
		}
	}
	u.RawQuery = q.Encode()
	return u.String()
}
