package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Config.BodyTTL keeps stored bodies shorter than keys: past it, a replay
// of the same request returns ErrResponseGone with the stored status (fn
// does not run), a different request is still refused (ErrKeyReused), and
// Prune drops the body and headers while the key row stays. Do and DoInTx
// alike; keys of a client without BodyTTL keep their bodies.
func TestBodyTTL(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t)
	const life = 300 * time.Millisecond
	short, err := idem.New(idem.Config{TTL: time.Hour, BodyTTL: life})
	if err != nil {
		t.Fatal(err)
	}
	keep, err := idem.New(idem.Config{TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	s := idem.Scope{Actor: "a", Operation: "draw"}
	doInTx := func(c *idem.Client, key string, fp idem.Fingerprint) (idem.Result, error) {
		return c.DoInTx(ctx, pool, s, key, fp, recordEffect(&calls, key))
	}
	do := func(c *idem.Client, key string, fp idem.Fingerprint) (res idem.Result, err error) {
		txErr := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			res, err = c.Do(ctx, tx, s, key, fp, recordEffect(&calls, key))
			return nil
		})
		if txErr != nil {
			t.Fatal(txErr)
		}
		return res, err
	}
	type call = func(c *idem.Client, key string, fp idem.Fingerprint) (idem.Result, error)
	for key, run := range map[string]call{"intx": doInTx, "do": do} {
		if _, err := run(short, key, fpA); err != nil {
			t.Fatal(err)
		}
		if _, err := run(keep, key+"-kept", fpA); err != nil {
			t.Fatal(err)
		}
		// Inside the body's life: a replay, body and headers.
		if res, err := run(short, key, fpA); err != nil || !res.Replayed || len(res.Body) == 0 || len(res.Header["Location"]) == 0 {
			t.Fatalf("%s inside BodyTTL: %+v, %v; want a whole replay", key, res, err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE body_expires_at IS NOT NULL`); n != 2 {
		t.Fatalf("%d rows with a body_expires_at, want 2 (the BodyTTL client's)", n)
	}
	// Lookup says when the body goes: BodyTTL after the claim; never for
	// a body that lives as long as its key.
	if rec, err := short.Lookup(ctx, pool, s, "intx"); err != nil || !rec.BodyExpiresAt.Equal(rec.CreatedAt.Add(life)) {
		t.Errorf("Lookup: BodyExpiresAt %v, CreatedAt %v (%v); want BodyTTL after it", rec.BodyExpiresAt, rec.CreatedAt, err)
	}
	if rec, err := keep.Lookup(ctx, pool, s, "intx-kept"); err != nil || !rec.BodyExpiresAt.IsZero() {
		t.Errorf("Lookup of a key without BodyTTL: BodyExpiresAt %v (%v), want zero", rec.BodyExpiresAt, err)
	}

	time.Sleep(life + 100*time.Millisecond)
	ran := calls.Load()
	check := func(when string) {
		t.Helper()
		for key, run := range map[string]call{"intx": doInTx, "do": do} {
			res, err := run(short, key, fpA)
			if !errors.Is(err, idem.ErrResponseGone) || !res.Replayed || res.Status != 201 || res.Body != nil || res.Header != nil {
				t.Errorf("%s %s: %+v, %v; want ErrResponseGone with status 201 and nothing else", key, when, res, err)
			}
			if _, err := run(short, key, fpB); !errors.Is(err, idem.ErrKeyReused) {
				t.Errorf("%s %s, another request: %v, want ErrKeyReused", key, when, err)
			}
			if res, err := run(keep, key+"-kept", fpA); err != nil || !res.Replayed || len(res.Body) == 0 {
				t.Errorf("%s-kept %s: %+v, %v; want a whole replay", key, when, res, err)
			}
		}
		if calls.Load() != ran {
			t.Errorf("%s: fn ran %d more times", when, calls.Load()-ran)
		}
		rec, err := short.Lookup(ctx, pool, s, "intx")
		if err != nil || !rec.ResponseGone || rec.Response == nil || rec.Response.Status != 201 || rec.Response.Body != nil {
			t.Errorf("Lookup %s: %+v, %v; want ResponseGone with status 201", when, rec, err)
		}
		if rec, err := keep.Lookup(ctx, pool, s, "intx-kept"); err != nil || rec.ResponseGone || rec.Response == nil || len(rec.Response.Body) == 0 {
			t.Errorf("Lookup of a kept body %s: %+v, %v", when, rec, err)
		}
	}
	check("past BodyTTL, before Prune")

	if n, err := short.Prune(ctx, pool, idem.PruneOptions{DryRun: true}); err != nil || n != 0 {
		t.Fatalf("Prune dry run: %d, %v", n, err)
	}
	if got := count(t, pool, `SELECT count(*) FROM idem_keys WHERE response_body IS NOT NULL`); got != 4 {
		t.Errorf("a dry run dropped %d bodies", 4-got)
	}
	res, err := short.PruneReport(ctx, pool, idem.PruneOptions{BatchSize: 1})
	if err != nil || res.KeysDeleted != 0 || res.BodiesDropped != 2 {
		t.Fatalf("PruneReport: %+v, %v; want no key deleted, 2 bodies dropped", res, err)
	}
	if got := count(t, pool, `SELECT count(*) FROM idem_keys
		WHERE response_body IS NULL AND response_headers IS NULL AND body_expires_at IS NULL AND response_status = 201`); got != 2 {
		t.Errorf("%d rows with a dropped body, want 2", got)
	}
	if got := count(t, pool, `SELECT count(*) FROM idem_keys WHERE response_body IS NOT NULL`); got != 2 {
		t.Errorf("%d rows keep their body, want 2 (the kept client's)", got)
	}
	if rec, err := short.Lookup(ctx, pool, s, "intx"); err != nil || !rec.ResponseGone || !rec.BodyExpiresAt.IsZero() {
		t.Errorf("Lookup after Prune: %+v, %v; want ResponseGone and no BodyExpiresAt", rec, err)
	}
	check("after Prune")
}

// A BodyTTL under a microsecond is refused; one not shorter than a key's
// TTL keeps the body for the key's life.
func TestBodyTTLConfig(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{-time.Second, time.Nanosecond} {
		if _, err := idem.New(idem.Config{BodyTTL: d}); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("BodyTTL %s: %v, want ErrInvalidConfig", d, err)
		}
	}
	ctx := t.Context()
	pool := newPool(t)
	c, err := idem.New(idem.Config{TTL: time.Minute, BodyTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	if _, err := c.DoInTx(ctx, pool, scope, "k", fpA, recordEffect(&calls, "k")); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE body_expires_at IS NULL`); n != 1 {
		t.Errorf("BodyTTL over the TTL: %d rows without body_expires_at, want 1", n)
	}
}

// Config.BodyTTLFor gives each operation its body's life, in place of
// BodyTTL (0: BodyTTL), through Do and DoInTx; a life at least the key's
// keeps the body as long as the key; a value under a microsecond fails the
// call with ErrInvalidConfig before anything is written or fn runs.
func TestBodyTTLFor(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t)
	c, err := idem.New(idem.Config{TTL: time.Hour, BodyTTL: 30 * time.Second,
		BodyTTLFor: func(operation string) time.Duration {
			switch operation {
			case "receipt":
				return time.Minute
			case "archive":
				return 2 * time.Hour // past the key's TTL: as long as the key
			case "bad":
				return -time.Second
			}
			return 0
		}})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	for op, want := range map[string]string{"receipt": "00:01:00", "order": "00:00:30", "archive": ""} {
		s := idem.Scope{Actor: "a", Operation: op}
		if _, err := c.DoInTx(ctx, pool, s, "intx", fpA, recordEffect(&calls, op)); err != nil {
			t.Fatal(err)
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := c.Do(ctx, tx, s, "do", fpA, recordEffect(&calls, op))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		for _, key := range []string{"intx", "do"} {
			var life string
			if err := pool.QueryRow(ctx, `SELECT coalesce((body_expires_at - created_at)::text, '')
				FROM idem_keys WHERE operation = $1 AND idem_key = $2`, op, key).Scan(&life); err != nil {
				t.Fatal(err)
			}
			if life != want {
				t.Errorf("%s %s: body life %q, want %q", op, key, life, want)
			}
		}
	}
	ran, rows := calls.Load(), count(t, pool, `SELECT count(*) FROM idem_keys`)
	_, err = c.DoInTx(ctx, pool, idem.Scope{Actor: "a", Operation: "bad"}, "k", fpA, recordEffect(&calls, "bad"))
	if !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "BodyTTLFor") {
		t.Errorf("BodyTTLFor under a microsecond: %v, want ErrInvalidConfig naming BodyTTLFor", err)
	}
	if calls.Load() != ran || count(t, pool, `SELECT count(*) FROM idem_keys`) != rows {
		t.Error("a refused BodyTTLFor ran fn or wrote a row")
	}
}

