package idem_test

import (
	"context"
	"errors"
	"maps"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

func TestLookupAndForget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	first, err := idem.DoInTx(ctx, pool, scope, "look", fpA, recordEffect(&calls, "look"))
	if err != nil {
		t.Fatal(err)
	}
	rec, err := idem.Lookup(ctx, pool, scope, "look")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status != idem.StatusSucceeded || rec.Fingerprint != fpA || rec.Scope != scope || rec.Key != "look" ||
		rec.Response == nil || string(rec.Response.Body) != string(first.Body) || rec.Response.Status != 201 ||
		rec.CreatedAt.IsZero() || rec.CompletedAt.IsZero() || !rec.ExpiresAt.After(time.Now()) {
		t.Fatalf("Lookup: %+v", rec)
	}
	// Another actor's key of the same name is another key.
	if _, err := idem.Lookup(ctx, pool, idem.Scope{Actor: "mallory", Operation: scope.Operation}, "look"); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("another actor: %v", err)
	}

	// Forget frees the key: the same key with another request runs.
	if err := idem.Forget(ctx, pool, scope, "look"); err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Lookup(ctx, pool, scope, "look"); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("after Forget: %v", err)
	}
	if err := idem.Forget(ctx, pool, scope, "look"); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("Forget twice: %v", err)
	}
	res, err := idem.DoInTx(ctx, pool, scope, "look", fpB, recordEffect(&calls, "look"))
	if err != nil || res.Replayed || calls.Load() != 2 {
		t.Fatalf("after Forget: %+v, %v", res, err)
	}
}

// Forget refuses keys in flight and unknown outcomes, and changes nothing.
func TestForgetRefusesKeysInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	r, err := idem.Reserve(ctx, pool, scope, "leased", fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.Forget(ctx, pool, scope, "leased"); !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("a live reservation: %v", err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "timed out"); err != nil {
		t.Fatal(err)
	}
	if err := idem.Forget(ctx, pool, scope, "leased"); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("an unknown outcome: %v", err)
	}

	// A lease that ran out, the record still processing: Forget answers as
	// Reserve and Do do, and changes nothing.
	if _, err := idem.Reserve(ctx, pool, scope, "lapsed", fpA, time.Millisecond); err != nil {
		t.Fatal(err)
	}
	waitPast(t, pool, scope, "lapsed", "lease_expires_at")
	before := readRow(t, pool, scope, "lapsed")
	if err := idem.Forget(ctx, pool, scope, "lapsed"); !errors.Is(err, idem.ErrOutcomeUnknown) || errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("Forget of a lapsed lease: %v, want ErrOutcomeUnknown", err)
	}
	if after := readRow(t, pool, scope, "lapsed"); after.Status != before.Status || after.Token != before.Token {
		t.Fatalf("Forget of a lapsed lease changed the row: %+v", after)
	}
	if _, err := idem.DoInTx(ctx, pool, scope, "lapsed", fpA, recordEffect(&calls, "lapsed")); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("DoInTx on a lapsed lease: %v", err)
	}

	// A take-over of an expired key that has not committed holds its row.
	short, _ := idem.New(idem.Config{TTL: time.Millisecond})
	if _, err := short.DoInTx(ctx, pool, scope, "old", fpA, recordEffect(&calls, "old")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := idem.Do(ctx, tx, scope, "old", fpA, recordEffect(&calls, "old")); err != nil {
		t.Fatal(err)
	}
	if err := idem.Forget(ctx, pool, scope, "old"); !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("a take-over in flight: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if keyRows(t, pool) != 3 {
		t.Fatalf("%d rows, want all kept", keyRows(t, pool))
	}

	for _, bad := range []func() error{
		func() error { return idem.Forget(ctx, pool, scope, "") },
		func() error { return idem.Forget(ctx, pool, idem.Scope{}, "old") },
		func() error { return idem.Forget(ctx, nil, scope, "old") },
		func() error { _, err := idem.Lookup(ctx, pool, scope, "has space"); return err },
		func() error { _, err := idem.Lookup(ctx, nil, scope, "old"); return err },
	} {
		err := bad()
		if !errors.Is(err, idem.ErrInvalidKey) && !errors.Is(err, idem.ErrInvalidScope) && !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("bad input: %v", err)
		}
	}
}

func TestReadStats(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	for _, key := range []string{"s1", "s2"} {
		if _, err := idem.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := idem.DoInTx(ctx, pool, scope, "no", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{}, idem.Reject(idem.Response{Status: 402})
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Reserve(ctx, pool, scope, "r", fpA, time.Minute); err != nil {
		t.Fatal(err)
	}
	st, err := idem.ReadStats(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	if st.Keys[idem.StatusSucceeded] != 2 || st.Keys[idem.StatusRejected] != 1 || st.Keys[idem.StatusProcessing] != 1 ||
		st.OldestProcessing.IsZero() || !st.OldestUnknown.IsZero() || st.TableBytes <= 0 || st.IndexBytes <= 0 {
		t.Fatalf("%+v", st)
	}
	if _, err := idem.ReadStats(ctx, nil); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatal(err)
	}

	// A Client reads the same, in its own (here serializable) transaction.
	c, err := idem.New(idem.Config{IsolationLevel: pgx.Serializable})
	if err != nil {
		t.Fatal(err)
	}
	cst, err := c.ReadStats(ctx, pool)
	if err != nil || !maps.Equal(cst.Keys, st.Keys) || !cst.OldestProcessing.Equal(st.OldestProcessing) {
		t.Fatalf("Client.ReadStats: %+v, %v; want %+v", cst, err, st)
	}
	if _, err := c.ReadStats(ctx, nil); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatal(err)
	}
}

// A Client checks both halves of a call's target: its key (under its
// bounds) and its scope (the package's limits).
func TestClientValidateScope(t *testing.T) {
	t.Parallel()
	c, err := idem.New(idem.Config{MinKeyLength: 8})
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []idem.Scope{{}, {Actor: "a"}, {Operation: "o"}, {Actor: strings.Repeat("a", 256), Operation: "o"}, {Actor: "a\x00", Operation: "o"}} {
		if err := c.ValidateScope(bad); !errors.Is(err, idem.ErrInvalidScope) || err.Error() != idem.ValidateScope(bad).Error() {
			t.Errorf("%q: %v", bad, err)
		}
	}
	if err := c.ValidateScope(idem.Scope{Actor: "alice", Operation: "draw"}); err != nil {
		t.Error(err)
	}
}
