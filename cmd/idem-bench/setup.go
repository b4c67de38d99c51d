package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/draw"
	"github.com/pgidem/idem/internal/pgserver"
)

// Schemas of the scale workloads. Each holds its own idem_keys, created by
// idem.Migrate through a pool whose search_path starts with the schema, so
// the table, its indexes and its fillfactor are exactly idem's; the draw
// tables stay in public.
const (
	schemaEmpty = "scale_empty"
	schemaFull  = "scale_full"
)

// bench is a prepared benchmark database and its pools.
type bench struct {
	o     options
	url   string        // the bench database
	pool  *pgxpool.Pool // public schema: the main workloads and the storm
	empty *pgxpool.Pool // search_path scale_empty, public
	full  *pgxpool.Pool // search_path scale_full, public

	replayKeys []replayKey // completed keys for the replay workload
	seq        *sequence   // suffixes of storm users

	pruneMu     sync.Mutex
	expiredLeft int // expired rows in scale_full not pruned yet
	refills     int // times expired rows were added again
	refillRows  int
}

// replayKey is a key that completed, with what a retry of it sends.
type replayKey struct {
	req request
	key string
}

type sequence struct {
	mu sync.Mutex
	n  int
}

func (s *sequence) next() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	return s.n
}

// setup recreates the bench database and fills it.
func setup(ctx context.Context, out io.Writer, srv *pgserver.Server, o options) (*bench, error) {
	t0 := time.Now()
	if err := checkConnections(ctx, srv, o); err != nil {
		fmt.Fprintln(out, "warning:", err)
	}
	if err := recreateDatabase(ctx, srv, o.database); err != nil {
		return nil, err
	}
	b := &bench{o: o, url: srv.DatabaseURL(o.database), seq: &sequence{}}

	setupPool, err := openPool(ctx, b.url, 4, "")
	if err != nil {
		return nil, err
	}
	defer setupPool.Close()
	if err := idem.Migrate(ctx, setupPool); err != nil {
		return nil, err
	}
	if err := draw.Setup(ctx, setupPool); err != nil {
		return nil, err
	}
	if err := loadDraw(ctx, setupPool, o); err != nil {
		return nil, err
	}
	for _, schema := range []string{schemaEmpty, schemaFull} {
		if err := migrateSchema(ctx, b.url, schema); err != nil {
			return nil, err
		}
	}
	fmt.Fprintf(out, "setup: %d wallets, %d boxes; loading %d keys (%d expired) into %s.idem_keys ...\n",
		o.users, o.boxes, o.scaleRows, o.pruneRows, schemaFull)
	tl := time.Now()
	if err := loadKeys(ctx, setupPool, schemaFull, 0, o.scaleRows, o.pruneRows, o.users); err != nil {
		return nil, err
	}
	b.expiredLeft = o.pruneRows
	for _, sql := range []string{
		"VACUUM ANALYZE " + schemaFull + ".idem_keys",
		"VACUUM ANALYZE wallets, boxes, prizes",
	} {
		if _, err := setupPool.Exec(ctx, sql); err != nil {
			return nil, fmt.Errorf("%s: %w", sql, err)
		}
	}
	var size string
	if err := setupPool.QueryRow(ctx,
		`SELECT pg_size_pretty(pg_total_relation_size('`+schemaFull+`.idem_keys'))`).Scan(&size); err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "setup: keys loaded and vacuumed in %s (%s with indexes)\n", time.Since(tl).Round(100*time.Millisecond), size)

	maxConns := int32(max(o.workers+4, o.storm+2))
	if b.pool, err = openPool(ctx, b.url, maxConns, ""); err != nil {
		return nil, err
	}
	if b.empty, err = openPool(ctx, b.url, int32(o.workers+2), schemaEmpty); err != nil {
		b.pool.Close()
		return nil, err
	}
	if b.full, err = openPool(ctx, b.url, int32(o.workers+2), schemaFull); err != nil {
		b.pool.Close()
		b.empty.Close()
		return nil, err
	}
	if err := b.makeReplayKeys(ctx); err != nil {
		return nil, err
	}
	if err := b.analyze(ctx); err != nil {
		return nil, err
	}
	for _, p := range []*pgxpool.Pool{b.pool, b.empty, b.full} {
		if err := b.warmConns(ctx, p); err != nil {
			return nil, err
		}
	}
	// Start the measurements from a clean checkpoint rather than in the
	// middle of the one the load triggered. Needs superuser or
	// pg_checkpoint; without it the run just goes on.
	_, _ = setupPool.Exec(ctx, "CHECKPOINT")
	fmt.Fprintf(out, "setup: done in %s\n\n", time.Since(t0).Round(100*time.Millisecond))
	return b, nil
}

