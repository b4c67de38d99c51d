package idem_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// fillKeys inserts n finished rows for scope "bulk"/"op", keys k1..kn; past
// their TTL when expired is true.
func fillKeys(t *testing.T, pool *pgxpool.Pool, n int, expired bool) {
	t.Helper()
	expiry := "now() + interval '1 hour'"
	if expired {
		expiry = "now() - interval '1 second' * i" // oldest first: kn
	}
	if _, err := pool.Exec(context.Background(), `INSERT INTO idem_keys
		(actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at)
		SELECT 'bulk', 'op', 'k' || i, '\x00', 'succeeded', 200, '\x', `+expiry+`
		FROM generate_series(1, $1) i`, n); err != nil {
		t.Fatal(err)
	}
}

func TestPruneDeletesOnlyExpiredFinishedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	fillKeys(t, pool, 2500, true)
	// Rows Prune must leave: finished and live, reservations in flight or
	// unknown whatever their expiry.
	if _, err := pool.Exec(ctx, `INSERT INTO idem_keys
		(actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at, token, lease_expires_at)
		VALUES ('keep', 'op', 'live', '\x00', 'succeeded', 200, '\x', now() + interval '1 hour', 0, NULL),
		       ('keep', 'op', 'leased', '\x00', 'processing', NULL, NULL, now() - interval '1 hour', 7, now() + interval '1 hour'),
		       ('keep', 'op', 'lapsed', '\x00', 'processing', NULL, NULL, now() - interval '1 hour', 8, now() - interval '1 hour'),
		       ('keep', 'op', 'unknown', '\x00', 'unknown', NULL, NULL, now() - interval '1 hour', 9, now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}

	// One bounded batch, then the rest.
	n, err := idem.Prune(ctx, pool, idem.PruneOptions{BatchSize: 1000, MaxBatches: 1})
	if err != nil || n != 1000 {
		t.Fatalf("one batch: %d, %v; want 1000", n, err)
	}
	// The oldest went first.
	if got := count(t, pool, `SELECT count(*) FROM idem_keys WHERE actor = 'bulk' AND substr(idem_key, 2)::int > 1500`); got != 0 {
		t.Fatalf("%d of the oldest rows left after the first batch", got)
	}
	n, err = idem.Prune(ctx, pool, idem.PruneOptions{BatchSize: 300})
	if err != nil || n != 1500 {
		t.Fatalf("the rest: %d, %v; want 1500", n, err)
	}
	if got := count(t, pool, `SELECT count(*) FROM idem_keys WHERE actor = 'keep'`); got != 4 {
		t.Fatalf("%d of the 4 rows Prune must keep are left", got)
	}
	if n, err := idem.Prune(ctx, pool, idem.PruneOptions{}); err != nil || n != 0 {
		t.Fatalf("nothing left: %d, %v", n, err)
	}
}

// Prune passes by keys in flight: a claim of a new key not yet committed,
// and the take-over of an expired key not yet committed.
func TestPruneBesideInFlightClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	short, err := idem.New(idem.Config{TTL: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	if _, err := short.DoInTx(ctx, pool, scope, "old", fpA, recordEffect(&calls, "old")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)

	// Two calls hold their claims open: one takes the expired key over, one
	// claims a new key.
	inFn := make(chan struct{}, 2)
	release := make(chan struct{})
	var wg sync.WaitGroup
	for _, key := range []string{"old", "new"} {
		wg.Go(func() {
			_, err := idem.DoInTx(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				inFn <- struct{}{}
				<-release
				return recordEffect(&calls, key)(ctx, tx)
			})
			if err != nil {
				t.Error(key, err)
			}
		})
	}
	<-inFn
	<-inFn
	n, err := idem.Prune(ctx, pool, idem.PruneOptions{})
	if err != nil || n != 0 {
		t.Fatalf("Prune beside claims in flight: %d, %v; want 0", n, err)
	}
	close(release)
	wg.Wait()
	for _, key := range []string{"old", "new"} {
		res, err := idem.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key))
		if err != nil || !res.Replayed {
			t.Fatalf("%s after the claims committed: %+v, %v", key, res, err)
		}
	}
	if calls.Load() != 3 {
		t.Fatalf("fn ran %d times, want 3", calls.Load())
	}
}

// Several pruners at once delete each row once and never wait on each
// other; the table is large enough that a scan per batch would show.
func TestPruneConcurrentWorkersAtScale(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	const rows = 60000
	fillKeys(t, pool, rows, true)
	fillKeys2 := `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at)
		SELECT 'live', 'op', 'k' || i, '\x00', 'succeeded', 200, '\x', now() + interval '1 hour' FROM generate_series(1, 20000) i`
	if _, err := pool.Exec(ctx, fillKeys2); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE idem_keys`); err != nil {
		t.Fatal(err)
	}
	var total atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			n, err := idem.Prune(ctx, pool, idem.PruneOptions{BatchSize: 500})
			if err != nil {
				t.Error(err)
			}
			total.Add(n)
		})
	}
	wg.Wait()
	if total.Load() != rows {
		t.Fatalf("pruned %d rows, want %d", total.Load(), rows)
	}
	if got := keyRows(t, pool); got != 20000 {
		t.Fatalf("%d rows left, want the 20000 live ones", got)
	}
}

