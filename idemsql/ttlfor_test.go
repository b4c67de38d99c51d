package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// Config.TTLFor gives each operation's keys their own TTL through idemsql
// too (Do, DoInTx, Reserve); a TTL under a microsecond is refused with
// ErrInvalidConfig and writes nothing.
func TestTTLFor(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		c, err := idemsql.New(idem.Config{TTL: time.Hour, TTLFor: func(op string) time.Duration {
			switch op {
			case "short":
				return 90 * time.Second
			case "broken":
				return -1
			}
			return 0
		}})
		if err != nil {
			t.Fatal(err)
		}
		ok := func(context.Context, *sql.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Body: []byte("{}")}, nil
		}
		fp := idem.Fingerprint{2}
		for op, want := range map[string]time.Duration{"short": 90 * time.Second, "other": time.Hour} {
			scope := idem.Scope{Actor: "a", Operation: op}
			if _, err := c.DoInTx(ctx, db, scope, "k-intx", fp, ok); err != nil {
				t.Fatal(err)
			}
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c.Do(ctx, tx, scope, "k-do", fp, ok); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Reserve(ctx, db, scope, "k-reserve", fp, time.Minute); err != nil {
				t.Fatal(err)
			}
			for _, key := range []string{"k-intx", "k-do", "k-reserve"} {
				var us int64
				if err := pool.QueryRow(ctx, `SELECT (extract(epoch FROM expires_at - created_at) * 1e6)::bigint
					FROM idem_keys WHERE operation = $1 AND idem_key = $2`, op, key).Scan(&us); err != nil {
					t.Fatal(err)
				}
				if got := time.Duration(us) * time.Microsecond; got != want {
					t.Errorf("%s %s: TTL %s, want %s", op, key, got, want)
				}
			}
		}
		before := keyCount(t, pool)
		broken := idem.Scope{Actor: "a", Operation: "broken"}
		if _, err := c.DoInTx(ctx, db, broken, "k", fp, ok); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("DoInTx with a negative TTL: %v, want ErrInvalidConfig", err)
		}
		if _, err := c.Reserve(ctx, db, broken, "k", fp, time.Minute); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("Reserve with a negative TTL: %v, want ErrInvalidConfig", err)
		}
		if n := keyCount(t, pool); n != before {
			t.Errorf("refused calls wrote %d rows", n-before)
		}
	})
}

// A TTLFor whose answer changes between two of its calls gives each call
// the TTL its claim read (as idem's TestTTLForChangingMidCall).
func TestTTLForChangingMidCall(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		var n atomic.Int64
		c, err := idemsql.New(idem.Config{TTLFor: func(string) time.Duration {
			return time.Hour + time.Duration(n.Add(1))*time.Minute // a new answer on every call
		}})
		if err != nil {
			t.Fatal(err)
		}
		ok := func(context.Context, *sql.Tx) (idem.Response, error) { return idem.Response{Status: 200}, nil }
		scope := idem.Scope{Actor: "a", Operation: "op"}
		if _, err := c.DoInTx(ctx, db, scope, "intx", idem.Fingerprint{1}, ok); err != nil {
			t.Fatalf("DoInTx: %v", err)
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Do(ctx, tx, scope, "do", idem.Fingerprint{1}, ok); err != nil {
			_ = tx.Rollback()
			t.Fatalf("Do: %v", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		var odd int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys
			WHERE status <> 'succeeded' OR expires_at - created_at < interval '61 minutes'`).Scan(&odd); err != nil || odd != 0 {
			t.Fatalf("%d rows not stored with a TTL TTLFor gave (%v)", odd, err)
		}
	})
}
