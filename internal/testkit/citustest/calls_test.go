package citustest_test

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Do, DoInTx, Reject, the typed calls and the inbox through the coordinator:
// one execution, replays byte for byte, ErrKeyReused; the key and the order
// on the same worker; Migrate and Distribute again change nothing.
func TestCallsDo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	scope := idem.Scope{Actor: "alice", Operation: "order"}

	first, err := idem.DoInTx(ctx, p, scope, "k1", fp("book"), order("alice", "k1", "book"))
	if err != nil || first.Replayed || first.Status != 201 {
		t.Fatalf("DoInTx: %+v, %v", first, err)
	}
	again, err := idem.DoInTx(ctx, p, scope, "k1", fp("book"), order("alice", "k1", "book"))
	if err != nil || !again.Replayed || !bytes.Equal(again.Body, first.Body) {
		t.Fatalf("replay: %+v, %v; first %s", again, err, first.Body)
	}
	_, err = idem.DoInTx(ctx, p, scope, "k1", fp("pen"), order("alice", "k1", "pen"))
	isErr(t, "other fingerprint", err, idem.ErrKeyReused)
	if n := ordersOf(t, p, "alice", "k1"); n != 1 {
		t.Fatalf("%d orders for k1", n)
	}
	if workerOf(t, p, "idem_keys", "alice") != workerOf(t, p, "orders", "alice") {
		t.Fatal("alice's key and orders are on different workers: not co-located")
	}

	// Do in the caller's transaction.
	tx, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res, err := idem.Do(ctx, tx, scope, "k2", fp("pen"), order("alice", "k2", "pen"))
	if err != nil || res.Replayed {
		t.Fatalf("Do: %+v, %v", res, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err = p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res2, err := idem.Do(ctx, tx, scope, "k2", fp("pen"), order("alice", "k2", "pen"))
	if err != nil || !res2.Replayed || !bytes.Equal(res2.Body, res.Body) {
		t.Fatalf("Do replay: %+v, %v", res2, err)
	}
	_ = tx.Rollback(ctx)

	// Reject: the refusal is stored, fn's writes undone, and replayed.
	refuse := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		if _, err := order("alice", "k3", "gold")(ctx, tx); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{}, idem.Reject(idem.Response{Status: 402, Body: []byte("no funds")})
	}
	for i := range 2 {
		res, err := idem.DoInTx(ctx, p, scope, "k3", fp("gold"), refuse)
		if err != nil || res.Status != 402 || res.Replayed != (i == 1) {
			t.Fatalf("Reject, call %d: %+v, %v", i, res, err)
		}
	}
	if n := ordersOf(t, p, "alice", "k3"); n != 0 {
		t.Fatalf("%d orders for a refused request", n)
	}

	// Typed results.
	type out struct{ N int }
	v, replayed, err := idem.DoInTxJSON(ctx, p, scope, "k4", fp("json"), func(ctx context.Context, tx pgx.Tx) (out, error) {
		return out{N: 7}, nil
	})
	if err != nil || replayed || v.N != 7 {
		t.Fatalf("DoInTxJSON: %v %v %v", v, replayed, err)
	}
	v, replayed, err = idem.DoInTxJSON(ctx, p, scope, "k4", fp("json"), func(ctx context.Context, tx pgx.Tx) (out, error) {
		return out{N: 8}, nil
	})
	if err != nil || !replayed || v.N != 7 {
		t.Fatalf("DoInTxJSON replay: %v %v %v", v, replayed, err)
	}

	// The inbox.
	runs := 0
	for i := range 2 {
		dup, err := idem.InboxInTx(ctx, p, "billing", "msg-1", []byte("payload"), func(ctx context.Context, tx pgx.Tx) error {
			runs++
			return nil
		})
		if err != nil || dup != (i == 1) {
			t.Fatalf("InboxInTx, delivery %d: duplicate %v, %v", i, dup, err)
		}
	}
	if runs != 1 {
		t.Fatalf("inbox handler ran %d times", runs)
	}

	// Lookup and Forget.
	rec, err := idem.Lookup(ctx, p, scope, "k1")
	if err != nil || rec.Status != idem.StatusSucceeded || rec.Fingerprint != fp("book") {
		t.Fatalf("Lookup: %+v, %v", rec, err)
	}
	if err := idem.Forget(ctx, p, scope, "k1"); err != nil {
		t.Fatalf("Forget: %v", err)
	}
	_, err = idem.Lookup(ctx, p, scope, "k1")
	isErr(t, "Lookup after Forget", err, idem.ErrNotFound)

	// Migrations and distribution again: nothing to do.
	if err := idem.Migrate(ctx, p); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	if err := idem.Distribute(ctx, p); err != nil {
		t.Fatalf("Distribute again: %v", err)
	}
}

