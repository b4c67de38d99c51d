package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/demo/draw"
	"github.com/pgidem/idem/internal/testkit/pgserver"
	"github.com/pgidem/idem/internal/testkit/relay"
)

// Schemas holding key tables besides public.idem_keys. Each gets its own
// idem_keys from idem.Migrate through a pool whose search_path starts with
// the schema; the business tables stay in public.
const (
	schemaStale = "stale"       // -stale: analyzed while empty, never again
	schemaEmpty = "scale_empty" // the scale run's reference
	schemaFull  = "scale_full"  // the scale run's -scale-rows keys
)

// bench is a prepared benchmark database.
type bench struct {
	o           options
	url         string       // the benchmark database
	relay       *relay.Relay // under -latency, the pools' way to the database
	light, draw *business
	pools       []*pgxpool.Pool
	pool        *pgxpool.Pool // public: the workloads and the storm
	stale       *pgxpool.Pool // -stale
	empty, full *pgxpool.Pool // the scale run
	settings    string        // the server's commit settings
}

// setup recreates the database, fills it and opens the pools.
func setup(ctx context.Context, out io.Writer, srv *pgserver.Server, o options) (_ *bench, err error) {
	t0 := time.Now()
	if err := recreate(ctx, srv, o.database); err != nil {
		return nil, err
	}
	b := &bench{o: o, url: srv.DatabaseURL(o.database)}
	b.light, b.draw = businesses(o)
	defer func() {
		if err != nil {
			b.close(nil)
		}
	}()
	if o.latency > 0 {
		if err := b.startRelay(); err != nil {
			return nil, err
		}
	}
	sp, err := openPool(ctx, b.url, 4, "", "")
	if err != nil {
		return nil, err
	}
	defer sp.Close()
	if err := idem.Migrate(ctx, sp); err != nil {
		return nil, err
	}
	if err := draw.Setup(ctx, sp); err != nil {
		return nil, err
	}
	// Rich accounts and wallets, boxes that never run out: no request is
	// ever refused.
	script := lightSchema + fmt.Sprintf(`
		INSERT INTO light_accounts SELECT g, 1000000000000 FROM generate_series(1, %[1]d) g;
		INSERT INTO light_items SELECT g, 1000000000000 FROM generate_series(1, %[2]d) g;
		INSERT INTO wallets (user_id, points) SELECT 'u' || g, 1000000000000000 FROM generate_series(1, %[1]d) g;
		INSERT INTO boxes (id, name, price, stock) SELECT 1000 + g, 'box ' || g, 1, 2000000000 FROM generate_series(1, %[2]d) g;
		INSERT INTO prizes (box_id, name, weight) SELECT 1000 + g, p.name, p.weight FROM generate_series(1, %[2]d) g,
			(VALUES ('Golden Goose', 1), ('Silver Goose', 9), ('Goose Plush', 30), ('Goose Sticker', 60)) AS p (name, weight);
		`+autovacuumOff, o.users, o.boxes)
	if err := execSQL(ctx, sp, script); err != nil {
		return nil, err
	}
	var schemas []string
	if o.stale {
		schemas = append(schemas, schemaStale)
	}
	if o.scaleRows > 0 {
		schemas = append(schemas, schemaEmpty, schemaFull)
	}
	for _, s := range schemas {
		if err := migrateSchema(ctx, b.url, s); err != nil {
			return nil, err
		}
	}
	if o.scaleRows > 0 {
		fmt.Fprintf(out, "setup: loading %d keys (%d expired) into %s.idem_keys ...\n", o.scaleRows, o.expiredRows, schemaFull)
		if err := loadKeys(ctx, sp, o.scaleRows, o.expiredRows); err != nil {
			return nil, err
		}
	}
	// Every table, and -stale's key table while it is empty: the statistics
	// it keeps for the whole run.
	if err := execSQL(ctx, sp, "VACUUM ANALYZE"); err != nil {
		return nil, err
	}
	if err := sp.QueryRow(ctx, `SELECT format('synchronous_commit %s, fsync %s, wal_sync_method %s, commit_delay %s, shared_buffers %s, autovacuum %s, plan_cache_mode %s',
		current_setting('synchronous_commit'), current_setting('fsync'), current_setting('wal_sync_method'), current_setting('commit_delay'),
		current_setting('shared_buffers'), current_setting('autovacuum'), current_setting('plan_cache_mode'))`).Scan(&b.settings); err != nil {
		return nil, err
	}

	conns := o.workers + 2
	if !o.stale {
		conns = max(conns, o.storm+1) // the storm's calls at once
	}
	if b.pool, err = b.open(ctx, int32(conns), ""); err != nil {
		return nil, err
	}
	if o.stale {
		if b.stale, err = b.open(ctx, int32(o.workers+2), schemaStale); err != nil {
			return nil, err
		}
		if err := prime(ctx, b.stale, b.light); err != nil {
			return nil, err
		}
	}
	if o.scaleRows > 0 {
		if b.empty, err = b.open(ctx, int32(o.workers+1), schemaEmpty); err != nil {
			return nil, err
		}
		if b.full, err = b.open(ctx, int32(o.workers+2), schemaFull); err != nil {
			return nil, err
		}
	}
	_, _ = sp.Exec(ctx, "CHECKPOINT") // start clean; needs superuser or pg_checkpoint
	fmt.Fprintf(out, "setup: done in %s\n", time.Since(t0).Round(100*time.Millisecond))
	return b, nil
}