func TestPruneBadOptions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	fillKeys(t, pool, 10, true)
	for _, opts := range []idem.PruneOptions{{BatchSize: -1}, {MaxBatches: -1}} {
		if n, err := idem.Prune(ctx, pool, opts); !errors.Is(err, idem.ErrInvalidArgument) || n != 0 {
			t.Errorf("%+v: %d, %v; want ErrInvalidArgument", opts, n, err)
		}
	}
	if _, err := idem.Prune(ctx, nil, idem.PruneOptions{}); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("nil db: %v", err)
	}
	// In a caller's transaction Prune works in savepoints and leaves the
	// planner settings alone.
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		n, err := idem.Prune(ctx, tx, idem.PruneOptions{DryRun: true})
		if err != nil || n != 10 {
			t.Errorf("in a pgx.Tx: %d, %v", n, err)
		}
		var seqscan string
		if err := tx.QueryRow(ctx, `SHOW enable_seqscan`).Scan(&seqscan); err != nil || seqscan != "on" {
			t.Errorf("enable_seqscan after Prune in a pgx.Tx: %q, %v", seqscan, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := keyRows(t, pool); got != 10 {
		t.Fatalf("bad options changed the table: %d rows", got)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := idem.Prune(cancelled, pool, idem.PruneOptions{}); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled context: %v", err)
	}
}

func TestPruneDryRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	fillKeys(t, pool, 42, true)
	n, err := idem.Prune(ctx, pool, idem.PruneOptions{DryRun: true})
	if err != nil || n != 42 {
		t.Fatalf("dry run: %d, %v; want 42", n, err)
	}
	if got := keyRows(t, pool); got != 42 {
		t.Fatalf("a dry run deleted rows: %d left", got)
	}
}

// A dry run with MaxBatches counts what Prune with the same options would
// delete: at most MaxBatches batches of BatchSize, not every expired key.
func TestPruneDryRunBoundedByMaxBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	fillKeys(t, pool, 42, true)
	opts := idem.PruneOptions{BatchSize: 10, MaxBatches: 2}
	dry := opts
	dry.DryRun = true
	would, err := idem.Prune(ctx, pool, dry)
	if err != nil {
		t.Fatal(err)
	}
	did, err := idem.Prune(ctx, pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	if did != 20 || would != did {
		t.Fatalf("dry run said %d, Prune with the same options deleted %d (want 20)", would, did)
	}
	// Without MaxBatches, every expired key.
	dry.MaxBatches = 0
	if n, err := idem.Prune(ctx, pool, dry); err != nil || n != 22 {
		t.Fatalf("unbounded dry run: %d, %v; want 22", n, err)
	}
}
