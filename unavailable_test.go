package idem_test

// Every public call, when the connection is lost under it, answers with an
// error for which idem.Unavailable is true (HTTP 503: retry with the same
// key), and what it did is discoverable afterwards: the retry replays or
// runs, or Lookup shows the record. Two faults: a relay that drops the
// acknowledgement of the call's COMMIT (the commit happened, the client
// cannot know), and an immediate restart of the server under connections
// opened before it.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/ledgertest"
	"github.com/pgidem/idem/internal/testkit/pgserver"
	"github.com/pgidem/idem/internal/testkit/pgtest"
	"github.com/pgidem/idem/internal/testkit/relay"
)

var lostScope = idem.Scope{Actor: "tenant-1", Operation: "lost"}

// lostCase is one public call: set sets up what it needs through a healthy
// pool, act makes the call on db (whose connection is lost under it), and
// check looks, through a healthy pool, for what it did.
type lostCase struct {
	name  string
	set   func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) idem.Reservation
	act   func(ctx context.Context, c *idem.Client, db idem.Beginner, key string, r idem.Reservation) error
	check func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, r idem.Reservation, acted bool)
}

var okResponse = idem.Response{Status: 201, Body: []byte("done")}

func okFn(context.Context, pgx.Tx) (idem.Response, error) { return okResponse, nil }

// lookupStatus is the status of key's record, "" when there is none.
func lookupStatus(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) idem.Record {
	t.Helper()
	rec, err := c.Lookup(ctx, pool, lostScope, key)
	if errors.Is(err, idem.ErrNotFound) {
		return idem.Record{}
	}
	if err != nil {
		t.Fatalf("Lookup %s: %v", key, err)
	}
	return rec
}

// replays checks that key's outcome is stored and replayed.
func replays(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) {
	t.Helper()
	res, err := c.DoInTx(ctx, pool, lostScope, key, fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{}, errors.New("ran again")
	})
	if err != nil || !res.Replayed || string(res.Body) != "done" {
		t.Fatalf("retry of %s: %+v, %v; want the replay", key, res, err)
	}
}

func reserveFor(lease time.Duration) func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) idem.Reservation {
	return func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) idem.Reservation {
		t.Helper()
		r, err := c.Reserve(ctx, pool, lostScope, key, fpA, lease)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
}

