package idemhttp_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// BenchmarkMiddleware measures a request over a real connection on
// 127.0.0.1 whose handler INSERTs one row: "bare" is a GET the middleware
// passes through (the handler commits its own transaction), "keyed" a
// first POST with a new key (claim, INSERT, stored response, one
// transaction), "replay" a retry of one key. Compare them as ratios within
// one run:
//
//	go test -run '^$' -bench Middleware -benchtime 2000x ./idemhttp/
func BenchmarkMiddleware(b *testing.B) {
	pool := pgtest.Pool(b, migrate)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		insert := func(tx pgx.Tx) error {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO effects (actor, route) VALUES ('a', $1) RETURNING id`, r.URL.Path).Scan(&id)
			if err == nil {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"id":%d}`, id)
			}
			return err
		}
		var err error
		if tx := idemhttp.Tx(ctx); tx != nil {
			err = insert(tx)
		} else {
			err = pgx.BeginFunc(ctx, pool, insert)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
		}
	})
	srv := httptest.NewServer(idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer})(handler))
	defer srv.Close()
	do := func(b *testing.B, method, key string) {
		req, _ := http.NewRequest(method, srv.URL+"/v1/effects", strings.NewReader(`{"n":1}`))
		req.Header.Set("Authorization", "Bearer alice")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			b.Fatalf("%s %s: %d", method, key, resp.StatusCode)
		}
	}
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			do(b, http.MethodGet, "")
		}
	})
	b.Run("keyed", func(b *testing.B) {
		i := 0
		for b.Loop() {
			i++
			do(b, http.MethodPost, fmt.Sprintf("bench-%d", i))
		}
	})
	b.Run("replay", func(b *testing.B) {
		for b.Loop() {
			do(b, http.MethodPost, "bench-1")
		}
	})
}
