package citustest_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// On Citus, Distribute shards the outbox by destination (the attempt log
// co-located); an event published with a request's writes is delivered
// once by two relays at once, a failed one is sent again by RetryEvent,
// and delivered events are pruned after the TTL, by both relays without a
// prune failing (they pick the same batches and wait for each other).
func TestOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	for _, table := range []string{"idem_events", "idem_event_attempts"} {
		if column, _ := distribution(t, p, table); column != idem.EventsDistributionColumn {
			t.Fatalf("%s is distributed by %q", table, column)
		}
	}
	var mu sync.Mutex
	sends := map[string]int{}
	sender := idem.SenderFunc(func(_ context.Context, d idem.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		sends[d.Event.ID]++
		if d.Event.ID == "poison" && sends["poison"] == 1 {
			return idem.Permanent(errors.New("410 Gone"))
		}
		return nil
	})
	var logged lockedBuffer
	log := slog.New(slog.NewTextHandler(&logged, nil))
	for range 2 {
		r, err := idem.NewRelay(pool(t, p.Config().ConnString()), idem.RelayOptions{Sender: sender, BatchSize: 7, Workers: 3,
			PollInterval: 10 * time.Millisecond, TTL: 50 * time.Millisecond, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(rctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
		})
	}

	const events = 60
	for i := range events {
		actor, key := fmt.Sprintf("actor-%d", i%5), fmt.Sprintf("k-%d", i)
		_, err := idem.DoInTx(ctx, p, idem.Scope{Actor: actor, Operation: "order.place"}, key, fp("book"),
			func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				resp, err := order(actor, key, "book")(ctx, tx)
				if err == nil {
					err = idem.Publish(ctx, tx, idem.Event{ID: fmt.Sprintf("ev-%d", i), Topic: "order.placed",
						Destination: fmt.Sprintf("dest-%d", i%7), Payload: resp.Body})
				}
				return resp, err
			})
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
		return idem.Publish(ctx, tx, idem.Event{ID: "poison", Topic: "t", Destination: "dest-0"})
	}); err != nil {
		t.Fatal(err)
	}
	wait := func(id, dest string, want idem.EventStatus) idem.EventRecord {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			rec, err := idem.LookupEvent(ctx, p, id, dest)
			if err == nil && rec.Status == want {
				return rec
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %+v, %v; want %s", id, rec, err, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	wait("poison", "dest-0", idem.EventFailed)
	if err := idem.RetryEvent(ctx, p, "poison", "dest-0", "test: fixed"); err != nil {
		t.Fatal(err)
	}
	// Every event is delivered, then pruned (TTL 50ms).
	deadline := time.Now().Add(60 * time.Second)
	for count(t, p, `SELECT count(*) FROM idem_events`) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d events left in the outbox", count(t, p, `SELECT count(*) FROM idem_events`))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := count(t, p, `SELECT count(*) FROM idem_event_attempts`); n != 0 {
		t.Fatalf("%d attempts left after pruning", n)
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range events {
		if n := sends[fmt.Sprintf("ev-%d", i)]; n != 1 {
			t.Fatalf("ev-%d sent %d times", i, n)
		}
	}
	if sends["poison"] != 2 {
		t.Fatalf("poison sent %d times, want 2", sends["poison"])
	}
	if out := logged.String(); strings.Contains(out, "prune failed") {
		t.Fatalf("a relay's prune failed:\n%s", out)
	}
}

// lockedBuffer is a bytes.Buffer that goroutines write to at once.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
