package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// Config.BodyTTL through idemsql, with pgx's stdlib and lib/pq: past the
// body's life a replay returns ErrResponseGone with the stored status and
// fn does not run; a different request is still ErrKeyReused; Prune drops
// the bodies and keeps the keys. A BodyTTL under a microsecond is refused.
func TestBodyTTL(t *testing.T) {
	t.Parallel()
	if _, err := idemsql.New(idem.Config{BodyTTL: -time.Second}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("BodyTTL -1s: %v, want ErrInvalidConfig", err)
	}
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		const life = 300 * time.Millisecond
		c, err := idemsql.New(idem.Config{TTL: time.Hour, BodyTTL: life})
		if err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int64
		fn := func(context.Context, *sql.Tx) (idem.Response, error) {
			calls.Add(1)
			return idem.Response{Status: 201, Header: map[string][]string{"Location": {"/draws/1"}}, Body: []byte(`{"id":1}`)}, nil
		}
		scope := idem.Scope{Actor: "a", Operation: "draw"}
		doInTx := func(key string, fp idem.Fingerprint) (idem.Result, error) {
			return c.DoInTx(ctx, db, scope, key, fp, fn)
		}
		do := func(key string, fp idem.Fingerprint) (idem.Result, error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			res, err := c.Do(ctx, tx, scope, key, fp, fn)
			if err == nil {
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
			}
			return res, err
		}
		calls2 := map[string]func(string, idem.Fingerprint) (idem.Result, error){"intx": doInTx, "do": do}
		for key, run := range calls2 {
			if _, err := run(key, idem.Fingerprint{1}); err != nil {
				t.Fatal(err)
			}
			if res, err := run(key, idem.Fingerprint{1}); err != nil || !res.Replayed || string(res.Body) != `{"id":1}` {
				t.Fatalf("%s inside BodyTTL: %+v, %v", key, res, err)
			}
		}
		time.Sleep(life + 100*time.Millisecond)
		ran := calls.Load()
		check := func(when string) {
			t.Helper()
			for key, run := range calls2 {
				res, err := run(key, idem.Fingerprint{1})
				if !errors.Is(err, idem.ErrResponseGone) || res.Status != 201 || res.Body != nil {
					t.Errorf("%s %s: %+v, %v; want ErrResponseGone with status 201", key, when, res, err)
				}
				if _, err := run(key, idem.Fingerprint{2}); !errors.Is(err, idem.ErrKeyReused) {
					t.Errorf("%s %s, another request: %v, want ErrKeyReused", key, when, err)
				}
			}
			if calls.Load() != ran {
				t.Errorf("%s: fn ran %d more times", when, calls.Load()-ran)
			}
		}
		check("past BodyTTL")
		if res, err := c.PruneReport(ctx, db, idem.PruneOptions{}); err != nil || res.KeysDeleted != 0 || res.BodiesDropped == 0 {
			t.Fatalf("PruneReport: %+v, %v; want 0 keys deleted, the bodies dropped", res, err)
		}
		var dropped int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE response_body IS NULL AND response_status = 201`).Scan(&dropped); err != nil || dropped != 2 {
			t.Errorf("%d bodies dropped, %v; want 2", dropped, err)
		}
		if n := keyCount(t, pool); n != 2 {
			t.Errorf("%d keys after Prune, want 2", n)
		}
		check("after Prune")
	})
}

// Config.BodyTTLFor through idemsql, with pgx's stdlib and lib/pq: each
// operation's body life in place of BodyTTL; under a microsecond the call
// is refused with ErrInvalidConfig, nothing written.
func TestBodyTTLFor(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		c, err := idemsql.New(idem.Config{TTL: time.Hour, BodyTTL: 30 * time.Second,
			BodyTTLFor: func(operation string) time.Duration {
				switch operation {
				case "receipt":
					return time.Minute
				case "bad":
					return -time.Second
				}
				return 0
			}})
		if err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int64
		fn := func(context.Context, *sql.Tx) (idem.Response, error) {
			calls.Add(1)
			return idem.Response{Status: 201, Body: []byte(`{"id":1}`)}, nil
		}
		for op, want := range map[string]string{"receipt": "00:01:00", "order": "00:00:30"} {
			if _, err := c.DoInTx(ctx, db, idem.Scope{Actor: "a", Operation: op}, "k", idem.Fingerprint{1}, fn); err != nil {
				t.Fatal(err)
			}
			var life string
			if err := pool.QueryRow(ctx, `SELECT (body_expires_at - created_at)::text FROM idem_keys WHERE operation = $1`,
				op).Scan(&life); err != nil || life != want {
				t.Errorf("%s: body life %q, %v; want %q", op, life, err, want)
			}
		}
		_, err = c.DoInTx(ctx, db, idem.Scope{Actor: "a", Operation: "bad"}, "k", idem.Fingerprint{1}, fn)
		if !errors.Is(err, idem.ErrInvalidConfig) || calls.Load() != 2 {
			t.Errorf("BodyTTLFor under a microsecond: %v (fn ran %d times); want ErrInvalidConfig, fn not run", err, calls.Load()-2)
		}
		var rows int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys`).Scan(&rows); err != nil || rows != 2 {
			t.Errorf("%d rows, %v; want 2 (nothing written by the refused call)", rows, err)
		}
	})
}

