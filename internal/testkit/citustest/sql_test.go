package citustest_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver
	_ "github.com/lib/pq"              // the "postgres" driver

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/idemsql"
)

// sqlOrder is fn of a request on database/sql: it inserts an order for the
// actor and answers with its id.
func sqlOrder(actor, key, item string) func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
	return func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		var id int64
		err := tx.QueryRowContext(ctx, `INSERT INTO orders (actor, idem_key, item) VALUES ($1, $2, $3) RETURNING id`,
			actor, key, item).Scan(&id)
		return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d,"item":%q}`, id, item)}, err
	}
}

// eachSQLDriver runs test for pgx's stdlib driver and for lib/pq, in
// parallel, each on a test database of its own with orders: a pool and a
// *sql.DB of the driver on the coordinator, closed with the test.
func eachSQLDriver(t *testing.T, test func(t *testing.T, p *pgxpool.Pool, db *sql.DB)) {
	for _, driverName := range []string{"pgx", "postgres"} {
		t.Run(driverName, func(t *testing.T) {
			t.Parallel()
			cdb, p := newDB(t)
			db, err := sql.Open(driverName, cdb.URL)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = db.Close() })
			test(t, p, db)
		})
	}
}

// idemsql's calls through the coordinator with a NewCitus Client, with
// pgx's stdlib driver and with lib/pq: Do and DoInTx run once and replay,
// a refusal is stored, a key held by a twin is given up after Config.Wait
// (the bound reaches the worker), fn changing its key row stores nothing,
// the reservation calls, Prune and ReadStats. A Client of New, which sends
// PostgreSQL's forms, is refused there with ErrUnsupported.
func TestCallsSQL(t *testing.T) {
	t.Parallel()
	eachSQLDriver(t, func(t *testing.T, p *pgxpool.Pool, db *sql.DB) {
		ctx := context.Background()
		c, err := idemsql.NewCitus(idem.Config{Wait: 300 * time.Millisecond, TTL: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		scope := idem.Scope{Actor: "alice", Operation: "order"}

		// DoInTx: once, then a replay byte for byte; another request
		// with the same key is refused.
		first, err := c.DoInTx(ctx, db, scope, "k1", fp("book"), sqlOrder("alice", "k1", "book"))
		if err != nil || first.Replayed || first.Status != 201 {
			t.Fatalf("DoInTx: %+v, %v", first, err)
		}
		again, err := c.DoInTx(ctx, db, scope, "k1", fp("book"), sqlOrder("alice", "k1", "book"))
		if err != nil || !again.Replayed || !bytes.Equal(again.Body, first.Body) {
			t.Fatalf("DoInTx replay: %+v, %v", again, err)
		}
		_, err = c.DoInTx(ctx, db, scope, "k1", fp("pen"), sqlOrder("alice", "k1", "pen"))
		isErr(t, "another request", err, idem.ErrKeyReused)
		if n := ordersOf(t, p, "alice", "k1"); n != 1 {
			t.Fatalf("%d orders for k1", n)
		}

		// Do in the caller's transaction, and a refusal.
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if res, err := c.Do(ctx, tx, scope, "k2", fp("pen"), sqlOrder("alice", "k2", "pen")); err != nil || res.Replayed {
			t.Fatalf("Do: %+v, %v", res, err)
		}
		refused, err := c.Do(ctx, tx, scope, "k3", fp("gold"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			return idem.Response{}, idem.Reject(idem.Response{Status: 402, Body: []byte("no funds")})
		})
		if err != nil || refused.Status != 402 {
			t.Fatalf("Do refusal: %+v, %v", refused, err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		replayed, err := c.DoInTx(ctx, db, scope, "k3", fp("gold"), sqlOrder("alice", "k3", "gold"))
		if err != nil || !replayed.Replayed || replayed.Status != 402 {
			t.Fatalf("the refusal replayed: %+v, %v", replayed, err)
		}

		// A twin holds the key: the wait is bounded on the worker.
		holder, err := p.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := idem.Do(ctx, holder, scope, "held", fp("x"), order("alice", "held", "x")); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := c.DoInTx(ctx, db, scope, "held", fp("x"), sqlOrder("alice", "held", "x"))
			done <- err
		}()
		select {
		case err := <-done:
			isErr(t, "DoInTx of a held key", err, idem.ErrInProgress)
		case <-time.After(20 * time.Second):
			t.Fatal("DoInTx is still waiting for the holder: Config.Wait did not reach the worker")
		}
		_ = holder.Rollback(ctx)

		// fn changes its own key row: nothing is stored.
		_, err = c.DoInTx(ctx, db, scope, "k4", fp("x"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			_, err := tx.ExecContext(ctx, `UPDATE idem_keys SET token = 7 WHERE actor = $1 AND operation = $2 AND idem_key = 'k4'`,
				scope.Actor, scope.Operation)
			return idem.Response{Status: 200}, err
		})
		isErr(t, "fn changing its key row", err, idem.ErrKeyRowChanged)
		if _, err := c.Lookup(ctx, db, scope, "k4"); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("Lookup after ErrKeyRowChanged: %v", err)
		}

		// Reservations: Reserve, Complete; FailRetryable and the next
		// attempt; MarkUnknown, ListUnknown, Resolve.
		r, err := c.Reserve(ctx, db, scope, "r1", fp("10"), time.Minute)
		if err != nil || r.Token <= 0 {
			t.Fatalf("Reserve: %+v, %v", r, err)
		}
		if _, err := c.Reserve(ctx, db, scope, "r1", fp("10"), time.Minute); !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("Reserve while leased: %v", err)
		}
		err = c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			return c.Complete(ctx, tx, r, idem.Response{Status: 201, Body: []byte("charged")})
		})
		if err != nil {
			t.Fatalf("Complete: %v", err)
		}
		r2, err := c.Reserve(ctx, db, scope, "r2", fp("20"), time.Minute)
		if err == nil {
			err = c.FailRetryable(ctx, db, r2, "refused")
		}
		if err != nil {
			t.Fatal(err)
		}
		if r2b, err := c.Reserve(ctx, db, scope, "r2", fp("20"), time.Minute); err != nil || r2b.Token <= r2.Token {
			t.Fatalf("Reserve after FailRetryable: %+v, %v", r2b, err)
		}
		r3, err := c.Reserve(ctx, db, scope, "r3", fp("30"), time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		if n, err := c.ExpireLeases(ctx, db, 10); err != nil || n != 1 {
			t.Fatalf("ExpireLeases: %d, %v", n, err)
		}
		recs, err := c.ListUnknown(ctx, db, 10, nil)
		if err != nil || len(recs) != 1 || recs[0].Key != "r3" {
			t.Fatalf("ListUnknown: %+v, %v", recs, err)
		}
		if err := c.Resolve(ctx, db, scope, "r3", idem.Resolution{Token: r3.Token, Retryable: true}); err != nil {
			t.Fatalf("Resolve: %v", err)
		}

		// Prune and ReadStats.
		short, err := idemsql.NewCitus(idem.Config{TTL: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := short.DoInTx(ctx, db, idem.Scope{Actor: "erin", Operation: "order"}, "p1", fp("p"),
			sqlOrder("erin", "p1", "p")); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
		if n, err := c.Prune(ctx, db, idem.PruneOptions{}); err != nil || n != 1 {
			t.Fatalf("Prune: %d, %v", n, err)
		}
		st, err := c.ReadStats(ctx, db)
		if err != nil || st.Keys[idem.StatusSucceeded] == 0 || st.TableBytes == 0 {
			t.Fatalf("ReadStats: %+v, %v", st, err)
		}

		// New's Client sends PostgreSQL's claim, which Citus refuses.
		plain, err := idemsql.New(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		_, err = plain.DoInTx(ctx, db, scope, "k5", fp("x"), sqlOrder("alice", "k5", "x"))
		isErr(t, "New's Client on Citus", err, idem.ErrUnsupported)
	})
}

// idemhttp's database/sql forms through the coordinator with Options.Citus,
// with both drivers: a request runs once and replays, its writes on the
// actor's worker; the status handler answers the stored response. Without
// Citus, the middleware answers 500 and nothing is written.
func TestMiddlewareSQLCitus(t *testing.T) {
	t.Parallel()
	eachSQLDriver(t, func(t *testing.T, p *pgxpool.Pool, db *sql.DB) {
		ctx := context.Background()
		actor := func(r *http.Request) (string, error) { return r.Header.Get("X-Actor"), nil }
		handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			key := r.Header.Get("Idempotency-Key")
			res, err := sqlOrder(r.Header.Get("X-Actor"), key, "book")(r.Context(), idemhttp.TxSQL(r.Context()))
			if err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(int(res.Status))
			_, _ = w.Write(res.Body)
		})
		mux := http.NewServeMux()
		mux.Handle("POST /citus", idemhttp.MiddlewareSQL(db, idemhttp.Options{Actor: actor, Citus: true})(handler))
		mux.Handle("POST /postgres", idemhttp.MiddlewareSQL(db, idemhttp.Options{Actor: actor,
			Logger: slog.New(slog.DiscardHandler)})(handler))
		mux.Handle("GET /status", idemhttp.StatusHandlerSQL(db, idemhttp.StatusOptions{Actor: actor, Citus: true}))
		srv := httptest.NewServer(mux)
		defer srv.Close()
		send := func(method, path, key string) (int, string, http.Header) {
			t.Helper()
			req, err := http.NewRequestWithContext(ctx, method, srv.URL+path, nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("X-Actor", "alice")
			req.Header.Set("Idempotency-Key", key)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(body), resp.Header
		}

		status, first, _ := send(http.MethodPost, "/citus", "k1")
		if status != 201 {
			t.Fatalf("first: %d %s", status, first)
		}
		status, again, h := send(http.MethodPost, "/citus", "k1")
		if status != 201 || again != first || h.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("replay: %d %s %v; first %s", status, again, h, first)
		}
		if n := ordersOf(t, p, "alice", "k1"); n != 1 {
			t.Fatalf("%d orders for k1", n)
		}
		if status, body, _ := send(http.MethodGet, "/status?operation=POST+%2Fcitus&key=k1", ""); status != 201 || body != first {
			t.Fatalf("status of k1: %d %s", status, body)
		}
		if status, body, _ := send(http.MethodPost, "/postgres", "k2"); status != 500 {
			t.Fatalf("without Options.Citus: %d %s", status, body)
		}
		if n := ordersOf(t, p, "alice", "k2"); n != 0 {
			t.Fatalf("without Options.Citus: %d orders", n)
		}
	})
}

// idemsql.Migrate on a worker is refused with ErrUnsupported, as
// idem.Migrate is (TestWorkerConnection), and creates nothing there.
func TestWorkerConnectionSQL(t *testing.T) {
	t.Parallel()
	cdb, _ := newDB(t)
	for _, driverName := range []string{"pgx", "postgres"} {
		w, err := sql.Open(driverName, cdb.Workers[0])
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		tables := func() (n int) {
			if err := w.QueryRowContext(t.Context(), `SELECT count(*) FROM pg_class`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		before := tables()
		isErr(t, driverName+": idemsql.Migrate on a worker", idemsql.Migrate(t.Context(), w), idem.ErrUnsupported)
		if after := tables(); after != before {
			t.Fatalf("%s: %d relations on the worker after idemsql.Migrate, %d before", driverName, after, before)
		}
	}
}
