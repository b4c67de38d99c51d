package idem_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// twoPools returns two pools on one fresh, migrated database with the
// effects table: two consumers of one broker, as two processes would be.
func twoPools(t *testing.T) (*pgxpool.Pool, *pgxpool.Pool) {
	t.Helper()
	url := pgtest.URL(t, idem.Migrate)
	pools := make([]*pgxpool.Pool, 2)
	for i := range pools {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = 8
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close) // before URL's cleanup drops the database
		pools[i] = pool
	}
	if _, err := pools[0].Exec(context.Background(),
		`CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, note text)`); err != nil {
		t.Fatal(err)
	}
	return pools[0], pools[1]
}

// handle is an inbox handler that writes one effects row for the message;
// calls counts its runs.
func handle(calls *atomic.Int64, id string) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		calls.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, id)
		return err
	}
}

// inboxInCallerTx runs Inbox in a transaction begun on pool, committed when
// Inbox returns nil.
func inboxInCallerTx(ctx context.Context, c *idem.Client, pool *pgxpool.Pool, consumer, id string, payload []byte,
	fn func(ctx context.Context, tx pgx.Tx) error) (bool, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx)
	dup, err := c.Inbox(ctx, tx, consumer, id, payload, fn)
	if err != nil {
		return false, err
	}
	return dup, tx.Commit(ctx)
}

func TestInboxProcessesOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	payload := []byte(`{"order":42}`)

	// First delivery in the caller's transaction; redeliveries in either form.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	dup, err := idem.Inbox(ctx, tx, "billing", "msg-1", payload, handle(&calls, "msg-1"))
	if err != nil || dup {
		t.Fatalf("first delivery: %v, %v", dup, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if dup, err := idem.InboxInTx(ctx, pool, "billing", "msg-1", payload, handle(&calls, "msg-1")); err != nil || !dup {
			t.Fatalf("redelivery: %v, %v", dup, err)
		}
		if dup, err := inboxInCallerTx(ctx, newClient(), pool, "billing", "msg-1", payload, handle(&calls, "msg-1")); err != nil || !dup {
			t.Fatalf("redelivery in the caller's transaction: %v, %v", dup, err)
		}
	}
	if calls.Load() != 1 || effects(t, pool) != 1 {
		t.Fatalf("handler ran %d times, %d effects; want 1", calls.Load(), effects(t, pool))
	}
	// Recorded as a key under the inbox scope.
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE actor = 'billing' AND operation = $1 AND idem_key = 'msg-1'`,
		idem.InboxOperation); n != 1 {
		t.Fatalf("%d inbox rows, want 1", n)
	}

	// Another consumer of the same message processes it on its own.
	if dup, err := idem.InboxInTx(ctx, pool, "shipping", "msg-1", payload, handle(&calls, "msg-1")); err != nil || dup {
		t.Fatalf("other consumer: %v, %v", dup, err)
	}

	// The same id with another payload is an error, never a silent skip;
	// the caller's transaction stays usable.
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if dup, err := idem.Inbox(ctx, tx, "billing", "msg-1", []byte(`{"order":43}`), handle(&calls, "msg-1")); !errors.Is(err, idem.ErrKeyReused) || dup {
		t.Fatalf("changed payload: %v, %v; want ErrKeyReused", dup, err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatalf("transaction unusable after ErrKeyReused: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 2 || effects(t, pool) != 2 {
		t.Fatalf("handler ran %d times, %d effects; want 2", calls.Load(), effects(t, pool))
	}
}

// A handler that fails records nothing: the next delivery runs it again.
// One that refuses with Reject records the message as processed, without
// its writes.
func TestInboxHandlerFailsOrRefuses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	boom := errors.New("downstream table locked")
	failing := func(ctx context.Context, tx pgx.Tx) error {
		if err := handle(&calls, "flaky")(ctx, tx); err != nil {
			return err
		}
		return boom
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if dup, err := idem.Inbox(ctx, tx, "billing", "flaky", nil, failing); !errors.Is(err, boom) || dup {
		t.Fatalf("failing handler: %v, %v", dup, err)
	}
	// Usable, and holds neither the handler's write nor the record.
	var n int
	if err := tx.QueryRow(ctx, `SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_keys)`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("after the failure: %d rows, %v", n, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if dup, err := idem.InboxInTx(ctx, pool, "billing", "flaky", nil, handle(&calls, "flaky")); err != nil || dup {
		t.Fatalf("delivery after the failure: %v, %v", dup, err)
	}
	if calls.Load() != 2 || effects(t, pool) != 1 {
		t.Fatalf("handler ran %d times, %d effects; want 2 and 1", calls.Load(), effects(t, pool))
	}

	poison := func(ctx context.Context, tx pgx.Tx) error {
		if err := handle(&calls, "poison")(ctx, tx); err != nil {
			return err
		}
		return fmt.Errorf("unknown event type: %w", idem.Reject(idem.Response{}))
	}
	if dup, err := idem.InboxInTx(ctx, pool, "billing", "poison", []byte("?"), poison); err != nil || dup {
		t.Fatalf("refused: %v, %v", dup, err)
	}
	if dup, err := idem.InboxInTx(ctx, pool, "billing", "poison", []byte("?"), poison); err != nil || !dup {
		t.Fatalf("redelivery of a refused message: %v, %v", dup, err)
	}
	if calls.Load() != 3 || count(t, pool, `SELECT count(*) FROM effects WHERE key = 'poison'`) != 0 {
		t.Fatalf("handler ran %d times; a refusal's writes survived", calls.Load())
	}
}

// An at-least-once broker hands the same messages to two consumers, on two
// pools, many times at once: each message is processed exactly once, and
// every other delivery is told it is a duplicate.
func TestInboxConcurrentRedeliveries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	poolA, poolB := twoPools(t)
	const (
		messages   = 4
		deliveries = 8 // of each message, all at once
	)
	var calls atomic.Int64
	slow := func(id string) func(ctx context.Context, tx pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			time.Sleep(20 * time.Millisecond) // hold the claim so the others wait
			return handle(&calls, id)(ctx, tx)
		}
	}
	// One Client for each consumer process.
	clients := []*idem.Client{newClient(), newClient()}
	pools := []*pgxpool.Pool{poolA, poolB}
	dups := make([]bool, messages*deliveries)
	errs := make([]error, messages*deliveries)
	runTogether(messages*deliveries, func(i int) {
		id := fmt.Sprintf("evt-%d", i%messages)
		payload := []byte(fmt.Sprintf(`{"n":%d}`, i%messages))
		c, pool := clients[i/messages%2], pools[i/messages%2]
		if i/messages/2%2 == 0 {
			dups[i], errs[i] = c.InboxInTx(ctx, pool, "billing", id, payload, slow(id))
		} else {
			dups[i], errs[i] = inboxInCallerTx(ctx, c, pool, "billing", id, payload, slow(id))
		}
	})
	processed := make([]int, messages)
	for i := range dups {
		if errs[i] != nil {
			t.Fatalf("delivery %d: %v", i, errs[i])
		}
		if !dups[i] {
			processed[i%messages]++
		}
	}
	for m, n := range processed {
		if n != 1 {
			t.Fatalf("message %d processed by %d deliveries, want 1", m, n)
		}
		if e := count(t, poolA, `SELECT count(*) FROM effects WHERE key = $1`, fmt.Sprintf("evt-%d", m)); e != 1 {
			t.Fatalf("message %d has %d effects, want 1", m, e)
		}
	}
	if calls.Load() != messages {
		t.Fatalf("handler ran %d times, want %d", calls.Load(), messages)
	}
}

// holdMessage delivers id on pool and keeps the handler's transaction open
// until release is closed; then the handler returns nil (commit) or an
// error.
func holdMessage(pool *pgxpool.Pool, calls *atomic.Int64, id string, commit bool) (claimed, release chan struct{}, done chan error) {
	claimed, release, done = make(chan struct{}), make(chan struct{}), make(chan error, 1)
	fail := errors.New("handler failed")
	go func() {
		_, err := idem.InboxInTx(context.Background(), pool, "billing", id, []byte("p"),
			func(ctx context.Context, tx pgx.Tx) error {
				if err := handle(calls, id)(ctx, tx); err != nil {
					return err
				}
				close(claimed)
				<-release
				if !commit {
					return fail
				}
				return nil
			})
		if errors.Is(err, fail) {
			err = nil
		}
		done <- err
	}()
	return claimed, release, done
}

// The first delivery's handler fails while redeliveries on another pool
// wait for it: one of them processes the message, once.
func TestInboxConcurrentFirstFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	poolA, poolB := twoPools(t)
	var calls atomic.Int64
	claimed, release, done := holdMessage(poolA, &calls, "evt", false)
	<-claimed
	go func() { time.Sleep(100 * time.Millisecond); close(release) }()
	const n = 4
	dups := make([]bool, n)
	errs := make([]error, n)
	runTogether(n, func(i int) {
		dups[i], errs[i] = newClient().InboxInTx(ctx, poolB, "billing", "evt", []byte("p"), handle(&calls, "evt"))
	})
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	processed := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("delivery %d: %v", i, errs[i])
		}
		if !dups[i] {
			processed++
		}
	}
	if processed != 1 || calls.Load() != 2 || effects(t, poolA) != 1 {
		t.Fatalf("processed %d, calls %d, effects %d; want 1, 2, 1", processed, calls.Load(), effects(t, poolA))
	}
}

// A redelivery that cannot wait out the first gets ErrInProgress (not a
// duplicate: do not acknowledge it); once the first commits, it is one.
func TestInboxWaitRunsOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	poolA, poolB := twoPools(t)
	client, err := idem.New(idem.Config{Wait: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	claimed, release, done := holdMessage(poolA, &calls, "evt", true)
	<-claimed
	if dup, err := inboxInCallerTx(ctx, client, poolB, "billing", "evt", []byte("p"), handle(&calls, "evt")); !errors.Is(err, idem.ErrInProgress) || dup {
		t.Fatalf("Inbox: %v, %v; want ErrInProgress", dup, err)
	}
	if dup, err := client.InboxInTx(ctx, poolB, "billing", "evt", []byte("p"), handle(&calls, "evt")); !errors.Is(err, idem.ErrInProgress) || dup {
		t.Fatalf("InboxInTx: %v, %v; want ErrInProgress", dup, err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if dup, err := client.InboxInTx(ctx, poolB, "billing", "evt", []byte("p"), handle(&calls, "evt")); err != nil || !dup {
		t.Fatalf("after the first committed: %v, %v", dup, err)
	}
	if calls.Load() != 1 || effects(t, poolA) != 1 {
		t.Fatalf("calls %d, effects %d; want 1", calls.Load(), effects(t, poolA))
	}
}

// Ids that are not valid keys are hashed; each is still processed once, and
// a hashed id never meets an id kept as it is.
func TestInboxMessageIDs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	hashed := func(id string) string {
		sum := sha256.Sum256([]byte(id))
		return "sha256:" + hex.EncodeToString(sum[:])
	}
	ids := []struct{ id, key string }{
		{"0190f5c2-7d1e-7cc1-9f0a-1b2c3d4e5f60", "0190f5c2-7d1e-7cc1-9f0a-1b2c3d4e5f60"},
		{strings.Repeat("x", 255), strings.Repeat("x", 255)},
		{strings.Repeat("x", 256), hashed(strings.Repeat("x", 256))},
		{strings.Repeat("y", 100_000), hashed(strings.Repeat("y", 100_000))},
		{"orders 42", hashed("orders 42")},
		{"événement-7", hashed("événement-7")},
		{"a\x00b", hashed("a\x00b")},
		{"\xff\xfe", hashed("\xff\xfe")},
		{"orders\t42", hashed("orders\t42")},
		// An id that looks like a hashed one is hashed too, so the literal
		// form of "orders 42"'s key is another message.
		{hashed("orders 42"), hashed(hashed("orders 42"))},
	}
	var calls atomic.Int64
	for _, c := range ids {
		key, err := idem.InboxKey(c.id)
		if err != nil || key != c.key {
			t.Fatalf("InboxKey(%.20q) = %.30q, %v; want %.30q", c.id, key, err, c.key)
		}
		for i := range 2 {
			dup, err := idem.InboxInTx(ctx, pool, "billing", c.id, []byte("p"), handle(&calls, c.key))
			if err != nil || dup != (i == 1) {
				t.Fatalf("id %.20q delivery %d: %v, %v", c.id, i, dup, err)
			}
		}
		if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE idem_key = $1`, c.key); n != 1 {
			t.Fatalf("id %.20q: %d rows under its key", c.id, n)
		}
	}
	if int(calls.Load()) != len(ids) || keyRows(t, pool) != len(ids) {
		t.Fatalf("calls %d, rows %d; want %d", calls.Load(), keyRows(t, pool), len(ids))
	}

	// A Client's own key bounds decide what is hashed.
	short, err := idem.New(idem.Config{MaxKeyLength: 80})
	if err != nil {
		t.Fatal(err)
	}
	if key, err := short.InboxKey(strings.Repeat("z", 81)); err != nil || key != hashed(strings.Repeat("z", 81)) {
		t.Fatalf("81 bytes under MaxKeyLength 80: %q, %v", key, err)
	}
	tiny, err := idem.New(idem.Config{MaxKeyLength: 40})
	if err != nil {
		t.Fatal(err)
	}
	if key, err := tiny.InboxKey("fits"); err != nil || key != "fits" {
		t.Fatalf("short id: %q, %v", key, err)
	}
	if _, err := tiny.InboxKey(strings.Repeat("z", 41)); !errors.Is(err, idem.ErrInvalidKey) {
		t.Fatalf("41 bytes under MaxKeyLength 40: %v, want ErrInvalidKey", err)
	}
}

func TestInboxBadInputTouchesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	fn := handle(&calls, "bad")
	cases := []struct {
		name, consumer, id string
		fn                 func(ctx context.Context, tx pgx.Tx) error
		want               error
	}{
		{"empty id", "billing", "", fn, idem.ErrInvalidKey},
		{"empty consumer", "", "m", fn, idem.ErrInvalidScope},
		{"long consumer", strings.Repeat("c", 256), "m", fn, idem.ErrInvalidScope},
		{"consumer not UTF-8", "\xff", "m", fn, idem.ErrInvalidScope},
		{"nil fn", "billing", "m", nil, idem.ErrInvalidArgument},
	}
	for _, c := range cases {
		if _, err := idem.InboxInTx(ctx, pool, c.consumer, c.id, nil, c.fn); !errors.Is(err, c.want) {
			t.Fatalf("%s: InboxInTx: %v, want %v", c.name, err, c.want)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := idem.Inbox(ctx, tx, c.consumer, c.id, nil, c.fn); !errors.Is(err, c.want) {
			t.Fatalf("%s: Inbox: %v, want %v", c.name, err, c.want)
		}
		if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
			t.Fatalf("%s: transaction unusable: %v", c.name, err)
		}
		_ = tx.Rollback(ctx)
	}
	if _, err := idem.Inbox(ctx, nil, "billing", "m", nil, fn); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("nil tx: %v", err)
	}
	if _, err := idem.InboxInTx(ctx, nil, "billing", "m", nil, fn); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("nil db: %v", err)
	}
	if calls.Load() != 0 || keyRows(t, pool) != 0 || effects(t, pool) != 0 {
		t.Fatal("bad input ran the handler or wrote rows")
	}
}

