// Package pgtest gives each test its own freshly migrated PostgreSQL
// database.
//
// The server is resolved once per test process with [pgserver.Resolve]
// (DATABASE_URL, localhost:5432, a container where a program of the cmd
// module registered one, or a temporary cluster).
// For each migration function, the first request creates a template
// database with a random name (idemtest_tpl_<hex>) and runs the migration on
// it once; every database handed out after that is a cheap
// CREATE DATABASE idemtest_<hex> TEMPLATE idemtest_tpl_<hex>. Names are
// random, so parallel tests, parallel test processes (go test runs packages
// concurrently) and leftovers of earlier runs never collide.
//
// Typical use:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
//
//	func TestSomething(t *testing.T) {
//		t.Parallel()
//		pool := pgtest.Pool(t, idem.Migrate) // dropped when the test ends
//		...
//	}
//
// [Main] drops the templates and stops a server that Resolve started (a
// container or temporary cluster). Without it, templates stay behind on an
// external server, and a temporary cluster is only stopped when the process
// exits (on Linux; its directory is removed by a later run).
//
// No server: the server is resolved when a test first needs one, so tests
// that need none run without it. Under [Main], if resolution fails, the
// test binary prints one message (why, and how to provide a server) and
// exits with status 1 at once, instead of failing every later test with the
// same error (and panicking in examples). Of the test binaries that one go
// test run starts, only the first to stop prints the message. A
// DATABASE_URL that is set but does not connect is such a failure: it is
// never replaced by another server (see [pgserver.Resolve]).
//
// Runnable examples have no *testing.T: they connect the way a service
// does, to DATABASE_URL (with a default for a local server), and keep to a
// schema of their own. So that they find the server the tests use, Main
// sets DATABASE_URL, when it is unset, to the server's URL once a test has
// resolved it. When the binary has examples that the run selects
// (-test.run, -test.skip), Main resolves the server before any test runs,
// so that examples run on their own (go test -run Example) find it too,
// and a DATABASE_URL that does not connect gives the one message rather
// than a panic in each example. With no server such a binary stops at
// once, before its tests that need none.
//
// Dropping needs DROP DATABASE … WITH (FORCE), so PostgreSQL 13 or newer.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/testkit/pgserver"
)

// MigrateFunc brings an empty database to the current schema. It is passed
// in by the caller so that pgtest does not import the package under test.
//
// Templates are keyed by the function's code: closures created from the
// same function literal share one template, whatever they captured.
type MigrateFunc func(ctx context.Context, pool *pgxpool.Pool) error

// PoolMaxConns is the MaxConns of pools returned by Pool.
const PoolMaxConns = 16

const (
	// resolveTimeout bounds server resolution, which may pull an image.
	resolveTimeout = 5 * time.Minute
	// setupTimeout bounds creating one database (and its template) in
	// URL and Pool.
	setupTimeout = 2 * time.Minute
	// dropTimeout bounds dropping one database.
	dropTimeout = 30 * time.Second
)

// exitNoServer is the exit status of a test binary that stops under Main
// because no server could be resolved.
const exitNoServer = 1

var (
	// stopOnNoServer is set by Main: a resolution failure then ends the
	// process (see stopNoServer) rather than each test that needs a server.
	stopOnNoServer bool
	stopOnce       sync.Once

	serverOnce sync.Once
	server     *pgserver.Server
	serverErr  error
	admin      *pgxpool.Pool // connections to server's admin database

	mu        sync.Mutex
	templates = map[uintptr]*template{} // by templateKey
	live      = map[string]bool{}       // databases created and not yet dropped
)

// template is the template database of one MigrateFunc.
type template struct {
	// mu guards name and serializes CREATE DATABASE … TEMPLATE name:
	// PostgreSQL refuses to copy a database that another session is
	// copying ("source database is being accessed by other users").
	mu   sync.Mutex
	name string // "" until created
}

