package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// idemsql.Publish, with pgx's stdlib driver and lib/pq: a committed event
// is sent by a relay once, a rolled-back one never; the same event again
// is a no-op, another payload under its id ErrEventReused, an invalid
// event ErrInvalidEvent, and none of them writes anything.
func TestPublish(t *testing.T) {
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, pool := migrated(t, driver)
		ev := idem.Event{ID: "ev-1", Topic: "payment.succeeded", Destination: "billing", Payload: []byte(`{"n":1}`),
			Header: map[string][]string{"Content-Type": {"application/json"}}}
		inTx := func(f func(tx *sql.Tx) error) error {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			if err := f(tx); err != nil {
				_ = tx.Rollback()
				return err
			}
			return tx.Commit()
		}
		if err := inTx(func(tx *sql.Tx) error {
			if err := idemsql.Publish(ctx, tx, ev); err != nil {
				return err
			}
			return idemsql.Publish(ctx, tx, ev) // the same event: a no-op
		}); err != nil {
			t.Fatal(err)
		}
		rolledBack := idem.Event{ID: "ev-2", Topic: "t", Destination: "billing"}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := idemsql.Publish(ctx, tx, rolledBack); err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}

		reused := ev
		reused.Payload = []byte(`{"n":2}`)
		if err := inTx(func(tx *sql.Tx) error { return idemsql.Publish(ctx, tx, reused) }); !errors.Is(err, idem.ErrEventReused) {
			t.Fatalf("Publish of a reused id: %v, want ErrEventReused", err)
		}
		if err := inTx(func(tx *sql.Tx) error {
			return idemsql.Publish(ctx, tx, idem.Event{ID: "x", Destination: "billing"})
		}); !errors.Is(err, idem.ErrInvalidEvent) {
			t.Fatalf("Publish without a topic: %v, want ErrInvalidEvent", err)
		}
		if err := idemsql.Publish(ctx, nil, ev); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Fatalf("Publish(nil tx): %v", err)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_events`).Scan(&n); err != nil || n != 1 {
			t.Fatalf("%d events, %v; want 1", n, err)
		}

		var mu sync.Mutex
		sent := map[string]idem.Delivery{}
		r, err := idem.NewRelay(pool, idem.RelayOptions{PollInterval: 10 * time.Millisecond,
			Sender: idem.SenderFunc(func(_ context.Context, d idem.Delivery) error {
				mu.Lock()
				defer mu.Unlock()
				sent[d.Event.ID] = d
				return nil
			})})
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(rctx) }()
		deadline := time.Now().Add(30 * time.Second)
		for {
			rec, err := idem.LookupEvent(ctx, pool, ev.ID, ev.Destination)
			if err == nil && rec.Status == idem.EventDelivered {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("not delivered: %+v, %v", rec, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("Run: %v", err)
		}
		mu.Lock()
		defer mu.Unlock()
		d, ok := sent[ev.ID]
		if !ok || len(sent) != 1 || string(d.Event.Payload) != string(ev.Payload) || d.Event.Header["Content-Type"][0] != "application/json" {
			t.Fatalf("sent %+v", sent)
		}
	})
}