// inCallerTx runs fn in a transaction of the caller's, begun on db, and
// commits it: the caller's own Commit.
func inCallerTx(ctx context.Context, db idem.Beginner, fn func(tx pgx.Tx) error) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func lostCases() []lostCase {
	return []lostCase{
		{name: "Do", act: func(ctx context.Context, c *idem.Client, db idem.Beginner, key string, _ idem.Reservation) error {
			return inCallerTx(ctx, db, func(tx pgx.Tx) error { _, err := c.Do(ctx, tx, lostScope, key, fpA, okFn); return err })
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if acted {
				replays(ctx, t, c, pool, key)
			}
		}},
		{name: "DoInTx", act: func(ctx context.Context, c *idem.Client, db idem.Beginner, key string, _ idem.Reservation) error {
			_, err := c.DoInTx(ctx, db, lostScope, key, fpA, okFn)
			return err
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if acted {
				replays(ctx, t, c, pool, key)
			}
		}},
		{name: "InTx", act: func(ctx context.Context, c *idem.Client, db idem.Beginner, key string, _ idem.Reservation) error {
			return c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
				_, err := c.Do(ctx, tx, lostScope, key, fpA, okFn)
				return err
			})
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if acted {
				replays(ctx, t, c, pool, key)
			}
		}},
		{name: "Reserve", act: func(ctx context.Context, c *idem.Client, db idem.Beginner, key string, _ idem.Reservation) error {
			_, err := c.Reserve(ctx, db, lostScope, key, fpA, time.Minute)
			return err
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if rec := lookupStatus(ctx, t, c, pool, key); acted && (rec.Status != idem.StatusProcessing || rec.Token == 0) {
				t.Fatalf("after a lost Reserve: %+v; want its processing record", rec)
			}
		}},
		{name: "Complete", set: reserveFor(time.Minute), act: func(ctx context.Context, c *idem.Client, db idem.Beginner, _ string, r idem.Reservation) error {
			return inCallerTx(ctx, db, func(tx pgx.Tx) error { return c.Complete(ctx, tx, r, okResponse) })
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if acted {
				replays(ctx, t, c, pool, key)
			}
		}},
		{name: "FailRetryable", set: reserveFor(time.Minute), act: func(ctx context.Context, c *idem.Client, db idem.Beginner, _ string, r idem.Reservation) error {
			return c.FailRetryable(ctx, db, r, "refused")
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if rec := lookupStatus(ctx, t, c, pool, key); acted && rec.Status != idem.StatusFailedRetryable {
				t.Fatalf("after a lost FailRetryable: %+v", rec)
			}
		}},
		{name: "MarkUnknown", set: reserveFor(time.Minute), act: func(ctx context.Context, c *idem.Client, db idem.Beginner, _ string, r idem.Reservation) error {
			return c.MarkUnknown(ctx, db, r, "timed out")
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if rec := lookupStatus(ctx, t, c, pool, key); acted && rec.Status != idem.StatusUnknown {
				t.Fatalf("after a lost MarkUnknown: %+v", rec)
			}
		}},
		{name: "Heartbeat", set: reserveFor(time.Minute), act: func(ctx context.Context, c *idem.Client, db idem.Beginner, _ string, r idem.Reservation) error {
			_, err := c.Heartbeat(ctx, db, r, time.Hour)
			return err
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, r idem.Reservation, acted bool) {
			if rec := lookupStatus(ctx, t, c, pool, key); acted && !rec.LeaseExpiresAt.After(r.LeaseExpiresAt.Add(time.Minute)) {
				t.Fatalf("after a lost Heartbeat: lease %s, was %s", rec.LeaseExpiresAt, r.LeaseExpiresAt)
			}
		}},
		{name: "ExpireLeases", set: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) idem.Reservation {
			r := reserveFor(time.Millisecond)(ctx, t, c, pool, key)
			waitPast(t, pool, lostScope, key, "lease_expires_at")
			return r
		}, act: func(ctx context.Context, c *idem.Client, db idem.Beginner, _ string, _ idem.Reservation) error {
			_, err := c.ExpireLeases(ctx, db, 100)
			return err
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if rec := lookupStatus(ctx, t, c, pool, key); acted && rec.Status != idem.StatusUnknown {
				t.Fatalf("after a lost ExpireLeases: %+v", rec)
			}
		}},
		{name: "ListUnknown", act: func(ctx context.Context, c *idem.Client, db idem.Beginner, _ string, _ idem.Reservation) error {
			_, err := c.ListUnknown(ctx, db, 10, nil)
			return err
		}},
		{name: "Resolve", set: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) idem.Reservation {
			r := reserveFor(time.Minute)(ctx, t, c, pool, key)
			if err := c.MarkUnknown(ctx, pool, r, "timed out"); err != nil {
				t.Fatal(err)
			}
			return r
		}, act: func(ctx context.Context, c *idem.Client, db idem.Beginner, key string, r idem.Reservation) error {
			return c.Resolve(ctx, db, lostScope, key, idem.Resolution{Token: r.Token, Succeeded: &okResponse, Reason: "found"})
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if acted {
				replays(ctx, t, c, pool, key)
			}
		}},
		{name: "Lookup", set: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) idem.Reservation {
			if _, err := c.DoInTx(ctx, pool, lostScope, key, fpA, okFn); err != nil {
				t.Fatal(err)
			}
			return idem.Reservation{}
		}, act: func(ctx context.Context, c *idem.Client, db idem.Beginner, key string, _ idem.Reservation) error {
			_, err := c.Lookup(ctx, db, lostScope, key)
			return err
		}},
		{name: "Forget", set: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string) idem.Reservation {
			if _, err := c.DoInTx(ctx, pool, lostScope, key, fpA, okFn); err != nil {
				t.Fatal(err)
			}
			return idem.Reservation{}
		}, act: func(ctx context.Context, c *idem.Client, db idem.Beginner, key string, _ idem.Reservation) error {
			return c.Forget(ctx, db, lostScope, key)
		}, check: func(ctx context.Context, t *testing.T, c *idem.Client, pool *pgxpool.Pool, key string, _ idem.Reservation, acted bool) {
			if rec := lookupStatus(ctx, t, c, pool, key); acted && rec.Status != "" {
				t.Fatalf("after a lost Forget: %+v", rec)
			}
		}},
		{name: "Prune", act: func(ctx context.Context, c *idem.Client, db idem.Beginner, _ string, _ idem.Reservation) error {
			_, err := c.Prune(ctx, db, idem.PruneOptions{})
			return err
		}},
		{name: "ReadStats", act: func(ctx context.Context, _ *idem.Client, db idem.Beginner, _ string, _ idem.Reservation) error {
			_, err := idem.ReadStats(ctx, db)
			return err
		}},
	}
}

