package main

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// A workload runs one op over one business on one pool, for a slot of every
// round.
type workload struct {
	name   string
	biz    *business
	op     op
	pool   *pgxpool.Pool
	replay []replayKey
	// beside runs beside the workers until its context ends (the scale
	// run's Prune); nil: nothing.
	beside func(ctx context.Context) pruneStats
}

// slot is one workload's measurement in one round.
type slot struct {
	ops, errs int
	err       error // the first error
	lat       []time.Duration
	elapsed   time.Duration
	prune     pruneStats
}

func (s slot) tps() float64 {
	if s.elapsed <= 0 {
		return 0
	}
	return float64(s.ops) / s.elapsed.Seconds()
}

// runSlot runs wl with n workers for d. Each worker runs transactions back
// to back; the slot ends when the last one started before d has finished.
func runSlot(ctx context.Context, wl *workload, n int, d time.Duration) slot {
	per := make([]slot, n)
	besideCtx, stopBeside := context.WithCancel(ctx)
	besideDone := make(chan pruneStats, 1)
	if wl.beside != nil {
		go func() { besideDone <- wl.beside(besideCtx) }()
	}
	start := time.Now()
	deadline := start.Add(d)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			w, s := newWorker(wl, i), &per[i]
			for time.Now().Before(deadline) && ctx.Err() == nil {
				t0 := time.Now()
				err := wl.op(ctx, w)
				s.lat = append(s.lat, time.Since(t0))
				if err != nil {
					s.errs++
					s.err = cmp(s.err, err)
					continue
				}
				s.ops++
			}
		})
	}
	wg.Wait()
	out := slot{elapsed: time.Since(start)}
	stopBeside()
	if wl.beside != nil {
		out.prune = <-besideDone
	}
	for _, s := range per {
		out = out.add(s)
	}
	return out
}

