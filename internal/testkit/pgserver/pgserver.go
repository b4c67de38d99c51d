// Package pgserver finds or starts a PostgreSQL server for tests and for the
// demo program.
//
// [Resolve] tries, in order:
//
//  1. the DATABASE_URL environment variable, used as it is. If it is set
//     but does not connect, Resolve fails and says so, instead of trying
//     anything else: an explicit choice is never quietly replaced by
//     another server (tests would then run against a database nobody
//     chose). Unset it, or set it to "", to let Resolve look further;
//  2. a server answering on localhost:5432 (user PGUSER if set, then
//     "postgres", then the current OS user; password from PGPASSWORD);
//  3. a throwaway container, only in a program that registered a way to
//     start one with [RegisterContainer]: the programs and tests of the
//     module github.com/pgidem/idem/cmd do (testcontainers-go, when a
//     Docker engine answers), so that the library's module needs no Docker
//     modules; the library's own tests skip this step;
//  4. a throwaway cluster created with the local PostgreSQL server binaries
//     (initdb + postgres) in a temporary directory.
//
// Each step is also available on its own ([FromURL], [Localhost],
// [StartTempCluster]), so callers and tests can force one.
//
// A [Server] must be closed with [Server.Close] to stop what was started;
// closing an external server is a no-op.
package pgserver

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/user"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// connectTimeout bounds every probe connection made while resolving.
const connectTimeout = 2 * time.Second

// Source values for servers that were found rather than started.
const (
	SourceDatabaseURL = "DATABASE_URL"
	SourceLocalhost   = "localhost:5432"
)

// ErrNoServer is wrapped by the error [Resolve] returns when no step found
// or started a server.
var ErrNoServer = errors.New("pgserver: no PostgreSQL server available")

// Server is a resolved PostgreSQL server.
type Server struct {
	// URL is the connection URL of an admin database on the server, e.g.
	// postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable. When it
	// comes from DATABASE_URL it is used verbatim and may also be a
	// keyword/value DSN.
	URL string
	// Source says where the server came from, for humans: "DATABASE_URL",
	// "localhost:5432", "testcontainers (postgres:16-alpine)" or
	// "initdb (temp cluster at /tmp/pgserver-…)".
	Source string

	// stop stops what was started; nil for external servers.
	stop func() error
	// dir is the directory of a temp cluster, "" otherwise.
	dir       string
	closeOnce sync.Once
	closeErr  error
}

// Close stops what Resolve started (the container or the temporary cluster,
// whose files are removed). It is a no-op for external servers, and safe to
// call more than once and on a nil *Server.
func (s *Server) Close() error {
	if s == nil {
		return nil
	}
	s.closeOnce.Do(func() {
		if s.stop != nil {
			s.closeErr = s.stop()
		}
	})
	return s.closeErr
}

// Started returns a server that something outside this package started
// (a [RegisterContainer] step): Close calls stop once (nil: nothing to stop).
func Started(url, source string, stop func() error) *Server {
	return &Server{URL: url, Source: source, stop: stop}
}

// DatabaseURL returns the connection string of database name on the same
// server, with the same user, password and options as s.URL.
func (s *Server) DatabaseURL(name string) string {
	return withDatabase(s.URL, name)
}

// withDatabase replaces the database of a connection string. URLs get a new
// path; keyword/value DSNs get a trailing dbname setting, which overrides an
// earlier one.
func withDatabase(connString, name string) string {
	if u, err := url.Parse(connString); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + name
		u.RawPath = ""
		return u.String()
	}
	escaped := strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(name)
	return strings.TrimSpace(connString) + " dbname='" + escaped + "'"
}

// Resolve finds a PostgreSQL server; see the package documentation for the
// order in which it looks. When nothing works the error wraps [ErrNoServer]
// and names every way to provide a server.
func Resolve(ctx context.Context) (*Server, error) {
	if dsn, ok := os.LookupEnv("DATABASE_URL"); ok && dsn != "" {
		// An explicit choice is never second-guessed by falling through.
		srv, err := FromURL(ctx, dsn, SourceDatabaseURL)
		if err != nil {
			return nil, fmt.Errorf("%w\nDATABASE_URL is used as set, never replaced by another server: "+
				"start that server, correct DATABASE_URL, or unset it so that Resolve looks further (localhost:5432 first)", err)
		}
		return srv, nil
	}
	return resolveWith(ctx, steps())
}

// step is one way of obtaining a server.
type step struct {
	name string
	// hint tells a user without a server how to provide one this way.
	hint string
	run  func(context.Context) (*Server, error)
}

// container is the step RegisterContainer set, if any.
var container struct {
	mu   sync.Mutex
	step *step
}