// A message older than the TTL is new again.
func TestInboxExpiredMessageIsNew(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client, err := idem.New(idem.Config{TTL: time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	for range 2 {
		if dup, err := client.InboxInTx(ctx, pool, "billing", "old", []byte("p"), handle(&calls, "old")); err != nil || dup {
			t.Fatalf("%v, %v", dup, err)
		}
	}
	if calls.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2", calls.Load())
	}
}

// newClient returns a Client of the defaults, one per simulated process, so
// that duplicates meet at the primary key rather than in DoInTx's
// in-process coalescing.
func newClient() *idem.Client {
	c, err := idem.New(idem.Config{})
	if err != nil {
		panic(err)
	}
	return c
}

// A webhook sender retries deliveries, many at once, against two receiver
// instances with pools and Clients of their own (two processes behind a
// load balancer): each event is processed once, every delivery ends
// acknowledged.
func TestInboxWebhookTwoReceivers(t *testing.T) {
	t.Parallel()
	poolA, poolB := twoPools(t)
	var calls atomic.Int64
	receiver := func(pool *pgxpool.Pool) *httptest.Server {
		client := newClient()
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			id := r.Header.Get("Webhook-Id")
			_, err = client.InboxInTx(r.Context(), pool, "webhook", id, body, func(ctx context.Context, tx pgx.Tx) error {
				time.Sleep(10 * time.Millisecond) // hold the claim so duplicates meet it
				return handle(&calls, id)(ctx, tx)
			})
			switch {
			case err == nil:
				w.WriteHeader(http.StatusNoContent)
			case errors.Is(err, idem.ErrKeyReused):
				w.WriteHeader(http.StatusUnprocessableEntity)
			default:
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		}))
	}
	servers := []*httptest.Server{receiver(poolA), receiver(poolB)}
	for _, s := range servers {
		t.Cleanup(s.Close) // before the pools close
	}
	const events, copies = 10, 6
	codes := make([]int, events*copies)
	runTogether(events*copies, func(i int) {
		id := fmt.Sprintf("evt_%03d", i%events)
		for attempt := range 20 {
			srv := servers[(i+attempt)%2]
			req, err := http.NewRequest("POST", srv.URL, strings.NewReader(`{"id":"`+id+`"}`))
			if err != nil {
				codes[i] = -1
				return
			}
			req.Header.Set("Webhook-Id", id)
			resp, err := srv.Client().Do(req)
			if err != nil {
				codes[i] = -1
				return
			}
			_ = resp.Body.Close()
			if codes[i] = resp.StatusCode; codes[i] < 500 {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	for i, code := range codes {
		if code != http.StatusNoContent {
			t.Fatalf("delivery %d ended with %d", i, code)
		}
	}
	if calls.Load() != events || effects(t, poolA) != events {
		t.Fatalf("handler ran %d times, %d effects; want %d", calls.Load(), effects(t, poolA), events)
	}
}

// With Config.BodyTTL, a redelivery of a message processed before its
// stored (empty) response's life ran out is still a duplicate, for Inbox
// and InboxInTx: (true, nil), fn does not run.
func TestInboxDuplicatePastBodyTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c, err := idem.New(idem.Config{BodyTTL: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	fn := func(context.Context, pgx.Tx) error { runs.Add(1); return nil }
	if dup, err := c.InboxInTx(ctx, pool, "billing", "m1", []byte("p"), fn); err != nil || dup {
		t.Fatalf("first: %v, %v", dup, err)
	}
	time.Sleep(200 * time.Millisecond)
	if dup, err := c.InboxInTx(ctx, pool, "billing", "m1", []byte("p"), fn); err != nil || !dup {
		t.Errorf("InboxInTx redelivery past BodyTTL: %v, %v; want a duplicate", dup, err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		dup, err := c.Inbox(ctx, tx, "billing", "m1", []byte("p"), fn)
		if err == nil && !dup {
			err = errors.New("not a duplicate")
		}
		return err
	})
	if err != nil || runs.Load() != 1 {
		t.Errorf("Inbox redelivery past BodyTTL: %v, %d runs; want a duplicate, 1 run", err, runs.Load())
	}
	// fn's own error wrapping ErrResponseGone (a call of its own, of a key
	// whose body is gone) is fn's failure, not a duplicate: the message is
	// not acknowledged.
	failing := func(ctx context.Context, tx pgx.Tx) error {
		_, err := c.Do(ctx, tx, idem.Scope{Actor: "billing", Operation: idem.InboxOperation}, "m1", idem.Fingerprint(sha256.Sum256([]byte("p"))),
			func(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{}, nil })
		if !errors.Is(err, idem.ErrResponseGone) {
			t.Errorf("the nested call: %v, want ErrResponseGone", err)
		}
		return err
	}
	if dup, err := c.InboxInTx(ctx, pool, "billing", "m2", []byte("p"), failing); dup || err == nil {
		t.Errorf("fn failing with ErrResponseGone of its own: %v, %v; want fn's error, no duplicate", dup, err)
	}
}
