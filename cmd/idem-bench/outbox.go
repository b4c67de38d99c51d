package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	idemdb "github.com/pgidem/idem/internal/db"
)

// The outbox run (-relay): idem's Relay against a hand-written FOR UPDATE
// SKIP LOCKED poller with the same no-op sender, in interleaved rounds
// (throughput: events delivered per second from a backlog); commit-to-send
// at idle with LISTEN/NOTIFY; and the claim's plan with -relay-pending
// pending events.

// Goals of the outbox run (issue 32).
const (
	relayGoalRatio   = 0.9                   // the relay's throughput over the poller's, at least
	relayGoalLatency = 20 * time.Millisecond // commit-to-send median at idle, at most
)

// runOutbox measures the outbox and returns how many checks failed.
func (b *bench) runOutbox(ctx context.Context, out io.Writer) (int, error) {
	o := b.o
	pool, err := b.open(ctx, int32(o.workers+4), "")
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	fmt.Fprintf(out, "\noutbox: %d rounds of %d backlogged events, relay (Workers %d, BatchSize %d) against a SKIP LOCKED poller (%d loops, batch %d), no-op sender\n",
		o.relayRounds, o.relayEvents, o.workers, relayBatch, relayPollers, relayBatch)
	failures := 0
	var ratios []float64
	for round := range o.relayRounds {
		contenders := []string{"relay", "poller"}
		if round%2 == 1 {
			slices.Reverse(contenders)
		}
		rate := map[string]float64{}
		for _, c := range contenders {
			if err := fillBacklog(ctx, pool, o.relayEvents, fmt.Sprintf("r%d-%s", round, c)); err != nil {
				return 0, err
			}
			var elapsed time.Duration
			var sent int64
			if c == "relay" {
				elapsed, sent, err = drainWithRelay(ctx, pool, o.workers, o.relayEvents)
			} else {
				elapsed, sent, err = drainWithPoller(ctx, pool, o.relayEvents)
			}
			if err != nil {
				return 0, err
			}
			if sent != int64(o.relayEvents) {
				fmt.Fprintf(out, "FAIL %s sent %d events, want %d\n", c, sent, o.relayEvents)
				failures++
			}
			rate[c] = float64(o.relayEvents) / elapsed.Seconds()
		}
		ratios = append(ratios, rate["relay"]/rate["poller"])
		fmt.Fprintf(out, "round %d: relay %.0f events/s, poller %.0f events/s, ratio %.2f\n", round+1, rate["relay"], rate["poller"], ratios[len(ratios)-1])
	}
	slices.Sort(ratios)
	ratio := ratios[len(ratios)/2]
	fmt.Fprintf(out, "%s relay throughput / poller's: median %.2f (goal at least %.2f)\n", verdict(ratio >= relayGoalRatio), ratio, relayGoalRatio)

	lat, err := commitToSend(ctx, pool, o.relayLatencyEvents)
	if err != nil {
		return 0, err
	}
	fmt.Fprintf(out, "%s commit-to-send at idle with LISTEN: median %s, p90 %s, max %s over %d events (goal median at most %s)\n",
		verdict(percentile(lat, 50) <= relayGoalLatency), percentile(lat, 50).Round(10*time.Microsecond),
		percentile(lat, 90).Round(10*time.Microsecond), lat[len(lat)-1].Round(10*time.Microsecond), len(lat), relayGoalLatency)

	plans, took, err := claimPlan(ctx, pool, o.relayPending)
	if err != nil {
		return 0, err
	}
	indexed := true
	for _, p := range plans {
		indexed = indexed && strings.Contains(p, "idem_events_due_idx") && !strings.Contains(p, "Seq Scan")
	}
	plan := strings.Join(plans, "\n")
	if !indexed {
		failures++
	}
	fmt.Fprintf(out, "%s claim of %d with %d pending events: %s, %s\n", map[bool]string{true: "ok  ", false: "FAIL"}[indexed],
		relayBatch, o.relayPending, map[bool]string{true: "walks idem_events_due_idx", false: "does not walk idem_events_due_idx"}[indexed],
		took.Round(10*time.Microsecond))
	if !indexed {
		fmt.Fprintln(out, plan)
	}
	return failures, nil
}

