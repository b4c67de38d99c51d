package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/pgtest"
)

// An order service: the handler's INSERT commits with the key and the
// stored response, and a retry of the same request gets the same order
// back instead of a second one.
func Example() {
	ctx := context.Background()
	url, drop, err := pgtest.NewDatabase(ctx, idem.Migrate)
	if err != nil {
		panic(err)
	}
	defer drop()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`); err != nil {
		panic(err)
	}

	// The user comes from authentication; here, a bearer token that is the
	// user name.
	userFromToken := func(r *http.Request) (string, error) {
		user, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok {
			return "", errors.New("not authenticated")
		}
		return user, nil
	}

	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: userFromToken})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var id int64
		err := idemhttp.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO orders (item) VALUES ('goose') RETURNING id`).Scan(&id)
		if err != nil {
			http.Error(w, "database error", http.StatusInternalServerError) // rolled back, not stored
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, id)
	})))
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
	post("9b1d2c6e-0d0f-4a57-8a1e-3b5f1c2d4e6f", `{"item":"goose"}`)
	post("9b1d2c6e-0d0f-4a57-8a1e-3b5f1c2d4e6f", `{ "item": "goose" }`) // a retry
	post("9b1d2c6e-0d0f-4a57-8a1e-3b5f1c2d4e6f", `{"item":"swan"}`)     // a client bug

	var orders int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		panic(err)
	}
	fmt.Println("orders:", orders)
	// Output:
	// 201 replayed="" location="/orders/1" {"order":1}
	// 201 replayed="true" location="/orders/1" {"order":1}
	// 422 replayed="" location="" {"type":"about:blank","title":"Unprocessable Entity","status":422,"code":"IDEMPOTENCY_KEY_REUSED","detail":"This Idempotency-Key was used for a different request."}
	// orders: 1
}
