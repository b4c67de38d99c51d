package idemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// An order service: the handler's INSERT commits with the key and the
// stored response, and a retry of the same request gets the same order
// back instead of a second one. A body the handler refuses as invalid is
// not stored (Invalid): the client corrects it and sends it again with the
// same key, and the order is placed.
func ExampleMiddleware() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (
		id bigserial PRIMARY KEY, customer text NOT NULL, item text NOT NULL, quantity int NOT NULL)`); err != nil {
		panic(err)
	}

	// The user comes from authentication; here, a bearer token that is the
	// user name.
	userFromToken := func(r *http.Request) (string, error) {
		user, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || user == "" {
			return "", errors.New("not authenticated")
		}
		return user, nil
	}

	// placeOrder is the handler: it runs once per key, in the transaction
	// of idemhttp.Tx.
	placeOrder := func(w http.ResponseWriter, r *http.Request) {
		var order struct {
			Item     string `json:"item"`
			Quantity int    `json:"quantity"`
		}
		if err := json.NewDecoder(r.Body).Decode(&order); err != nil || order.Item == "" || order.Quantity < 1 {
			idemhttp.Invalid(r.Context()) // not stored: the key stays free for the corrected body
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprint(w, `{"title":"An order needs an item and a quantity of at least 1."}`)
			return
		}
		customer, _ := userFromToken(r) // the middleware has authenticated the request
		var id int64
		err := idemhttp.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO orders (customer, item, quantity) VALUES ($1, $2, $3) RETURNING id`,
			customer, order.Item, order.Quantity).Scan(&id)
		if err != nil {
			http.Error(w, "database error", http.StatusInternalServerError) // rolled back, not stored
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, id)
	}

	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: userFromToken})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw(http.HandlerFunc(placeOrder)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(key, body string) {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Printf("%d replayed=%q location=%q %s\n", resp.StatusCode,
			resp.Header.Get("Idempotent-Replayed"), resp.Header.Get("Location"), b)
	}
	const key = "9b1d2c6e-0d0f-4a57-8a1e-3b5f1c2d4e6f" // one intent, one key
	post(key, `{"item":"goose","quantity":"two"}`)     // invalid: refused, not stored
	post(key, `{"item":"goose","quantity":2}`)         // corrected, same key: placed
	post(key, `{ "quantity": 2, "item": "goose" }`)    // a retry: the same order back
	post(key, `{"item":"swan","quantity":2}`)          // a client bug: another order, same key

	var orders int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		panic(err)
	}
	fmt.Println("orders:", orders)
	// Output:
	// 400 replayed="" location="" {"title":"An order needs an item and a quantity of at least 1."}
	// 201 replayed="" location="/orders/1" {"order":1}
	// 201 replayed="true" location="/orders/1" {"order":1}
	// 422 replayed="" location="" {"type":"about:blank","title":"Unprocessable Entity","status":422,"code":"IDEMPOTENCY_KEY_REUSED","detail":"This Idempotency-Key was used for a different request."}
	// orders: 1
}

// examplePool connects the way a service does: to DATABASE_URL (here with
// a default for a local PostgreSQL), through a pgxpool, with idem.Migrate at
// start-up. In a service that is all:
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	...
//	err = idem.Migrate(ctx, pool)
//
// Only so that the examples never see each other's rows or those of an
// earlier run, each one gets a schema of its own, first on the pool's
// search_path: idem's table and the example's tables live there, and the
// function returned drops it and closes the pool.
func examplePool() (*pgxpool.Pool, func()) {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@localhost:5432/postgres"
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 10
	schema := fmt.Sprintf("example_%x", rand.Uint64())
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		_, err = pool.Exec(ctx, "CREATE SCHEMA "+schema)
		if err == nil {
			err = idem.Migrate(ctx, pool)
		}
	}
	if err != nil {
		panic(err)
	}
	return pool, func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	}
}
