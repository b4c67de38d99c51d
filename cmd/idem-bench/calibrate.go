package main

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// calibration is what one transaction of a workload costs when it runs
// alone on one connection.
type calibration struct {
	name     string
	ops      int
	rts      float64 // round trips: writes to the socket, each answered before the next
	stmts    float64 // statements, BEGIN and COMMIT included
	prepares float64 // statements prepared (0 once the cache is warm)
	sent     float64 // bytes to the server
	recv     float64 // bytes from the server
	p50      time.Duration
}

// counters count what crosses the calibration connection.
type counters struct {
	writes, sent, recv, stmts, prepares atomic.Int64
}

type countingConn struct {
	net.Conn
	c *counters
}

func (c countingConn) Write(p []byte) (int, error) {
	c.c.writes.Add(1)
	n, err := c.Conn.Write(p)
	c.c.sent.Add(int64(n))
	return n, err
}

func (c countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.c.recv.Add(int64(n))
	return n, err
}

// counters is also the pgx tracer that counts statements.
func (c *counters) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.stmts.Add(1)
	return ctx
}
func (c *counters) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *counters) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (c *counters) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	c.stmts.Add(1)
}
func (c *counters) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
func (c *counters) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.prepares.Add(1)
	return ctx
}
func (c *counters) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

func (c *counters) reset() {
	for _, v := range []*atomic.Int64{&c.writes, &c.sent, &c.recv, &c.stmts, &c.prepares} {
		v.Store(0)
	}
}

// calibrate runs each workload alone on a single counted connection.
func (b *bench) calibrate(ctx context.Context, wls []workload) ([]calibration, error) {
	const warm, measured = 5, 30
	var c counters
	cfg, err := pgxpool.ParseConfig(b.url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 1
	dialer := &net.Dialer{KeepAlive: 5 * time.Minute}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countingConn{Conn: conn, c: &c}, nil
	}
	cfg.ConnConfig.Tracer = &c
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer pool.Close()

	var cals []calibration
	for _, wl := range wls {
		w := newWorker(b, 1<<22, pool)
		for range warm {
			if err := wl.op(ctx, w); err != nil {
				return nil, fmt.Errorf("calibrate %s: %w", wl.name, err)
			}
		}
		c.reset()
		lat := make([]time.Duration, 0, measured)
		for range measured {
			t0 := time.Now()
			if err := wl.op(ctx, w); err != nil {
				return nil, fmt.Errorf("calibrate %s: %w", wl.name, err)
			}
			lat = append(lat, time.Since(t0))
		}
		cal := calibration{name: wl.name, ops: measured}
		n := float64(measured)
		cal.rts = float64(c.writes.Load()) / n
		cal.stmts = float64(c.stmts.Load()) / n
		cal.prepares = float64(c.prepares.Load()) / n
		cal.sent = float64(c.sent.Load()) / n
		cal.recv = float64(c.recv.Load()) / n
		slices.Sort(lat)
		cal.p50 = percentile(lat, 50)
		cals = append(cals, cal)
	}
	return cals, nil
}

// syncCost is what a commit's WAL flush costs on this server, beside a bare
// round trip: the price of two-tx's second commit, which depends on the
// storage far more than anything idem does.
type syncCost struct {
	commit, roundTrip time.Duration
	settings          string
}

// measureSync times, on one connection, autocommitted one-row INSERTs
// (each commit waits for its WAL flush when synchronous_commit is on) and
// SELECT 1, and reads the server's commit settings.
func (b *bench) measureSync(ctx context.Context) (syncCost, error) {
	const n = 200
	var s syncCost
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return s, err
	}
	defer conn.Release()
	err = conn.QueryRow(ctx, `SELECT format('synchronous_commit %s, fsync %s, wal_sync_method %s, commit_delay %s',
		current_setting('synchronous_commit'), current_setting('fsync'),
		current_setting('wal_sync_method'), current_setting('commit_delay'))`).Scan(&s.settings)
	if err == nil {
		_, err = conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS bench_sync (v int)`)
	}
	if err != nil {
		return s, fmt.Errorf("sync cost: %w", err)
	}
	for _, m := range []struct {
		dst *time.Duration
		sql string
	}{{&s.commit, `INSERT INTO bench_sync VALUES (1)`}, {&s.roundTrip, `SELECT 1`}} {
		lat := make([]time.Duration, 0, n)
		for range n {
			t0 := time.Now()
			if _, err := conn.Exec(ctx, m.sql); err != nil {
				return s, fmt.Errorf("sync cost: %w", err)
			}
			lat = append(lat, time.Since(t0))
		}
		slices.Sort(lat)
		*m.dst = percentile(lat, 50)
	}
	return s, nil
}
