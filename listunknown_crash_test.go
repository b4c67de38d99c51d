package idem_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// A crashed worker's record (no window) whose lease ran out is listed by
// ListUnknown at once, still 'processing', without ExpireLeases or a
// client's retry first; ListResumable does not list it; Resolve with its
// token settles it, and ListUnknown no longer lists it.
func TestListUnknownShowsExpiredLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{})
	const key = "crashed-worker"
	workerPool, err := pgxpool.New(ctx, pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	r, err := c.Reserve(ctx, workerPool, payScope, key, fpA, 200*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	workerPool.Close() // the crash: no Complete, no MarkUnknown

	if unknown, err := c.ListUnknown(ctx, pool, 10, nil); err != nil || len(unknown) != 0 {
		t.Fatalf("during the lease: %+v, %v", unknown, err)
	}
	waitPast(t, pool, payScope, key, "lease_expires_at")
	unknown, err := c.ListUnknown(ctx, pool, 10, nil)
	if err != nil || len(unknown) != 1 || unknown[0].Key != key || unknown[0].Token != r.Token ||
		unknown[0].Status != idem.StatusProcessing {
		t.Fatalf("after the lease: %+v, %v", unknown, err)
	}
	if resumable, err := c.ListResumable(ctx, pool, 10, nil); err != nil || len(resumable) != 0 {
		t.Fatalf("ListResumable: %+v, %v", resumable, err)
	}
	err = c.Resolve(ctx, pool, payScope, key, idem.Resolution{Token: unknown[0].Token, Retryable: true, Reason: "no charge at the gateway"})
	if err != nil {
		t.Fatal(err)
	}
	if unknown, err := c.ListUnknown(ctx, pool, 10, nil); err != nil || len(unknown) != 0 {
		t.Fatalf("after Resolve: %+v, %v", unknown, err)
	}
}