// resolve resolves the process-wide server and its admin pool once.
func resolve() (*pgserver.Server, *pgxpool.Pool, error) {
	serverOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), resolveTimeout)
		defer cancel()
		server, serverErr = pgserver.Resolve(ctx)
		if serverErr != nil {
			return
		}
		cfg, err := pgxpool.ParseConfig(server.URL)
		if err == nil {
			cfg.MaxConns = 4
			admin, err = pgxpool.NewWithConfig(ctx, cfg)
		}
		if err != nil {
			_ = server.Close()
			server, serverErr = nil, fmt.Errorf("pgtest: admin pool: %w", err)
			return
		}
		if stopOnNoServer && os.Getenv("DATABASE_URL") == "" {
			// For the runnable examples, which connect as a service does.
			_ = os.Setenv("DATABASE_URL", server.URL)
		}
	})
	if serverErr != nil && stopOnNoServer {
		stopNoServer(serverErr)
	}
	return server, admin, serverErr
}

// stopNoServer prints why no server could be resolved, once, and exits with
// exitNoServer. Concurrent callers block in the Once until the process is
// gone, so the message appears once and nothing else runs after it.
//
// go test runs the test binaries of several packages at once, and each
// would print the same message; only the first of one go test run does
// (see firstNoServer), the others print the one line noServerAgain.
func stopNoServer(err error) {
	stopOnce.Do(func() {
		if firstNoServer() {
			fmt.Fprintf(os.Stderr, "\npgtest: no PostgreSQL server for these tests; stopping the run.\n%v\n\n", err)
		} else {
			fmt.Fprintln(os.Stderr, noServerAgain)
		}
		os.Exit(exitNoServer)
	})
}

// noServerAgain is what the test binaries of a go test run after the first
// print when they stop for want of a server.
const noServerAgain = "pgtest: no server; stopping (the reason is printed once in this go test run, with another package)"

// noServerDirEnv names a directory to hold the marker of firstNoServer in
// place of go test's work directory: for this package's own tests.
const noServerDirEnv = "PGTEST_NO_SERVER_DIR"

// firstNoServer reports whether this test binary is the first of its go
// test run to stop for want of a server. It creates a marker file with
// O_EXCL in the directory that go test builds and runs the binaries of one
// run in ($WORK/bNNN/pkg.test, where $WORK is a go-build* directory that go
// test removes at the end), so that the binaries of one run share it and
// nothing outlives the run. A binary run otherwise (built with go test -c)
// is always first.
func firstNoServer() bool {
	dir := os.Getenv(noServerDirEnv)
	if dir == "" {
		dir = filepath.Dir(filepath.Dir(os.Args[0]))
		if !strings.HasPrefix(filepath.Base(dir), "go-build") {
			return true
		}
	}
	f, err := os.OpenFile(filepath.Join(dir, "pgtest-no-server"), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return false
	}
	if err == nil {
		_ = f.Close()
	}
	return true
}

// Server returns the process-wide PostgreSQL server, resolving it on first
// use. A resolution failure stops the test binary under Main, and fails the
// test with t.Fatal otherwise; so do those of URL, Pool and NewDatabase
// (which returns the error instead).
func Server(t testing.TB) *pgserver.Server {
	t.Helper()
	srv, _, err := resolve()
	if err != nil {
		t.Fatal(err)
	}
	return srv
}

// NewDatabase creates a fresh database migrated by migrate (nil means an
// empty database) and returns its connection URL and a function that drops
// it. The drop function ignores errors and may be called more than once.
// NewDatabase is safe for concurrent use.
func NewDatabase(ctx context.Context, migrate MigrateFunc) (url string, drop func(), err error) {
	name, err := newDatabase(ctx, migrate)
	if err != nil {
		return "", nil, err
	}
	var once sync.Once
	drop = func() {
		once.Do(func() { _ = dropDatabase(name) })
	}
	return server.DatabaseURL(name), drop, nil
}

// URL returns the URL of a fresh database migrated by migrate (nil means an
// empty database), dropped when the test ends. Failures fail the test.
func URL(t testing.TB, migrate MigrateFunc) string {
	t.Helper()
	if _, _, err := resolve(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), setupTimeout)
	defer cancel()
	name, err := newDatabase(ctx, migrate)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dropDatabase(name); err != nil {
			t.Errorf("pgtest: %v", err)
		}
	})
	return server.DatabaseURL(name)
}

