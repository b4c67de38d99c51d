package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A workload is run for one slot of every round.
type workload struct {
	name string
	op   op
	pool *pgxpool.Pool
	// before runs unmeasured before each slot (nil: nothing).
	before func(ctx context.Context) error
	// beside runs beside the workers during the slot until its context is
	// done (nil: nothing), and reports what it did.
	beside func(ctx context.Context) besideStats
}

// besideStats is what ran beside a slot (the prune).
type besideStats struct {
	rows    int
	batches int
	busy    time.Duration
	lat     []time.Duration
	err     error
}

// slot is the measurement of one workload in one round.
type slot struct {
	ops     int
	errs    int
	err     error // the first error
	lat     []time.Duration
	elapsed time.Duration
	cpu     cpuUsage
	beside  besideStats
}

func (s slot) tps() float64 {
	if s.elapsed <= 0 {
		return 0
	}
	return float64(s.ops) / s.elapsed.Seconds()
}

// runSlot runs wl with n workers for d and measures it. Each worker runs
// transactions back to back; the slot ends when the last transaction that
// started before d ran out has finished, and the elapsed time includes it.
func (b *bench) runSlot(ctx context.Context, wl workload, n int, d time.Duration) (slot, error) {
	if wl.before != nil {
		if err := wl.before(ctx); err != nil {
			return slot{}, fmt.Errorf("%s: before: %w", wl.name, err)
		}
	}
	per := make([]slot, n)
	var wg sync.WaitGroup
	besideCtx, stopBeside := context.WithCancel(ctx)
	defer stopBeside()
	besideDone := make(chan besideStats, 1)
	pids, err := b.backendPIDs(ctx)
	if err != nil {
		return slot{}, err
	}
	srv0 := backendCPU(pids)
	cpu0 := readCPU()
	start := time.Now()
	deadline := start.Add(d)
	if wl.beside != nil {
		go func() { besideDone <- wl.beside(besideCtx) }()
	}
	for i := range n {
		wg.Go(func() {
			w := newWorker(b, i, wl.pool)
			s := &per[i]
			s.lat = make([]time.Duration, 0, 1024)
			for time.Now().Before(deadline) && ctx.Err() == nil {
				t0 := time.Now()
				err := wl.op(ctx, w)
				s.lat = append(s.lat, time.Since(t0))
				if err != nil {
					s.errs++
					if s.err == nil {
						s.err = err
					}
					continue
				}
				s.ops++
			}
		})
	}
	wg.Wait()
	out := slot{elapsed: time.Since(start)}
	out.cpu = readCPU().since(cpu0)
	out.cpu.server, out.cpu.serverOK = serverDelta(srv0, backendCPU(pids))
	if wl.beside != nil {
		stopBeside()
		out.beside = <-besideDone
	}
	for _, s := range per {
		out.ops += s.ops
		out.errs += s.errs
		if out.err == nil {
			out.err = s.err
		}
		out.lat = append(out.lat, s.lat...)
	}
	if ctx.Err() != nil {
		return out, ctx.Err()
	}
	return out, nil
}

// series is the slots of one workload over the rounds.
type series struct {
	name  string
	slots []slot
}

func (s *series) total() slot {
	var t slot
	for _, x := range s.slots {
		t.ops += x.ops
		t.errs += x.errs
		if t.err == nil {
			t.err = x.err
		}
		t.lat = append(t.lat, x.lat...)
		t.elapsed += x.elapsed
		t.cpu = t.cpu.add(x.cpu)
		t.beside.rows += x.beside.rows
		t.beside.batches += x.beside.batches
		t.beside.busy += x.beside.busy
		t.beside.lat = append(t.beside.lat, x.beside.lat...)
		if t.beside.err == nil {
			t.beside.err = x.beside.err
		}
	}
	slices.Sort(t.lat)
	slices.Sort(t.beside.lat)
	return t
}