// startRelay puts the database behind a relay that adds o.latency to every
// round trip, half of it each way. Setup connects directly; the measured
// pools go through the relay.
func (b *bench) startRelay() error {
	cfg, err := pgx.ParseConfig(b.url)
	if err != nil {
		return err
	}
	b.relay, err = relay.Start(net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), relay.Options{Delay: b.o.latency / 2})
	return err
}

// open opens a measured pool on the benchmark database (through the relay,
// if any); a schema goes first on its search_path.
func (b *bench) open(ctx context.Context, conns int32, schema string) (*pgxpool.Pool, error) {
	via := ""
	if b.relay != nil {
		via = b.relay.Addr()
	}
	p, err := openPool(ctx, b.url, conns, schema, via)
	if err == nil {
		b.pools = append(b.pools, p)
	}
	return p, err
}

// openPool opens a pool of conns connections to url, or to the same
// database at the address via (host:port) when it is not "".
func openPool(ctx context.Context, url string, conns int32, schema, via string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = conns
	if schema != "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = schema + ", public"
	}
	if via != "" {
		host, port, _ := net.SplitHostPort(via)
		p, _ := strconv.Atoi(port)
		cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = host, uint16(p), nil
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

func execSQL(ctx context.Context, p *pgxpool.Pool, sql string, args ...any) error {
	if _, err := p.Exec(ctx, sql, args...); err != nil {
		return fmt.Errorf("%.60s...: %w", sql, err)
	}
	return nil
}

// analyze refreshes the statistics of what the workloads write, as
// autovacuum would, between rounds; -stale's key table is left alone.
func (b *bench) analyze(ctx context.Context) error {
	tables := []string{"idem_keys", "light_orders", "draw_batches", "inventory", "point_ledger"}
	if b.o.scaleRows > 0 {
		tables = append(tables, schemaEmpty+".idem_keys", schemaFull+".idem_keys")
	}
	return execSQL(ctx, b.pool, "ANALYZE "+strings.Join(tables, ", "))
}

// close closes the pools and the relay and drops the database unless
// -keep (srv nil: drop nothing): the database this run created (recreate).
func (b *bench) close(srv *pgserver.Server) {
	for _, p := range b.pools {
		p.Close()
	}
	if b.relay != nil {
		_ = b.relay.Close()
	}
	if srv == nil || b.o.keep {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if conn, err := pgx.Connect(ctx, srv.URL); err == nil {
		_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{b.o.database}.Sanitize()+" WITH (FORCE)")
		_ = conn.Close(ctx)
	}
}

// benchMark is the comment idem-bench puts on the database it creates: only
// a database that carries it is ever dropped.
const benchMark = "idem-bench's database: dropped and recreated by every run"

// recreate creates the database called name, marked as idem-bench's. A
// database of that name that exists already is dropped first only when it
// is idem-bench's (a run's with -keep, or one that stopped early) and no
// session uses it; anything else is refused and left as it is.
func recreate(ctx context.Context, srv *pgserver.Server, name string) error {
	conn, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", srv.Source, err)
	}
	defer conn.Close(context.Background())
	var exists bool
	var mark string
	var sessions int
	err = conn.QueryRow(ctx, `SELECT true, coalesce(shobj_description(d.oid, 'pg_database'), ''),
			(SELECT count(*) FROM pg_stat_activity a WHERE a.datid = d.oid)
		FROM pg_database d WHERE d.datname = $1`, name).Scan(&exists, &mark, &sessions)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return err
	}
	ident := pgx.Identifier{name}.Sanitize()
	switch {
	case exists && mark != benchMark:
		return fmt.Errorf("database %s exists and is not idem-bench's (it never drops a database it did not create): pass -database with another name", name)
	case exists && sessions > 0:
		return fmt.Errorf("database %s is idem-bench's but %d session(s) use it (another run?): pass -database with another name", name, sessions)
	}
	sqls := []string{"CREATE DATABASE " + ident, "COMMENT ON DATABASE " + ident + " IS '" + strings.ReplaceAll(benchMark, "'", "''") + "'"}
	if exists {
		sqls = append([]string{"DROP DATABASE " + ident}, sqls...)
	}
	for _, sql := range sqls {
		if _, err := conn.Exec(ctx, sql); err != nil {
			return fmt.Errorf("%s: %w", sql, err)
		}
	}
	return nil
}

