package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/pgidem/idem"
)

// storm sends n same-key DoInTx calls at once, each from its own
// idem.Client, so they meet at the primary key as from separate processes
// (a Client coalesces its own same-key calls in the process).
type storm struct {
	b       *bench
	clients []*idem.Client
	seq     int // fresh actors created so far
}

func newStorm(b *bench, n int) *storm {
	s := &storm{b: b}
	for range n {
		c, err := idem.New(idem.Config{})
		if err != nil {
			panic(err) // the zero Config is valid
		}
		s.clients = append(s.clients, c)
	}
	return s
}

// stormStats is the storm's measurement of one business.
type stormStats struct {
	keys, badKeys, inProgress, errs int
	minExec, maxExec                int
	err                             error
	single, winners, losers         []time.Duration
}

// run spends a quarter of d on single DoInTx executions one at a time (the
// reference latency) and the rest on storms, key after key. Every key has
// an actor of its own, so the database says how often the business
// transaction committed for it.
func (s *storm) run(ctx context.Context, biz *business, d time.Duration, st *stormStats) error {
	start, keys := time.Now(), st.keys
	w := newWorker(&workload{biz: biz, pool: s.b.pool}, -3)
	for n := 0; time.Since(start) < d/4 || n < 3; n++ {
		t0 := time.Now()
		if err := opDoInTx(ctx, w); err != nil {
			return fmt.Errorf("storm: single execution: %w", err)
		}
		st.single = append(st.single, time.Since(t0))
	}
	for st.keys == keys || time.Since(start) < d {
		if err := s.key(ctx, biz, w, st); err != nil {
			return err
		}
	}
	return nil
}

// key runs one storm: every client calls DoInTx with the same fresh key at
// once.
func (s *storm) key(ctx context.Context, biz *business, w *worker, st *stormStats) error {
	s.seq++
	r, executions, err := biz.fresh(ctx, s.b.pool, s.seq)
	if err != nil {
		return fmt.Errorf("storm: new actor: %w", err)
	}
	key := w.newKey()
	type call struct {
		res idem.Result
		err error
		lat time.Duration
	}
	calls := make([]call, len(s.clients))
	gate := make(chan struct{})
	var ready, done sync.WaitGroup
	var t0 time.Time
	for i, c := range s.clients {
		ready.Add(1)
		done.Go(func() {
			ready.Done()
			<-gate
			res, err := c.DoInTx(ctx, s.b.pool, r.scope, key, r.fp, r.run)
			calls[i] = call{res, err, time.Since(t0)}
		})
	}
	ready.Wait()
	t0 = time.Now()
	close(gate)
	done.Wait()
	if ctx.Err() != nil {
		return ctx.Err()
	}

	n, err := executions(ctx)
	if err != nil {
		return fmt.Errorf("storm: count executions: %w", err)
	}
	if st.keys == 0 {
		st.minExec, st.maxExec = n, n
	}
	st.keys++
	st.minExec, st.maxExec = min(st.minExec, n), max(st.maxExec, n)
	bad := n != 1
	var body []byte
	winners := 0
	for _, c := range calls {
		switch {
		case errors.Is(c.err, idem.ErrInProgress):
			st.inProgress++
			continue
		case c.err != nil:
			st.errs++
			st.err = cmp(st.err, c.err)
			bad = true
			continue
		case c.res.Replayed:
			st.losers = append(st.losers, c.lat)
		default:
			winners++
			st.winners = append(st.winners, c.lat)
		}
		if body == nil {
			body = c.res.Body
		} else if !bytes.Equal(body, c.res.Body) {
			bad = true
		}
	}
	if bad || winners != 1 {
		st.badKeys++
	}
	return nil
}

// sorted returns a sorted copy.
func sorted(d []time.Duration) []time.Duration {
	d = slices.Clone(d)
	slices.Sort(d)
	return d
}
