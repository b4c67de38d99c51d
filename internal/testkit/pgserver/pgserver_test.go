package pgserver

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

const localURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// requireLocalhost skips the test when no usable server answers on
// localhost:5432.
func requireLocalhost(t *testing.T) {
	t.Helper()
	srv, err := Localhost(t.Context())
	if err != nil {
		t.Skipf("no server on localhost:5432: %v", err)
	}
	_ = srv.Close()
}

func TestResolveFindsLocalhost(t *testing.T) {
	requireLocalhost(t)
	t.Setenv("DATABASE_URL", "")

	srv, err := Resolve(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	if srv.Source != SourceLocalhost {
		t.Fatalf("Source = %q, want %q", srv.Source, SourceLocalhost)
	}
	if err := Ping(t.Context(), srv.URL); err != nil {
		t.Fatal(err)
	}
	if err := srv.Close(); err != nil {
		t.Fatalf("Close of an external server: %v", err)
	}
	if err := Ping(t.Context(), srv.URL); err != nil {
		t.Fatalf("Close must not stop an external server: %v", err)
	}
}

func TestResolveUsesDatabaseURL(t *testing.T) {
	requireLocalhost(t)
	t.Setenv("DATABASE_URL", localURL)

	srv, err := Resolve(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	if srv.Source != SourceDatabaseURL || srv.URL != localURL {
		t.Fatalf("got %q from %q, want %q from DATABASE_URL", srv.URL, srv.Source, localURL)
	}
}

func TestResolveDoesNotFallThroughFromBadDatabaseURL(t *testing.T) {
	port, err := freePort() // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:"+strconv.Itoa(port)+"/postgres?sslmode=disable")

	start := time.Now()
	srv, err := Resolve(t.Context())
	if err == nil {
		srv.Close()
		t.Fatalf("Resolve succeeded with %s; want an error", srv.Source)
	}
	if !strings.Contains(err.Error(), "DATABASE_URL") {
		t.Errorf("error does not mention DATABASE_URL: %v", err)
	}
	t.Logf("failed in %v", time.Since(start)) // a hang would hit the test timeout
}

func TestResolveErrorNamesAllOptions(t *testing.T) {
	fail := func(msg string) func(context.Context) (*Server, error) {
		return func(context.Context) (*Server, error) { return nil, errors.New(msg) }
	}
	_, err := resolveWith(t.Context(), []step{
		{"localhost:5432", "run PostgreSQL on localhost:5432", fail("connection refused")},
		{"testcontainers", "start a Docker engine", fail("no docker")},
		{"initdb", "install initdb", fail("no binaries")},
	})
	if !errors.Is(err, ErrNoServer) {
		t.Fatalf("error %v does not wrap ErrNoServer", err)
	}
	for _, want := range []string{
		"DATABASE_URL", "localhost:5432", "Docker", "initdb", // the options
		"connection refused", "no docker", "no binaries", // why each failed
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
}

func TestResolveStopsAtFirstSuccess(t *testing.T) {
	want := &Server{URL: "x", Source: "second"}
	srv, err := resolveWith(t.Context(), []step{
		{"first", "", func(context.Context) (*Server, error) { return nil, errors.New("no") }},
		{"second", "", func(context.Context) (*Server, error) { return want, nil }},
		{"third", "", func(context.Context) (*Server, error) { t.Fatal("third step ran"); return nil, nil }},
	})
	if err != nil || srv != want {
		t.Fatalf("got %v, %v", srv, err)
	}
}

// Without RegisterContainer, Resolve tries localhost and initdb; a
// registered step goes between them, and its hint joins the advice.
func TestRegisterContainer(t *testing.T) {
	names := func() []string {
		var out []string
		for _, st := range steps() {
			out = append(out, st.name)
		}
		return out
	}
	if got := names(); !slices.Equal(got, []string{"localhost:5432", "initdb"}) {
		t.Fatalf("steps without a container step: %q", got)
	}
	stopped := false
	srv := Started("postgres://x", "test", func() error { stopped = true; return nil })
	RegisterContainer("box", "start a box", func(context.Context) (*Server, error) { return srv, nil })
	t.Cleanup(func() {
		container.mu.Lock()
		container.step = nil
		container.mu.Unlock()
	})
	if got := names(); !slices.Equal(got, []string{"localhost:5432", "box", "initdb"}) {
		t.Fatalf("steps with a container step: %q", got)
	}
	st := steps()[1]
	if got, err := st.run(t.Context()); got != srv || err != nil || st.hint != "start a box" {
		t.Fatalf("registered step: %v, %v, hint %q", got, err, st.hint)
	}
	if err := srv.Close(); err != nil || !stopped {
		t.Fatalf("Close of a Started server: %v, stopped %t", err, stopped)
	}
}

func TestStartTempCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	if _, err := findServerBinaries(); err != nil {
		t.Skip(err)
	}
	start := time.Now()
	srv, err := StartTempCluster(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("temp cluster up in %v: %s", time.Since(start).Round(time.Millisecond), srv.Source)
	defer srv.Close()

	if !strings.HasPrefix(srv.Source, "initdb (temp cluster at ") {
		t.Errorf("Source = %q", srv.Source)
	}
	if _, err := os.Stat(filepath.Join(srv.dir, "data", "PG_VERSION")); err != nil {
		t.Errorf("cluster directory: %v", err)
	}

	conn, err := pgx.Connect(t.Context(), srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	var one int
	if err := conn.QueryRow(t.Context(), "select 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("select 1: %d, %v", one, err)
	}
	// The server must be usable for the test harness: create, use and
	// drop a database through DatabaseURL.
	if _, err := conn.Exec(t.Context(), "create database pgserver_check"); err != nil {
		t.Fatal(err)
	}
	if err := Ping(t.Context(), srv.DatabaseURL("pgserver_check")); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(t.Context(), "drop database pgserver_check"); err != nil {
		t.Fatal(err)
	}
	conn.Close(t.Context())

	if err := srv.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := os.Stat(srv.dir); !os.IsNotExist(err) {
		t.Errorf("cluster directory still there after Close: %v", err)
	}
	if err := Ping(t.Context(), srv.URL); err == nil {
		t.Error("server still answers after Close")
	}
	if err := srv.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestRemoveStaleClusters(t *testing.T) {
	base := t.TempDir()
	mk := func(name, owner string) string {
		dir := filepath.Join(base, name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if owner != "" {
			if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(owner), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return dir
	}
	dead := mk(clusterDirPrefix+"dead", "2147483646") // no such process
	alive := mk(clusterDirPrefix+"alive", strconv.Itoa(os.Getpid()))
	unowned := mk(clusterDirPrefix+"unowned", "")
	other := mk("something-else", "2147483646")

	removeStaleClusters(base)

	for dir, wantGone := range map[string]bool{dead: true, alive: false, unowned: false, other: false} {
		_, err := os.Stat(dir)
		if gone := os.IsNotExist(err); gone != wantGone {
			t.Errorf("%s: removed = %v, want %v", filepath.Base(dir), gone, wantGone)
		}
	}
}

func TestDatabaseURL(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{localURL, "postgres://postgres@127.0.0.1:5432/other?sslmode=disable"},
		{"postgresql://u:p%40ss@h:1/db", "postgresql://u:p%40ss@h:1/other"},
		{"host=h user=u dbname=db", "host=h user=u dbname=db dbname='other'"},
	} {
		s := &Server{URL: tc.in}
		if got := s.DatabaseURL("other"); got != tc.want {
			t.Errorf("DatabaseURL(%q) = %q, want %q", tc.in, got, tc.want)
		}
		cfg, err := pgx.ParseConfig(s.DatabaseURL("other"))
		if err != nil {
			t.Fatal(err)
		}
		if cfg.Database != "other" {
			t.Errorf("%q: database = %q", tc.in, cfg.Database)
		}
	}
}

func TestVersionOf(t *testing.T) {
	for in, want := range map[string]int{
		"/usr/lib/postgresql/15/bin":          15,
		"/usr/pgsql-9.6/bin":                  9,
		"/opt/homebrew/opt/postgresql@16/bin": 16,
		"/usr/local/bin":                      -1,
	} {
		if got := versionOf(in); got != want {
			t.Errorf("versionOf(%q) = %d, want %d", in, got, want)
		}
	}
}

// Behind PgBouncer in transaction mode, a DATABASE_URL in pgx's default exec
// mode connects: the probes do not prepare statements, which the pooler
// would lose (42P05 from the second probe on), so the connection string's
// exec mode is left to the program to judge.
func TestFromURLBehindPooler(t *testing.T) {
	pooler := os.Getenv("IDEM_PGBOUNCER_URL")
	if pooler == "" {
		t.Skip("IDEM_PGBOUNCER_URL is unset: no PgBouncer to test behind (eval \"$(.ci/pgbouncer)\" starts one)")
	}
	for range 4 {
		srv, err := FromURL(t.Context(), pooler, SourceDatabaseURL)
		if err != nil {
			t.Fatal(err)
		}
		_ = srv.Close()
	}
}
