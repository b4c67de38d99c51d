package idemhttp_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

// A serialization failure or a deadlock that one of the handler's own
// statements meets dooms the transaction whatever the handler answers: the
// middleware runs the handler again in a new transaction and sends the
// second run's answer, with the key or without one.
func TestHandlerSerializationFailureRunsAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t, migrate)
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, note text)`); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := idemhttp.Tx(r.Context())
		if runs.Add(1)%2 == 1 { // every first run of a request fails as a conflict would
			_, err := tx.Exec(r.Context(), `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END $$`)
			if err == nil {
				t.Error("the simulated conflict did not fail")
			}
			http.Error(w, "conflict", http.StatusInternalServerError)
			return
		}
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO orders (note) VALUES ('x') RETURNING id`).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "created")
	})
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, KeyOptional: true})
	srv := httptest.NewServer(mw(handler))
	defer srv.Close()

	for i, key := range []string{"order-1", ""} {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
		req.Header.Set("Authorization", "Bearer alice")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated || string(body) != "created" {
			t.Fatalf("request %d (key %q): %d %s, want the second run's 201", i, key, resp.StatusCode, body)
		}
	}
	var orders int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 4 || orders != 2 {
		t.Fatalf("%d handler runs, %d orders; want 4 runs, 2 orders", runs.Load(), orders)
	}
}
