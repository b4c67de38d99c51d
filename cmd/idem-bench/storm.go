package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// stormSlot is the storm's measurement in one round.
type stormSlot struct {
	keys       int
	execs      []int // per key: draws the database holds for the key's user
	winners    int   // calls that ran fn and committed, summed over keys
	fnCalls    int   // calls of fn, summed over keys (a rolled-back call counts too)
	badKeys    int   // keys where anything but one execution and identical replays happened
	inProgress int   // calls that gave up waiting (ErrInProgress)
	errs       int
	err        error // the first unexpected error
	winnerLat  []time.Duration
	loserLat   []time.Duration
	soloLat    []time.Duration // single DoInTx executions, one at a time
	stormTime  time.Duration   // wall time of the storms (the single executions excluded)
	stormCPU   cpuUsage
}

// runStorm spends a quarter of d on single executions, one at a time (the
// reference latency), and the rest on storms: o.storm goroutines send the
// same fresh key at once, key after key. Every key's user is new, so the
// database itself says how often the draw ran.
func (b *bench) runStorm(ctx context.Context, d time.Duration) (stormSlot, error) {
	var s stormSlot
	start := time.Now()
	w := newWorker(b, 1<<21, b.pool)
	for soloEnd := start.Add(d / 4); time.Now().Before(soloEnd) || len(s.soloLat) < 3; {
		t0 := time.Now()
		if err := opDoInTx(ctx, w); err != nil {
			return s, fmt.Errorf("storm: single execution: %w", err)
		}
		s.soloLat = append(s.soloLat, time.Since(t0))
	}
	pids, err := b.backendPIDs(ctx)
	if err != nil {
		return s, err
	}
	srv0 := backendCPU(pids)
	t0, cpu0 := time.Now(), readCPU()
	for s.keys == 0 || time.Since(start) < d {
		if err := b.stormKey(ctx, w, &s); err != nil {
			return s, err
		}
	}
	s.stormTime, s.stormCPU = time.Since(t0), readCPU().since(cpu0)
	s.stormCPU.server, s.stormCPU.serverOK = serverDelta(srv0, backendCPU(pids))
	return s, nil
}

// stormCall is the outcome of one call in a storm.
type stormCall struct {
	res idem.Result
	err error
	lat time.Duration
}

func (b *bench) stormKey(ctx context.Context, w *worker, s *stormSlot) error {
	r := w.newRequest()
	r.user = "storm-" + strconv.Itoa(b.seq.next())
	if _, err := b.pool.Exec(ctx, `INSERT INTO wallets (user_id, points) VALUES ($1, 1000000000000000)`, r.user); err != nil {
		return fmt.Errorf("storm: add wallet: %w", err)
	}
	key := w.newKey()
	var fnCalls atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		fnCalls.Add(1)
		return r.execute(ctx, tx)
	}

	n := b.o.storm
	call := func(int) (idem.Result, error) { return idem.DoInTx(ctx, b.pool, r.scope(), key, r.fp, fn) }
	if b.o.stormSeparate {
		// One Client per goroutine, as from separate processes: no
		// in-process coalescing, the duplicates meet at the primary key.
		clients := make([]*idem.Client, n)
		for i := range clients {
			c, err := idem.New(idem.Config{})
			if err != nil {
				return err
			}
			clients[i] = c
		}
		call = func(i int) (idem.Result, error) { return clients[i].DoInTx(ctx, b.pool, r.scope(), key, r.fp, fn) }
	}
	calls := make([]stormCall, n)
	var ready, done sync.WaitGroup
	gate := make(chan struct{})
	var t0 time.Time
	for i := range n {
		ready.Add(1)
		done.Go(func() {
			ready.Done()
			<-gate
			res, err := call(i)
			calls[i] = stormCall{res: res, err: err, lat: time.Since(t0)}
		})
	}
	ready.Wait()
	t0 = time.Now()
	close(gate) // every call starts now
	done.Wait()
	if ctx.Err() != nil {
		return ctx.Err()
	}

	var execs int
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM draw_batches WHERE user_id = $1`, r.user).Scan(&execs); err != nil {
		return fmt.Errorf("storm: count draws: %w", err)
	}
	s.keys++
	s.execs = append(s.execs, execs)
	bad := execs != 1
	var body []byte
	winners := 0
	for _, c := range calls {
		switch {
		case errors.Is(c.err, idem.ErrInProgress):
			s.inProgress++
			continue
		case c.err != nil:
			s.errs++
			if s.err == nil {
				s.err = c.err
			}
			bad = true
			continue
		case !c.res.Replayed:
			winners++
			s.winnerLat = append(s.winnerLat, c.lat)
		default:
			s.loserLat = append(s.loserLat, c.lat)
		}
		if body == nil {
			body = c.res.Body
		} else if !bytes.Equal(body, c.res.Body) {
			bad = true
		}
	}
	s.winners += winners
	s.fnCalls += int(fnCalls.Load())
	if winners != 1 {
		bad = true
	}
	if bad {
		s.badKeys++
	}
	return nil
}
