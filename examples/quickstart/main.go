// Quickstart places one order twice with the same idempotency key, and once
// with the same key and another order: the first runs, the retry replays,
// the third is refused. Run it with go run ./examples/quickstart; it uses
// DATABASE_URL, or the PostgreSQL on localhost.
package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

func main() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@localhost:5432/postgres"
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	// Once, at start-up: idem's table, and the service's own.
	if err := idem.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS quickstart_orders (
		id bigserial PRIMARY KEY, idem_key text NOT NULL, item text NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	// The client makes one key per intent and sends it with every retry.
	key := rand.Text()
	placeOrder := func(item string) {
		body := fmt.Sprintf(`{"item":%q}`, item) // the request
		fp, err := idem.FingerprintJSON([]byte(body))
		if err != nil {
			log.Fatal(err)
		}
		scope := idem.Scope{Actor: "alice", Operation: "orders.create"} // the actor comes from authentication
		res, err := idem.DoInTx(ctx, pool, scope, key, fp,
			func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				// The order and the stored response commit together.
				_, err := tx.Exec(ctx, `INSERT INTO quickstart_orders (idem_key, item) VALUES ($1, $2)`, key, item)
				if err != nil {
					return idem.Response{}, err // rolled back: nothing stored, the key is free again
				}
				return idem.Response{Status: 201, Body: []byte(body)}, nil
			})
		switch {
		case errors.Is(err, idem.ErrKeyReused):
			fmt.Println("422: this key was used for another order")
		case err != nil:
			log.Fatal(err)
		default:
			fmt.Printf("%d %s replayed=%t\n", res.Status, res.Body, res.Replayed)
		}
	}
	placeOrder("coffee")
	placeOrder("coffee") // a retry: the same answer, and fn does not run
	placeOrder("tea")    // the same key with another order

	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM quickstart_orders WHERE idem_key = $1`, key).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders placed with this key:", n)
}
