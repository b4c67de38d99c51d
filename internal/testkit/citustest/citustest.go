// Package citustest gives each test its own database on a real Citus
// cluster (a coordinator and its workers), with idem_keys migrated and
// distributed by actor, for the Citus suite in this folder.
//
// The cluster is the one IDEM_CITUS_URL names (the coordinator's URL;
// .ci/citus builds Citus and starts a cluster, and prints it). Without it
// the suite does not run: [Main] prints one line saying so and exits 0.
//
// A Citus database is a database of the same name on every node, each with
// the citus extension, and the workers registered in the coordinator's. For
// every test, [New] copies such a database on each node from a [Template]
// (idem.Migrate, idem.Distribute and the tests' own schema run once per
// process, in a database made the same way) and drops it on every node
// when the test ends; [Empty] copies one that holds only the extension and
// registers the workers.
package citustest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// EnvURL names the environment variable with the coordinator's URL.
const EnvURL = "IDEM_CITUS_URL"

// Main runs the suite when EnvURL is set, and otherwise prints one line and
// returns 0 without running anything. Call it from TestMain.
func Main(m *testing.M) int {
	if os.Getenv(EnvURL) == "" {
		fmt.Println("citustest: " + EnvURL + " is not set: the Citus suite is skipped (.ci/citus starts a cluster and prints its URL)")
		return 0
	}
	code := m.Run()
	cleanup()
	return code
}

// Node is one PostgreSQL server of the cluster.
type Node struct{ Host, Port string }

// DB is a test's database on the cluster.
type DB struct {
	Name string
	// URL is the database on the coordinator: connect there.
	URL string
	// Workers are the URLs of the database on each worker, for tests that
	// look at (or break) what happens there.
	Workers []string
}

// Schema is the tests' own schema, run on the coordinator after idem's
// migrations and Distribute.
type Schema func(ctx context.Context, pool *pgxpool.Pool) error

// Template is the database that [New] copies for a test: the citus
// extension on every node, the workers registered, idem migrated and
// idem_keys distributed, then Schema (nil for none). It is made once per
// process, by the first New that asks for it, and a test's database starts
// as that copy: a Schema sees no test's data, and a test changes its copy
// only. Declare one per schema as a package-level variable.
type Template struct {
	Schema Schema

	mu   sync.Mutex
	name string
	err  error
}

// migrated is the Template of New(t, nil): idem's tables, nothing else.
var migrated = &Template{}

var (
	clusterOnce sync.Once
	clusterErr  error
	base        *url.URL // the coordinator's URL, database replaced per test
	coordinator Node
	workers     []Node

	tplMu   sync.Mutex // serializes the copies of databases (one at a time)
	tplName string
	liveMu  sync.Mutex
	live    = map[string]bool{}
)

// cluster reads the coordinator's URL and asks it for its workers, once.
func cluster() error {
	clusterOnce.Do(func() {
		raw := os.Getenv(EnvURL)
		if raw == "" {
			clusterErr = errors.New(EnvURL + " is not set")
			return
		}
		u, err := url.Parse(raw)
		if err != nil {
			clusterErr = fmt.Errorf("%s: %w", EnvURL, err)
			return
		}
		base = u
		host, port, err := net.SplitHostPort(u.Host)
		if err != nil {
			host, port = u.Host, "5432"
		}
		coordinator = Node{host, port}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		conn, err := pgx.Connect(ctx, raw)
		if err != nil {
			clusterErr = fmt.Errorf("citustest: the coordinator at %s: %w", EnvURL, err)
			return
		}
		defer conn.Close(ctx)
		rows, err := conn.Query(ctx, `SELECT nodename, nodeport::text FROM pg_dist_node
			WHERE groupid <> 0 AND noderole = 'primary' ORDER BY nodeport`)
		if err == nil {
			workers, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (Node, error) {
				var n Node
				return n, r.Scan(&n.Host, &n.Port)
			})
		}
		if err == nil && len(workers) == 0 {
			err = errors.New("no workers registered")
		}
		if err != nil {
			clusterErr = fmt.Errorf("citustest: the cluster's workers: %w", err)
		}
	})
	return clusterErr
}

