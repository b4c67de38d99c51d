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
// every test, [New] creates such a database (copied on each node from a
// template that already holds the extension, made once per process),
// registers the workers, runs idem.Migrate and idem.Distribute and the
// test's own schema, and drops it on every node when the test ends.
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

// Schema is a test's own schema, run on the coordinator after idem's
// migrations and Distribute.
type Schema func(ctx context.Context, pool *pgxpool.Pool) error

var (
	clusterOnce sync.Once
	clusterErr  error
	base        *url.URL // the coordinator's URL, database replaced per test
	coordinator Node
	workers     []Node

	tplMu   sync.Mutex // serializes copies of the template (one at a time per source)
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

// New creates a test's database on the cluster: the citus extension on
// every node, the workers registered, idem migrated and idem_keys
// distributed, then schema (nil for none). It is dropped on every node when
// the test ends. Failures fail the test.
func New(t testing.TB, schema Schema) DB {
	t.Helper()
	db := Empty(t)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := idem.Distribute(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if schema != nil {
		if err := schema(ctx, pool); err != nil {
			t.Fatalf("citustest: schema: %v", err)
		}
	}
	return db
}

// Empty creates a test's database on the cluster, the citus extension on
// every node and the workers registered, without idem's tables. It is
// dropped on every node when the test ends. Failures fail the test.
func Empty(t testing.TB) DB {
	t.Helper()
	if err := cluster(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	db, err := create(ctx)
	if db.Name != "" {
		t.Cleanup(func() { drop(db.Name) })
	}
	if err != nil {
		t.Fatal(err)
	}
	return db
}

// create copies the template on every node and registers the workers.
func create(ctx context.Context) (DB, error) {
	tplMu.Lock()
	defer tplMu.Unlock()
	tpl, err := template(ctx)
	if err != nil {
		return DB{}, err
	}
	db := DB{Name: "idemcitus_" + randomHex()}
	db.URL = urlOf(coordinator, db.Name)
	for _, n := range nodes() {
		if err := exec(ctx, n, "postgres", "CREATE DATABASE "+ident(db.Name)+" TEMPLATE "+ident(tpl)); err != nil {
			return db, fmt.Errorf("citustest: database on %s:%s: %w", n.Host, n.Port, err)
		}
		track(db.Name, true)
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
		db.Workers = append(db.Workers, urlOf(w, db.Name))
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