// autovacuumOff is set on every key table, so that each mode means the same
// on every server: the benchmark decides when statistics change.
const autovacuumOff = `ALTER TABLE idem_keys SET (autovacuum_enabled = off)`

// migrateSchema creates schema and runs idem.Migrate in it.
func migrateSchema(ctx context.Context, url, schema string) error {
	// The schema alone on the search_path: with public behind it, the
	// migrations' DROP INDEX IF EXISTS (00003) would find and drop
	// public's indexes of the same name.
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.MaxConns = 2
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer p.Close()
	if err := execSQL(ctx, p, "CREATE SCHEMA "+schema); err != nil {
		return err
	}
	if err := idem.Migrate(ctx, p); err != nil {
		return fmt.Errorf("migrate schema %s: %w", schema, err)
	}
	return execSQL(ctx, p, autovacuumOff)
}

// loadKeys inserts n finished keys into the full scale table, server-side,
// the first expired of them expired. Keys are md5 strings, spread over the
// primary key like client UUIDs; the responses are shaped like an order's.
func loadKeys(ctx context.Context, p *pgxpool.Pool, n, expired int) error {
	const chunk = 250_000
	for lo := 0; lo < n; lo += chunk {
		err := execSQL(ctx, p, `INSERT INTO `+schemaFull+`.idem_keys (actor, operation, idem_key, fingerprint, status,
				response_status, response_headers, response_body, created_at, completed_at, expires_at)
			SELECT 'a' || (1 + g % 100000), 'order', md5('k' || g), sha256(('f' || g)::bytea), 'succeeded',
				201, '{"Content-Type": ["application/json"]}', convert_to('{"order_id":' || g || '}', 'UTF8'),
				e - interval '24 hours', e - interval '24 hours', e
			FROM generate_series($1::int, $2::int - 1) g,
			LATERAL (SELECT CASE WHEN g < $3::int THEN now() - interval '1 hour' - g * interval '1 millisecond'
				ELSE now() + interval '1 hour' + (g % 86400) * interval '1 second' END) AS x (e)`,
			lo, min(lo+chunk, n), expired)
		if err != nil {
			return err
		}
	}
	return nil
}

// makeReplayKeys completes n keys of biz on pool with DoInTx, workers at a
// time, for a replay workload to send again.
func makeReplayKeys(ctx context.Context, pool *pgxpool.Pool, biz *business, n, workers int) ([]replayKey, error) {
	keys := make([]replayKey, n)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for i := range workers {
		wg.Go(func() {
			w := newWorker(&workload{biz: biz, pool: pool}, -1-i)
			for j := i; j < n && errs[i] == nil; j += workers {
				r, key := biz.request(w), w.newKey()
				_, errs[i] = idem.DoInTx(ctx, pool, r.scope, key, r.fp, r.run)
				keys[j] = replayKey{req: r, key: key}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("replay keys: %w", err)
	}
	return keys, nil
}

// prime plans every statement of biz's workloads on every connection of
// pool while the key table is nearly empty, as a service started on a
// freshly migrated table does: each runs more than five times, so
// PostgreSQL settles on the generic plan it then keeps on that connection
// until the table's statistics change, which for -stale's table they never
// do.
func prime(ctx context.Context, pool *pgxpool.Pool, biz *business) error {
	var conns []*pgxpool.Conn
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range pool.Config().MaxConns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return err
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		w := newWorker(&workload{biz: biz}, -5)
		w.db = c.Conn()
		r, key := biz.request(w), w.newKey()
		w.replay = []replayKey{{r, key}}
		if _, err := idem.DoInTx(ctx, w.db, r.scope, key, r.fp, r.run); err != nil {
			return fmt.Errorf("prime: %w", err)
		}
		for range 6 {
			for _, o := range ops {
				if err := o.op(ctx, w); err != nil {
					return fmt.Errorf("prime %s: %w", o.name, err)
				}
			}
		}
	}
	return nil
}

// commitCost times, on one connection, an autocommitted one-row INSERT (a
// commit that waits for its WAL flush) and SELECT 1 (a bare round trip):
// what two-tx's second commit costs depends on the first far more than on
// anything idem does.
func (b *bench) commitCost(ctx context.Context) (commit, roundTrip time.Duration, err error) {
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS bench_sync (v int)`); err != nil {
		return 0, 0, err
	}
	p50 := func(sql string) (time.Duration, error) {
		lat := make([]time.Duration, 0, 200)
		for range cap(lat) {
			t0 := time.Now()
			if _, err := conn.Exec(ctx, sql); err != nil {
				return 0, err
			}
			lat = append(lat, time.Since(t0))
		}
		slices.Sort(lat)
		return percentile(lat, 50), nil
	}
	if commit, err = p50(`INSERT INTO bench_sync VALUES (1)`); err != nil {
		return 0, 0, err
	}
	roundTrip, err = p50(`SELECT 1`)
	return commit, roundTrip, err
}
