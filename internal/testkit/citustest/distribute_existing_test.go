package citustest_test

import (
	"bytes"
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
	"github.com/pgidem/idem/internal/testkit/citustest"
)

// A service that already stores keys moves to Citus: idem_keys, the audit
// trail (idem_audit) and the service's orders hold rows on the coordinator
// when Distribute runs.
// create_distributed_table copies them into the shards, and every outcome
// stored before answers as before through the coordinator: replays byte for
// byte, refusals, ErrKeyReused, unknown outcomes resolved by their token, a
// live reservation completed by its owner, a retryable one run again; the
// trail's rows land on the workers of their keys. The copy the coordinator
// keeps on disk is removed with truncate_local_data_after_distributing_table,
// as docs/citus.md says.
func TestDistributeExistingKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := citustest.Empty(t)
	p := pool(t, db.URL)
	if err := idem.Migrate(ctx, p); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, `CREATE TABLE orders (
		actor text NOT NULL, id bigserial, idem_key text NOT NULL, item text NOT NULL, PRIMARY KEY (actor, id))`); err != nil {
		t.Fatal(err)
	}

	// Before: idem_keys and orders are local tables on the coordinator.
	const actors = 40
	scope := func(i int) idem.Scope { return idem.Scope{Actor: "actor-" + strconv.Itoa(i), Operation: "order"} }
	first := make([]idem.Result, actors)
	for i := range actors {
		res, err := idem.DoInTx(ctx, p, scope(i), "k1", fp("book"), order(scope(i).Actor, "k1", "book"))
		if err != nil || res.Replayed {
			t.Fatalf("DoInTx before: %+v, %v", res, err)
		}
		first[i] = res
	}
	refusal := idem.Response{Status: 402, Body: []byte(`{"title":"insufficient points"}`)}
	if _, err := idem.DoInTx(ctx, p, scope(0), "k-rejected", fp("car"), func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{}, idem.Reject(refusal)
	}); err != nil {
		t.Fatal(err)
	}
	unknown, err := idem.Reserve(ctx, p, scope(1), "k-unknown", fp("charge"), time.Minute)
	if err == nil {
		err = idem.MarkUnknown(ctx, p, unknown, "gateway: no answer")
	}
	if err != nil {
		t.Fatal(err)
	}
	live, err := idem.Reserve(ctx, p, scope(2), "k-live", fp("charge"), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	retry, err := idem.Reserve(ctx, p, scope(3), "k-retry", fp("charge"), time.Minute)
	if err == nil {
		err = idem.FailRetryable(ctx, p, retry, "gateway: refused")
	}
	if err != nil {
		t.Fatal(err)
	}
	// An operator forgot a key: the trail holds a row for its actor.
	if _, err := idem.DoInTx(ctx, p, scope(4), "k-forget", fp("book"), order(scope(4).Actor, "k-forget", "book")); err != nil {
		t.Fatal(err)
	}
	if _, err := audit.Forget(ctx, p, nil, "sam", scope(4), "k-forget", nil, "reused"); err != nil {
		t.Fatal(err)
	}
	const rows = actors + 4

	// Distribute, then the service's table, co-located.
	if err := idem.Distribute(ctx, p); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, `SELECT create_distributed_table('orders', 'actor', colocate_with => 'idem_keys')`); err != nil {
		t.Fatal(err)
	}
	if n := count(t, p, `SELECT count(*) FROM citus_tables WHERE table_name = 'idem_keys'::regclass AND distribution_column = 'actor'`); n != 1 {
		t.Fatal("idem_keys is not distributed by actor")
	}
	// The rows moved to the shards: the workers hold every one.
	if n := count(t, p, `SELECT sum(result::bigint) FROM run_command_on_shards('idem_keys', $$SELECT count(*) FROM %s$$)`); n != rows {
		t.Fatalf("the shards hold %d rows, want %d", n, rows)
	}
	if n := count(t, p, `SELECT count(*) FROM idem_keys`); n != rows {
		t.Fatalf("the coordinator sees %d rows, want %d", n, rows)
	}
	if n := count(t, p, `SELECT sum(result::bigint) FROM run_command_on_shards('idem_audit', $$SELECT count(*) FROM %s$$)`); n != 1 {
		t.Fatalf("the shards hold %d audit rows, want 1", n)
	}
	if workerOf(t, p, "idem_audit", scope(4).Actor) != workerOf(t, p, "idem_keys", scope(4).Actor) {
		t.Fatal("the audit row and its key are on different workers")
	}
	// The coordinator's copies stay on disk, invisible, until truncated.
	for _, table := range []string{"idem_keys", "idem_audit"} {
		if n := count(t, p, `SELECT pg_relation_size($1::regclass)`, table); n == 0 {
			t.Fatalf("no local copy of %s left on the coordinator: the docs' truncate step would not be needed", table)
		}
	}
	if _, err := p.Exec(ctx, `SELECT truncate_local_data_after_distributing_table('idem_keys'),
		truncate_local_data_after_distributing_table('idem_audit'),
		truncate_local_data_after_distributing_table('orders')`); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"idem_keys", "idem_audit"} {
		if n := count(t, p, `SELECT pg_relation_size($1::regclass)`, table); n != 0 {
			t.Fatalf("the coordinator's local copy of %s is %d bytes after truncating it", table, n)
		}
	}

	// After: every stored outcome answers as before.
	for i := range actors {
		res, err := idem.DoInTx(ctx, p, scope(i), "k1", fp("book"), order(scope(i).Actor, "k1", "book"))
		if err != nil || !res.Replayed || res.Status != first[i].Status || !bytes.Equal(res.Body, first[i].Body) {
			t.Fatalf("replay of %s after Distribute: %+v, %v; first %+v", scope(i).Actor, res, err, first[i])
		}
		if n := ordersOf(t, p, scope(i).Actor, "k1"); n != 1 {
			t.Fatalf("%d orders for %s", n, scope(i).Actor)
		}
		if workerOf(t, p, "idem_keys", scope(i).Actor) != workerOf(t, p, "orders", scope(i).Actor) {
			t.Fatalf("%s's key and orders are on different workers", scope(i).Actor)
		}
	}
	_, err = idem.DoInTx(ctx, p, scope(0), "k1", fp("pen"), order(scope(0).Actor, "k1", "pen"))
	isErr(t, "another request under a key stored before", err, idem.ErrKeyReused)

	res, err := idem.DoInTx(ctx, p, scope(0), "k-rejected", fp("car"), func(context.Context, pgx.Tx) (idem.Response, error) {
		t.Error("fn ran for a stored refusal")
		return idem.Response{}, nil
	})
	if err != nil || !res.Replayed || res.Status != 402 || !bytes.Equal(res.Body, refusal.Body) {
		t.Fatalf("refusal after Distribute: %+v, %v", res, err)
	}

	_, err = idem.Reserve(ctx, p, scope(1), "k-unknown", fp("charge"), time.Minute)
	isErr(t, "unknown outcome", err, idem.ErrOutcomeUnknown)
	paid := idem.Response{Status: 201, Body: []byte(`{"charge":"ch_1"}`)}
	if err := idem.Resolve(ctx, p, scope(1), "k-unknown", idem.Resolution{Token: unknown.Token, Succeeded: &paid, Reason: "charged"}); err != nil {
		t.Fatal(err)
	}
	if r, err := idem.Reserve(ctx, p, scope(1), "k-unknown", fp("charge"), time.Minute); err != nil || !r.Replayed || !bytes.Equal(r.Body, paid.Body) {
		t.Fatalf("resolved outcome: %+v, %v", r, err)
	}

	_, err = idem.Reserve(ctx, p, scope(2), "k-live", fp("charge"), time.Minute)
	isErr(t, "live lease", err, idem.ErrInProgress)
	if err := idem.InTx(ctx, p, func(ctx context.Context, tx pgx.Tx) error {
		return idem.Complete(ctx, tx, live, paid)
	}); err != nil {
		t.Fatalf("Complete by the owner of a lease taken before Distribute: %v", err)
	}
	if r, err := idem.Reserve(ctx, p, scope(2), "k-live", fp("charge"), time.Minute); err != nil || !r.Replayed {
		t.Fatalf("completed reservation: %+v, %v", r, err)
	}

	again, err := idem.Reserve(ctx, p, scope(3), "k-retry", fp("charge"), time.Minute)
	if err != nil || again.Replayed || again.Token <= retry.Token {
		t.Fatalf("retryable reservation: %+v, %v; token before %d", again, err, retry.Token)
	}

	// A new key runs, on its actor's worker.
	res, err = idem.DoInTx(ctx, p, scope(5), "k2", fp("pen"), order(scope(5).Actor, "k2", "pen"))
	if err != nil || res.Replayed {
		t.Fatalf("new key after Distribute: %+v, %v", res, err)
	}
	if n := count(t, p, `SELECT count(*) FROM idem_keys`); n != rows+1 {
		t.Fatalf("%d rows, want %d", n, rows+1)
	}

	// The trail: the row written before Distribute, and one written after.
	if _, err := audit.Forget(ctx, p, nil, "sam", scope(5), "k2", nil, "reused"); err != nil {
		t.Fatal(err)
	}
	trail, err := audit.List(ctx, audit.Planned{DB: p}, audit.ListFilter{Limit: 10})
	if err != nil || len(trail) != 2 || trail[0].Scope != scope(5) || trail[1].Scope != scope(4) || trail[1].Key != "k-forget" {
		t.Fatalf("the trail after Distribute: %+v, %v", trail, err)
	}
}
