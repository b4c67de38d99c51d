package citustest_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/relay"
)

// Duplicates from two pools (two processes, as far as idem can tell), each
// with Clients of its own, meet at the primary key on the worker: one
// execution per key, and every answer is that execution's response.
func TestStormTwoPools(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, p1 := newDB(t)
	p2 := pool(t, db.URL)
	const keys, perPool = 8, 8
	for k := range keys {
		actor := fmt.Sprintf("storm-%d", k)
		key := fmt.Sprintf("key-%d", k)
		scope := idem.Scope{Actor: actor, Operation: "order"}
		var runs atomic.Int64
		var mu sync.Mutex
		var bodies [][]byte
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range 2 * perPool {
			p := p1
			if i%2 == 1 {
				p = p2
			}
			c, err := idem.New(idem.Config{Wait: 30 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			wg.Go(func() {
				<-start
				res, err := c.DoInTx(ctx, p, scope, key, fp("x"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
					runs.Add(1)
					return order(actor, key, "x")(ctx, tx)
				})
				if err != nil {
					t.Errorf("%s: %v", key, err)
					return
				}
				mu.Lock()
				bodies = append(bodies, res.Body)
				mu.Unlock()
			})
		}
		close(start)
		wg.Wait()
		if t.Failed() {
			return
		}
		if n := ordersOf(t, p1, actor, key); n != 1 {
			t.Fatalf("%s: %d orders committed (fn ran %d times)", key, n, runs.Load())
		}
		for _, b := range bodies {
			if !bytes.Equal(b, bodies[0]) {
				t.Fatalf("%s: answers differ: %s and %s", key, b, bodies[0])
			}
		}
	}
}

// A backend on the worker that holds the actor's shard is killed while fn
// runs: the call fails and stores nothing, and the retry runs fn once.
func TestFaultWorkerBackendKilled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, p := newDB(t)
	scope := idem.Scope{Actor: "erin", Operation: "order"}
	port := workerOf(t, p, "idem_keys", "erin")
	var workerURL string
	for _, w := range db.Workers {
		if bytes.Contains([]byte(w), fmt.Appendf(nil, ":%d/", port)) {
			workerURL = w
		}
	}
	worker, err := pgx.Connect(ctx, workerURL)
	if err != nil {
		t.Fatal(err)
	}
	defer worker.Close(ctx)

	_, err = idem.DoInTx(ctx, p, scope, "kill", fp("x"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		if _, err := order("erin", "kill", "x")(ctx, tx); err != nil {
			return idem.Response{}, err
		}
		// The coordinator's connections to the worker for this
		// transaction are gone.
		var killed int
		if err := worker.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'`).
			Scan(&killed); err != nil || killed == 0 {
			t.Errorf("killed %d backends: %v", killed, err)
		}
		return order("erin", "kill", "x")(ctx, tx)
	})
	// The worker's 57P01 reaches the client: a store failure, 503.
	if !idem.Unavailable(err) {
		t.Fatalf("DoInTx with its worker backend killed: %v, want Unavailable", err)
	}
	if n := ordersOf(t, p, "erin", "kill"); n != 0 {
		t.Fatalf("%d orders after the failed call", n)
	}
	if _, err := idem.Lookup(ctx, p, scope, "kill"); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("Lookup after the failed call: %v, want ErrNotFound", err)
	}
	res, err := idem.DoInTx(ctx, p, scope, "kill", fp("x"), order("erin", "kill", "x"))
	if err != nil || res.Replayed {
		t.Fatalf("retry: %+v, %v", res, err)
	}
	if n := ordersOf(t, p, "erin", "kill"); n != 1 {
		t.Fatalf("%d orders after the retry", n)
	}
}