// wantUnavailable fails the test unless err is a store failure.
func wantUnavailable(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil || !idem.Unavailable(err) {
		t.Errorf("%s: %v; want an error for which idem.Unavailable is true", what, err)
	}
}

func TestUnavailableWhenCommitAcknowledgementLost(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	var armed atomic.Bool
	direct, relayed, r := ledgertest.BehindRelay(t, func() bool { return armed.CompareAndSwap(true, false) })
	pool, err := pgxpool.New(ctx, direct)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	through, err := pgxpool.New(ctx, relayed)
	if err != nil {
		t.Fatal(err)
	}
	defer through.Close()
	c := mustClient(t, idem.Config{})
	for _, tc := range lostCases() {
		key := "ack-" + tc.name
		var res idem.Reservation
		if tc.set != nil {
			res = tc.set(ctx, t, c, pool, key)
		}
		cuts := r.CommitsCut()
		armed.Store(true)
		err := tc.act(ctx, c, through, key, res)
		armed.Store(false)
		if r.CommitsCut() != cuts+1 {
			t.Fatalf("%s: no COMMIT acknowledgement was dropped (%v)", tc.name, err)
		}
		wantUnavailable(t, tc.name+" with its COMMIT acknowledgement lost", err)
		if tc.check != nil {
			tc.check(ctx, t, c, pool, key, res, true)
		}
	}

	// The caller's own statements on a transaction whose connection broke.
	tx, err := through.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Do(ctx, tx, lostScope, "cut-in-tx", fpA, okFn); err != nil {
		t.Fatal(err)
	}
	r.CutAll()
	_, err = tx.Exec(ctx, `SELECT 1`)
	wantUnavailable(t, "the caller's Exec after the cut", err)
	_, err = tx.Exec(ctx, `SELECT 1`)
	wantUnavailable(t, "the caller's Exec after the cut, again", err)
	_, err = c.Do(ctx, tx, lostScope, "cut-in-tx-2", fpA, okFn)
	wantUnavailable(t, "Do after the cut", err)
	err = c.Complete(ctx, tx, idem.Reservation{Scope: lostScope, Key: "cut", Token: 1}, okResponse)
	wantUnavailable(t, "Complete after the cut", err)
	wantUnavailable(t, "the caller's Commit after the cut", tx.Commit(ctx))
	if rec := lookupStatus(ctx, t, c, pool, "cut-in-tx"); rec.Status != "" {
		t.Fatalf("a transaction cut before its commit committed: %+v", rec)
	}
}

func TestMigrateUnavailableWhenCommitAcknowledgementLost(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	direct := pgtest.URL(t, noMigrate)
	target, err := relay.Target(direct)
	if err != nil {
		t.Fatal(err)
	}
	var armed atomic.Bool
	armed.Store(true)
	r, err := relay.Start(target, relay.Options{DropAfterCommit: func() bool { return armed.CompareAndSwap(true, false) }})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	relayed, err := r.ConnString(direct)
	if err != nil {
		t.Fatal(err)
	}
	through, err := pgxpool.New(ctx, relayed)
	if err != nil {
		t.Fatal(err)
	}
	defer through.Close()
	err = idem.Migrate(ctx, through)
	if r.CommitsCut() != 1 {
		t.Fatalf("no COMMIT acknowledgement was dropped (%v)", err)
	}
	wantUnavailable(t, "Migrate with a COMMIT acknowledgement lost", err)
	// The retry finishes the job.
	if err := idem.Migrate(ctx, through); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	if _, err := idem.ReadStats(ctx, through); err != nil {
		t.Fatalf("after Migrate: %v", err)
	}
}

