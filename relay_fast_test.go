package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// openApp opens a pool on url whose connections carry application_name
// app, so that a test can find (and terminate) them.
func openApp(t *testing.T, url, app string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// terminateClaim terminates the connection of the relay's fast batch that
// holds the row lock of event id (billing), once its transaction is idle,
// retrying until it does or ctx ends. The backend is found by what it
// holds: the row's xmax is the id of the transaction that locked it, and
// that transaction's backend has it as backend_xid. Any other connection
// of the relay (the pruner's transaction, the LISTEN connection) is left
// alone. When the event has a lease instead (the fast batch's transaction
// committed before it was found), it says so (t.Errorf) and gives up.
func terminateClaim(ctx context.Context, t *testing.T, pool *pgxpool.Pool, id string) {
	for ctx.Err() == nil {
		var killed, leased bool
		if err := pool.QueryRow(context.Background(), `SELECT
				(SELECT count(pg_terminate_backend(a.pid)) > 0 FROM pg_stat_activity a
				 WHERE a.datname = current_database() AND a.application_name = 'relay'
				   AND a.state LIKE 'idle in transaction%' AND a.backend_xid = e.xmax),
				e.lease_until IS NOT NULL
			FROM idem_events e WHERE e.destination = 'billing' AND e.id = $1`, id).Scan(&killed, &leased); err != nil {
			t.Error(err)
			return
		}
		switch {
		case killed:
			return
		case leased:
			t.Errorf("%s has a lease: the transaction that locked it committed before the test found it", id)
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// With a fast sender, the relay claims by row locks only: each event is
// written once, by the record of its delivery (its token moved on once,
// no lease ever written), and its attempt is logged (time, duration).
func TestRelayFastPathWritesOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	const events = 120
	var evs []idem.Event
	for i := range events {
		evs = append(evs, event(i))
	}
	publish(t, pool, evs...)
	c := newCounter(nil)
	opts := fastRelay(c)
	opts.BatchSize = 50
	runRelay(t, pool, opts)
	for i := range events {
		rec := waitStatus(t, pool, event(i).ID, "billing", idem.EventDelivered)
		if c.count(event(i).ID) != 1 || rec.AttemptCount != 1 || len(rec.Attempts) != 1 || rec.Attempts[0].Attempt != 1 ||
			rec.Attempts[0].StartedAt.IsZero() || rec.Attempts[0].Error != "" {
			t.Fatalf("event %d, sent %d times: %+v", i, c.count(event(i).ID), rec)
		}
	}
	var claims, leased int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE claim = 1), count(*) FILTER (WHERE lease_until IS NOT NULL)
		FROM idem_events`).Scan(&claims, &leased); err != nil {
		t.Fatal(err)
	}
	if claims != events || leased != 0 {
		t.Fatalf("%d of %d events written once (token 1), %d leased; want all, none", claims, events, leased)
	}
	if _, attempts := countEvents(t, pool); attempts != 0 {
		t.Fatalf("%d attempt rows; want none (deliveries at the first attempt)", attempts)
	}
}

// A send that outlives the fast path's bound gets a lease, written while
// it runs: another relay does not send the event meanwhile, and the send's
// outcome is recorded under the lease. The other events of its batch are
// delivered once.
func TestRelayFastPathLeasesSlowSends(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	pool := openApp(t, url, "test")
	const events = 20
	var evs []idem.Event
	for i := range events {
		evs = append(evs, event(i))
	}
	publish(t, pool, evs...)

	// ev-3 blocks until the test has seen its lease and run a second relay
	// beside the first.
	slow, release := make(chan struct{}), make(chan struct{})
	c := newCounter(func(d idem.Delivery) error {
		if d.Event.ID == "ev-3" && d.Attempt == 1 {
			close(slow)
			<-release
		}
		return nil
	})
	opts := fastRelay(c)
	opts.AttemptTimeout, opts.Lease = time.Minute, 2*time.Minute
	runRelay(t, openApp(t, url, "relay-1"), opts)
	<-slow
	deadline := time.Now().Add(30 * time.Second)
	for {
		var leased bool
		if err := pool.QueryRow(ctx, `SELECT lease_until IS NOT NULL FROM idem_events WHERE id = 'ev-3'`).Scan(&leased); err != nil {
			t.Fatal(err)
		}
		if leased {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the slow send got no lease")
		}
		time.Sleep(5 * time.Millisecond)
	}
	runRelay(t, openApp(t, url, "relay-2"), opts)
	for i := range events {
		if i != 3 {
			waitStatus(t, pool, event(i).ID, "billing", idem.EventDelivered)
		}
	}
	close(release)
	rec := waitStatus(t, pool, "ev-3", "billing", idem.EventDelivered)
	if rec.AttemptCount != 1 || len(rec.Attempts) != 1 || rec.Attempts[0].Error != "" {
		t.Fatalf("the slow event: %+v", rec)
	}
	for i := range events {
		if n := c.count(event(i).ID); n != 1 {
			t.Fatalf("event %d sent %d times", i, n)
		}
	}
}

// The connection that holds a fast batch's locks is terminated while a
// send runs: the send is cut (its ctx ends) once the relay finds its
// transaction gone, the attempt is logged as cut, and the event is sent
// again and delivered.
func TestRelayFastPathLostConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	pool := openApp(t, url, "test")
	publish(t, pool, event(1))
	c := newCounter(nil)
	cut := make(chan error, 1)
	send := idem.SenderFunc(func(sctx context.Context, d idem.Delivery) error {
		if d.Attempt > 1 {
			return c.Send(sctx, d)
		}
		// The relay's transaction is idle while the Sender runs (and
		// the batch waits for it up to its bound, long here).
		terminateClaim(sctx, t, pool, d.Event.ID)
		<-sctx.Done()
		select {
		case cut <- sctx.Err():
		default:
		}
		return sctx.Err()
	})
	opts := fastRelay(send)
	opts.AttemptTimeout, opts.Lease = time.Minute, 2*time.Minute
	r, err := idem.NewRelay(openApp(t, url, "relay"), opts)
	if err != nil {
		t.Fatal(err)
	}
	idem.SetFastBound(r, 2*time.Second)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	defer func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run: %v", err)
		}
	}()
	rec := waitStatus(t, pool, event(1).ID, "billing", idem.EventDelivered)
	if err := <-cut; !errors.Is(err, context.Canceled) {
		t.Fatalf("the first send ended with %v, want context.Canceled (cut by the relay)", err)
	}
	if rec.AttemptCount != 2 || len(rec.Attempts) != 2 || !strings.HasPrefix(rec.Attempts[0].Error, "relay lost its claim: ") ||
		rec.Attempts[1].Error != "" || c.count(event(1).ID) != 1 {
		t.Fatalf("after the lost connection: %+v (sent again %d times)", rec, c.count(event(1).ID))
	}
}

// A fast batch's transaction holds two batches: the second is locked while
// the first's sends run, and sent while the first's records are written.
// The connection is terminated while the second batch's send runs: the
// first batch's records, which went down with the transaction, are written
// again on their own (each event sent once, delivered at its first
// attempt), and the cut send is logged and sent again.
func TestRelayFastPathLostConnectionAfterTwoBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	pool := openApp(t, url, "test")
	// Two transactions, so the first batch (BatchSize 5) is ev-0..4.
	publish(t, pool, event(0), event(1), event(2), event(3), event(4))
	publish(t, pool, event(5), event(6), event(7), event(8), event(9))
	c := newCounter(nil)
	cut := make(chan error, 1)
	send := idem.SenderFunc(func(sctx context.Context, d idem.Delivery) error {
		if d.Event.ID != "ev-7" || d.Attempt > 1 {
			return c.Send(sctx, d)
		}
		// The relay's transaction, which holds ev-7's lock, is idle once
		// the first batch's records are sent into it; terminate it then
		// (and no other connection of the relay: not the pruner's
		// transaction, which runs as the relay starts).
		terminateClaim(sctx, t, pool, d.Event.ID)
		<-sctx.Done()
		select {
		case cut <- sctx.Err():
		default:
		}
		return sctx.Err()
	})
	opts := fastRelay(send)
	opts.BatchSize, opts.Workers = 5, 2
	opts.AttemptTimeout, opts.Lease = time.Minute, 2*time.Minute
	r, err := idem.NewRelay(openApp(t, url, "relay"), opts)
	if err != nil {
		t.Fatal(err)
	}
	idem.SetFastBound(r, 2*time.Second)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	defer func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run: %v", err)
		}
	}()
	rec := waitStatus(t, pool, "ev-7", "billing", idem.EventDelivered)
	if err := <-cut; !errors.Is(err, context.Canceled) {
		t.Fatalf("the first send of ev-7 ended with %v, want context.Canceled (cut by the relay)", err)
	}
	if rec.AttemptCount != 2 || len(rec.Attempts) != 2 || !strings.HasPrefix(rec.Attempts[0].Error, "relay lost its claim: ") ||
		rec.Attempts[1].Error != "" || c.count("ev-7") != 1 {
		t.Fatalf("ev-7 after the lost connection: %+v (sent again %d times)", rec, c.count("ev-7"))
	}
	for i := range 10 {
		if i == 7 {
			continue
		}
		rec := waitStatus(t, pool, event(i).ID, "billing", idem.EventDelivered)
		if n := c.count(event(i).ID); n != 1 || rec.AttemptCount != 1 || len(rec.Attempts) != 1 || rec.Attempts[0].Error != "" {
			t.Fatalf("event %d, sent %d times: %+v", i, n, rec)
		}
	}
}

// Run's ctx ending while a full batch's sends run, the next batch locked
// ahead meanwhile: the sends that finished are recorded, each event written
// once, by its delivery, and a relay started afterwards sends the rest,
// nothing twice. (The lock ahead is read to the end rather than cut, so the
// transaction ends with its COMMIT; cut, it broke the connection and the
// records were written on their own, to the same end: this test passes
// both ways and guards the outcome, not the route.)
func TestRelayFastPathStopMidBatch(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, idem.Migrate)
	const events = 250
	evs := make([]idem.Event, events)
	for i := range evs {
		evs[i] = event(i)
	}
	publish(t, pool, evs...)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var sent atomic.Int32
	c := newCounter(func(idem.Delivery) error {
		if sent.Add(1) == 10 { // in the first batch of 100, the next one locked ahead
			cancel()
		}
		return nil
	})
	opts := fastRelay(c)
	opts.BatchSize = 100
	r, err := idem.NewRelay(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Run(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v, want context.Canceled", err)
	}
	first := 0
	for i := range events {
		if c.count(event(i).ID) == 0 {
			continue
		}
		first++
		var status string
		var claim int64
		if err := pool.QueryRow(context.Background(), `SELECT status, claim FROM idem_events WHERE id = $1`,
			event(i).ID).Scan(&status, &claim); err != nil {
			t.Fatal(err)
		}
		if status != "delivered" || claim != 1 {
			t.Errorf("event %d, sent before the stop: %s, claim %d; want delivered, written once (claim 1)", i, status, claim)
		}
	}
	if first < 10 {
		t.Fatalf("%d events sent before the stop, want at least 10", first)
	}
	runRelay(t, pool, fastRelay(c))
	for i := range events {
		waitStatus(t, pool, event(i).ID, "billing", idem.EventDelivered)
		if n := c.count(event(i).ID); n != 1 {
			t.Errorf("event %d sent %d times", i, n)
		}
	}
}