// The reservation mode through the coordinator: Reserve, Heartbeat,
// Complete, FailRetryable and the next attempt (a new token from the
// coordinator's sequence), MarkUnknown, ListUnknown, Resolve both ways,
// ExpireLeases.
func TestCallsReserve(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	scope := idem.Scope{Actor: "bob", Operation: "charge"}

	// Reserve, Heartbeat, Complete; then a replay.
	r, err := idem.Reserve(ctx, p, scope, "r1", fp("10"), time.Minute)
	if err != nil || r.Token <= 0 || r.Replayed {
		t.Fatalf("Reserve: %+v, %v", r, err)
	}
	_, err = idem.Reserve(ctx, p, scope, "r1", fp("10"), time.Minute)
	isErr(t, "Reserve while leased", err, idem.ErrInProgress)
	if r, err = idem.Heartbeat(ctx, p, r, time.Minute); err != nil {
		t.Fatalf("Heartbeat: %v", err)
	}
	err = idem.InTx(ctx, p, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := order("bob", "r1", "charge")(ctx, tx); err != nil {
			return err
		}
		return idem.Complete(ctx, tx, r, idem.Response{Status: 201, Body: []byte("charged")})
	})
	if err != nil {
		t.Fatalf("Complete: %v", err)
	}
	rep, err := idem.Reserve(ctx, p, scope, "r1", fp("10"), time.Minute)
	if err != nil || !rep.Replayed || string(rep.Body) != "charged" {
		t.Fatalf("Reserve after Complete: %+v, %v", rep, err)
	}

	// FailRetryable, then the next attempt takes the record over.
	r2, err := idem.Reserve(ctx, p, scope, "r2", fp("20"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.FailRetryable(ctx, p, r2, "gateway refused the connection"); err != nil {
		t.Fatalf("FailRetryable: %v", err)
	}
	r2b, err := idem.Reserve(ctx, p, scope, "r2", fp("20"), time.Minute)
	if err != nil || r2b.Replayed || r2b.Token <= r2.Token {
		t.Fatalf("Reserve after FailRetryable: %+v, %v (old token %d)", r2b, err, r2.Token)
	}
	err = idem.InTx(ctx, p, func(ctx context.Context, tx pgx.Tx) error {
		return idem.Complete(ctx, tx, r2, idem.Response{Status: 201})
	})
	isErr(t, "Complete with the old token", err, idem.ErrFenced)

	// MarkUnknown, ListUnknown, Resolve as succeeded.
	r3, err := idem.Reserve(ctx, p, scope, "r3", fp("30"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, p, r3, "gateway timed out"); err != nil {
		t.Fatalf("MarkUnknown: %v", err)
	}
	_, err = idem.Reserve(ctx, p, scope, "r3", fp("30"), time.Minute)
	isErr(t, "Reserve of an unknown outcome", err, idem.ErrOutcomeUnknown)
	recs, err := idem.ListUnknown(ctx, p, 10, nil)
	if err != nil || len(recs) != 1 || recs[0].Key != "r3" {
		t.Fatalf("ListUnknown: %+v, %v", recs, err)
	}
	if err := idem.Resolve(ctx, p, scope, "r3", idem.Resolution{Token: recs[0].Token,
		Succeeded: &idem.Response{Status: 201, Body: []byte("found at the provider")}, Reason: "checked"}); err != nil {
		t.Fatalf("Resolve succeeded: %v", err)
	}
	rep, err = idem.Reserve(ctx, p, scope, "r3", fp("30"), time.Minute)
	if err != nil || !rep.Replayed || string(rep.Body) != "found at the provider" {
		t.Fatalf("Reserve after Resolve: %+v, %v", rep, err)
	}

	// A lease that runs out: ExpireLeases turns it unknown; Resolve as
	// retryable; the next Reserve runs.
	r4, err := idem.Reserve(ctx, p, scope, "r4", fp("40"), time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	n, err := idem.ExpireLeases(ctx, p, 100)
	if err != nil || n != 1 {
		t.Fatalf("ExpireLeases: %d, %v", n, err)
	}
	if err := idem.Resolve(ctx, p, scope, "r4", idem.Resolution{Token: r4.Token, Retryable: true, Reason: "not charged"}); err != nil {
		t.Fatalf("Resolve retryable: %v", err)
	}
	r4b, err := idem.Reserve(ctx, p, scope, "r4", fp("40"), time.Minute)
	if err != nil || r4b.Replayed || r4b.Token <= r4.Token {
		t.Fatalf("Reserve after Resolve retryable: %+v, %v", r4b, err)
	}
	if _, err := idem.Heartbeat(ctx, p, r4, time.Minute); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("Heartbeat of the fenced reservation: %v", err)
	}
}

// Keys past their TTL: a new request takes the key over, by Do and by
// Reserve.
func TestCallsTakeOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	short, err := idem.New(idem.Config{TTL: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "carol", Operation: "order"}
	if _, err := short.DoInTx(ctx, p, scope, "t1", fp("a"), order("carol", "t1", "a")); err != nil {
		t.Fatal(err)
	}
	r, err := short.Reserve(ctx, p, scope, "t2", fp("b"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := short.InTx(ctx, p, func(ctx context.Context, tx pgx.Tx) error {
		return short.Complete(ctx, tx, r, idem.Response{Status: 200})
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)

	r2, err := short.Reserve(ctx, p, scope, "t2", fp("other"), time.Minute)
	if err != nil || r2.Replayed || r2.Token <= r.Token {
		t.Fatalf("Reserve past the TTL: %+v, %v", r2, err)
	}
	res, err := short.DoInTx(ctx, p, scope, "t1", fp("other"), order("carol", "t1", "other"))
	if err != nil || res.Replayed {
		t.Fatalf("DoInTx past the TTL: %+v, %v", res, err)
	}
	if n := ordersOf(t, p, "carol", "t1"); n != 2 {
		t.Fatalf("%d orders for t1, want one per TTL generation", n)
	}
}

// Prune deletes finished keys past their TTL, never a reservation in flight
// or unknown, and ReadStats counts what is left.
func TestCallsPrune(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	short, err := idem.New(idem.Config{TTL: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "carol", Operation: "order"}
	for _, k := range []string{"p1", "p2", "p3", "p4"} {
		if _, err := short.DoInTx(ctx, p, idem.Scope{Actor: "dave-" + k, Operation: "order"}, k, fp(k),
			order("dave-"+k, k, k)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := short.Reserve(ctx, p, scope, "inflight", fp("i"), time.Minute); err != nil {
		t.Fatal(err)
	}
	u, err := short.Reserve(ctx, p, scope, "u1", fp("u"), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := short.MarkUnknown(ctx, p, u, "lost"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	n, err := idem.Prune(ctx, p, idem.PruneOptions{DryRun: true})
	if err != nil || n != 4 {
		t.Fatalf("Prune dry run: %d, %v", n, err)
	}
	n, err = idem.Prune(ctx, p, idem.PruneOptions{BatchSize: 3})
	if err != nil || n != 4 {
		t.Fatalf("Prune: %d, %v", n, err)
	}
	st, err := idem.ReadStats(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	if st.Keys[idem.StatusProcessing] != 1 || st.Keys[idem.StatusUnknown] != 1 || len(st.Keys) != 2 {
		t.Fatalf("ReadStats after Prune: %+v", st.Keys)
	}
}

// Config.BodyTTL through the coordinator: past the body's life a replay is
// ErrResponseGone with the stored status and nothing runs; another request
// is still ErrKeyReused; Prune (KeyDropBodiesCitus) drops the bodies on the
// workers and keeps the keys.
func TestCallsBodyTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	const life = 200 * time.Millisecond
	c, err := idem.New(idem.Config{TTL: time.Hour, BodyTTL: life})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"b1", "b2", "b3"} {
		if _, err := c.DoInTx(ctx, p, idem.Scope{Actor: "erin-" + k, Operation: "order"}, k, fp(k), order("erin-"+k, k, k)); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(life + 100*time.Millisecond)
	check := func(when string) {
		t.Helper()
		for _, k := range []string{"b1", "b2", "b3"} {
			scope := idem.Scope{Actor: "erin-" + k, Operation: "order"}
			res, err := c.DoInTx(ctx, p, scope, k, fp(k), order("erin-"+k, k, k))
			if !errors.Is(err, idem.ErrResponseGone) || !res.Replayed || res.Status == 0 {
				t.Errorf("%s %s: %+v, %v; want ErrResponseGone with the stored status", k, when, res, err)
			}
			if _, err := c.DoInTx(ctx, p, scope, k, fp("other"), order("erin-"+k, k, "other")); !errors.Is(err, idem.ErrKeyReused) {
				t.Errorf("%s %s, another request: %v, want ErrKeyReused", k, when, err)
			}
			if n := ordersOf(t, p, "erin-"+k, k); n != 1 {
				t.Errorf("%s %s: %d orders, want 1", k, when, n)
			}
		}
	}
	check("past BodyTTL")
	if n, err := c.Prune(ctx, p, idem.PruneOptions{BatchSize: 2}); err != nil || n != 0 {
		t.Fatalf("Prune: %d keys deleted, %v; want 0", n, err)
	}
	var dropped int
	if err := p.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE response_body IS NULL AND response_status IS NOT NULL`).Scan(&dropped); err != nil || dropped != 3 {
		t.Fatalf("%d bodies dropped, %v; want 3", dropped, err)
	}
	check("after Prune")
}

// A TTLFor whose answer changes between two of its calls gives each call
// the TTL its claim read, on Citus too (whose completion is KeyCompleteCitus):
// the completion does not take the change for fn having changed its row.
func TestCallsTTLForChangingMidCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	var n atomic.Int64
	c, err := idem.New(idem.Config{TTLFor: func(string) time.Duration {
		return time.Hour + time.Duration(n.Add(1))*time.Minute // a new answer on every call
	}})
	if err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "frank", Operation: "order"}
	if _, err := c.DoInTx(ctx, p, scope, "t1", fp("t1"), order("frank", "t1", "t1")); err != nil {
		t.Fatalf("DoInTx: %v", err)
	}
	if err := pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
		_, err := c.Do(ctx, tx, scope, "t2", fp("t2"), order("frank", "t2", "t2"))
		return err
	}); err != nil {
		t.Fatalf("Do: %v", err)
	}
	var odd int
	if err := p.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE actor = 'frank'
		AND (status <> 'succeeded' OR expires_at - created_at < interval '61 minutes')`).Scan(&odd); err != nil || odd != 0 {
		t.Fatalf("%d rows not stored with a TTL TTLFor gave (%v)", odd, err)
	}
}