// An immediate restart of the server under connections opened before it:
// every call on such a connection fails with an error for which
// Unavailable is true (twice: the second meets pgx's "conn closed"), and
// the retry on a new connection runs. A caller's transaction that was
// open across the restart gets the same from its own Exec and Commit.
func TestUnavailableAcrossRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	t.Parallel()
	srv, err := pgserver.StartTempCluster(t.Context())
	if errors.Is(err, pgserver.ErrNoBinaries) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	// The throwaway cluster runs with synchronous_commit off.
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "on"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	pool.Close()
	c := mustClient(t, idem.Config{})

	cases := lostCases()
	conns := make([]*pgx.Conn, len(cases))
	res := make([]idem.Reservation, len(cases))
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i, tc := range cases {
		if tc.set != nil {
			res[i] = tc.set(ctx, t, c, pool, "restart-"+tc.name)
		}
		if conns[i], err = pgx.ConnectConfig(ctx, cfg.ConnConfig); err != nil {
			t.Fatal(err)
		}
		defer conns[i].Close(context.Background())
	}
	open, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close(context.Background())
	tx, err := open.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Do(ctx, tx, lostScope, "restart-open-tx", fpA, okFn); err != nil {
		t.Fatal(err)
	}
	pool.Close()
	migrateCfg := cfg.Copy()
	migrateCfg.MaxConns = 1
	migrateCfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	migratePool, err := pgxpool.NewWithConfig(ctx, migrateCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer migratePool.Close()
	if err := migratePool.Ping(ctx); err != nil {
		t.Fatal(err)
	}

	if err := srv.Restart(ctx); err != nil {
		t.Fatal(err)
	}

	_, err = tx.Exec(ctx, `SELECT 1`)
	wantUnavailable(t, "the caller's Exec across the restart", err)
	wantUnavailable(t, "the caller's Commit across the restart", tx.Commit(ctx))
	wantUnavailable(t, "Migrate across the restart", idem.Migrate(ctx, migratePool))
	for i, tc := range cases {
		key := "restart-" + tc.name
		for try := range 2 {
			wantUnavailable(t, fmt.Sprintf("%s across the restart (call %d)", tc.name, try+1), tc.act(ctx, c, conns[i], key, res[i]))
		}
	}
	if t.Failed() {
		return
	}
	// Retried on new connections, every call runs.
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate after the restart: %v", err)
	}
	for i, tc := range cases {
		key := "restart-" + tc.name
		if err := tc.act(ctx, c, pool, key, res[i]); err != nil {
			t.Errorf("%s after the restart: %v", tc.name, err)
			continue
		}
		if tc.check != nil {
			tc.check(ctx, t, c, pool, key, res[i], true)
		}
	}
	if rec := lookupStatus(ctx, t, c, pool, "restart-open-tx"); rec.Status != "" {
		t.Fatalf("a transaction open across the restart committed: %+v", rec)
	}
}

// Migrate waiting for the migration lock that another run holds stops at
// once, Unavailable, when the server goes away, instead of polling for the
// lock's five minutes.
func TestMigrateWaitingForTheLockFailsFastWhenTheServerGoes(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	direct := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, direct)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// A migration to apply, and another run holds the lock, with a long
	// lease.
	if _, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil {
		t.Fatal(err)
	}
	if tag, err := pool.Exec(ctx, `UPDATE `+idem.MigrationLockTable+` SET locked = true, locked_by = 'other',
		lease_expires_at = now() + interval '1 hour' WHERE lock_id = $1`, idem.MigrationLockID); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("holding the lock: %v, %v", tag, err)
	}
	target, err := relay.Target(direct)
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.Start(target, relay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	relayed, err := r.ConnString(direct)
	if err != nil {
		t.Fatal(err)
	}
	through, err := pgxpool.New(ctx, relayed)
	if err != nil {
		t.Fatal(err)
	}
	defer through.Close()
	done := make(chan error, 1)
	go func() { done <- idem.Migrate(ctx, through) }()
	time.Sleep(500 * time.Millisecond) // waiting for the lock
	_ = r.Close()                      // the server is gone
	select {
	case err := <-done:
		wantUnavailable(t, "Migrate waiting for the lock when the server went away", err)
	case <-ctx.Done():
		t.Fatal("Migrate still waits for the lock a minute after the server went away")
	}
}
