package idem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgserver"
)

// PostgreSQL restarted twice (once straight back up, once after a pause
// with connections refused) while events are published and relayed, and
// replies lost after the receiver processed an event: no published event
// is lost, and the receiver, which processes each through Inbox, runs its
// handler once per event id.
func TestFaultRelayRestartAndLostReplies(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	t.Parallel()
	events, restarts := 150, 2
	if soak() {
		events, restarts = 2000, 8
	}
	srv, err := pgserver.StartTempCluster(t.Context())
	if errors.Is(err, pgserver.ErrNoBinaries) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	// The temp cluster runs with synchronous_commit off: an immediate
	// shutdown would lose acknowledged commits.
	cfg, err := pgxpool.ParseConfig(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "on"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE processed (id text PRIMARY KEY, runs int NOT NULL)`); err != nil {
		t.Fatal(err)
	}

	// The receiver: processes each delivery through Inbox, in its own
	// database transaction; the first reply of every third event is lost
	// after the processing committed.
	var lost sync.Map
	receiver := idem.SenderFunc(func(ctx context.Context, d idem.Delivery) error {
		_, err := idem.InboxInTx(ctx, pool, "receiver", d.Event.ID, d.Event.Payload, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO processed VALUES ($1, 1) ON CONFLICT (id) DO UPDATE SET runs = processed.runs + 1`, d.Event.ID)
			return err
		})
		if err != nil {
			return err
		}
		var n int
		if _, err := fmt.Sscanf(d.Event.ID, "ev-%d", &n); err == nil && n%3 == 0 {
			if _, seen := lost.LoadOrStore(d.Event.ID, true); !seen {
				return errors.New("reply lost")
			}
		}
		return nil
	})
	opts := fastRelay(receiver)
	opts.Schedule = []time.Duration{0, 10 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond,
		500 * time.Millisecond, time.Second, time.Second, time.Second, time.Second, time.Second, time.Second}
	runRelay(t, pool, opts)
	runRelay(t, pool, opts)

	// Publish, each event until its transaction commits (a restart may cut
	// it; publishing it again is a no-op when it had committed).
	var published atomic.Int64
	pubDone := make(chan error, 1)
	go func() {
		for i := range events {
			ev := event(i)
			for {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return idem.Publish(ctx, tx, ev) })
				if err == nil {
					break
				}
				if ctx.Err() != nil {
					pubDone <- err
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
			published.Add(1)
			time.Sleep(time.Millisecond)
		}
		pubDone <- nil
	}()
	for i := 1; i <= restarts; i++ {
		for published.Load() < int64(events*i/(restarts+1)) {
			if ctx.Err() != nil {
				t.Fatal(ctx.Err())
			}
			time.Sleep(2 * time.Millisecond)
		}
		if i%2 == 0 {
			if err := srv.StopImmediate(); err != nil {
				t.Fatal(err)
			}
			time.Sleep(300 * time.Millisecond)
		}
		if err := srv.Restart(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-pubDone; err != nil {
		t.Fatal(err)
	}
	for i := range events {
		waitStatus(t, pool, event(i).ID, "billing", idem.EventDelivered)
	}
	var processed, twice int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE runs <> 1) FROM processed`).Scan(&processed, &twice); err != nil {
		t.Fatal(err)
	}
	if processed != events || twice != 0 {
		t.Fatalf("%d events processed (want %d), %d more than once", processed, events, twice)
	}
}
