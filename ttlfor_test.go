package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Config.TTLFor gives each operation's keys their own TTL (0: Config.TTL),
// for Do, DoInTx and Reserve; a key past its own TTL is a new request, a
// key of another operation is still replayed. A TTL under a microsecond
// fails the call with ErrInvalidConfig and writes nothing.
func TestTTLFor(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t)
	c, err := idem.New(idem.Config{TTL: time.Hour, TTLFor: func(op string) time.Duration {
		switch op {
		case "short":
			return 200 * time.Millisecond
		case "week":
			return 7 * 24 * time.Hour
		case "broken":
			return -time.Second
		}
		return 0
	}})
	if err != nil {
		t.Fatal(err)
	}
	ttlOf := func(op, key string) time.Duration {
		t.Helper()
		var us int64
		if err := pool.QueryRow(ctx, `SELECT (extract(epoch FROM expires_at - created_at) * 1e6)::bigint
			FROM idem_keys WHERE operation = $1 AND idem_key = $2`, op, key).Scan(&us); err != nil {
			t.Fatalf("%s/%s: %v", op, key, err)
		}
		return time.Duration(us) * time.Microsecond
	}
	var calls atomic.Int64
	fp := idem.Fingerprint{1}
	for op, want := range map[string]time.Duration{"short": 200 * time.Millisecond, "week": 7 * 24 * time.Hour, "other": time.Hour} {
		scope := idem.Scope{Actor: "a", Operation: op}
		if _, err := c.DoInTx(ctx, pool, scope, "k-intx", fp, recordEffect(&calls, "k-intx")); err != nil {
			t.Fatal(err)
		}
		if got := ttlOf(op, "k-intx"); got != want {
			t.Errorf("DoInTx %s: TTL %s, want %s", op, got, want)
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := c.Do(ctx, tx, scope, "k-do", fp, recordEffect(&calls, "k-do"))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if got := ttlOf(op, "k-do"); got != want {
			t.Errorf("Do %s: TTL %s, want %s", op, got, want)
		}
		if _, err := c.Reserve(ctx, pool, scope, "k-reserve", fp, time.Minute); err != nil {
			t.Fatal(err)
		}
		if got := ttlOf(op, "k-reserve"); got != want {
			t.Errorf("Reserve %s: TTL %s, want %s", op, got, want)
		}
	}

	// Past its own TTL a "short" key runs again; an "other" key is replayed.
	time.Sleep(300 * time.Millisecond)
	before := calls.Load()
	res, err := c.DoInTx(ctx, pool, idem.Scope{Actor: "a", Operation: "short"}, "k-intx", fp, recordEffect(&calls, "k-intx"))
	if err != nil || res.Replayed || calls.Load() != before+1 {
		t.Errorf("short key past its TTL: replayed %t, %v, fn ran %d times (want a new request)", res.Replayed, err, calls.Load()-before)
	}
	res, err = c.DoInTx(ctx, pool, idem.Scope{Actor: "a", Operation: "other"}, "k-intx", fp, recordEffect(&calls, "k-intx"))
	if err != nil || !res.Replayed {
		t.Errorf("other key inside its TTL: replayed %t, %v (want a replay)", res.Replayed, err)
	}

	// A negative TTL is refused before anything is written.
	broken := idem.Scope{Actor: "a", Operation: "broken"}
	before = calls.Load()
	if _, err := c.DoInTx(ctx, pool, broken, "k", fp, recordEffect(&calls, "k")); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("DoInTx with a negative TTL: %v, want ErrInvalidConfig", err)
	}
	if _, err := c.Reserve(ctx, pool, broken, "k", fp, time.Minute); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("Reserve with a negative TTL: %v, want ErrInvalidConfig", err)
	}
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_keys WHERE operation = 'broken'`).Scan(&n); err != nil || n != 0 || calls.Load() != before {
		t.Errorf("refused calls wrote %d rows, ran fn %d times (%v)", n, calls.Load()-before, err)
	}
}

// A TTLFor whose answer changes between two of its calls (a setting
// reloaded while a call runs) gives each call the TTL its claim read: the
// completion stores that one, and does not take the change for fn having
// changed the key's row.
func TestTTLForChangingMidCall(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t)
	var n atomic.Int64
	c, err := idem.New(idem.Config{TTLFor: func(string) time.Duration {
		return time.Hour + time.Duration(n.Add(1))*time.Minute // a new answer on every call
	}})
	if err != nil {
		t.Fatal(err)
	}
	ok := func(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{Status: 200}, nil }
	scope := idem.Scope{Actor: "a", Operation: "op"}
	if _, err := c.DoInTx(ctx, pool, scope, "intx", idem.Fingerprint{1}, ok); err != nil {
		t.Fatalf("DoInTx: %v", err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := c.Do(ctx, tx, scope, "do", idem.Fingerprint{1}, ok)
		return err
	}); err != nil {
		t.Fatalf("Do: %v", err)
	}
	var odd int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys
		WHERE status <> 'succeeded' OR expires_at - created_at < interval '61 minutes'`).Scan(&odd); err != nil || odd != 0 {
		t.Fatalf("%d rows not stored with a TTL TTLFor gave (%v)", odd, err)
	}
}