// urlOf is the URL of database name on n.
func urlOf(n Node, name string) string {
	u := *base
	u.Host = net.JoinHostPort(n.Host, n.Port)
	u.Path = "/" + name
	return u.String()
}

// nodes is the coordinator and then the workers.
func nodes() []Node { return append([]Node{coordinator}, workers...) }

// exec runs sql in database db of n.
func exec(ctx context.Context, n Node, db string, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, urlOf(n, db))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql, args...)
	return err
}

// template makes, once per process, a database on every node that holds
// the citus extension and accepts no connections, to copy.
func template(ctx context.Context) (string, error) {
	if tplName != "" {
		return tplName, nil
	}
	name := "idemcitus_tpl_" + randomHex()
	for _, n := range nodes() {
		if err := exec(ctx, n, "postgres", "CREATE DATABASE "+ident(name)); err != nil {
			return "", fmt.Errorf("citustest: template on %s:%s: %w", n.Host, n.Port, err)
		}
		track(name, true)
		if err := exec(ctx, n, name, "CREATE EXTENSION citus"); err != nil {
			return "", fmt.Errorf("citustest: citus extension on %s:%s: %w", n.Host, n.Port, err)
		}
		if err := seal(ctx, n, name); err != nil {
			return "", err
		}
	}
	tplName = name
	return name, nil
}