// analyze does what autovacuum's ANALYZE would do on a server that runs it
// (this project's test server does not): it refreshes the statistics of the
// tables the workloads write, which also makes every connection plan its
// prepared statements again. Without it, a statement first planned while
// idem_keys was nearly empty keeps a generic plan with a sequential scan,
// and every later call scans the whole, grown table. It runs between slots,
// unmeasured.
func (b *bench) analyze(ctx context.Context) error {
	_, err := b.pool.Exec(ctx, "ANALYZE idem_keys, "+schemaEmpty+".idem_keys, draw_batches, inventory, point_ledger")
	if err != nil {
		return fmt.Errorf("analyze: %w", err)
	}
	return nil
}

// close closes the pools and drops the database unless -keep.
func (b *bench) close(ctx context.Context, srv *pgserver.Server, o options) {
	for _, p := range []*pgxpool.Pool{b.pool, b.empty, b.full} {
		if p != nil {
			p.Close()
		}
	}
	if o.keep {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{o.database}.Sanitize()+" WITH (FORCE)")
}

// checkConnections warns when the server may not have room for the pools.
func checkConnections(ctx context.Context, srv *pgserver.Server, o options) error {
	conn, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var limit, used int
	err = conn.QueryRow(ctx, `SELECT current_setting('max_connections')::int
		- current_setting('superuser_reserved_connections')::int,
		(SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')`).Scan(&limit, &used)
	if err != nil {
		return err
	}
	need := max(o.workers+4, o.storm+2) + 2*(o.workers+2) + 6
	if used+need > limit {
		return fmt.Errorf("the benchmark opens up to %d connections; the server allows %d and %d are in use "+
			"(lower -storm or -workers, or raise max_connections)", need, limit, used)
	}
	return nil
}

func recreateDatabase(ctx context.Context, srv *pgserver.Server, name string) error {
	conn, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", srv.Source, err)
	}
	defer conn.Close(context.Background())
	ident := pgx.Identifier{name}.Sanitize()
	for _, sql := range []string{
		"DROP DATABASE IF EXISTS " + ident + " WITH (FORCE)",
		"CREATE DATABASE " + ident,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			return fmt.Errorf("%s: %w", sql, err)
		}
	}
	return nil
}

// openPool opens a pool of maxConns connections; a non-empty schema is put
// first on the search_path.
func openPool(ctx context.Context, url string, maxConns int32, schema string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	if schema != "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = schema + ", public"
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

// migrateSchema creates schema and runs idem.Migrate in it.
func migrateSchema(ctx context.Context, url, schema string) error {
	pool, err := openPool(ctx, url, 2, schema)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		return err
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		return fmt.Errorf("migrate schema %s: %w", schema, err)
	}
	var where string
	if err := pool.QueryRow(ctx, `SELECT schemaname FROM pg_tables WHERE tablename = 'idem_keys' AND schemaname = $1`,
		schema).Scan(&where); err != nil {
		return fmt.Errorf("migrate schema %s: idem_keys not created there: %w", schema, err)
	}
	return nil
}

// loadDraw creates the wallets, boxes and prizes: every user can afford
// every draw of the run, and no box runs out.
func loadDraw(ctx context.Context, pool *pgxpool.Pool, o options) error {
	for _, st := range []struct {
		sql string
		n   int
	}{
		{`INSERT INTO wallets (user_id, points)
		  SELECT 'u' || g, 1000000000000000 FROM generate_series(1, $1::int) g`, o.users},
		{`INSERT INTO boxes (id, name, price, stock)
		  SELECT 1000 + g, 'box ' || g, 1, 2000000000 FROM generate_series(1, $1::int) g`, o.boxes},
		{`INSERT INTO prizes (box_id, name, weight)
		  SELECT 1000 + g, p.name, p.weight FROM generate_series(1, $1::int) g,
		    (VALUES ('Golden Goose', 1), ('Silver Goose', 9), ('Goose Plush', 30), ('Goose Sticker', 60)) AS p (name, weight)`, o.boxes},
	} {
		if _, err := pool.Exec(ctx, st.sql, st.n); err != nil {
			return fmt.Errorf("load draw tables: %w", err)
		}
	}
	return nil
}

