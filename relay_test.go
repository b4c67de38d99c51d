package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/outbox"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// counter is a Sender that counts the sends of each event id, failing
// them as fail says (nil: every send succeeds).
type counter struct {
	mu    sync.Mutex
	sends map[string]int
	fail  func(d idem.Delivery) error
}

func newCounter(fail func(idem.Delivery) error) *counter {
	return &counter{sends: map[string]int{}, fail: fail}
}

func (c *counter) Send(ctx context.Context, d idem.Delivery) error {
	c.mu.Lock()
	c.sends[d.Event.ID]++
	c.mu.Unlock()
	if c.fail != nil {
		return c.fail(d)
	}
	return nil
}

func (c *counter) count(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sends[id]
}

// fastRelay are relay options for tests: a short schedule and lease, and
// a short poll so that retries come quickly.
func fastRelay(s idem.Sender) idem.RelayOptions {
	return idem.RelayOptions{Sender: s, Schedule: []time.Duration{0, 5 * time.Millisecond, 5 * time.Millisecond, 5 * time.Millisecond},
		AttemptTimeout: 200 * time.Millisecond, Lease: time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler)}
}

// runRelay runs a relay on db until the returned stop is called (or the
// test ends), and fails the test if Run returns anything but ctx's error.
func runRelay(t *testing.T, db idem.Beginner, opts idem.RelayOptions) (stop func()) {
	t.Helper()
	r, err := idem.NewRelay(db, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v, want context.Canceled", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// publish publishes evs in one transaction on pool and commits it.
func publish(t *testing.T, pool *pgxpool.Pool, evs ...idem.Event) {
	t.Helper()
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		for _, ev := range evs {
			if err := idem.Publish(context.Background(), tx, ev); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// event is a test event.
func event(i int) idem.Event {
	return idem.Event{ID: fmt.Sprintf("ev-%d", i), Topic: "payment.succeeded", Destination: "billing",
		Payload: []byte(fmt.Sprintf(`{"n":%d}`, i)), Header: map[string][]string{"Content-Type": {"application/json"}}}
}

// waitStatus waits until the event (destination, id) has status want, and
// returns its record.
func waitStatus(t *testing.T, pool *pgxpool.Pool, id, destination string, want idem.EventStatus) idem.EventRecord {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		rec, err := idem.LookupEvent(context.Background(), pool, id, destination)
		if err == nil && rec.Status == want {
			return rec
		}
		if time.Now().After(deadline) {
			t.Fatalf("event %s: %+v, %v; want status %s", id, rec, err, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// countEvents counts the rows of idem_events and idem_event_attempts.
func countEvents(t *testing.T, pool *pgxpool.Pool) (events, attempts int) {
	t.Helper()
	err := pool.QueryRow(context.Background(),
		`SELECT (SELECT count(*) FROM idem_events), (SELECT count(*) FROM idem_event_attempts)`).Scan(&events, &attempts)
	if err != nil {
		t.Fatal(err)
	}
	return events, attempts
}

// An event published in a committed transaction is sent once, with what
// was published; one in a rolled-back transaction is never sent.
func TestPublishDeliversOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	var got sync.Map
	c := newCounter(nil)
	runRelay(t, pool, fastRelay(idem.SenderFunc(func(ctx context.Context, d idem.Delivery) error {
		got.Store(d.Event.ID, d)
		return c.Send(ctx, d)
	})))
	publish(t, pool, event(1), event(2))
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.Publish(ctx, tx, event(3)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	publish(t, pool, event(4))
	for _, i := range []int{1, 2, 4} {
		ev := event(i)
		rec := waitStatus(t, pool, ev.ID, ev.Destination, idem.EventDelivered)
		if rec.AttemptCount != 1 || len(rec.Attempts) != 1 || rec.Attempts[0].Error != "" || rec.DeliveredAt.IsZero() ||
			rec.ExpiresAt.IsZero() || rec.LastError != "" {
			t.Fatalf("delivered record: %+v", rec)
		}
		v, _ := got.Load(ev.ID)
		d := v.(idem.Delivery)
		if d.Attempt != 1 || d.Event.Topic != ev.Topic || string(d.Event.Payload) != string(ev.Payload) ||
			d.Event.Header["Content-Type"][0] != "application/json" {
			t.Fatalf("sent %+v, published %+v", d, ev)
		}
		if string(rec.Event.Payload) != string(ev.Payload) || rec.Event.Header["Content-Type"][0] != "application/json" {
			t.Fatalf("looked up %+v, published %+v", rec.Event, ev)
		}
	}
	// Event 4 was published after 3 rolled back: once it is delivered, 3
	// would have been claimed too had it been written.
	if n := c.count(event(3).ID); n != 0 {
		t.Fatalf("the rolled-back event was sent %d times", n)
	}
	if _, err := idem.LookupEvent(ctx, pool, event(3).ID, "billing"); !errors.Is(err, idem.ErrEventNotFound) {
		t.Fatalf("LookupEvent of the rolled-back event: %v", err)
	}
	for _, i := range []int{1, 2, 4} {
		if n := c.count(event(i).ID); n != 1 {
			t.Fatalf("event %d sent %d times", i, n)
		}
	}
}

// The same event again is a no-op; the same id with another payload,
// topic or header is ErrEventReused and writes nothing, and the
// transaction stays usable; invalid events are ErrInvalidEvent before any
// statement.
func TestPublishRefusesBadAndReusedEvents(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	ev := event(1)
	publish(t, pool, ev, ev)
	publish(t, pool, ev)
	publish(t, pool, idem.Event{ID: ev.ID, Topic: "t", Destination: "other"}) // another destination: another event
	sameHeader := ev
	sameHeader.Header = map[string][]string{"Content-Type": {"application/json"}}
	publish(t, pool, sameHeader)

	reused := []idem.Event{ev, ev, ev, ev}
	reused[0].Payload = []byte(`{"n":2}`)
	reused[1].Topic = "payment.failed"
	reused[2].Header = nil
	reused[3].Header = map[string][]string{"Content-Type": {"text/plain"}}
	before, _ := countEvents(t, pool)
	for i, bad := range reused {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := idem.Publish(ctx, tx, bad); !errors.Is(err, idem.ErrEventReused) {
				return fmt.Errorf("Publish of reused event %d: %v, want ErrEventReused", i, err)
			}
			// The transaction is usable after the refusal.
			return idem.Publish(ctx, tx, event(100+i))
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if after, _ := countEvents(t, pool); after != before+len(reused) {
		t.Fatalf("%d events after the refusals, want %d", after, before+len(reused))
	}
	rec, err := idem.LookupEvent(ctx, pool, ev.ID, ev.Destination)
	if err != nil || string(rec.Event.Payload) != string(ev.Payload) || rec.Event.Topic != ev.Topic {
		t.Fatalf("the first event changed: %+v, %v", rec, err)
	}

	long := strings.Repeat("x", idem.MaxEventNameLength+1)
	invalid := map[string]idem.Event{
		"empty id":          {Topic: "t", Destination: "d"},
		"empty topic":       {ID: "i", Destination: "d"},
		"empty destination": {ID: "i", Topic: "t"},
		"long id":           {ID: long, Topic: "t", Destination: "d"},
		"long destination":  {ID: "i", Topic: "t", Destination: long},
		"control in id":     {ID: "a\nb", Topic: "t", Destination: "d"},
		"invalid utf-8":     {ID: "i", Topic: "\xff", Destination: "d"},
		"large payload":     {ID: "i", Topic: "t", Destination: "d", Payload: make([]byte, idem.MaxEventPayload+1)},
		"header name":       {ID: "i", Topic: "t", Destination: "d", Header: map[string][]string{"a b": {"v"}}},
		"header value":      {ID: "i", Topic: "t", Destination: "d", Header: map[string][]string{"A": {"v\r\nX: y"}}},
		"header control":    {ID: "i", Topic: "t", Destination: "d", Header: map[string][]string{"A": {"v\x01"}}},
		"header DEL":        {ID: "i", Topic: "t", Destination: "d", Header: map[string][]string{"A": {"v\x7f"}}},
		"large header":      {ID: "i", Topic: "t", Destination: "d", Header: map[string][]string{"A": {strings.Repeat("v", idem.MaxEventHeader)}}},
	}
	before, _ = countEvents(t, pool)
	for name, bad := range invalid {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := idem.Publish(ctx, tx, bad); !errors.Is(err, idem.ErrInvalidEvent) {
			t.Errorf("%s: %v, want ErrInvalidEvent", name, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("%s: the transaction is not usable after the refusal: %v", name, err)
		}
	}
	if err := idem.Publish(ctx, nil, event(1)); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("Publish(nil tx): %v", err)
	}
	if after, _ := countEvents(t, pool); after != before {
		t.Fatalf("invalid events wrote %d rows", after-before)
	}
}

// Several relays on separate pools at once, with no failure, send every
// event exactly once.
func TestRelaysSendEachEventOnce(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t, idem.Migrate)
	const relays, events = 3, 300
	c := newCounter(nil)
	var pools []*pgxpool.Pool
	for range relays {
		p, err := pgxpool.New(context.Background(), url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		pools = append(pools, p)
	}
	for i, p := range pools {
		opts := fastRelay(c)
		opts.BatchSize, opts.Workers = 7, 4
		opts.PollOnly = i == 0 // one polls, the others listen
		runRelay(t, p, opts)
	}
	var evs []idem.Event
	for i := range events {
		evs = append(evs, event(i))
		if len(evs) == 10 {
			publish(t, pools[i%relays], evs...)
			evs = nil
		}
	}
	for i := range events {
		waitStatus(t, pools[0], event(i).ID, "billing", idem.EventDelivered)
	}
	for i := range events {
		if n := c.count(event(i).ID); n != 1 {
			t.Fatalf("event %d sent %d times", i, n)
		}
	}
}

// A receiver down across several steps of the schedule, then up: the
// event is delivered, and its log holds every attempt.
func TestRelayRetriesOnTheSchedule(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, idem.Migrate)
	c := newCounter(func(d idem.Delivery) error {
		if d.Attempt < 4 {
			return errors.New("503 Service Unavailable")
		}
		return nil
	})
	runRelay(t, pool, fastRelay(c))
	publish(t, pool, event(1))
	rec := waitStatus(t, pool, event(1).ID, "billing", idem.EventDelivered)
	if rec.AttemptCount != 4 || len(rec.Attempts) != 4 || c.count(event(1).ID) != 4 {
		t.Fatalf("after 3 failures, delivered: %+v (sent %d times)", rec, c.count(event(1).ID))
	}
	for i, a := range rec.Attempts {
		wantErr := "503 Service Unavailable"
		if i == 3 {
			wantErr = ""
		}
		if a.Attempt != i+1 || a.Error != wantErr || a.Permanent || a.StartedAt.IsZero() {
			t.Fatalf("attempt %d: %+v", i+1, a)
		}
	}
}

// A Permanent error fails the event at once; an exhausted schedule fails
// it after its last attempt; RetryEvent sends a failed event again, and
// refuses every other case without changing anything.
func TestRelayFailsAndRetryEventSendsAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	var up atomic.Bool
	c := newCounter(func(d idem.Delivery) error {
		switch {
		case up.Load():
			return nil
		case d.Event.ID == "gone":
			return idem.Permanent(errors.New("410 Gone"))
		}
		return errors.New("timeout")
	})
	runRelay(t, pool, fastRelay(c))
	publish(t, pool, idem.Event{ID: "gone", Topic: "t", Destination: "d"}, idem.Event{ID: "down", Topic: "t", Destination: "d"})
	gone := waitStatus(t, pool, "gone", "d", idem.EventFailed)
	if gone.AttemptCount != 1 || len(gone.Attempts) != 1 || !gone.Attempts[0].Permanent || gone.LastError != "permanent: 410 Gone" ||
		gone.FailedAt.IsZero() || gone.ExpiresAt.IsZero() {
		t.Fatalf("after a permanent error: %+v", gone)
	}
	down := waitStatus(t, pool, "down", "d", idem.EventFailed)
	if down.AttemptCount != 4 || len(down.Attempts) != 4 || down.LastError != "timeout" {
		t.Fatalf("after the schedule ran out: %+v", down)
	}

	// Refusals change nothing.
	before, beforeAttempts := countEvents(t, pool)
	var snapshot string
	if err := pool.QueryRow(ctx, `SELECT string_agg(e::text, ',' ORDER BY id) FROM idem_events e`).Scan(&snapshot); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		id, reason string
		want       error
	}{
		"missing":      {"nope", "r", idem.ErrEventNotFound},
		"empty reason": {"down", "", idem.ErrInvalidArgument},
		"long reason":  {"down", strings.Repeat("r", idem.MaxRetryReason+1), idem.ErrInvalidArgument},
	} {
		if err := idem.RetryEvent(ctx, pool, c.id, "d", c.reason); !errors.Is(err, c.want) {
			t.Fatalf("RetryEvent %s: %v, want %v", name, err, c.want)
		}
	}
	if err := idem.RetryEvent(ctx, nil, "down", "d", "r"); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("RetryEvent(nil db): %v", err)
	}
	var after string
	if err := pool.QueryRow(ctx, `SELECT string_agg(e::text, ',' ORDER BY id) FROM idem_events e`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if n, na := countEvents(t, pool); after != snapshot || n != before || na != beforeAttempts {
		t.Fatalf("a refused RetryEvent changed the outbox")
	}

	up.Store(true)
	if err := idem.RetryEvent(ctx, pool, "down", "d", "ops: receiver fixed"); err != nil {
		t.Fatal(err)
	}
	rec := waitStatus(t, pool, "down", "d", idem.EventDelivered)
	if rec.AttemptCount != 5 || len(rec.Attempts) != 5 || rec.Attempts[4].Attempt != 5 || rec.Attempts[4].Error != "" ||
		rec.RetryReason != "ops: receiver fixed" || rec.RetriedAt.IsZero() || rec.LastError != "" {
		t.Fatalf("after RetryEvent: %+v", rec)
	}
	if err := idem.RetryEvent(ctx, pool, "down", "d", "again"); !errors.Is(err, idem.ErrEventNotFailed) {
		t.Fatalf("RetryEvent of a delivered event: %v", err)
	}
	if rec2, _ := idem.LookupEvent(ctx, pool, "down", "d"); rec2.RetryReason != "ops: receiver fixed" {
		t.Fatalf("a refused RetryEvent changed the reason: %q", rec2.RetryReason)
	}
}

// A relay stopped mid-send (its ctx cancelled) and one whose connections
// are terminated lose no event: a relay started afterwards sends them all.
func TestRelayKilledLosesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	open := func(app string) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["application_name"] = app
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	pool := open("test")
	const events = 50
	for i := 0; i < events; i += 10 {
		var evs []idem.Event
		for j := i; j < i+10; j++ {
			evs = append(evs, event(j))
		}
		publish(t, pool, evs...)
	}

	// A relay whose sends hang until its Run ends: stopped mid-send.
	started := make(chan struct{}, events)
	hang := idem.SenderFunc(func(ctx context.Context, d idem.Delivery) error {
		started <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	})
	opts := fastRelay(hang)
	opts.AttemptTimeout, opts.Lease = time.Minute, 2*time.Minute
	stop := runRelay(t, open("relay-1"), opts)
	<-started
	stop()

	// A relay whose connections are cut while it sends.
	c := newCounter(nil)
	var killed atomic.Bool
	slow := idem.SenderFunc(func(ctx context.Context, d idem.Delivery) error {
		if killed.CompareAndSwap(false, true) {
			// Not with the send's ctx: the relay cuts the send when it
			// finds its connection gone, maybe before Exec returns.
			if _, err := pool.Exec(context.WithoutCancel(ctx), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name = 'relay-2' AND datname = current_database()`); err != nil {
				t.Error(err)
			}
		}
		return c.Send(ctx, d)
	})
	runRelay(t, open("relay-2"), fastRelay(slow))
	for i := range events {
		waitStatus(t, pool, event(i).ID, "billing", idem.EventDelivered)
	}
	if !killed.Load() {
		t.Fatal("no connection was terminated")
	}
	// Released by the first relay's stop, or sent again after a lost
	// record: each at least once, and the log agrees with the status.
	for i := range events {
		if n := c.count(event(i).ID); n < 1 {
			t.Fatalf("event %d delivered without a send", i)
		}
	}
}

// NewRelay refuses options out of range with ErrInvalidConfig, and a nil
// db with ErrInvalidArgument.
func TestNewRelayRefusesBadOptions(t *testing.T) {
	t.Parallel()
	s := newCounter(nil)
	for name, o := range map[string]idem.RelayOptions{
		"no sender":        {},
		"empty schedule":   {Sender: s, Schedule: []time.Duration{}},
		"delayed first":    {Sender: s, Schedule: []time.Duration{time.Second}},
		"negative step":    {Sender: s, Schedule: []time.Duration{0, -time.Second}},
		"long schedule":    {Sender: s, Schedule: make([]time.Duration, 101)},
		"batch":            {Sender: s, BatchSize: -1},
		"huge batch":       {Sender: s, BatchSize: 10001},
		"workers":          {Sender: s, Workers: -1},
		"attempt timeout":  {Sender: s, AttemptTimeout: time.Microsecond},
		"lease too short":  {Sender: s, AttemptTimeout: time.Minute, Lease: time.Minute},
		"poll":             {Sender: s, PollInterval: time.Microsecond},
		"negative ttl":     {Sender: s, TTL: -time.Hour},
		"negative failed ": {Sender: s, FailedTTL: -time.Hour},
	} {
		if _, err := idem.NewRelay(noDB{}, o); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: %v, want ErrInvalidConfig", name, err)
		}
	}
	if _, err := idem.NewRelay(nil, idem.RelayOptions{Sender: s}); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("nil db: %v", err)
	}
	// One connection cannot serve Run's goroutines (it sent nothing, and
	// raced, on a *pgx.Conn).
	pool := newPool(t)
	conn, err := pgx.Connect(t.Context(), pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	pconn, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer pconn.Release()
	for name, db := range map[string]idem.Beginner{"*pgx.Conn": conn, "pgx.Tx": tx, "*pgxpool.Conn": pconn} {
		if _, err := idem.NewRelay(db, idem.RelayOptions{Sender: s}); !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "pgxpool") {
			t.Errorf("%s: %v, want ErrInvalidArgument naming a pool", name, err)
		}
	}
}

// noDB is a Beginner that never begins.
type noDB struct{}

func (noDB) Begin(context.Context) (pgx.Tx, error) { return nil, errors.New("no database") }

// With many pending events, the claim walks the due index.
func TestEventClaimUsesTheDueIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	_, err := pool.Exec(ctx, `INSERT INTO idem_events (destination, id, topic, payload, status, expires_at)
		SELECT 'd' || (i % 100), 'e' || i, 't', '\x00', CASE WHEN i % 2 = 0 THEN 'pending' ELSE 'delivered' END,
		       CASE WHEN i % 2 = 1 THEN now() + interval '1 day' END
		FROM generate_series(1, 200000) i`)
	if err == nil {
		_, err = pool.Exec(ctx, `ANALYZE idem_events`)
	}
	if err != nil {
		t.Fatal(err)
	}
	var plan []string
	// The lease path's claim and the fast path's locks (the one ahead
	// leaving out the 100 row versions of the batch before).
	var skip []string
	for i := range 100 {
		skip = append(skip, fmt.Sprintf("(%d,%d)", i/50, i%50+1))
	}
	for _, q := range []struct {
		sql  string
		args []any
	}{{db.EventClaim, []any{int64(time.Minute / time.Microsecond), int32(100)}}, {db.EventLock, []any{int32(100)}},
		{db.EventLockAhead, []any{skip, int32(100)}}} {
		rows, err := pool.Query(ctx, "EXPLAIN "+q.sql, q.args...)
		if err == nil {
			plan, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
		if err != nil {
			t.Fatal(err)
		}
		if p := strings.Join(plan, "\n"); !strings.Contains(p, "idem_events_due_idx") || strings.Contains(p, "Seq Scan") {
			t.Fatalf("the claim does not walk idem_events_due_idx:\n%s\n%s", q.sql, p)
		}
	}

	// The failed events, among the 100,000 delivered, are listed through
	// their own index, newest first.
	_, err = pool.Exec(ctx, `INSERT INTO idem_events (destination, id, topic, payload, status, failed_at, created_at, expires_at)
		SELECT 'f', 'f' || i, 't', '\x00', 'failed', now(), now() + i * interval '1 second', now() + interval '1 day'
		FROM generate_series(1, 3) i`)
	if err == nil {
		_, err = pool.Exec(ctx, `ANALYZE idem_events`)
	}
	if err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, "EXPLAIN "+db.EventListFailed, "", int32(50))
	if err == nil {
		plan, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		t.Fatal(err)
	}
	if p := strings.Join(plan, "\n"); !strings.Contains(p, "idem_events_failed_idx") || strings.Contains(p, "Seq Scan") {
		t.Fatalf("the failed list does not walk idem_events_failed_idx:\n%s", p)
	}
	failed, err := outbox.List(ctx, pool, outbox.Filter{Status: "failed", Limit: 50})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range failed {
		ids = append(ids, e.ID)
	}
	if strings.Join(ids, " ") != "f3 f2 f1" {
		t.Fatalf("failed events listed: %q, want f3 f2 f1", ids)
	}
}

// The public limits of an event are the ones Publish checks.
func TestEventLimitsMatch(t *testing.T) {
	if idem.MaxEventNameLength != outbox.MaxName || idem.MaxEventPayload != outbox.MaxPayload ||
		idem.MaxEventHeader != outbox.MaxHeader {
		t.Fatal("idem's event limits differ from internal/outbox's")
	}
}

// A stalled relay's late answer cannot overwrite a newer claim: its record,
// under the old token, logs its attempt and leaves the event as the newer
// claim holds it.
func TestEventRecordGuardedByTheClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	publish(t, pool, event(1))
	q := db.New()
	claim := func() db.EventClaimRow {
		t.Helper()
		rows, err := q.EventClaim(ctx, pool, db.EventClaimParams{LeaseMicros: time.Hour.Microseconds(), MaxRows: 10})
		if err != nil || len(rows) != 1 {
			t.Fatalf("claim: %v, %v", rows, err)
		}
		return rows[0]
	}
	first := claim()
	// The first claim's lease runs out; a second relay claims the event.
	if _, err := pool.Exec(ctx, `UPDATE idem_events SET lease_until = now()`); err != nil {
		t.Fatal(err)
	}
	second := claim()
	if second.Claim == first.Claim || second.Attempts != first.Attempts+1 {
		t.Fatalf("claims %+v then %+v", first, second)
	}
	record := func(c db.EventClaimRow) string {
		return fmt.Sprintf(`[{"destination":"billing","id":%q,"claim":%d,"row_version":%q,"attempt":%d,"started_at":"2026-01-01T00:00:00Z",
		"duration_micros":5,"error":null,"permanent":false,"status":"delivered","delay_micros":0,"ttl_micros":1000000}]`,
			c.ID, c.Claim, c.RowVersion, c.Attempts)
	}
	late := record(first)
	if n, err := q.EventRecord(ctx, pool, late); err != nil || n != 0 {
		t.Fatalf("the late record wrote %d states, %v; want 0", n, err)
	}
	rec, err := idem.LookupEvent(ctx, pool, first.ID, "billing")
	if err != nil || rec.Status != idem.EventPending || len(rec.Attempts) != 1 || rec.Attempts[0].Attempt != 1 || rec.AttemptCount != 2 {
		t.Fatalf("after the late record: %+v, %v", rec, err)
	}
	// The newer claim's record lands.
	if n, err := q.EventRecord(ctx, pool, record(second)); err != nil || n != 1 {
		t.Fatalf("the current record wrote %d states, %v; want 1", n, err)
	}
	rec, err = idem.LookupEvent(ctx, pool, first.ID, "billing")
	if err != nil || rec.Status != idem.EventDelivered || len(rec.Attempts) != 2 || rec.Attempts[1].Attempt != 2 {
		t.Fatalf("after the current record: %+v, %v", rec, err)
	}
}

// A relay runs once at a time: a second Run while the first runs is
// ErrInvalidArgument; once the first returned, Run works again.
func TestRelayRunsOnceAtATime(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, idem.Migrate)
	r, err := idem.NewRelay(pool, fastRelay(newCounter(nil)))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		start := func() { go func() { done <- r.Run(ctx) }() }
		start()
		// The probe's ctx has ended: if it runs before the first, it
		// returns at once.
		ended, end := context.WithCancel(context.Background())
		end()
		deadline := time.Now().Add(10 * time.Second)
		for {
			select {
			case err := <-done:
				// A probe ran first, and the first Run, refused while
				// the probe held the relay, returned: run it again.
				if !errors.Is(err, idem.ErrInvalidArgument) {
					t.Fatalf("first Run returned early: %v", err)
				}
				start()
			default:
			}
			err := r.Run(ended)
			if errors.Is(err, idem.ErrInvalidArgument) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("second Run: %v, want ErrInvalidArgument", err)
			}
			time.Sleep(time.Millisecond) // the first Run had not begun
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("Run: %v", err)
		}
	}
}

// The claim writes no indexed column, so with the table's fillfactor a
// batch of neighbouring events is claimed by HOT updates; a leased event is
// left to its claim; and the record finds its events by their row
// versions, never by a scan of the table (its cost does not grow with the
// backlog).
func TestEventClaimIsHOTAndRecordScansNoTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	if _, err := pool.Exec(ctx, `INSERT INTO idem_events (destination, id, topic, payload)
		SELECT 'd' || (g % 5), 'e' || g, 'bench.event', '{}'::bytea FROM generate_series(1, 2000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE idem_events`); err != nil {
		t.Fatal(err)
	}
	q := db.New()
	var first []db.EventClaimRow
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		if first, err = q.EventClaim(ctx, tx, db.EventClaimParams{LeaseMicros: time.Hour.Microseconds(), MaxRows: 100}); err != nil {
			return err
		}
		var updated, hot int64
		if err := tx.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables
			WHERE relname = 'idem_events'`).Scan(&updated, &hot); err != nil {
			return err
		}
		if len(first) != 100 || updated != 100 || hot < 90 {
			t.Errorf("claimed %d events by %d updates, %d of them HOT; want 100, 100, at least 90", len(first), updated, hot)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Another relay's claim skips the leased events.
	rest, err := q.EventClaim(ctx, pool, db.EventClaimParams{LeaseMicros: time.Hour.Microseconds(), MaxRows: 2000})
	if err != nil || len(rest) != 1900 {
		t.Fatalf("the second claim took %d events, %v; want 1900", len(rest), err)
	}
	var attempts []string
	for _, c := range first {
		attempts = append(attempts, fmt.Sprintf(`{"destination":%q,"id":%q,"claim":%d,"row_version":%q,"attempt":%d,
			"started_at":"2026-01-01T00:00:00Z","duration_micros":5,"error":null,"permanent":false,"status":"delivered",
			"delay_micros":0,"ttl_micros":1000000}`, c.Destination, c.ID, c.Claim, c.RowVersion, c.Attempts))
	}
	records := "[" + strings.Join(attempts, ",") + "]"
	rows, err := pool.Query(ctx, "EXPLAIN (COSTS off) "+db.EventRecord, records)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if p := strings.Join(plan, "\n"); strings.Contains(p, "Seq Scan on idem_events") {
		t.Fatalf("the record scans idem_events:\n%s", p)
	}
	if n, err := q.EventRecord(ctx, pool, records); err != nil || n != 100 {
		t.Fatalf("the record wrote %d states, %v; want 100", n, err)
	}
	// The deliveries' own record (arrays, not JSON) finds its events the
	// same way.
	var del db.EventRecordDeliveriesParams
	for _, c := range rest[:100] {
		del.Destinations, del.Ids, del.Claims = append(del.Destinations, c.Destination), append(del.Ids, c.ID), append(del.Claims, c.Claim)
		del.RowVersions, del.Attempts = append(del.RowVersions, c.RowVersion), append(del.Attempts, c.Attempts)
		del.StartedAt = append(del.StartedAt, pgtype.Timestamptz{Time: time.Now(), Valid: true})
		del.DurationMicros = append(del.DurationMicros, 5)
	}
	del.TtlMicros = time.Hour.Microseconds()
	rows, err = pool.Query(ctx, "EXPLAIN (COSTS off) "+db.EventRecordDeliveries, del.Destinations, del.Ids, del.Claims,
		del.RowVersions, del.Attempts, del.StartedAt, del.DurationMicros, del.TtlMicros)
	if err == nil {
		plan, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		t.Fatal(err)
	}
	if p := strings.Join(plan, "\n"); strings.Contains(p, "Seq Scan on idem_events") {
		t.Fatalf("the deliveries' record scans idem_events:\n%s", p)
	}
	if n, err := q.EventRecordDeliveries(ctx, pool, del); err != nil || n != 100 {
		t.Fatalf("the deliveries' record wrote %d states, %v; want 100", n, err)
	}
	// Again: the token moved on, so nothing is written, and the
	// deliveries that came too late are logged.
	if n, err := q.EventRecordDeliveries(ctx, pool, del); err != nil || n != 0 {
		t.Fatalf("the second record wrote %d states, %v; want 0", n, err)
	}
	var logged int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_event_attempts`).Scan(&logged); err != nil || logged != 100 {
		t.Fatalf("%d attempts logged, %v; want 100 (only the late deliveries)", logged, err)
	}
}

// The fast path's record of its own locked events (EventRecordLocked)
// finds them by their row versions, one TID scan each, and writes each
// delivery with its attempt's time and duration; when a row is not as
// EventLock left it (another token here), the statement fails with
// SQLSTATE IDMRL, taking its transaction with it.
func TestEventRecordLockedWritesOrRefuses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	if _, err := pool.Exec(ctx, `INSERT INTO idem_events (destination, id, topic, payload)
		SELECT 'd' || (g % 5), 'e' || g, 'bench.event', '{}'::bytea FROM generate_series(1, 2000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE idem_events`); err != nil {
		t.Fatal(err)
	}
	q := db.New()
	started := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	record := func(tx pgx.Tx, badClaim bool) (db.EventRecordLockedParams, error) {
		rows, err := q.EventLock(ctx, tx, 100)
		if err != nil || len(rows) != 100 {
			t.Fatalf("locked %d events, %v; want 100", len(rows), err)
		}
		p := db.EventRecordLockedParams{TtlMicros: time.Hour.Microseconds()}
		for i, r := range rows {
			claim := r.Claim
			if badClaim && i == 7 {
				claim++
			}
			p.RowVersions, p.Claims, p.Attempts = append(p.RowVersions, r.RowVersion), append(p.Claims, claim), append(p.Attempts, r.Attempts)
			p.StartedAt = append(p.StartedAt, pgtype.Timestamptz{Time: started, Valid: true})
			p.DurationMicros = append(p.DurationMicros, int64(i))
		}
		plan, err := tx.Query(ctx, "EXPLAIN (COSTS off) "+db.EventRecordLocked, p.RowVersions, p.Claims, p.Attempts, p.StartedAt,
			p.DurationMicros, p.TtlMicros)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(plan, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		if pl := strings.Join(lines, "\n"); strings.Contains(pl, "Seq Scan on idem_events") || !strings.Contains(pl, "Tid Scan") {
			t.Fatalf("the locked record does not find its events by TID scans:\n%s", pl)
		}
		n, err := q.EventRecordLocked(ctx, tx, p)
		if err == nil && n != 100 {
			t.Fatalf("the locked record wrote %d states; want 100", n)
		}
		return p, err
	}
	var p db.EventRecordLockedParams
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		p, err = record(tx, false)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var delivered, logged int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_events WHERE status = 'delivered' AND attempts = 1 AND claim = 1
		AND delivered_attempt = 1 AND delivery_started_at = $1 AND expires_at IS NOT NULL AND lease_until IS NULL`, started).Scan(&delivered); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_event_attempts`).Scan(&logged); err != nil {
		t.Fatal(err)
	}
	if delivered != 100 || logged != 0 || len(p.RowVersions) != 100 {
		t.Fatalf("%d events delivered at attempt 1 with their start, %d attempt rows; want 100, 0", delivered, logged)
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := record(tx, true)
		return err
	})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "IDMRL" {
		t.Fatalf("the locked record of a changed row: %v; want SQLSTATE IDMRL", err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_events WHERE status = 'delivered'`).Scan(&delivered); err != nil || delivered != 100 {
		t.Fatalf("%d events delivered after the refused record, %v; want 100 (the refusal wrote nothing)", delivered, err)
	}
}

// retryAfterError is a Sender's error that says how long the destination
// asked to wait, as idemhttp.WebhookError does.
type retryAfterError time.Duration

func (e retryAfterError) Error() string             { return "429 Too Many Requests" }
func (e retryAfterError) RetryAfter() time.Duration { return time.Duration(e) }

// A failure whose error asks for a longer wait (Retry-After) puts the next
// attempt that far away, up to the schedule's longest delay; a shorter ask
// keeps the schedule's.
func TestRelayHonoursRetryAfter(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, idem.Migrate)
	asks := map[string]time.Duration{"ev-1": 30 * time.Minute, "ev-2": 5 * time.Hour, "ev-3": time.Millisecond}
	c := newCounter(func(d idem.Delivery) error { return retryAfterError(asks[d.Event.ID]) })
	opts := fastRelay(c)
	opts.Schedule = []time.Duration{0, time.Second, 2 * time.Hour}
	runRelay(t, pool, opts)
	start := time.Now()
	publish(t, pool, event(1), event(2), event(3))
	for id, want := range map[string][2]time.Duration{
		"ev-1": {30 * time.Minute, 30 * time.Minute},              // as asked
		"ev-2": {2 * time.Hour, 2 * time.Hour},                    // capped at the schedule's longest
		"ev-3": {900 * time.Millisecond, 1100 * time.Millisecond}, // the schedule's, jittered
	} {
		deadline := time.Now().Add(30 * time.Second)
		for {
			rec, err := idem.LookupEvent(context.Background(), pool, id, "billing")
			if err != nil {
				t.Fatal(err)
			}
			// The second attempt's due time, read from the event while it
			// waits, or from the log once it ran (ev-3's comes a second
			// after the first: a loaded machine may check it that late).
			var wait time.Duration
			switch {
			case rec.AttemptCount == 1 && len(rec.Attempts) == 1:
				wait = rec.NextAttemptAt.Sub(start)
			case len(rec.Attempts) >= 2:
				wait = rec.Attempts[1].StartedAt.Sub(start)
			}
			if wait != 0 {
				if wait < want[0]-100*time.Millisecond || wait > want[1]+10*time.Second { // the record comes after the publish
					t.Errorf("%s: next attempt %v after the publish, want %v to %v", id, wait, want[0], want[1])
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %+v", id, rec)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}