// seal makes database name on n (when it exists) one that nobody is
// connected to and that refuses connections, so that it can be copied or
// dropped: it ends the sessions there and waits until they have gone.
// Citus's maintenance daemon connects to every database with the
// extension, to the coordinator's own too; a connection it opens while
// CREATE or DROP DATABASE holds the database's lock waits for that
// statement, which waits (5 s, then fails) for the daemon to leave.
func seal(ctx context.Context, n Node, name string) error {
	conn, err := pgx.Connect(ctx, urlOf(n, "postgres"))
	if err != nil {
		return fmt.Errorf("citustest: sealing %s on %s:%s: %w", name, n.Host, n.Port, err)
	}
	defer conn.Close(context.Background())
	var exists bool
	err = conn.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists)
	if err == nil && exists {
		_, err = conn.Exec(ctx, "ALTER DATABASE "+ident(name)+" ALLOW_CONNECTIONS false")
	}
	for err == nil && exists {
		var left int
		err = conn.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = $1 AND pid <> pg_backend_pid()`, name).Scan(&left)
		if err != nil || left == 0 {
			break
		}
		select {
		case <-ctx.Done():
			err = ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err != nil {
		return fmt.Errorf("citustest: sealing %s on %s:%s: %w", name, n.Host, n.Port, err)
	}
	return nil
}

// make returns tp's database on the cluster, making it the first time
// (a failure is kept: every later call returns it).
func (tp *Template) make(ctx context.Context) (string, error) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	if tp.name != "" || tp.err != nil {
		return tp.name, tp.err
	}
	tp.name, tp.err = tp.build(ctx)
	if tp.err != nil {
		tp.name = ""
	}
	return tp.name, tp.err
}

func (tp *Template) build(ctx context.Context) (string, error) {
	db, err := create(ctx, "")
	if err != nil {
		return "", err
	}
	pool, err := pgxpool.New(ctx, db.URL)
	if err != nil {
		return "", err
	}
	err = idem.Migrate(ctx, pool)
	if err == nil {
		err = idem.Distribute(ctx, pool)
	}
	if err == nil && tp.Schema != nil {
		if err = tp.Schema(ctx, pool); err != nil {
			err = fmt.Errorf("citustest: schema: %w", err)
		}
	}
	pool.Close()
	if err != nil {
		return "", fmt.Errorf("citustest: template: %w", err)
	}
	for _, n := range nodes() {
		if err := seal(ctx, n, db.Name); err != nil {
			return "", err
		}
	}
	return db.Name, nil
}

// New creates a test's database on the cluster, a copy of tpl's on every
// node (nil: idem migrated and idem_keys distributed, no schema of the
// test's). It is dropped on every node when the test ends. Failures fail
// the test.
func New(t testing.TB, tpl *Template) DB {
	t.Helper()
	if tpl == nil {
		tpl = migrated
	}
	return newDB(t, tpl)
}

// Empty creates a test's database on the cluster, the citus extension on
// every node and the workers registered, without idem's tables. It is
// dropped on every node when the test ends. Failures fail the test.
func Empty(t testing.TB) DB {
	t.Helper()
	return newDB(t, nil)
}

func newDB(t testing.TB, tpl *Template) DB {
	t.Helper()
	if err := cluster(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	from := ""
	if tpl != nil {
		var err error
		if from, err = tpl.make(ctx); err != nil {
			t.Fatal(err)
		}
	}
	db, err := create(ctx, from)
	if db.Name != "" {
		t.Cleanup(func() { drop(db.Name) })
	}
	if err != nil {
		t.Fatal(err)
	}
	return db
}

// create copies database from on every node ("": the template with the
// extension, then registers the workers; a copy of a Template has them
// registered already).
func create(ctx context.Context, from string) (DB, error) {
	tplMu.Lock()
	defer tplMu.Unlock()
	register := from == ""
	if register {
		var err error
		if from, err = template(ctx); err != nil {
			return DB{}, err
		}
	}
	db := DB{Name: "idemcitus_" + randomHex()}
	db.URL = urlOf(coordinator, db.Name)
	// On every node at once (each a server of its own).
	track(db.Name, true)
	all := nodes()
	errs := make([]error, len(all))
	var wg sync.WaitGroup
	for i, n := range all {
		wg.Go(func() {
			if err := exec(ctx, n, "postgres", "CREATE DATABASE "+ident(db.Name)+" TEMPLATE "+ident(from)); err != nil {
				errs[i] = fmt.Errorf("citustest: database on %s:%s: %w", n.Host, n.Port, err)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return db, err
	}
	for _, w := range workers {
		db.Workers = append(db.Workers, urlOf(w, db.Name))
	}
	if !register {
		return db, nil
	}
	conn, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		return db, err
	}
	defer conn.Close(context.Background())
	port, _ := strconv.Atoi(coordinator.Port)
	if _, err := conn.Exec(ctx, "SELECT citus_set_coordinator_host($1, $2)", coordinator.Host, port); err != nil {
		return db, fmt.Errorf("citustest: coordinator host: %w", err)
	}
	for _, w := range workers {
		port, _ := strconv.Atoi(w.Port)
		if _, err := conn.Exec(ctx, "SELECT citus_add_node($1, $2)", w.Host, port); err != nil {
			return db, fmt.Errorf("citustest: adding worker %s:%s: %w", w.Host, w.Port, err)
		}
	}
	return db, nil
}

// drop drops database name on every node, coordinator first, sealing it
// first (see seal). It stays tracked, for cleanup to try again, when a
// node refused.
func drop(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dropped := true
	for _, n := range nodes() {
		err := seal(ctx, n, name)
		if err == nil {
			err = exec(ctx, n, "postgres", "DROP DATABASE IF EXISTS "+ident(name)+" WITH (FORCE)")
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "citustest: dropping %s on %s:%s: %v\n", name, n.Host, n.Port, err)
			dropped = false
		}
	}
	if dropped {
		track(name, false)
	}
}

// cleanup drops what this process created and did not drop yet.
func cleanup() {
	liveMu.Lock()
	names := make([]string, 0, len(live))
	for name := range live {
		names = append(names, name)
	}
	liveMu.Unlock()
	for _, name := range names {
		drop(name)
	}
}

func track(name string, exists bool) {
	liveMu.Lock()
	defer liveMu.Unlock()
	if exists {
		live[name] = true
	} else {
		delete(live, name)
	}
}

func randomHex() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func ident(name string) string { return pgx.Identifier{name}.Sanitize() }