// RegisterContainer makes [Resolve] try start, under name, after
// localhost:5432 and before a temporary initdb cluster. hint completes the
// advice of Resolve's error ("Provide one of: ...; <hint>; ..."), e.g.
// "start a Docker engine (used through testcontainers)". start must fail
// quickly where it cannot work. A later call replaces an earlier one.
func RegisterContainer(name, hint string, start func(context.Context) (*Server, error)) {
	container.mu.Lock()
	defer container.mu.Unlock()
	container.step = &step{name: name, hint: hint, run: start}
}

// steps lists what Resolve tries after DATABASE_URL, in order.
func steps() []step {
	s := []step{{"localhost:5432", "run PostgreSQL on localhost:5432 (user postgres, or set PGUSER/PGPASSWORD)", Localhost}}
	container.mu.Lock()
	if container.step != nil {
		s = append(s, *container.step)
	}
	container.mu.Unlock()
	return append(s, step{"initdb", "or install the PostgreSQL server binaries initdb and postgres " +
		"(e.g. apt-get install postgresql, brew install postgresql)", StartTempCluster})
}

// resolveWith runs steps in order and returns the first server obtained.
func resolveWith(ctx context.Context, steps []step) (*Server, error) {
	var reasons, hints []string
	for _, st := range steps {
		srv, err := st.run(ctx)
		if err == nil {
			return srv, nil
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("pgserver: resolving server: %w", ctx.Err())
		}
		reasons = append(reasons, fmt.Sprintf("  - %s: %v", st.name, err))
		if st.hint != "" {
			hints = append(hints, st.hint)
		}
	}
	return nil, fmt.Errorf("%w; tried:\n  - DATABASE_URL: not set\n%s\n"+
		"Provide one of: set DATABASE_URL to a server where the user may create databases; %s",
		ErrNoServer, strings.Join(reasons, "\n"), strings.Join(hints, "; "))
}

// FromURL returns the external server at connString, after checking that it
// accepts a connection. source becomes Server.Source. Close is a no-op.
func FromURL(ctx context.Context, connString, source string) (*Server, error) {
	if err := Ping(ctx, connString); err != nil {
		return nil, fmt.Errorf("pgserver: %s does not connect: %w", source, err)
	}
	return &Server{URL: connString, Source: source}, nil
}

// Localhost returns the server answering on 127.0.0.1:5432 as a role that
// may create databases. It tries the user in PGUSER (if set), then
// "postgres", then the current OS user, each with PGPASSWORD (if set).
func Localhost(ctx context.Context) (*Server, error) {
	var errs []error
	for _, connString := range localhostCandidates() {
		err := pingCreateDB(ctx, connString)
		if err == nil {
			return &Server{URL: connString, Source: SourceLocalhost}, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}

// localhostCandidates lists the admin URLs Localhost tries.
func localhostCandidates() []string {
	var names []string
	if u := os.Getenv("PGUSER"); u != "" {
		names = append(names, u)
	}
	names = append(names, "postgres")
	if u, err := user.Current(); err == nil && u.Username != "" {
		names = append(names, u.Username)
	}
	var urls []string
	seen := map[string]bool{}
	for _, name := range names {
		if seen[name] {
			continue
		}
		seen[name] = true
		u := url.URL{
			Scheme:   "postgres",
			User:     url.User(name),
			Host:     "127.0.0.1:5432",
			Path:     "/postgres",
			RawQuery: "sslmode=disable",
		}
		if pw, ok := os.LookupEnv("PGPASSWORD"); ok {
			u.User = url.UserPassword(name, pw)
		}
		urls = append(urls, u.String())
	}
	return urls
}

// Ping connects to connString with a short timeout and runs "select 1".
func Ping(ctx context.Context, connString string) error {
	return withConn(ctx, connString, func(ctx context.Context, conn *pgx.Conn) error {
		var one int
		return conn.QueryRow(ctx, "select 1").Scan(&one)
	})
}

// pingCreateDB is Ping that also requires the role to be allowed to create
// databases, which the test harness needs.
func pingCreateDB(ctx context.Context, connString string) error {
	return withConn(ctx, connString, func(ctx context.Context, conn *pgx.Conn) error {
		var role string
		var ok bool
		err := conn.QueryRow(ctx,
			"select current_user, rolsuper or rolcreatedb from pg_roles where rolname = current_user").
			Scan(&role, &ok)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("role %q may not create databases", role)
		}
		return nil
	})
}

// withConn opens one connection (bounded by connectTimeout), runs fn and
// closes the connection. The connection runs its statements with the simple
// protocol, whatever connString's default_query_exec_mode: a probe checks
// that the server answers, not that its exec mode suits the way to the
// server (a transaction pooler loses the statements pgx's default mode
// prepares; the programs name that fix themselves).
func withConn(ctx context.Context, connString string, fn func(context.Context, *pgx.Conn) error) error {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return err
	}
	cfg.ConnectTimeout = connectTimeout
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	ctx, cancel := context.WithTimeout(ctx, 2*connectTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), connectTimeout)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	return fn(ctx, conn)
}
