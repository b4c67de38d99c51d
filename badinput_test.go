package idem_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Header names must be RFC 9110 tokens in every call that stores a
// response: anything else is ErrInvalidResponse and nothing changes.
func TestHeaderNamesMustBeTokens(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{})
	r, err := c.Reserve(ctx, pool, payScope, "pay", fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	u, err := c.Reserve(ctx, pool, payScope, "unknown", fpA, time.Minute)
	if err == nil {
		err = c.MarkUnknown(ctx, pool, u, "timeout")
	}
	if err != nil {
		t.Fatal(err)
	}
	before := tableState(t, pool)
	for _, name := range []string{"X-A: b", "Bad Name(x)", "X\tY", "Ünïcode", "a/b", "x@y", `"q"`, "{x}"} {
		resp := idem.Response{Status: 200, Header: map[string][]string{name: {"v"}}}
		fn := func(context.Context, pgx.Tx) (idem.Response, error) { return resp, nil }
		for call, err := range map[string]error{
			"Do": c.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				_, err := c.Do(ctx, tx, scope, "k", fpA, fn)
				return err
			}),
			"DoInTx":   func() error { _, err := c.DoInTx(ctx, pool, scope, "k", fpA, fn); return err }(),
			"Complete": completeTx(ctx, c, pool, r, resp),
			"Resolve":  c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: u.Token, Succeeded: &resp}),
		} {
			if !errors.Is(err, idem.ErrInvalidResponse) {
				t.Errorf("%s with header name %q: %v, want ErrInvalidResponse", call, name, err)
			}
		}
	}
	if after := tableState(t, pool); after != before {
		t.Fatalf("refused header names changed the table:\nbefore %s\nafter  %s", before, after)
	}
	// Every token character is fine.
	ok := idem.Response{Status: 200, Header: map[string][]string{"!#$%&'*+-.^_`|~09azAZ": {"v"}}}
	if err := completeTx(ctx, c, pool, r, ok); err != nil {
		t.Fatal(err)
	}
}

// ListUnknown's and ListResumable's cursor is checked before it reaches
// SQL: text that is not valid UTF-8 or holds NUL, or a time PostgreSQL
// cannot hold, is ErrInvalidArgument.
func TestListUnknownValidatesCursor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{})
	now := time.Now()
	for name, after := range map[string]idem.Record{
		"actor NUL":         {Scope: idem.Scope{Actor: "a\x00", Operation: "o"}, CreatedAt: now},
		"operation invalid": {Scope: idem.Scope{Actor: "a", Operation: "\xff"}, CreatedAt: now},
		"key NUL":           {Key: "k\x00", CreatedAt: now},
		"key invalid":       {Key: "\xc3", CreatedAt: now},
		"time too late":     {CreatedAt: time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)},
		"time too early":    {CreatedAt: time.Date(-5000, 1, 1, 0, 0, 0, 0, time.UTC)},
		"time far too late": {CreatedAt: time.Unix(math.MaxInt64/2, 0)},
	} {
		if _, err := c.ListUnknown(ctx, pool, 10, &after); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
		if _, err := c.ListResumable(ctx, pool, 10, &after); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("ListResumable, %s: %v, want ErrInvalidArgument", name, err)
		}
	}
	// The zero Record and PostgreSQL's own bounds are fine.
	for _, after := range []idem.Record{{}, {CreatedAt: time.Date(-4712, 1, 1, 0, 0, 0, 0, time.UTC)}, {CreatedAt: time.Date(294276, 1, 1, 0, 0, 0, 0, time.UTC)}} {
		if _, err := c.ListUnknown(ctx, pool, 10, &after); err != nil {
			t.Errorf("cursor at %s: %v", after.CreatedAt, err)
		}
		if _, err := c.ListResumable(ctx, pool, 10, &after); err != nil {
			t.Errorf("ListResumable, cursor at %s: %v", after.CreatedAt, err)
		}
	}
}

// Do and Complete on a transaction that is aborted (a statement failed)
// or closed (committed or rolled back) give ErrInvalidArgument, saying
// which, and change nothing.
func TestDoAndCompleteOnUnusableTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{})
	r, err := c.Reserve(ctx, pool, payScope, "pay", fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	before := tableState(t, pool)
	var calls atomicCounter
	for _, state := range []string{"aborted", "committed", "rolled back"} {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		switch state {
		case "aborted":
			_, _ = tx.Exec(ctx, `SELECT 1/0`)
		case "committed":
			err = tx.Commit(ctx)
		case "rolled back":
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Do(ctx, tx, scope, "k", fpA, calls.fn)
		if !errors.Is(err, idem.ErrInvalidArgument) || idem.Unavailable(err) {
			t.Errorf("Do on a %s transaction: %v, want ErrInvalidArgument", state, err)
		}
		err = c.Complete(ctx, tx, r, okResponse)
		if !errors.Is(err, idem.ErrInvalidArgument) || idem.Unavailable(err) {
			t.Errorf("Complete on a %s transaction: %v, want ErrInvalidArgument", state, err)
		}
		_ = tx.Rollback(ctx)
	}
	if calls.n != 0 {
		t.Errorf("fn ran %d times", calls.n)
	}
	if after := tableState(t, pool); after != before {
		t.Fatalf("calls on unusable transactions changed the table:\nbefore %s\nafter  %s", before, after)
	}
}

// fn's own error that says "aborted transaction" (it ran a statement after
// one of its statements failed) is fn's error, not a complaint about the
// caller's transaction: Do undid fn's work, and the transaction goes on.
func TestDoReturnsFnsAbortedError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = idem.Do(ctx, tx, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		_, _ = tx.Exec(ctx, `SELECT 1/0`)
		_, err := tx.Exec(ctx, `SELECT 1`) // 25P02
		return idem.Response{}, err
	})
	if err == nil || errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("Do = %v, want fn's error as it is", err)
	}
	var one int
	if err := tx.QueryRow(ctx, `SELECT 1`).Scan(&one); err != nil {
		t.Fatalf("the caller's transaction after Do: %v", err)
	}
}

type atomicCounter struct{ n int }

func (a *atomicCounter) fn(context.Context, pgx.Tx) (idem.Response, error) {
	a.n++
	return idem.Response{}, fmt.Errorf("ran")
}