// The coordinator's acknowledgement of COMMIT is lost on the way to the
// client: the call gets ErrUnavailable, the commit happened, and the retry
// replays it.
func TestFaultCommitAcknowledgementLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, direct := newDB(t)
	var armed atomic.Bool
	target, err := relay.Target(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.Start(target, relay.Options{DropAfterCommit: func() bool { return armed.CompareAndSwap(true, false) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	relayed, err := r.ConnString(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	p := pool(t, relayed)
	for i := range 3 {
		actor, key := fmt.Sprintf("frank-%d", i), fmt.Sprintf("ack-%d", i)
		scope := idem.Scope{Actor: actor, Operation: "order"}
		armed.Store(true)
		_, err := idem.DoInTx(ctx, p, scope, key, fp("x"), order(actor, key, "x"))
		if !errors.Is(err, idem.ErrUnavailable) {
			t.Fatalf("%s: acknowledgement lost: %v, want ErrUnavailable", key, err)
		}
		if n := ordersOf(t, direct, actor, key); n != 1 {
			t.Fatalf("%s: %d orders: the cut commit did not commit", key, n)
		}
		res, err := idem.DoInTx(ctx, p, scope, key, fp("x"), order(actor, key, "x"))
		if err != nil || !res.Replayed {
			t.Fatalf("%s: retry %+v, %v; want a replay", key, res, err)
		}
		if n := ordersOf(t, direct, actor, key); n != 1 {
			t.Fatalf("%s: %d orders after the retry", key, n)
		}
	}
	if r.CommitsCut() != 3 {
		t.Fatalf("%d commits cut, want 3", r.CommitsCut())
	}
}

// A twin waits for the holder of its key at most Config.Wait, then gets
// ErrInProgress: the holder's transaction is still open when the twin
// returns, so no clock is read. (The wait happens on the worker, which only
// a SET LOCAL lock_timeout statement reaches.)
func TestBoundedWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	scope := idem.Scope{Actor: "grace", Operation: "order"}
	holder, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := idem.Do(ctx, holder, scope, "held", fp("x"), order("grace", "held", "x")); err != nil {
		t.Fatal(err)
	}
	short, err := idem.New(idem.Config{Wait: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	twin := func(name string, call func() error) {
		done := make(chan error, 1)
		go func() { done <- call() }()
		select {
		case err := <-done:
			isErr(t, name+" of a held key", err, idem.ErrInProgress)
		case <-time.After(20 * time.Second):
			t.Fatalf("%s is still waiting for the holder: Config.Wait did not reach the worker", name)
		}
	}
	twin("Reserve", func() error {
		_, err := short.Reserve(ctx, p, scope, "held", fp("x"), time.Minute)
		return err
	})
	twin("DoInTx", func() error {
		_, err := short.DoInTx(ctx, p, scope, "held", fp("x"), order("grace", "held", "x"))
		return err
	})
	tx, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	twin("Do", func() error {
		_, err := short.Do(ctx, tx, scope, "held", fp("x"), order("grace", "held", "x"))
		return err
	})
}

// Config.Wait bounds the claim only: fn's own statements wait for locks as
// long as the server's lock_timeout says (here: without bound), on the
// coordinator and on the worker.
func TestWaitDoesNotBoundFn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	short, err := idem.New(idem.Config{Wait: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := p.QueryRow(ctx, `INSERT INTO orders (actor, idem_key, item) VALUES ('ivan', 'seed', 'x') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	// fn updates a row another transaction holds for a second.
	fn := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		var timeout string
		if err := tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&timeout); err != nil || timeout != "0" {
			return idem.Response{}, fmt.Errorf("lock_timeout in fn: %q, %v", timeout, err)
		}
		_, err := tx.Exec(ctx, `UPDATE orders SET item = item || '+' WHERE actor = 'ivan' AND id = $1`, id)
		return idem.Response{Status: 200}, err
	}
	hold := func() {
		locker, err := p.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := locker.Exec(ctx, `UPDATE orders SET item = item WHERE actor = 'ivan' AND id = $1`, id); err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(time.Second, func() { _ = locker.Commit(ctx) })
	}
	hold()
	if _, err := short.DoInTx(ctx, p, idem.Scope{Actor: "ivan", Operation: "order"}, "w1", fp("x"), fn); err != nil {
		t.Fatalf("DoInTx: fn's wait was bounded: %v", err)
	}
	hold()
	err = pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
		_, err := short.Do(ctx, tx, idem.Scope{Actor: "ivan", Operation: "order"}, "w2", fp("x"), fn)
		return err
	})
	if err != nil {
		t.Fatalf("Do: fn's wait was bounded: %v", err)
	}
}

// On a warm connection (cache_statement), a Reserve refused after its
// bounded wait makes pgx drop the statements of its batch from its cache;
// the claim's statements are not among them: the next Do sends its claim
// with the statements prepared before (nothing prepared again outside its
// savepoint).
func TestFailedReserveKeepsClaimStatementsCached(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, p := newDB(t)
	scope := idem.Scope{Actor: "heidi", Operation: "order"}
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	client, err := idem.New(idem.Config{Wait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	do := func(key string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			_, err := client.Do(ctx, tx, scope, key, fp("x"), order("heidi", key, "x"))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	// prepared lists the statements prepared on conn that set lock_timeout,
	// with when each was prepared.
	prepared := func() map[string]time.Time {
		t.Helper()
		rows, err := conn.Query(ctx, `SELECT statement, prepare_time FROM pg_prepared_statements
			WHERE statement LIKE 'SET LOCAL lock_timeout%'`, pgx.QueryExecModeSimpleProtocol)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]time.Time{}
		var sql string
		var at time.Time
		if _, err := pgx.ForEachRow(rows, []any{&sql, &at}, func() error { got[sql] = at; return nil }); err != nil {
			t.Fatal(err)
		}
		return got
	}
	do("warm-1")
	do("warm-2")
	before := prepared()
	holder, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Do(ctx, holder, scope, "held", fp("x"), order("heidi", "held", "x")); err != nil {
		t.Fatal(err)
	}
	_, err = client.Reserve(ctx, conn, scope, "held", fp("x"), time.Minute)
	_ = holder.Rollback(ctx)
	isErr(t, "Reserve of a held key", err, idem.ErrInProgress)
	do("after")
	after := prepared()
	if len(before) == 0 {
		t.Fatal("no claim statement setting lock_timeout prepared on the warm connection")
	}
	for sql, at := range before {
		if !after[sql].Equal(at) {
			t.Errorf("%q prepared at %v before the failed Reserve, at %v after it: the claim prepared it again", sql, at, after[sql])
		}
	}
}