// cmp keeps the first error.
func cmp(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

// add sums two slots' counts, latencies and prune figures.
func (s slot) add(x slot) slot {
	s.ops += x.ops
	s.errs += x.errs
	s.err = cmp(s.err, x.err)
	s.lat = append(s.lat, x.lat...)
	s.elapsed += x.elapsed
	s.prune.rows += x.prune.rows
	s.prune.lat = append(s.prune.lat, x.prune.lat...)
	s.prune.err = cmp(s.prune.err, x.prune.err)
	return s
}

// pruneStats is what idem.Prune did beside a slot.
type pruneStats struct {
	rows int64
	lat  []time.Duration // per call of one batch
	err  error
}

// pruneBeside calls idem.Prune for one batch of 1000 rows at a time, with
// pause between batches (0: back to back), until ctx ends or no expired key
// is left. A batch that has started finishes.
func pruneBeside(pool *pgxpool.Pool, pause time.Duration) func(ctx context.Context) pruneStats {
	return func(ctx context.Context) pruneStats {
		var st pruneStats
		for ctx.Err() == nil {
			t0 := time.Now()
			n, err := idem.Prune(context.WithoutCancel(ctx), pool, idem.PruneOptions{BatchSize: 1000, MaxBatches: 1})
			if err != nil {
				st.err = err
				break
			}
			st.lat = append(st.lat, time.Since(t0))
			if st.rows += n; n == 0 {
				break
			}
			if pause > 0 {
				select {
				case <-ctx.Done():
				case <-time.After(pause):
				}
			}
		}
		return st
	}
}

// percentile returns the p-th percentile (0..100) of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p/100+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// workloads lists what the rounds run, and completes the replay keys.
func (b *bench) workloads(ctx context.Context) ([]*workload, error) {
	type target struct {
		biz    *business
		pool   *pgxpool.Pool
		suffix string
	}
	targets := []target{{b.light, b.pool, ""}, {b.draw, b.pool, ""}}
	if b.o.stale {
		targets = []target{{b.light, b.pool, ""}, {b.light, b.stale, " stale"}}
	}
	var wls []*workload
	for _, t := range targets {
		for _, o := range ops {
			if o.name == "bare" && t.suffix != "" {
				continue // bare writes no key: one bare is enough
			}
			wl := &workload{name: t.biz.name + " " + o.name + t.suffix, biz: t.biz, op: o.op, pool: t.pool}
			if o.name == "replay" {
				var err error
				if wl.replay, err = makeReplayKeys(ctx, t.pool, t.biz, b.o.replayKeys, b.o.workers); err != nil {
					return nil, err
				}
			}
			wls = append(wls, wl)
		}
	}
	if b.o.scaleRows > 0 {
		wls = append(wls,
			&workload{name: "scale empty", biz: b.light, op: opDoInTx, pool: b.empty},
			&workload{name: "scale full+prune", biz: b.light, op: opDoInTx, pool: b.full, beside: pruneBeside(b.full, b.o.prunePause)})
	}
	return wls, nil
}

// measure warms up, runs the interleaved rounds and the allocation counts,
// and returns the report.
func (b *bench) measure(ctx context.Context, out io.Writer) (*report, error) {
	o := b.o
	wls, err := b.workloads(ctx)
	if err != nil {
		return nil, err
	}
	rep := &report{o: o, settings: b.settings, slots: map[string][]slot{}, storms: map[string]*stormStats{}}
	type entry struct {
		name string
		run  func(d time.Duration, keep bool) error
	}
	var entries []entry
	for _, wl := range wls {
		rep.order = append(rep.order, wl.name)
		entries = append(entries, entry{wl.name, func(d time.Duration, keep bool) error {
			s := runSlot(ctx, wl, o.workers, d)
			if keep {
				rep.slots[wl.name] = append(rep.slots[wl.name], s)
			}
			return ctx.Err()
		}})
	}
	if !o.stale {
		st := newStorm(b, o.storm)
		for _, biz := range []*business{b.light, b.draw} {
			rep.storms[biz.name] = &stormStats{}
			entries = append(entries, entry{"storm " + biz.name, func(d time.Duration, keep bool) error {
				if keep {
					return st.run(ctx, biz, d, rep.storms[biz.name])
				}
				return st.run(ctx, biz, d, &stormStats{})
			}})
		}
	}

	fmt.Fprintf(out, "warm-up: every workload for %s ...\n", o.warmup)
	for _, e := range entries {
		if err := e.run(o.warmup, false); err != nil {
			return nil, fmt.Errorf("warm-up %s: %w", e.name, err)
		}
	}
	if rep.commit, rep.roundTrip, err = b.commitCost(ctx); err != nil {
		return nil, fmt.Errorf("commit cost: %w", err)
	}
	for r := range o.rounds {
		if err := b.analyze(ctx); err != nil {
			return nil, err
		}
		t0 := time.Now()
		for i := range entries {
			e := entries[(i+r)%len(entries)] // rotate: no workload always follows the same one
			if err := e.run(o.round, true); err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", r+1, e.name, err)
			}
		}
		fmt.Fprintf(out, "round %d/%d (%s)\n", r+1, o.rounds, time.Since(t0).Round(100*time.Millisecond))
	}
	if o.latency == 0 { // the relay's own allocations would be counted too
		if rep.allocs, err = b.allocs(ctx); err != nil {
			return nil, fmt.Errorf("allocations: %w", err)
		}
	}
	rows, _ := b.pool.Query(ctx, `SELECT format('%s.idem_keys: %s rows, %s sequential scans reading %s rows, %s index scans',
			schemaname, n_live_tup, seq_scan, seq_tup_read, idx_scan)
		FROM pg_stat_user_tables WHERE relname = 'idem_keys' ORDER BY schemaname`)
	if rep.scans, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		return nil, err
	}
	if b.full != nil {
		if err := b.full.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE expires_at <= now()`).Scan(&rep.expiredLeft); err != nil {
			return nil, err
		}
	}
	return rep, nil
}
