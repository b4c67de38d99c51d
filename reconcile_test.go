package idem_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// tableState is everything the reservation calls can change: every row and
// the token sequence.
func tableState(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var rows, seq string
	err := pool.QueryRow(context.Background(), `
		SELECT coalesce(string_agg(k::text, E'\n' ORDER BY actor, operation, idem_key), ''),
		       (SELECT last_value::text || is_called::text FROM idem_keys_token_seq)
		FROM idem_keys AS k`).Scan(&rows, &seq)
	if err != nil {
		t.Fatal(err)
	}
	return rows + "\n" + seq
}

// Turning expired leases unknown while workers complete some of the same
// records and new reservations come and go: every expired record ends
// exactly once, unknown or succeeded; no batch is larger than asked; live
// leases and finished records are left alone.
func TestExpireLeasesUnderLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{})
	const expired, live, batch = 3000, 200, 100

	// Rows as reservations leave them, written in bulk: expired leases,
	// live leases, finished records.
	for _, bulk := range []struct {
		n   int
		sql string
	}{{expired, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at, expires_at)
		SELECT 'load', 'charge', 'expired-' || g, $1, 'processing', nextval('idem_keys_token_seq'),
		       now() - interval '1 minute' + g * interval '1 ms', now() + interval '1 day'
		FROM generate_series(1, $2::int) AS g`}, {live, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token, lease_expires_at, expires_at)
		SELECT 'load', 'charge', 'live-' || g, $1, 'processing', nextval('idem_keys_token_seq'),
		       now() + interval '1 hour', now() + interval '1 day'
		FROM generate_series(1, $2::int) AS g`}, {200, `
		INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at)
		SELECT 'load', 'charge', 'done-' || g, $1, 'succeeded', 201, '', now() + interval '1 day'
		FROM generate_series(1, $2::int) AS g`},
	} {
		if _, err := pool.Exec(ctx, bulk.sql, fpA[:], bulk.n); err != nil {
			t.Fatal(err)
		}
	}
	// The owners of a third of the expired records come back to complete.
	rows, err := pool.Query(ctx, `SELECT idem_key, token FROM idem_keys
		WHERE idem_key LIKE 'expired-%' AND token % 3 = 0`)
	if err != nil {
		t.Fatal(err)
	}
	var late []idem.Reservation
	for rows.Next() {
		r := idem.Reservation{Scope: idem.Scope{Actor: "load", Operation: "charge"}}
		if err := rows.Scan(&r.Key, &r.Token); err != nil {
			t.Fatal(err)
		}
		late = append(late, r)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}

	var expiredTotal, completed, fenced atomic.Int64
	errs := make(chan error, 16)
	var wg sync.WaitGroup
	for range 4 { // expirers
		wg.Go(func() {
			for {
				n, err := c.ExpireLeases(ctx, pool, batch)
				if err != nil || n > batch {
					errs <- fmt.Errorf("ExpireLeases = %d, %v", n, err)
					return
				}
				expiredTotal.Add(n)
				if n == 0 {
					return
				}
			}
		})
	}
	for w := range 2 { // late owners
		wg.Go(func() {
			for i := w; i < len(late); i += 2 {
				switch err := completeTx(ctx, c, pool, late[i], charged); {
				case err == nil:
					completed.Add(1)
				case errors.Is(err, idem.ErrFenced):
					fenced.Add(1)
				default:
					errs <- err
					return
				}
			}
		})
	}
	stop := make(chan struct{})
	var traffic sync.WaitGroup
	for w := range 2 { // new reservations, completed at once
		traffic.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				r, err := c.Reserve(ctx, pool, payScope, fmt.Sprintf("new-%d-%d", w, i), fpA, time.Minute)
				if err == nil {
					err = completeTx(ctx, c, pool, r, charged)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	traffic.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// An expirer stops when a batch finds nothing unlocked; a last pass
	// catches rows another one skipped while they were locked.
	n, err := c.ExpireLeases(ctx, pool, expired)
	if err != nil {
		t.Fatal(err)
	}
	expiredTotal.Add(n)

	unknown := count(t, pool, `SELECT count(*) FROM idem_keys WHERE idem_key LIKE 'expired-%' AND status = 'unknown'`)
	succeeded := count(t, pool, `SELECT count(*) FROM idem_keys WHERE idem_key LIKE 'expired-%' AND status = 'succeeded'`)
	if int64(unknown) != expiredTotal.Load() || int64(succeeded) != completed.Load() || unknown+succeeded != expired ||
		completed.Load()+fenced.Load() != int64(len(late)) {
		t.Fatalf("expired %d (unknown rows %d), completed %d (succeeded rows %d), fenced %d, of %d; late owners %d",
			expiredTotal.Load(), unknown, completed.Load(), succeeded, fenced.Load(), expired, len(late))
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE idem_key LIKE 'live-%' AND status = 'processing'`); n != live {
		t.Fatalf("%d live leases left processing, want %d", n, live)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE idem_key LIKE 'done-%' AND status = 'succeeded'`); n != 200 {
		t.Fatalf("%d finished rows left, want 200", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem_keys WHERE actor = $1 AND status <> 'succeeded'`, payScope.Actor); n != 0 {
		t.Fatalf("%d new reservations not succeeded", n)
	}
	t.Logf("expired %d, completed late %d, fenced %d", expiredTotal.Load(), completed.Load(), fenced.Load())
}

// ExpireLeases skips a record that another transaction holds locked,
// rather than waiting for it, and takes it on a later call.
func TestExpireLeasesSkipsLocked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	for _, key := range []string{"a", "b"} {
		if _, err := idem.Reserve(ctx, pool, payScope, key, fpA, time.Millisecond); err != nil {
			t.Fatal(err)
		}
		waitPast(t, pool, payScope, key, "lease_expires_at")
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM idem_keys WHERE idem_key = 'a' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	// A deadline turns waiting into a failure instead of a hang.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, err := idem.ExpireLeases(wctx, pool, 10)
	if err != nil || n != 1 || readRow(t, pool, payScope, "a").Status != "processing" {
		t.Fatalf("ExpireLeases with a row locked = %d, %v", n, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	n, err = idem.ExpireLeases(ctx, pool, 10)
	if err != nil || n != 1 || readRow(t, pool, payScope, "a").Status != "unknown" {
		t.Fatalf("ExpireLeases after the lock = %d, %v", n, err)
	}
}

// ListUnknown pages through unknown records that need a person oldest
// first, each once; ListResumable likewise through unknown records inside
// their window. Neither lists the other's.
func TestListUnknownPages(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name             string
		list             func(ctx context.Context, db idem.Beginner, limit int, after *idem.Record) ([]idem.Record, error)
		window, notThere time.Duration // of the records listed, and of those not
	}{
		{"ListUnknown", idem.ListUnknown, 0, time.Hour},
		{"ListResumable", idem.ListResumable, time.Hour, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := newPool(t)
			unknown := func(key string, window time.Duration) {
				r, err := idem.ReserveWith(ctx, pool, payScope, key, fpA, idem.ReserveOptions{Lease: time.Minute, ResumeWithin: window})
				if err == nil {
					err = idem.MarkUnknown(ctx, pool, r, "timeout "+key)
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			var want []string
			for i := range 7 {
				key := fmt.Sprintf("u-%d", i)
				unknown(key, tc.window)
				want = append(want, key)
				if i%3 == 0 {
					unknown(fmt.Sprintf("other-%d", i), tc.notThere) // the other list's
				}
			}
			for i := range 2 { // not unknown: never listed
				r, err := idem.ReserveWith(ctx, pool, payScope, fmt.Sprintf("s-%d", i), fpA, idem.ReserveOptions{ResumeWithin: tc.window})
				if err != nil {
					t.Fatal(err)
				}
				if i == 0 {
					if err := completeTx(ctx, defaultClient(t), pool, r, charged); err != nil {
						t.Fatal(err)
					}
				}
			}

			var got []idem.Record
			var after *idem.Record
			for page := 0; ; page++ {
				recs, err := tc.list(ctx, pool, 3, after)
				if err != nil {
					t.Fatal(err)
				}
				if len(recs) > 3 || page > 3 {
					t.Fatalf("page %d holds %d records", page, len(recs))
				}
				if len(recs) == 0 {
					break
				}
				got = append(got, recs...)
				after = &recs[len(recs)-1]
			}
			var keys []string
			for i, rec := range got {
				keys = append(keys, rec.Key)
				if rec.Status != idem.StatusUnknown || rec.Scope != payScope || rec.Fingerprint != fpA || rec.Token <= 0 ||
					rec.LastError != "timeout "+rec.Key || rec.CreatedAt.IsZero() || rec.LeaseExpiresAt.IsZero() ||
					!rec.CompletedAt.IsZero() || rec.Response != nil || !rec.ExpiresAt.After(rec.CreatedAt) ||
					rec.ResumeUntil.IsZero() != (tc.window == 0) {
					t.Fatalf("record %+v", rec)
				}
				if i > 0 && rec.CreatedAt.Before(got[i-1].CreatedAt) {
					t.Fatalf("not oldest first: %s before %s", got[i-1].CreatedAt, rec.CreatedAt)
				}
			}
			slices.Sort(keys)
			if !slices.Equal(keys, want) {
				t.Fatalf("listed %v, want %v", keys, want)
			}

			// A resolved record leaves the list.
			if err := idem.Resolve(ctx, pool, payScope, "u-3", idem.Resolution{Token: readRow(t, pool, payScope, "u-3").Token, Retryable: true}); err != nil {
				t.Fatal(err)
			}
			recs, err := tc.list(ctx, pool, 100, nil)
			if err != nil || len(recs) != 6 || slices.ContainsFunc(recs, func(r idem.Record) bool { return r.Key == "u-3" }) {
				t.Fatalf("after Resolve: %d records, %v", len(recs), err)
			}
		})
	}
}

func defaultClient(t *testing.T) *idem.Client { return mustClient(t, idem.Config{}) }

// Every bad input is refused with a typed error before anything runs:
// no row and no token changes.
func TestReservationBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{MaxResponseBytes: 16})
	// A record of every kind to refuse things about.
	owner, err := c.Reserve(ctx, pool, payScope, "held", fpA, time.Minute)
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

	var nilPool *pgxpool.Pool
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	long := strings.Repeat("x", idem.MaxReasonLength+1)
	zero := idem.Reservation{}
	replay := idem.Reservation{Scope: payScope, Key: "held", Result: idem.Result{Replayed: true}}
	badScope := owner
	badScope.Scope.Actor = ""
	badKey := owner
	badKey.Key = "has space"
	heartbeat := func(db idem.Beginner, r idem.Reservation, d time.Duration) error {
		_, err := c.Heartbeat(ctx, db, r, d)
		return err
	}
	reserve := func(db idem.Beginner, scope idem.Scope, key string, lease time.Duration) error {
		_, err := c.Reserve(ctx, db, scope, key, fpA, lease)
		return err
	}
	reserveWith := func(db idem.Beginner, scope idem.Scope, key string, opts idem.ReserveOptions) error {
		_, err := c.ReserveWith(ctx, db, scope, key, fpA, opts)
		return err
	}
	list := func(db idem.Beginner, limit int) error {
		_, err := c.ListUnknown(ctx, db, limit, nil)
		return err
	}
	listResumable := func(db idem.Beginner, limit int) error {
		_, err := c.ListResumable(ctx, db, limit, nil)
		return err
	}
	expire := func(db idem.Beginner, limit int) error {
		_, err := c.ExpireLeases(ctx, db, limit)
		return err
	}
	ok := idem.Response{Status: 200}
	for _, tc := range []struct {
		name string
		err  error
		want error
	}{
		{"Reserve lease 0", reserve(pool, payScope, "k", 0), idem.ErrInvalidArgument},
		{"Reserve lease < 0", reserve(pool, payScope, "k", -time.Second), idem.ErrInvalidArgument},
		{"Reserve lease < 1µs", reserve(pool, payScope, "k", time.Nanosecond), idem.ErrInvalidArgument},
		{"Reserve nil pool", reserve(nilPool, payScope, "k", time.Minute), idem.ErrInvalidArgument},
		{"Reserve nil db", reserve(nil, payScope, "k", time.Minute), idem.ErrInvalidArgument},
		{"Reserve on a pgx.Tx", reserve(tx, payScope, "k", time.Minute), idem.ErrInvalidArgument},
		{"Reserve empty key", reserve(pool, payScope, "", time.Minute), idem.ErrInvalidKey},
		{"Reserve bad key", reserve(pool, payScope, "a b", time.Minute), idem.ErrInvalidKey},
		{"Reserve long key", reserve(pool, payScope, strings.Repeat("k", 256), time.Minute), idem.ErrInvalidKey},
		{"Reserve empty actor", reserve(pool, idem.Scope{Operation: "x"}, "k", time.Minute), idem.ErrInvalidScope},
		{"Reserve bad operation", reserve(pool, idem.Scope{Actor: "a", Operation: "\xff"}, "k", time.Minute), idem.ErrInvalidScope},
		{"ReserveWith ResumeWithin < 0", reserveWith(pool, payScope, "k", idem.ReserveOptions{ResumeWithin: -time.Hour}), idem.ErrInvalidArgument},
		{"ReserveWith Lease < 0", reserveWith(pool, payScope, "k", idem.ReserveOptions{Lease: -time.Second, ResumeWithin: time.Hour}), idem.ErrInvalidArgument},
		{"ReserveWith Lease < 1µs", reserveWith(pool, payScope, "k", idem.ReserveOptions{Lease: time.Nanosecond}), idem.ErrInvalidArgument},
		{"ReserveWith window < lease", reserveWith(pool, payScope, "k", idem.ReserveOptions{Lease: time.Hour, ResumeWithin: time.Minute}), idem.ErrInvalidArgument},
		{"ReserveWith window < default lease", reserveWith(pool, payScope, "k", idem.ReserveOptions{ResumeWithin: time.Second}), idem.ErrInvalidArgument},
		{"ReserveWith window < lease, on an unknown key", reserveWith(pool, payScope, "unknown", idem.ReserveOptions{Lease: time.Hour, ResumeWithin: time.Minute}), idem.ErrInvalidArgument},
		{"ReserveWith nil db", reserveWith(nil, payScope, "k", idem.ReserveOptions{}), idem.ErrInvalidArgument},
		{"ReserveWith on a pgx.Tx", reserveWith(tx, payScope, "k", idem.ReserveOptions{}), idem.ErrInvalidArgument},
		{"ReserveWith bad key", reserveWith(pool, payScope, "a b", idem.ReserveOptions{}), idem.ErrInvalidKey},
		{"ReserveWith bad scope", reserveWith(pool, idem.Scope{Actor: "a"}, "k", idem.ReserveOptions{}), idem.ErrInvalidScope},

		{"Complete zero", c.Complete(ctx, tx, zero, ok), idem.ErrInvalidArgument},
		{"Complete replay", c.Complete(ctx, tx, replay, ok), idem.ErrInvalidArgument},
		{"Complete bad scope", c.Complete(ctx, tx, badScope, ok), idem.ErrInvalidScope},
		{"Complete bad key", c.Complete(ctx, tx, badKey, ok), idem.ErrInvalidKey},
		{"Complete nil tx", c.Complete(ctx, nil, owner, ok), idem.ErrInvalidArgument},
		{"Complete bad status", c.Complete(ctx, tx, owner, idem.Response{Status: 1000}), idem.ErrInvalidResponse},
		{"Complete too large", c.Complete(ctx, tx, owner, idem.Response{Status: 200, Body: make([]byte, 17)}), idem.ErrResponseTooLarge},

		{"FailRetryable zero", c.FailRetryable(ctx, pool, zero, ""), idem.ErrInvalidArgument},
		{"FailRetryable nil db", c.FailRetryable(ctx, nilPool, owner, ""), idem.ErrInvalidArgument},
		{"FailRetryable long reason", c.FailRetryable(ctx, pool, owner, long), idem.ErrInvalidArgument},
		{"FailRetryable NUL reason", c.FailRetryable(ctx, pool, owner, "a\x00b"), idem.ErrInvalidArgument},
		{"MarkUnknown replay", c.MarkUnknown(ctx, pool, replay, ""), idem.ErrInvalidArgument},
		{"MarkUnknown bad reason", c.MarkUnknown(ctx, pool, owner, "\xff"), idem.ErrInvalidArgument},
		{"MarkUnknown nil db", c.MarkUnknown(ctx, nil, owner, ""), idem.ErrInvalidArgument},
		{"Heartbeat extend 0", heartbeat(pool, owner, 0), idem.ErrInvalidArgument},
		{"Heartbeat extend < 0", heartbeat(pool, owner, -time.Minute), idem.ErrInvalidArgument},
		{"Heartbeat zero", heartbeat(pool, zero, time.Minute), idem.ErrInvalidArgument},
		{"Heartbeat nil db", heartbeat(nil, owner, time.Minute), idem.ErrInvalidArgument},

		{"ExpireLeases limit 0", expire(pool, 0), idem.ErrInvalidArgument},
		{"ExpireLeases limit < 0", expire(pool, -1), idem.ErrInvalidArgument},
		{"ExpireLeases nil db", expire(nilPool, 10), idem.ErrInvalidArgument},
		{"ListUnknown limit 0", list(pool, 0), idem.ErrInvalidArgument},
		{"ListUnknown nil db", list(nil, 10), idem.ErrInvalidArgument},
		{"ListResumable limit 0", listResumable(pool, 0), idem.ErrInvalidArgument},
		{"ListResumable limit < 0", listResumable(pool, -1), idem.ErrInvalidArgument},
		{"ListResumable nil db", listResumable(nil, 10), idem.ErrInvalidArgument},

		{"Resolve neither", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: u.Token}), idem.ErrInvalidArgument},
		{"Resolve both", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: u.Token, Succeeded: &ok, Retryable: true}), idem.ErrInvalidArgument},
		{"Resolve bad response", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: u.Token, Succeeded: &idem.Response{Status: 7}}), idem.ErrInvalidResponse},
		{"Resolve too large", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: u.Token, Succeeded: &idem.Response{Body: make([]byte, 17)}}), idem.ErrResponseTooLarge},
		{"Resolve long reason", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: u.Token, Retryable: true, Reason: long}), idem.ErrInvalidArgument},
		{"Resolve bad key", c.Resolve(ctx, pool, payScope, "", idem.Resolution{Token: u.Token, Retryable: true}), idem.ErrInvalidKey},
		{"Resolve bad scope", c.Resolve(ctx, pool, idem.Scope{Actor: "a"}, "unknown", idem.Resolution{Token: u.Token, Retryable: true}), idem.ErrInvalidScope},
		{"Resolve no token", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Retryable: true}), idem.ErrInvalidArgument},
		{"Resolve token < 0", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: -u.Token, Retryable: true}), idem.ErrInvalidArgument},
		{"Resolve nil db", c.Resolve(ctx, nil, payScope, "unknown", idem.Resolution{Token: u.Token, Retryable: true}), idem.ErrInvalidArgument},

		// Well-formed, but not the state of things.
		{"Resolve no record", c.Resolve(ctx, pool, payScope, "never", idem.Resolution{Token: u.Token, Retryable: true}), idem.ErrNotFound},
		{"Resolve stale token", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: u.Token - 1, Retryable: true}), idem.ErrFenced},
		{"Resolve newer token", c.Resolve(ctx, pool, payScope, "unknown", idem.Resolution{Token: u.Token + 1000, Succeeded: &ok}), idem.ErrFenced},
		{"Resolve live lease", c.Resolve(ctx, pool, payScope, "held", idem.Resolution{Token: owner.Token, Retryable: true}), idem.ErrNotResolvable},
		{"Complete stale token", completeTx(ctx, c, pool, idem.Reservation{Scope: payScope, Key: "held", Token: owner.Token + 1000}, ok), idem.ErrFenced},
		{"Complete no record", completeTx(ctx, c, pool, idem.Reservation{Scope: payScope, Key: "never", Token: owner.Token}, ok), idem.ErrFenced},
		{"FailRetryable unknown", c.FailRetryable(ctx, pool, u, ""), idem.ErrFenced},
		{"Heartbeat unknown", heartbeat(pool, u, time.Minute), idem.ErrFenced},
	} {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, tc.err, tc.want)
		}
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if after := tableState(t, pool); after != before {
		t.Fatalf("bad input changed the table:\nbefore %s\nafter  %s", before, after)
	}
}

// Resolve advances the token: the reservation that held the key is fenced
// whichever way the record was resolved.
func TestResolveFencesTheOwner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	for _, res := range []idem.Resolution{{Succeeded: &resolved, Reason: "found"}, {Retryable: true, Reason: "not found"}} {
		key := fmt.Sprintf("resolve-%t", res.Retryable)
		r, err := idem.Reserve(ctx, pool, payScope, key, fpA, time.Minute)
		if err == nil {
			err = idem.MarkUnknown(ctx, pool, r, "timeout")
		}
		if err == nil {
			res.Token = r.Token
			err = idem.Resolve(ctx, pool, payScope, key, res)
		}
		if err != nil {
			t.Fatal(err)
		}
		row := readRow(t, pool, payScope, key)
		if row.Token <= r.Token || row.LastError == nil || *row.LastError != "timeout" || row.Completed == nil {
			t.Fatalf("resolved row %+v", row)
		}
		// The original reason stays; the operator's is beside it.
		rec, err := idem.Lookup(ctx, pool, payScope, key)
		if err != nil || rec.LastError != "timeout" || rec.ResolveReason != res.Reason || rec.Token != row.Token {
			t.Fatalf("Lookup after Resolve: %+v, %v", rec, err)
		}
		err = idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error { return idem.Complete(ctx, tx, r, charged) })
		if !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("Complete after Resolve: %v, want ErrFenced", err)
		}
		if err := idem.MarkUnknown(ctx, pool, r, "late"); !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("MarkUnknown after Resolve: %v, want ErrFenced", err)
		}
		// The same verdict again names a token that is gone.
		if err := idem.Resolve(ctx, pool, payScope, key, res); !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("second Resolve: %v, want ErrFenced", err)
		}
		res.Token = row.Token
		if err := idem.Resolve(ctx, pool, payScope, key, res); !errors.Is(err, idem.ErrNotResolvable) {
			t.Fatalf("Resolve with the new token: %v, want ErrNotResolvable", err)
		}
		if after := readRow(t, pool, payScope, key); after.Token != row.Token || after.Status != row.Status {
			t.Fatalf("fenced calls changed the row: %+v", after)
		}
	}
}

// Two operators reconcile the same unknown attempt. B's verdict lands first
// and a second attempt runs, charges, and its lease runs out. A's late
// verdict names the first attempt's token: it is refused with ErrFenced and
// changes nothing, so the second attempt's charge is not run a third time.
// Verdicts racing on one token: exactly one lands.
func TestResolveOperatorRace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{})
	const key = "operator-race"
	first, err := c.Reserve(ctx, pool, payScope, key, fpA, time.Minute)
	if err == nil {
		err = c.MarkUnknown(ctx, pool, first, "gateway timed out")
	}
	if err != nil {
		t.Fatal(err)
	}
	listed, err := c.ListUnknown(ctx, pool, 10, nil)
	if err != nil || len(listed) != 1 || listed[0].Token != first.Token {
		t.Fatalf("ListUnknown = %+v, %v; want token %d", listed, err, first.Token)
	}
	seen := listed[0] // what both operators look at

	// B: no charge for attempt 1.
	if err := c.Resolve(ctx, pool, payScope, key, idem.Resolution{Token: seen.Token, Retryable: true, Reason: "B: no charge"}); err != nil {
		t.Fatal(err)
	}
	// Attempt 2 runs (and charges), then its lease runs out.
	second, err := c.Reserve(ctx, pool, payScope, key, fpA, 10*time.Millisecond)
	if err != nil || second.Replayed || second.Token == first.Token {
		t.Fatalf("second attempt: %+v, %v", second, err)
	}
	waitPast(t, pool, payScope, key, "lease_expires_at")
	before := tableState(t, pool)

	// A's verdict about attempt 1 arrives late.
	err = c.Resolve(ctx, pool, payScope, key, idem.Resolution{Token: seen.Token, Retryable: true, Reason: "A: no charge"})
	if !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("late verdict: %v, want ErrFenced", err)
	}
	if after := tableState(t, pool); after != before {
		t.Fatalf("the refused verdict changed the table:\nbefore %s\nafter  %s", before, after)
	}
	// The third request does not run: attempt 2 may have charged.
	if r, err := c.Reserve(ctx, pool, payScope, key, fpA, time.Minute); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("third attempt: %+v, %v; want ErrOutcomeUnknown", r, err)
	}
	rec, err := c.Lookup(ctx, pool, payScope, key)
	if err != nil || rec.Token != second.Token || rec.Status != idem.StatusUnknown {
		t.Fatalf("Lookup: %+v, %v; want attempt 2 (token %d) unknown", rec, err, second.Token)
	}

	// Racing verdicts on attempt 2's token: one lands, the others are fenced.
	var wg sync.WaitGroup
	var landed, fenced atomic.Int64
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := idem.Resolution{Token: rec.Token, Retryable: i%2 == 0, Reason: fmt.Sprint("operator ", i)}
			if !res.Retryable {
				res.Succeeded = &resolved
			}
			switch err := c.Resolve(ctx, pool, payScope, key, res); {
			case err == nil:
				landed.Add(1)
			case errors.Is(err, idem.ErrFenced):
				fenced.Add(1)
			default:
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if landed.Load() != 1 || fenced.Load() != 7 {
		t.Fatalf("%d verdicts landed, %d fenced; want 1 and 7", landed.Load(), fenced.Load())
	}
}
