package idem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/callertest"
)

// When a record became unknown, through idem: see callertest.UnknownAt.
func TestUnknownAt(t *testing.T) {
	t.Parallel()
	callertest.UnknownAt(t, callertest.PgxFront(newPool(t)))
}

// A claim of DoInTx that fn committed without an outcome is marked unknown
// with the time it was (the lease that ended then, in the same statement);
// a verdict keeps it, and Do's take-over of the failed_retryable record
// clears it.
func TestUnknownAtOfAnOrphanedClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	_, err := idem.DoInTx(ctx, pool, scope, "orphan", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 200}, tx.Commit(ctx)
	})
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("fn committed: %v", err)
	}
	rec, err := idem.Lookup(ctx, pool, scope, "orphan")
	if err != nil || rec.Status != idem.StatusUnknown || rec.UnknownAt.IsZero() || !rec.UnknownAt.Equal(rec.LeaseExpiresAt) {
		t.Fatalf("the orphaned claim: %+v, %v", rec, err)
	}
	marked := rec.UnknownAt
	if err := idem.Resolve(ctx, pool, scope, "orphan", idem.Resolution{Token: rec.Token, Retryable: true, Reason: "rolled back by hand"}); err != nil {
		t.Fatal(err)
	}
	if rec, err := idem.Lookup(ctx, pool, scope, "orphan"); err != nil || !rec.UnknownAt.Equal(marked) {
		t.Fatalf("after the verdict: %+v, %v; want UnknownAt %s", rec, err, marked)
	}
	res, err := idem.DoInTx(ctx, pool, scope, "orphan", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201}, nil
	})
	if err != nil || res.Replayed {
		t.Fatalf("Do after the retryable verdict: %+v, %v", res, err)
	}
	if rec, err := idem.Lookup(ctx, pool, scope, "orphan"); err != nil || rec.Status != idem.StatusSucceeded || !rec.UnknownAt.IsZero() {
		t.Fatalf("taken over: %+v, %v", rec, err)
	}
}
