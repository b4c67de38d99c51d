package citustest_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/citustest"
)

// The Citus suite: every public call through the coordinator of a real
// cluster, with idem_keys distributed by actor and the service's table
// (orders) co-located with it. Without IDEM_CITUS_URL it does not run (one
// line says so); .ci/run starts a cluster with .ci/citus.
func TestMain(m *testing.M) { os.Exit(citustest.Main(m)) }

// orders is the service's table: distributed by its actor column and
// co-located with idem_keys, so a request's key and its writes live on one
// worker.
func orders(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `
		CREATE TABLE orders (
			actor    text NOT NULL,
			id       bigserial,
			idem_key text NOT NULL,
			item     text NOT NULL,
			PRIMARY KEY (actor, id));
		SELECT create_distributed_table('orders', 'actor', colocate_with => 'idem_keys')`)
	return err
}

// withOrders is the template of newDB's databases: idem's tables and orders.
var withOrders = &citustest.Template{Schema: orders}

// newDB makes a test's database with orders, and a pool on the coordinator.
func newDB(t testing.TB) (citustest.DB, *pgxpool.Pool) {
	t.Helper()
	db := citustest.New(t, withOrders)
	return db, pool(t, db.URL)
}

// pool opens a pool on url, closed when the test ends.
func pool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// order is fn of a request: it inserts an order for the scope's actor and
// answers with its id.
func order(actor, key, item string) func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
	return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO orders (actor, idem_key, item) VALUES ($1, $2, $3) RETURNING id`,
			actor, key, item).Scan(&id)
		return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d,"item":%q}`, id, item)}, err
	}
}

// fp is the fingerprint of a request for item.
func fp(item string) idem.Fingerprint { return idem.FingerprintParts([]byte(item)) }

// count runs a count query.
func count(t testing.TB, p *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := p.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// ordersOf counts the orders written for a key.
func ordersOf(t testing.TB, p *pgxpool.Pool, actor, key string) int64 {
	t.Helper()
	return count(t, p, `SELECT count(*) FROM orders WHERE actor = $1 AND idem_key = $2`, actor, key)
}

// workerOf returns the port of the worker that holds the shard of table for
// actor.
func workerOf(t testing.TB, p *pgxpool.Pool, table, actor string) int {
	t.Helper()
	var port int
	if err := p.QueryRow(context.Background(), `SELECT nodeport FROM citus_shards
		WHERE shardid = get_shard_id_for_distribution_column($1, $2::text)`, table, actor).Scan(&port); err != nil {
		t.Fatal(err)
	}
	return port
}

// distribution returns the distribution column of table ("" when it is not
// a Citus table, "<none>" for a reference table) and whether it is in
// idem_keys' co-location group.
func distribution(t testing.TB, p *pgxpool.Pool, table string) (string, bool) {
	t.Helper()
	var column string
	var colocated bool
	err := p.QueryRow(context.Background(), `SELECT coalesce(column_to_column_name(logicalrelid, partkey), '<none>'),
		coalesce(colocationid = (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = 'idem_keys'::regclass), false)
		FROM pg_dist_partition WHERE logicalrelid = $1::regclass`, table).Scan(&column, &colocated)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatal(err)
	}
	return column, colocated
}

// actorsOnTwoWorkers returns two actors whose shards are on different
// workers.
func actorsOnTwoWorkers(t testing.TB, p *pgxpool.Pool) (string, string) {
	t.Helper()
	first := "actor-0"
	w := workerOf(t, p, "idem_keys", first)
	for i := 1; i < 1000; i++ {
		a := "actor-" + strconv.Itoa(i)
		if workerOf(t, p, "idem_keys", a) != w {
			return first, a
		}
	}
	t.Fatal("no two actors on different workers")
	return "", ""
}

// isErr fails the test unless err is target.
func isErr(t testing.TB, what string, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: %v, want %v", what, err, target)
	}
}