// Pool returns a pool (MaxConns PoolMaxConns) on a fresh database migrated
// by migrate (nil means an empty database). When the test ends the pool is
// closed and the database dropped. Failures fail the test, and so does a
// connection still acquired when the test ends (instead of hanging).
func Pool(t testing.TB, migrate MigrateFunc) *pgxpool.Pool {
	t.Helper()
	url := URL(t, migrate)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = PoolMaxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Runs before URL's cleanup drops the database.
	t.Cleanup(func() {
		if !closePool(pool, poolCloseTimeout) {
			t.Errorf("pgtest: pool.Close still blocked after %v: a connection is still acquired "+
				"(a goroutine holds it or a Rows was not closed); dropping the database anyway", poolCloseTimeout)
		}
	})
	return pool
}

// poolCloseTimeout bounds the wait for a test's pool to close. pgxpool's
// Close waits for every acquired connection to be released, so one leaked
// connection would otherwise hang the test binary until go test's timeout.
var poolCloseTimeout = 10 * time.Second

// closePool closes pool and reports whether that finished within timeout.
// If not, Close goes on in the background.
func closePool(pool *pgxpool.Pool, timeout time.Duration) bool {
	closed := make(chan struct{})
	go func() {
		pool.Close()
		close(closed)
	}()
	select {
	case <-closed:
		return true
	case <-time.After(timeout):
		return false
	}
}

// Main runs the tests and then cleans up with Shutdown, returning m.Run's
// exit code. Call it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
//
// (Plain `pgtest.Main(m)` works too: when TestMain returns, the testing
// package exits with m.Run's code.) A test binary killed by go test's
// -timeout never gets here; what it created stays behind, harmlessly, since
// every run uses new random names.
//
// Under Main, the first test or example that needs a server and finds none
// (resolution failed, including a DATABASE_URL that does not connect) stops
// the whole binary: one message on stderr, exit status 1, no further tests.
// Tests that need no server and ran before it have run; none runs after.
//
// When the run selects one of the binary's runnable examples, Main resolves
// the server before m.Run and, if DATABASE_URL is unset, sets it to the
// server's URL (or stops as above): examples connect to DATABASE_URL, and
// without a test before them nothing else would set it or check that it
// connects. Main parses the command-line flags for that (flag.Parse), as
// m.Run would.
//
// Cleanup errors are printed to stderr; they do not fail the run.
func Main(m *testing.M) int {
	stopOnNoServer = true
	if runsExamples(m) {
		_, _, _ = resolve() // sets DATABASE_URL if unset, or stops the binary
	}
	code := m.Run()
	if err := Shutdown(); err != nil {
		fmt.Fprintln(os.Stderr, "pgtest: cleanup:", err)
	}
	return code
}

// runsExamples reports whether m will run a runnable example: whether the
// binary has one (go test lists only those with an output comment) that
// -test.run selects and -test.skip does not. testing.M does not export its
// examples, so they are read by reflection; if that ever fails, the answer
// is yes (resolving early costs a little time, never a wrong result).
func runsExamples(m *testing.M) bool {
	if !flag.Parsed() {
		flag.Parse()
	}
	if flagValue("test.list") != "" {
		return false // -test.list runs nothing
	}
	v := reflect.ValueOf(m).Elem().FieldByName("examples")
	if !v.IsValid() || v.Type() != reflect.TypeOf([]testing.InternalExample(nil)) {
		return true
	}
	run, skip := flagValue("test.run"), flagValue("test.skip")
	for i := range v.Len() {
		if selectsExample(run, skip, v.Index(i).FieldByName("Name").String()) {
			return true
		}
	}
	return false
}

// flagValue is the value of the command-line flag name, "" if undefined.
func flagValue(name string) string {
	if f := flag.Lookup(name); f != nil {
		return f.Value.String()
	}
	return ""
}

// selectsExample reports whether the -test.run pattern run and the
// -test.skip pattern skip select the example name. Examples have no
// subtests, so only the first slash-separated element of each pattern
// counts, as in testing; a skip with more elements skips subtests only. A
// pattern that does not compile counts as selecting (testing reports it).
func selectsExample(run, skip, name string) bool {
	first := func(pattern string) (*regexp.Regexp, bool) {
		elem, _, _ := strings.Cut(pattern, "/")
		re, err := regexp.Compile(elem)
		return re, err == nil
	}
	if run != "" {
		if re, ok := first(run); ok && !re.MatchString(name) {
			return false
		}
	}
	if skip != "" && !strings.Contains(skip, "/") {
		if re, ok := first(skip); ok && re.MatchString(name) {
			return false
		}
	}
	return true
}