// A response Resolve stores lives as long as the key, whatever BodyTTL
// said of the claim that left the record without an outcome: the key
// replays it past BodyTTL, and Prune keeps it. So does a record marked
// unknown before 2026-12-06, which kept its claim's body time.
func TestBodyTTLResolvedResponseStays(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t)
	const life = 100 * time.Millisecond
	c, err := idem.New(idem.Config{TTL: time.Hour, BodyTTL: life})
	if err != nil {
		t.Fatal(err)
	}
	commits := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201}, tx.Commit(ctx)
	}
	for _, key := range []string{"orphan", "orphan-old"} {
		if _, err := c.DoInTx(ctx, pool, scope, key, fpA, commits); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Fatalf("%s: fn's COMMIT: %v, want ErrInvalidArgument", key, err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE status = 'unknown' AND body_expires_at IS NULL`); n != 2 {
		t.Fatalf("%d unknown records without a body time, want 2", n)
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_keys SET body_expires_at = created_at + interval '100 milliseconds'
		WHERE idem_key = 'orphan-old'`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(life + 50*time.Millisecond)
	var calls atomic.Int64
	for _, key := range []string{"orphan", "orphan-old"} {
		rec, err := c.Lookup(ctx, pool, scope, key)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Resolve(ctx, pool, scope, key, idem.Resolution{Token: rec.Token,
			Succeeded: &idem.Response{Status: 201, Body: []byte(`{"id":1}`)}, Reason: "found at the provider"}); err != nil {
			t.Fatalf("Resolve %s: %v", key, err)
		}
	}
	if _, err := c.Prune(ctx, pool, idem.PruneOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"orphan", "orphan-old"} {
		res, err := c.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key))
		if err != nil || !res.Replayed || string(res.Body) != `{"id":1}` {
			t.Errorf("%s after Resolve and Prune: %+v, %v; want the resolved response replayed", key, res, err)
		}
	}
	if calls.Load() != 0 {
		t.Errorf("fn ran %d times", calls.Load())
	}
}

