package relay_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/testkit/pgtest"
	"github.com/pgidem/idem/internal/testkit/relay"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// schema creates the table the tests write to.
func schema(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `CREATE TABLE t (id int PRIMARY KEY)`)
	return err
}

// setup returns the URL of a fresh database and a relay in front of its
// server, closed when the test ends.
func setup(t *testing.T, opts relay.Options) (direct string, r *relay.Relay) {
	t.Helper()
	direct = pgtest.URL(t, schema)
	target, err := relay.Target(direct)
	if err != nil {
		t.Fatal(err)
	}
	r, err = relay.Start(target, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Error(err)
		}
	})
	return direct, r
}

func connect(t *testing.T, r *relay.Relay, direct string, sslmode string) *pgx.Conn {
	t.Helper()
	url, err := r.ConnString(direct)
	if err != nil {
		t.Fatal(err)
	}
	if sslmode != "" {
		url = strings.Replace(url, "sslmode=disable", "sslmode="+sslmode, 1)
	}
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func rows(t *testing.T, direct string) int {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), direct)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(t.Context(), `SELECT count(*) FROM t`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestRelaysQueries(t *testing.T) {
	t.Parallel()
	for _, delay := range []time.Duration{0, 2 * time.Millisecond} {
		direct, r := setup(t, relay.Options{Delay: delay})
		conn := connect(t, r, direct, "")
		// A result larger than one read buffer, both ways.
		big := strings.Repeat("x", 200_000)
		var got string
		if err := conn.QueryRow(t.Context(), `SELECT $1::text`, big).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != big {
			t.Fatalf("delay %v: echoed %d bytes, want %d", delay, len(got), len(big))
		}
		// A pipeline of many small messages keeps their order.
		batch := &pgx.Batch{}
		for i := range 100 {
			batch.Queue(`INSERT INTO t VALUES ($1)`, i)
		}
		if err := conn.SendBatch(t.Context(), batch).Close(); err != nil {
			t.Fatal(err)
		}
		if n := rows(t, direct); n != 100 {
			t.Fatalf("delay %v: %d rows, want 100", delay, n)
		}
	}
}

// With a delay, chunks in flight overlap instead of queueing behind each
// other's sleep: many connections doing round trips at once all finish.
func TestDelayManyConnections(t *testing.T) {
	t.Parallel()
	direct, r := setup(t, relay.Options{Delay: 5 * time.Millisecond})
	url, err := r.ConnString(direct)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			for range 10 {
				var one int
				if err := pool.QueryRow(t.Context(), `SELECT 1`).Scan(&one); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// The relay cuts the connection after the server acknowledged COMMIT and
// before the client saw it: the row is committed, the client gets an error.
func TestDropAfterCommit(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		delay time.Duration
	}{
		{"plain", 0},
		{"delayed", 3 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var armed atomic.Bool
			direct, r := setup(t, relay.Options{Delay: tc.delay, DropAfterCommit: func() bool {
				return armed.CompareAndSwap(true, false)
			}})
			conn := connect(t, r, direct, "")

			// Unarmed: commits pass.
			tx, err := conn.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(t.Context(), `INSERT INTO t VALUES (1)`); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(t.Context()); err != nil {
				t.Fatal(err)
			}
			// A rollback is not a COMMIT acknowledgement, even armed.
			armed.Store(true)
			tx, err = conn.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(t.Context(), `INSERT INTO t VALUES (2)`); err != nil {
				t.Fatal(err)
			}
			if err := tx.Rollback(t.Context()); err != nil {
				t.Fatal(err)
			}
			// Neither is COMMIT of a failed transaction (tagged ROLLBACK).
			tx, err = conn.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(t.Context(), `INSERT INTO t VALUES (1)`); err == nil {
				t.Fatal("duplicate insert succeeded")
			}
			if err := tx.Commit(t.Context()); !errors.Is(err, pgx.ErrTxCommitRollback) {
				t.Fatalf("commit of failed transaction: %v", err)
			}
			if r.CommitsCut() != 0 {
				t.Fatalf("CommitsCut = %d before any armed COMMIT", r.CommitsCut())
			}

			// Armed: the commit happens, the client cannot know.
			tx, err = conn.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(t.Context(), `INSERT INTO t VALUES (3)`); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(t.Context()); err == nil {
				t.Fatal("commit succeeded through a cut connection")
			}
			if r.CommitsCut() != 1 {
				t.Fatalf("CommitsCut = %d, want 1", r.CommitsCut())
			}
			if n := rows(t, direct); n != 2 {
				t.Fatalf("%d rows committed, want 2 (ids 1 and 3)", n)
			}
			if !conn.IsClosed() {
				t.Fatal("client connection still open")
			}
			// A new connection through the same relay works.
			var n int
			if err := connect(t, r, direct, "").QueryRow(t.Context(), `SELECT count(*) FROM t`).Scan(&n); err != nil || n != 2 {
				t.Fatalf("after the cut: %d rows, %v", n, err)
			}
		})
	}
}

// A connection that negotiates TLS is relayed as opaque bytes: it works, and
// the commit fault does not fire on it.
func TestTLSIsOpaque(t *testing.T) {
	t.Parallel()
	direct, r := setup(t, relay.Options{DropAfterCommit: func() bool { return true }})
	var ssl string
	if err := connect(t, r, direct, "").QueryRow(t.Context(), `SHOW ssl`).Scan(&ssl); err != nil {
		t.Fatal(err)
	}
	if ssl != "on" {
		t.Skip("server has ssl off")
	}
	conn := connect(t, r, direct, "require")
	tx, err := conn.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(t.Context(), `INSERT INTO t VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	if r.CommitsCut() != 0 || rows(t, direct) != 1 {
		t.Fatalf("CommitsCut = %d, rows = %d", r.CommitsCut(), rows(t, direct))
	}
}

func TestCutAllAndClose(t *testing.T) {
	t.Parallel()
	direct, r := setup(t, relay.Options{})
	a := connect(t, r, direct, "")
	b := connect(t, r, direct, "")
	r.CutAll()
	for _, c := range []*pgx.Conn{a, b} {
		if err := c.Ping(t.Context()); err == nil {
			t.Fatal("ping succeeded on a cut connection")
		}
	}
	c := connect(t, r, direct, "")
	if err := c.Ping(t.Context()); err != nil {
		t.Fatalf("new connection after CutAll: %v", err)
	}
	// pgx may also open connections of its own to send cancel requests.
	if got := r.Accepted(); got < 3 {
		t.Fatalf("Accepted = %d, want at least 3", got)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(t.Context()); err == nil {
		t.Fatal("ping succeeded after Close")
	}
	url, _ := r.ConnString(direct)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, url); err == nil {
		conn.Close(ctx)
		t.Fatal("connected after Close")
	}
}

func TestBadInput(t *testing.T) {
	if _, err := relay.Start("127.0.0.1:1", relay.Options{Delay: -1}); err == nil {
		t.Fatal("negative delay accepted")
	}
	r, err := relay.Start("127.0.0.1:1", relay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for _, s := range []string{"host=a port=1", "postgres://a:1,b:2/db", "::"} {
		if _, err := r.ConnString(s); err == nil {
			t.Errorf("ConnString(%q) accepted", s)
		}
	}
	if _, err := relay.Target("postgres://h:99999/db"); err == nil {
		t.Error("Target accepted a bad port")
	}
}

// BenchmarkRoundTrip reports what one query costs through the relay with
// and without a delay (the delay appears twice per round trip).
func BenchmarkRoundTrip(b *testing.B) {
	for _, delay := range []time.Duration{0, time.Millisecond} {
		b.Run(delay.String(), func(b *testing.B) {
			direct := pgtest.URL(b, nil)
			target, _ := relay.Target(direct)
			r, err := relay.Start(target, relay.Options{Delay: delay})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			url, _ := r.ConnString(direct)
			conn, err := pgx.Connect(b.Context(), url)
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close(context.Background())
			var one int
			for b.Loop() {
				if err := conn.QueryRow(b.Context(), `SELECT 1`).Scan(&one); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