// Shutdown drops every database this process created and has not dropped
// yet (templates included), then stops the server if Resolve started it.
// Call it only once all tests are done; Main does.
func Shutdown() error {
	if server == nil {
		return nil // never resolved, or resolution failed
	}
	mu.Lock()
	names := make([]string, 0, len(live))
	for name := range live {
		names = append(names, name)
	}
	mu.Unlock()

	var errs []error
	for _, name := range names {
		errs = append(errs, dropDatabase(name))
	}
	admin.Close()
	errs = append(errs, server.Close())
	return errors.Join(errs...)
}

// newDatabase creates a database from migrate's template (creating the
// template first if needed) and returns its name.
func newDatabase(ctx context.Context, migrate MigrateFunc) (string, error) {
	srv, admin, err := resolve()
	if err != nil {
		return "", err
	}
	tpl := templateFor(migrate)
	tpl.mu.Lock()
	defer tpl.mu.Unlock()
	if tpl.name == "" {
		// Not cached on failure: the next caller tries again with a new
		// template, so a canceled context does not poison later tests.
		name, err := createTemplate(ctx, srv, admin, migrate)
		if err != nil {
			return "", err
		}
		tpl.name = name
	}

	name := "idemtest_" + randomHex()
	if _, err := admin.Exec(ctx, "create database "+ident(name)+" template "+ident(tpl.name)); err != nil {
		return "", fmt.Errorf("pgtest: creating database from template %s: %w", tpl.name, err)
	}
	track(name, true)
	return name, nil
}

// createTemplate creates and migrates a new template database and returns
// its name. Once migrated, the template accepts no connections, so that
// copying it never fails because someone is connected.
func createTemplate(ctx context.Context, srv *pgserver.Server, admin *pgxpool.Pool, migrate MigrateFunc) (string, error) {
	name := "idemtest_tpl_" + randomHex()
	// template0 rather than the default template1: nobody can be connected
	// to it, and it holds nothing added locally.
	if _, err := admin.Exec(ctx, "create database "+ident(name)+" template template0"); err != nil {
		return "", fmt.Errorf("pgtest: creating template database: %w", err)
	}
	track(name, true)

	err := runMigrate(ctx, srv.DatabaseURL(name), migrate)
	if err == nil {
		_, err = admin.Exec(ctx, "alter database "+ident(name)+" allow_connections false")
	}
	if err == nil {
		// In case migrate left connections of its own open.
		_, err = admin.Exec(ctx,
			"select pg_terminate_backend(pid) from pg_stat_activity where datname = $1 and pid <> pg_backend_pid()",
			name)
	}
	if err != nil {
		_ = dropDatabase(name)
		return "", fmt.Errorf("pgtest: preparing template %s: %w", name, err)
	}
	return name, nil
}

// runMigrate runs migrate on the database at url through a pool that is
// closed before it returns.
func runMigrate(ctx context.Context, url string, migrate MigrateFunc) error {
	if migrate == nil {
		return nil
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrate(ctx, pool); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return nil
}

// dropDatabase drops a database created by this process, disconnecting
// anyone still connected to it.
func dropDatabase(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), dropTimeout)
	defer cancel()
	if _, err := admin.Exec(ctx, "drop database if exists "+ident(name)+" with (force)"); err != nil {
		return fmt.Errorf("dropping database %s: %w", name, err)
	}
	track(name, false)
	return nil
}

// templateFor returns the template record of migrate, creating it if new.
func templateFor(migrate MigrateFunc) *template {
	key := templateKey(migrate)
	mu.Lock()
	defer mu.Unlock()
	tpl := templates[key]
	if tpl == nil {
		tpl = &template{}
		templates[key] = tpl
	}
	return tpl
}

// templateKey identifies a MigrateFunc by its code pointer (0 for nil).
func templateKey(migrate MigrateFunc) uintptr {
	if migrate == nil {
		return 0
	}
	return reflect.ValueOf(migrate).Pointer()
}

// track records that a database exists (or no longer does).
func track(name string, exists bool) {
	mu.Lock()
	defer mu.Unlock()
	if exists {
		live[name] = true
	} else {
		delete(live, name)
	}
}

// randomHex returns 16 random hex digits, for database names.
func randomHex() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand panics instead)
	return hex.EncodeToString(b[:])
}

// ident quotes a database name for SQL.
func ident(name string) string {
	return pgx.Identifier{name}.Sanitize()
}