// loadKeys inserts n finished keys into schema.idem_keys server-side, the
// first expired of them already expired, in chunks. Keys are md5 strings, so
// they land all over the primary key like client UUIDs do; the response is
// shaped like a draw outcome.
func loadKeys(ctx context.Context, pool *pgxpool.Pool, schema string, from, n, expired, users int) error {
	const chunk = 250_000
	for lo := from; lo < from+n; lo += chunk {
		hi := min(lo+chunk, from+n)
		_, err := pool.Exec(ctx, `
			INSERT INTO `+schema+`.idem_keys (actor, operation, idem_key, fingerprint, status,
				response_status, response_headers, response_body, created_at, completed_at, expires_at)
			SELECT 'u' || (1 + g % $3::int), 'draw', md5('k' || g), sha256(('f' || g)::bytea), 'succeeded',
				201, '{"Content-Type": ["application/json"]}',
				convert_to('{"batch_id":' || g || ',"prizes":["Goose Sticker"],"points_spent":1,"points_left":999999999}', 'UTF8'),
				e - interval '24 hours', e - interval '24 hours', e
			FROM generate_series($1::int, $2::int - 1) g,
			LATERAL (SELECT CASE WHEN g < $4::int
				THEN now() - interval '1 hour' - g * interval '1 millisecond'
				ELSE now() + interval '1 hour' + (g % 86400) * interval '1 second' END) AS x (e)`,
			lo, hi, users, from+expired)
		if err != nil {
			return fmt.Errorf("load %s.idem_keys: %w", schema, err)
		}
	}
	return nil
}

// refillExpired adds another prune-rows expired keys to scale_full when
// the prune has used up most of them, so that every scale-prune slot has a
// prune running beside it. It runs between slots, unmeasured.
func (b *bench) refillExpired(ctx context.Context) error {
	b.pruneMu.Lock()
	defer b.pruneMu.Unlock()
	if b.o.pruneRows == 0 || b.expiredLeft > b.o.pruneRows/4 {
		return nil
	}
	from := b.o.scaleRows + b.refills*b.o.pruneRows + 1_000_000_000
	if err := loadKeys(ctx, b.full, schemaFull, from, b.o.pruneRows, b.o.pruneRows, b.o.users); err != nil {
		return err
	}
	b.refills++
	b.refillRows += b.o.pruneRows
	b.expiredLeft += b.o.pruneRows
	return nil
}

// makeReplayKeys completes o.replayKey keys with DoInTx, for the replay
// workload to send again.
func (b *bench) makeReplayKeys(ctx context.Context) error {
	n := b.o.replayKey
	keys := make([]replayKey, n)
	var wg sync.WaitGroup
	errs := make([]error, b.o.workers)
	for i := range b.o.workers {
		wg.Go(func() {
			w := newWorker(b, i, b.pool)
			for j := i; j < n; j += b.o.workers {
				r := w.newRequest()
				key := w.newKey()
				res, err := idem.DoInTx(ctx, b.pool, r.scope(), key, r.fp, r.execute)
				if err == nil && res.Replayed {
					err = fmt.Errorf("fresh key %s replayed", key)
				}
				if err != nil {
					errs[i] = fmt.Errorf("complete replay keys: %w", err)
					return
				}
				keys[j] = replayKey{req: r, key: key}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	b.replayKeys = keys
	return nil
}

// warmConns opens every connection of pool and runs a fresh draw and its
// replay on each, so the statements every workload uses are prepared on all
// of them before anything is measured.
func (b *bench) warmConns(ctx context.Context, pool *pgxpool.Pool) error {
	n := int(pool.Config().MaxConns)
	conns := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range n {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("warm connections: %w", err)
		}
		conns = append(conns, c)
	}
	w := newWorker(b, 1<<20, pool)
	for i, c := range conns {
		r := w.newRequest()
		key := "warm-" + strconv.Itoa(i) + "-" + w.newKey()
		for range 2 {
			if _, err := idem.DoInTx(ctx, c.Conn(), r.scope(), key, r.fp, r.execute); err != nil {
				return fmt.Errorf("warm connections: %w", err)
			}
		}
	}
	return nil
}