// An empty body replays as an empty body, not as a dropped one, through
// lib/pq with its parameters sent in binary (docs/sql.md), which reads
// results as text: in bytea's escape format it reads an empty bytea as nil.
func TestEmptyBodyReplaysThroughLibPQEscape(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db := open(t, "postgres", pgtest.WithParams(t, pgtest.URL(t, idem.Migrate), "binary_parameters=yes&options=-c%20bytea_output%3Descape"))
	for _, body := range [][]byte{nil, {}} {
		key := fmt.Sprintf("empty-%v", body == nil)
		for i := range 2 {
			res, err := idemsql.DoInTx(ctx, db, scope, key, fpOf("e"), func(context.Context, *sql.Tx) (idem.Response, error) {
				return idem.Response{Status: 204, Body: body}, nil
			})
			if err != nil || res.Replayed != (i == 1) || res.Status != 204 || res.Body == nil || len(res.Body) != 0 {
				t.Fatalf("%s call %d: %+v %v, want an empty body", key, i+1, res, err)
			}
		}
	}
}

// A response Resolve stores lives as long as the key, whatever BodyTTL
// said of the claim fn's own COMMIT left without an outcome: past BodyTTL
// and after Prune the key replays it, with pgx's stdlib and lib/pq.
func TestBodyTTLResolvedResponseStays(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, _ := migrated(t, driver)
		const life = 100 * time.Millisecond
		c, err := idemsql.New(idem.Config{TTL: time.Hour, BodyTTL: life})
		if err != nil {
			t.Fatal(err)
		}
		scope := idem.Scope{Actor: "a", Operation: "pay"}
		commits := func(_ context.Context, tx *sql.Tx) (idem.Response, error) {
			return idem.Response{Status: 201}, tx.Commit()
		}
		if _, err := c.DoInTx(ctx, db, scope, "orphan", idem.Fingerprint{1}, commits); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Fatalf("fn's COMMIT: %v, want ErrInvalidArgument", err)
		}
		time.Sleep(life + 50*time.Millisecond)
		rec, err := c.Lookup(ctx, db, scope, "orphan")
		if err != nil || rec.Status != idem.StatusUnknown {
			t.Fatalf("Lookup: %+v, %v; want an unknown record", rec, err)
		}
		if err := c.Resolve(ctx, db, scope, "orphan", idem.Resolution{Token: rec.Token,
			Succeeded: &idem.Response{Status: 201, Body: []byte(`{"id":1}`)}, Reason: "found at the provider"}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Prune(ctx, db, idem.PruneOptions{}); err != nil {
			t.Fatal(err)
		}
		ran := false
		res, err := c.DoInTx(ctx, db, scope, "orphan", idem.Fingerprint{1}, func(context.Context, *sql.Tx) (idem.Response, error) {
			ran = true
			return idem.Response{}, nil
		})
		if err != nil || ran || !res.Replayed || string(res.Body) != `{"id":1}` {
			t.Errorf("after Resolve and Prune: %+v, %v, fn ran %v; want the resolved response replayed", res, err, ran)
		}
	})
}
