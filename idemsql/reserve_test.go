package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// The reservation mode and the operator calls, with both drivers: every
// transition of the state machine that idem.Reserve documents, through the
// database/sql forms.
func TestReservations(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		c, err := idemsql.New(idem.Config{Wait: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		paid := idem.Response{Status: 200, Header: map[string][]string{"X-Charge": {"ch_1"}}, Body: []byte(`{"charge":"ch_1"}`)}

		// execute, then in progress while the lease lives, then complete
		// in the caller's transaction, then replay.
		r, err := c.Reserve(ctx, db, scope, "r1", fpOf("a"), time.Minute)
		if err != nil || r.Token <= 0 || r.Replayed || r.LeaseExpiresAt.IsZero() {
			t.Fatalf("Reserve: %+v, %v", r, err)
		}
		if _, err := c.Reserve(ctx, db, scope, "r1", fpOf("a"), time.Minute); !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("Reserve while leased: %v", err)
		}
		if _, err := c.Reserve(ctx, db, scope, "r1", fpOf("b"), time.Minute); !errors.Is(err, idem.ErrKeyReused) {
			t.Fatalf("Reserve with another fingerprint: %v", err)
		}
		if _, err := c.DoInTx(ctx, db, scope, "r1", fpOf("a"), func(context.Context, *sql.Tx) (idem.Response, error) {
			return paid, nil
		}); !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("DoInTx on a reserved key: %v", err)
		}
		r2, err := c.Heartbeat(ctx, db, r, 2*time.Minute)
		if err != nil || !r2.LeaseExpiresAt.After(r.LeaseExpiresAt) {
			t.Fatalf("Heartbeat: %+v, %v", r2, err)
		}
		err = c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error { return c.Complete(ctx, tx, r, paid) })
		if err != nil {
			t.Fatalf("Complete: %v", err)
		}
		err = c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error { return c.Complete(ctx, tx, r, paid) })
		if !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("Complete twice: %v", err)
		}
		again, err := c.Reserve(ctx, db, scope, "r1", fpOf("a"), time.Minute)
		if err != nil || !again.Replayed || again.Token != 0 || !reflect.DeepEqual(again.Response, paid) {
			t.Fatalf("Reserve after Complete: %+v, %v", again, err)
		}
		rec, err := c.Lookup(ctx, db, scope, "r1")
		if err != nil || rec.Status != idem.StatusSucceeded || rec.Token != r.Token || rec.Response == nil || !reflect.DeepEqual(*rec.Response, paid) {
			t.Fatalf("Lookup: %+v, %v", rec, err)
		}

		// failed_retryable: the next Reserve executes again.
		r, err = c.Reserve(ctx, db, scope, "r2", fpOf("a"), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.FailRetryable(ctx, db, r, "gateway said 503"); err != nil {
			t.Fatalf("FailRetryable: %v", err)
		}
		if err := c.FailRetryable(ctx, db, r, "again"); !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("FailRetryable twice: %v", err)
		}
		r3, err := c.Reserve(ctx, db, scope, "r2", fpOf("a"), time.Minute)
		if err != nil || r3.Token <= r.Token {
			t.Fatalf("Reserve after FailRetryable: %+v, %v", r3, err)
		}

		// unknown: refused until resolved; ListUnknown finds it.
		if err := c.MarkUnknown(ctx, db, r3, "timeout after send"); err != nil {
			t.Fatalf("MarkUnknown: %v", err)
		}
		if _, err := c.Reserve(ctx, db, scope, "r2", fpOf("a"), time.Minute); !errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Fatalf("Reserve on unknown: %v", err)
		}
		if err := c.Forget(ctx, db, scope, "r2"); !errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Fatalf("Forget on unknown: %v", err)
		}
		list, err := c.ListUnknown(ctx, db, 10, nil)
		if err != nil || len(list) != 1 || list[0].Key != "r2" || list[0].LastError != "timeout after send" {
			t.Fatalf("ListUnknown: %+v, %v", list, err)
		}
		if next, err := c.ListUnknown(ctx, db, 10, &list[0]); err != nil || len(next) != 0 {
			t.Fatalf("ListUnknown's next page: %+v, %v", next, err)
		}
		if err := c.Resolve(ctx, db, scope, "r2", idem.Resolution{Token: list[0].Token, Succeeded: &paid, Reason: "found at the gateway"}); err != nil {
			t.Fatalf("Resolve: %v", err)
		}
		if err := c.Resolve(ctx, db, scope, "r2", idem.Resolution{Token: list[0].Token, Retryable: true}); !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("Resolve twice with the same token: %v", err)
		}
		resolved, err := c.Lookup(ctx, db, scope, "r2")
		if err != nil || resolved.ResolveReason != "found at the gateway" || resolved.LastError != "timeout after send" {
			t.Fatalf("Lookup after Resolve: %+v, %v", resolved, err)
		}
		if err := c.Resolve(ctx, db, scope, "r2", idem.Resolution{Token: resolved.Token, Retryable: true}); !errors.Is(err, idem.ErrNotResolvable) {
			t.Fatalf("Resolve of a resolved record: %v", err)
		}
		if err := c.Resolve(ctx, db, scope, "nobody", idem.Resolution{Token: 1, Retryable: true}); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("Resolve of no record: %v", err)
		}
		err = c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error { return c.Complete(ctx, tx, r3, paid) })
		if !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("Complete after Resolve: %v", err)
		}
		res, err := c.DoInTx(ctx, db, scope, "r2", fpOf("a"), func(context.Context, *sql.Tx) (idem.Response, error) {
			return idem.Response{}, errors.New("ran")
		})
		if err != nil || !res.Replayed || !reflect.DeepEqual(res.Response, paid) {
			t.Fatalf("DoInTx after Resolve: %+v, %v", res, err)
		}

		// A lease that runs out: ExpireLeases turns it unknown.
		r, err = c.Reserve(ctx, db, scope, "r3", fpOf("a"), time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		if _, err := c.Heartbeat(ctx, db, r, time.Minute); !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("Heartbeat after the lease ran out: %v", err)
		}
		if n, err := c.ExpireLeases(ctx, db, 100); err != nil || n != 1 {
			t.Fatalf("ExpireLeases: %d, %v", n, err)
		}
		if rec, err := c.Lookup(ctx, db, scope, "r3"); err != nil || rec.Status != idem.StatusUnknown {
			t.Fatalf("Lookup after ExpireLeases: %+v, %v", rec, err)
		}
		// A lease that runs out, met by Reserve: unknown at once.
		r, err = c.Reserve(ctx, db, scope, "r4", fpOf("a"), time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		if _, err := c.Reserve(ctx, db, scope, "r4", fpOf("a"), time.Minute); !errors.Is(err, idem.ErrOutcomeUnknown) {
			t.Fatalf("Reserve after the lease ran out: %v", err)
		}

		// Forget, Prune, ReadStats.
		if err := c.Forget(ctx, db, scope, "r1"); err != nil {
			t.Fatalf("Forget: %v", err)
		}
		if _, err := c.Lookup(ctx, db, scope, "r1"); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("Lookup after Forget: %v", err)
		}
		if err := c.Forget(ctx, db, scope, "r1"); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("Forget twice: %v", err)
		}
		if _, err := pool.Exec(ctx, `UPDATE idem_keys SET expires_at = now() - interval '1 second' WHERE idem_key = 'r2'`); err != nil {
			t.Fatal(err)
		}
		if n, err := idemsql.Prune(ctx, db, idem.PruneOptions{DryRun: true}); err != nil || n != 1 {
			t.Fatalf("Prune dry run: %d, %v", n, err)
		}
		if n, err := idemsql.Prune(ctx, db, idem.PruneOptions{}); err != nil || n != 1 {
			t.Fatalf("Prune: %d, %v", n, err)
		}
		st, err := idemsql.ReadStats(ctx, db)
		if err != nil || st.Keys[idem.StatusUnknown] != 2 || st.OldestUnknown.IsZero() || st.TableBytes == 0 {
			t.Fatalf("ReadStats: %+v, %v", st, err)
		}
	})
}