// Sizes of the outbox run.
const (
	relayBatch   = 100 // BatchSize of the relay, batch of the poller
	relayPollers = 1   // the poller: one loop, as a hand-written one
)

// verdict is a speed goal's mark: a miss is reported, never a failure.
func verdict(ok bool) string {
	if ok {
		return "ok  "
	}
	return "MISS"
}

// fillBacklog empties the outbox and fills it with n pending events.
func fillBacklog(ctx context.Context, pool *pgxpool.Pool, n int, prefix string) error {
	err := execSQL(ctx, pool, `TRUNCATE idem_events, idem_event_attempts;
		INSERT INTO idem_events (destination, id, topic, payload)
		SELECT 'dest-' || (g % 50), '`+prefix+`-' || g, 'bench.event', '{"n":1}'::bytea FROM generate_series(1, `+fmt.Sprint(n)+`) g`)
	if err != nil {
		return err
	}
	return execSQL(ctx, pool, `VACUUM ANALYZE idem_events`)
}

// drainWithRelay runs a Relay until it has sent n events and recorded them.
func drainWithRelay(ctx context.Context, pool *pgxpool.Pool, workers, n int) (time.Duration, int64, error) {
	var sent atomic.Int64
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r, err := idem.NewRelay(pool, idem.RelayOptions{BatchSize: relayBatch, Workers: workers, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler),
		Sender: idem.SenderFunc(func(context.Context, idem.Delivery) error {
			if sent.Add(1) == int64(n) {
				cancel() // Run records what it sent, then returns
			}
			return nil
		})})
	if err != nil {
		return 0, 0, err
	}
	t0 := time.Now()
	_ = r.Run(rctx)
	elapsed := time.Since(t0)
	if ctx.Err() != nil {
		return 0, 0, ctx.Err()
	}
	var pending int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_events WHERE status <> 'delivered'`).Scan(&pending); err != nil {
		return 0, 0, err
	}
	if pending > 0 {
		return 0, 0, fmt.Errorf("relay: %d events not recorded delivered after Run", pending)
	}
	return elapsed, sent.Load(), nil
}

// drainWithPoller is the hand-written poller: relayPollers loops, each
// claiming a batch with FOR UPDATE SKIP LOCKED, sending it, and marking it
// delivered, in one transaction per batch, until the outbox is empty.
func drainWithPoller(ctx context.Context, pool *pgxpool.Pool, n int) (time.Duration, int64, error) {
	var sent atomic.Int64
	send := func(context.Context, idem.Delivery) error { sent.Add(1); return nil }
	t0 := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, relayPollers)
	for range relayPollers {
		wg.Go(func() {
			for {
				var got int
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					rows, err := tx.Query(ctx, `SELECT destination, id, topic, payload, header FROM idem_events
						WHERE status = 'pending' AND next_attempt_at <= now()
						ORDER BY next_attempt_at LIMIT $1 FOR UPDATE SKIP LOCKED`, relayBatch)
					if err != nil {
						return err
					}
					var dests, ids []string
					var evs []idem.Event
					for rows.Next() {
						var ev idem.Event
						if err := rows.Scan(&ev.Destination, &ev.ID, &ev.Topic, &ev.Payload, &ev.Header); err != nil {
							return err
						}
						evs = append(evs, ev)
					}
					if err := rows.Err(); err != nil {
						return err
					}
					for _, ev := range evs {
						if err := send(ctx, idem.Delivery{Event: ev, Attempt: 1}); err != nil {
							return err
						}
						dests, ids = append(dests, ev.Destination), append(ids, ev.ID)
					}
					got = len(evs)
					if got == 0 {
						return nil
					}
					_, err = tx.Exec(ctx, `UPDATE idem_events e SET status = 'delivered', delivered_at = now(), attempts = attempts + 1
						FROM unnest($1::text[], $2::text[]) AS d (destination, id)
						WHERE e.destination = d.destination AND e.id = d.id`, dests, ids)
					return err
				})
				if err != nil {
					errs <- err
					return
				}
				if got == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(t0)
	close(errs)
	if err := <-errs; err != nil {
		return 0, 0, err
	}
	return elapsed, sent.Load(), nil
}

// commitToSend publishes n events one at a time, at idle, to a relay that
// listens, and returns the times from the start of each COMMIT to the
// Sender's call, sorted.
func commitToSend(ctx context.Context, pool *pgxpool.Pool, n int) ([]time.Duration, error) {
	if err := execSQL(ctx, pool, `TRUNCATE idem_events, idem_event_attempts`); err != nil {
		return nil, err
	}
	var mu sync.Mutex
	sentAt := map[string]time.Time{}
	got := make(chan struct{}, 1)
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r, err := idem.NewRelay(pool, idem.RelayOptions{Logger: slog.New(slog.DiscardHandler),
		Sender: idem.SenderFunc(func(_ context.Context, d idem.Delivery) error {
			mu.Lock()
			sentAt[d.Event.ID] = time.Now()
			mu.Unlock()
			got <- struct{}{}
			return nil
		})})
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(rctx) }()
	defer func() { cancel(); <-done }()
	time.Sleep(200 * time.Millisecond) // the relay listens
	var lat []time.Duration
	for i := range n {
		id := fmt.Sprintf("lat-%d", i)
		tx, err := pool.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if err := idem.Publish(ctx, tx, idem.Event{ID: id, Topic: "bench.event", Destination: "dest", Payload: []byte(`{}`)}); err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		t0 := time.Now()
		if err := tx.Commit(ctx); err != nil {
			return nil, err
		}
		select {
		case <-got:
		case <-time.After(10 * time.Second):
			return nil, fmt.Errorf("commit-to-send: %s not sent within 10s", id)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		mu.Lock()
		lat = append(lat, sentAt[id].Sub(t0))
		mu.Unlock()
		time.Sleep(20 * time.Millisecond) // idle between events
	}
	slices.Sort(lat)
	return lat, nil
}

// claimPlan fills the outbox with pending events and returns the plans of
// one claim of each path (EXPLAIN ANALYZE, in a transaction rolled back)
// and how long the slower took.
func claimPlan(ctx context.Context, pool *pgxpool.Pool, pending int) ([]string, time.Duration, error) {
	if err := fillBacklog(ctx, pool, pending, "pending"); err != nil {
		return nil, 0, err
	}
	// The lease path's claim, then the fast path's locks (Relay: the one
	// ahead leaves out the batch before, here 100 row versions), each in a
	// transaction rolled back.
	var skip []string
	for i := range relayBatch {
		skip = append(skip, fmt.Sprintf("(%d,%d)", i/50, i%50+1))
	}
	var plans []string
	var took time.Duration
	for _, q := range []struct {
		sql  string
		args []any
	}{{idemdb.EventClaim, []any{time.Minute.Microseconds(), int32(relayBatch)}}, {idemdb.EventLock, []any{int32(relayBatch)}},
		{idemdb.EventLockAhead, []any{skip, int32(relayBatch)}}} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			t0 := time.Now()
			rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, COSTS off) "+q.sql, q.args...)
			if err == nil {
				var plan []string
				plan, err = pgx.CollectRows(rows, pgx.RowTo[string])
				plans = append(plans, strings.Join(plan, "\n"))
			}
			took = max(took, time.Since(t0))
			if err != nil {
				return err
			}
			return errRollback
		})
		if err != nil && err != errRollback {
			return nil, 0, err
		}
	}
	return plans, took, execSQL(ctx, pool, `TRUNCATE idem_events, idem_event_attempts`)
}

// errRollback rolls back claimPlan's transaction.
var errRollback = fmt.Errorf("rollback")