// percentile returns the p-th percentile (0..100) of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p/100+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// measure warms up, counts round trips, runs the rounds and measures
// allocations, and returns the report.
func (b *bench) measure(ctx context.Context, out io.Writer) (*report, error) {
	o := b.o
	main := []workload{
		{name: "bare", op: opBare, pool: b.pool},
		{name: "floor", op: opFloor, pool: b.pool},
		{name: "do", op: opDo, pool: b.pool},
		{name: "doInTx", op: opDoInTx, pool: b.pool},
		{name: "replay", op: opReplay, pool: b.pool},
		{name: "two-tx", op: opTwoTx, pool: b.pool},
	}
	scale := []workload{
		{name: "scale-empty", op: opDo, pool: b.empty},
		{name: "scale-full", op: opDo, pool: b.full},
		{name: "scale-prune", op: opDo, pool: b.full, before: b.refillExpired, beside: b.prune},
	}
	if o.proto {
		main = append(main, b.protoWorkloads()...)
	}
	all := append(append([]workload{}, main...), scale...)
	const stormName = "storm"

	rep := &report{o: o, series: map[string]*series{}}
	for _, wl := range all {
		rep.order = append(rep.order, wl.name)
		rep.series[wl.name] = &series{name: wl.name}
	}

	fmt.Fprintf(out, "warm-up: every workload for %s ...\n", o.warmup)
	for _, wl := range all {
		s, err := b.runSlot(ctx, wl, o.workers, o.warmup)
		if err != nil {
			return nil, err
		}
		if s.err != nil {
			return nil, fmt.Errorf("warm-up %s: %d error(s), first: %w", wl.name, s.errs, s.err)
		}
	}
	if _, err := b.runStorm(ctx, o.warmup); err != nil {
		return nil, err
	}

	if err := b.analyze(ctx); err != nil {
		return nil, err
	}
	fmt.Fprintln(out, "calibration: round trips and statements per transaction, one connection ...")
	cal, err := b.calibrate(ctx, main)
	if err != nil {
		return nil, err
	}
	rep.calibration = cal
	if rep.sync, err = b.measureSync(ctx); err != nil {
		return nil, err
	}

	// The slots of a round, in an order that rotates from round to round,
	// so no workload always follows the same one.
	type entry struct {
		name string
		run  func() error
	}
	var entries []entry
	for _, wl := range all {
		entries = append(entries, entry{wl.name, func() error {
			s, err := b.runSlot(ctx, wl, o.workers, o.round)
			rep.series[wl.name].slots = append(rep.series[wl.name].slots, s)
			return err
		}})
	}
	entries = append(entries, entry{stormName, func() error {
		s, err := b.runStorm(ctx, o.round)
		rep.storm = append(rep.storm, s)
		return err
	}})
	for r := range o.rounds {
		if err := b.analyze(ctx); err != nil {
			return nil, err
		}
		t0 := time.Now()
		fmt.Fprintf(out, "round %d/%d:", r+1, o.rounds)
		for i := range entries {
			e := entries[(i+r)%len(entries)]
			if err := e.run(); err != nil {
				fmt.Fprintln(out)
				return nil, fmt.Errorf("round %d, %s: %w", r+1, e.name, err)
			}
			fmt.Fprintf(out, " %s", e.name)
		}
		fmt.Fprintf(out, " (%s)\n", time.Since(t0).Round(100*time.Millisecond))
	}

	fmt.Fprintln(out, "allocations: sequential calls with a trivial fn ...")
	if rep.allocs, err = b.measureAllocs(ctx); err != nil {
		return nil, err
	}
	rep.expiredLeft, rep.refillRows = b.expiredLeft, b.refillRows
	return rep, nil
}

// pruneBatch deletes up to 1000 expired, finished keys, oldest first, the
// way DESIGN.md asks pruning to work (small batches, never an in-flight
// key). The core has no prune yet; this is the benchmark's own.
const pruneBatch = `DELETE FROM idem_keys
WHERE (actor, operation, idem_key) IN (
	SELECT actor, operation, idem_key FROM idem_keys
	WHERE expires_at <= now() AND status <> 'processing'
	ORDER BY expires_at
	LIMIT 1000
	FOR UPDATE SKIP LOCKED)`

// prune deletes expired keys from scale_full in batches, back to back,
// until ctx is done or none are left. A batch that has started is finished
// rather than cancelled.
func (b *bench) prune(ctx context.Context) besideStats {
	var st besideStats
	t0 := time.Now()
	for ctx.Err() == nil {
		ts := time.Now()
		tag, err := b.full.Exec(context.WithoutCancel(ctx), pruneBatch)
		if err != nil {
			st.err = err
			break
		}
		st.lat = append(st.lat, time.Since(ts))
		st.rows += int(tag.RowsAffected())
		st.batches++
		b.pruneMu.Lock()
		b.expiredLeft -= int(tag.RowsAffected())
		b.pruneMu.Unlock()
		if tag.RowsAffected() == 0 {
			break
		}
	}
	st.busy = time.Since(t0)
	return st
}

// backendPIDs lists the server processes of the bench database's
// connections.
func (b *bench) backendPIDs(ctx context.Context) ([]int32, error) {
	rows, _ := b.pool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()`)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("list backends: %w", err)
	}
	return pids, nil
}