// Resolve and Forget answer as idem's do on the same rows: package idem's
// code decides. A record Do wrote (token 0) is not awaiting reconciliation,
// whatever token the Resolution names.
func TestResolveForgetAsIdem(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		ok := func(context.Context, *sql.Tx) (idem.Response, error) { return idem.Response{Status: 201}, nil }
		if _, err := idemsql.DoInTx(ctx, db, scope, "done", fpOf("a"), ok); err != nil {
			t.Fatal(err)
		}
		live, err := idemsql.Reserve(ctx, db, scope, "live", fpOf("a"), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		lost, err := idemsql.Reserve(ctx, db, scope, "lost", fpOf("a"), time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		for _, tc := range []struct {
			key   string
			token int64
			want  error
		}{
			{"done", 1, idem.ErrNotResolvable},
			{"done", 7, idem.ErrNotResolvable},
			{"live", live.Token, idem.ErrNotResolvable},
			{"live", live.Token + 1, idem.ErrFenced},
			{"lost", lost.Token + 1, idem.ErrFenced},
		} {
			res := idem.Resolution{Token: tc.token, Retryable: true}
			sqlErr := idemsql.Resolve(ctx, db, scope, tc.key, res)
			pgxErr := idem.Resolve(ctx, pool, scope, tc.key, res)
			if !errors.Is(sqlErr, tc.want) || !errors.Is(pgxErr, tc.want) {
				t.Errorf("Resolve %s token %d: idemsql %v, idem %v; want %v", tc.key, tc.token, sqlErr, pgxErr, tc.want)
			}
		}
		for _, tc := range []struct {
			key  string
			want error
		}{{"live", idem.ErrInProgress}, {"lost", idem.ErrOutcomeUnknown}} {
			sqlErr := idemsql.Forget(ctx, db, scope, tc.key)
			pgxErr := idem.Forget(ctx, pool, scope, tc.key)
			if !errors.Is(sqlErr, tc.want) || !errors.Is(pgxErr, tc.want) {
				t.Errorf("Forget %s: idemsql %v, idem %v; want %v", tc.key, sqlErr, pgxErr, tc.want)
			}
		}
	})
}