// Reserve of a key whose stored body is gone answers ErrResponseGone with
// the stored status (Replayed, no body, no token), as Do does.
func TestBodyTTLReserveSaysGone(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t)
	c, err := idem.New(idem.Config{TTL: time.Hour, BodyTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	if _, err := c.DoInTx(ctx, pool, scope, "k", fpA, recordEffect(&calls, "k")); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_keys SET body_expires_at = now()`); err != nil {
		t.Fatal(err)
	}
	r, err := c.Reserve(ctx, pool, scope, "k", fpA, time.Minute)
	if !errors.Is(err, idem.ErrResponseGone) || !r.Replayed || r.Status != 201 || r.Body != nil || r.Token != 0 {
		t.Errorf("Reserve: %+v, %v; want ErrResponseGone with status 201", r, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE status = 'succeeded' AND token = 0`); n != 1 {
		t.Errorf("Reserve changed the record (%d rows as they were)", n)
	}
}

// PruneReport counts what it did: a key past its TTL is deleted (its body
// with it: not a body dropped), a body past its life dropped.
func TestPruneReport(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t)
	c, err := idem.New(idem.Config{TTL: time.Hour, BodyTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	for _, key := range []string{"expired", "body-due", "kept"} {
		if _, err := c.DoInTx(ctx, pool, scope, key, fpA, recordEffect(&calls, key)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_keys SET expires_at = now(), body_expires_at = now() WHERE idem_key = 'expired';
		UPDATE idem_keys SET body_expires_at = now() WHERE idem_key = 'body-due'`); err != nil {
		t.Fatal(err)
	}
	if res, err := c.PruneReport(ctx, pool, idem.PruneOptions{DryRun: true}); err != nil || res != (idem.PruneResult{KeysDeleted: 1}) {
		t.Errorf("dry run: %+v, %v", res, err)
	}
	if res, err := c.PruneReport(ctx, pool, idem.PruneOptions{}); err != nil || res != (idem.PruneResult{KeysDeleted: 1, BodiesDropped: 1}) {
		t.Errorf("PruneReport: %+v, %v; want 1 key deleted, 1 body dropped", res, err)
	}
	if res, err := c.PruneReport(ctx, pool, idem.PruneOptions{}); err != nil || res != (idem.PruneResult{}) {
		t.Errorf("PruneReport again: %+v, %v; want nothing done", res, err)
	}
}
