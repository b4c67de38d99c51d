package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// A service layer that is not HTTP deals in values: PlaceOrder returns an
// Order, and a retry with the same key returns the same Order instead of
// placing another. A refusal is stored and replayed as well, as a
// *RejectedError carrying its value.
func ExampleDoInTxJSON() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE stock (item text PRIMARY KEY, remaining int NOT NULL);
		INSERT INTO stock VALUES ('goose', 1);
		CREATE TABLE orders (id bigserial PRIMARY KEY, customer text NOT NULL, item text NOT NULL)`); err != nil {
		panic(err)
	}

	type Order struct {
		ID   int64  `json:"id"`
		Item string `json:"item"`
	}
	type OutOfStock struct {
		Item string `json:"item"`
	}
	placeOrder := func(ctx context.Context, customer, key, item string) (Order, bool, error) {
		scope := idem.Scope{Actor: customer, Operation: "order.place"}
		fp := idem.FingerprintParts([]byte(item))
		return idem.DoInTxJSON(ctx, pool, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (Order, error) {
			tag, err := tx.Exec(ctx, `UPDATE stock SET remaining = remaining - 1 WHERE item = $1 AND remaining > 0`, item)
			if err != nil {
				return Order{}, err // rolled back, nothing stored: the retry runs again
			}
			if tag.RowsAffected() == 0 {
				return Order{}, idem.RejectJSON(409, OutOfStock{Item: item}) // stored and replayed
			}
			o := Order{Item: item}
			err = tx.QueryRow(ctx, `INSERT INTO orders (customer, item) VALUES ($1, $2) RETURNING id`,
				customer, item).Scan(&o.ID)
			return o, err
		})
	}
	show := func(who string, o Order, replayed bool, err error) {
		var refused *idem.RejectedError
		switch {
		case errors.As(err, &refused):
			var why OutOfStock
			if err := refused.Decode(&why); err != nil {
				panic(err)
			}
			fmt.Printf("%s: refused (%d): %s is out of stock; replayed=%t\n", who, refused.Status, why.Item, replayed)
		case err != nil:
			panic(err)
		default:
			fmt.Printf("%s: order %d for a %s; replayed=%t\n", who, o.ID, o.Item, replayed)
		}
	}

	o, replayed, err := placeOrder(ctx, "alice", "key-a1", "goose")
	show("alice", o, replayed, err)
	o, replayed, err = placeOrder(ctx, "alice", "key-a1", "goose") // the response was lost; the app retries
	show("alice retries", o, replayed, err)
	o, replayed, err = placeOrder(ctx, "bob", "key-b1", "goose")
	show("bob", o, replayed, err)

	// Restocked: bob's retry still replays the refusal it was given; his
	// new attempt (a new key) orders.
	if _, err := pool.Exec(ctx, `UPDATE stock SET remaining = 1`); err != nil {
		panic(err)
	}
	o, replayed, err = placeOrder(ctx, "bob", "key-b1", "goose")
	show("bob retries", o, replayed, err)
	o, replayed, err = placeOrder(ctx, "bob", "key-b2", "goose")
	show("bob tries again", o, replayed, err)

	// Output:
	// alice: order 1 for a goose; replayed=false
	// alice retries: order 1 for a goose; replayed=true
	// bob: refused (409): goose is out of stock; replayed=false
	// bob retries: refused (409): goose is out of stock; replayed=true
	// bob tries again: order 2 for a goose; replayed=false
}

// A webhook receiver. The sender retries every delivery until it gets a 2xx,
// sends the first retry of each event while the first attempt is still
// running, and loses the first acknowledgement of each event on the way
// back. The handler records each event once, and every delivery ends
// acknowledged.
func ExampleInboxInTx() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `CREATE TABLE payments (
		id bigserial PRIMARY KEY, invoice text NOT NULL, amount bigint NOT NULL)`); err != nil {
		panic(err)
	}

	var mu sync.Mutex
	runs := map[string]int{} // handler runs by event id

	// The receiver. (Verify the sender's signature first, in a real one.)
	receiver := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		eventID := r.Header.Get("Webhook-Id")
		_, err = idem.InboxInTx(r.Context(), pool, "payments-webhook", eventID, body,
			func(ctx context.Context, tx pgx.Tx) error {
				var event struct {
					Invoice string `json:"invoice"`
					Amount  int64  `json:"amount"`
				}
				if err := json.Unmarshal(body, &event); err != nil {
					return idem.Reject(idem.Response{}) // malformed for good: recorded, never retried
				}
				mu.Lock()
				runs[eventID]++
				mu.Unlock()
				_, err := tx.Exec(ctx, `INSERT INTO payments (invoice, amount) VALUES ($1, $2)`,
					event.Invoice, event.Amount)
				return err
			})
		switch {
		case err == nil: // processed now, or a duplicate of a processed event
			w.WriteHeader(http.StatusNoContent)
		case errors.Is(err, idem.ErrKeyReused): // the sender reused an id: retrying will not help
			http.Error(w, "event id reused with another payload", http.StatusUnprocessableEntity)
		case errors.Is(err, idem.ErrInvalidKey):
			http.Error(w, "missing Webhook-Id", http.StatusBadRequest)
		default: // in progress elsewhere, or the database failed: nothing recorded, retry
			w.Header().Set("Retry-After", "1")
			http.Error(w, "try again", http.StatusServiceUnavailable)
		}
	})

	// The network between them loses the first acknowledgement of each
	// event: the receiver has processed it, the sender sees a timeout.
	var netMu sync.Mutex
	lostOnce := map[string]bool{} // event ids whose acknowledgement was lost
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := httptest.NewRecorder()
		receiver.ServeHTTP(rec, r)
		id := r.Header.Get("Webhook-Id")
		netMu.Lock()
		lose := rec.Code < 300 && !lostOnce[id]
		if lose {
			lostOnce[id] = true
		}
		netMu.Unlock()
		if lose {
			w.WriteHeader(http.StatusGatewayTimeout)
			return
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
	}))
	defer srv.Close()

	// The sender: delivers until a 2xx, or a 4xx that a retry cannot fix.
	deliver := func(eventID, body string) int {
		for attempt := 1; ; attempt++ {
			req, err := http.NewRequest("POST", srv.URL, strings.NewReader(body))
			if err != nil {
				panic(err)
			}
			req.Header.Set("Webhook-Id", eventID)
			resp, err := srv.Client().Do(req)
			if err == nil {
				_ = resp.Body.Close()
				if resp.StatusCode < 300 || (resp.StatusCode < 500 && resp.StatusCode != http.StatusRequestTimeout) || attempt == 10 {
					return resp.StatusCode
				}
			}
			time.Sleep(time.Duration(attempt) * 10 * time.Millisecond)
		}
	}
	events := []struct{ id, body string }{
		{"evt_001", `{"invoice":"inv_1","amount":1500}`},
		{"evt_002", `{"invoice":"inv_2","amount":2500}`},
		{"evt_003", `{"invoice":"inv_3","amount":900}`},
	}
	var wg sync.WaitGroup
	for _, e := range events {
		for range 2 { // the first attempt and an impatient retry, at once
			wg.Go(func() { deliver(e.id, e.body) })
		}
	}
	wg.Wait()

	for _, e := range events {
		fmt.Printf("%s: handler ran %d time(s)\n", e.id, runs[e.id])
	}
	var n, total int64
	if err := pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM payments`).Scan(&n, &total); err != nil {
		panic(err)
	}
	fmt.Printf("payments: %d, total %d\n", n, total)
	// A buggy sender reuses an id for another event: refused, not skipped.
	fmt.Println("evt_002 with another payload:", deliver("evt_002", `{"invoice":"inv_9","amount":1}`))

	// Output:
	// evt_001: handler ran 1 time(s)
	// evt_002: handler ran 1 time(s)
	// evt_003: handler ran 1 time(s)
	// payments: 3, total 4900
	// evt_002 with another payload: 422
}

// The outbox recipe. Placing an order writes the order and an event row in
// one transaction, with an id derived from the idempotency scope and key; a
// retry of the request writes neither again. A relay publishes the outbox
// (at least once: it crashes once after publishing and before marking), and
// the consumer processes each event id once, in its own transaction.
func ExampleEventID() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL);
		CREATE TABLE outbox (
			seq          bigserial PRIMARY KEY,
			id           uuid NOT NULL UNIQUE,
			name         text NOT NULL,
			payload      jsonb NOT NULL,
			published_at timestamptz);
		CREATE TABLE shipments (id bigserial PRIMARY KEY, order_id bigint NOT NULL)`); err != nil {
		panic(err)
	}

	// The producer: the order and its event commit with the key, or not
	// at all.
	placeOrder := func(key string) idem.Result {
		scope := idem.Scope{Actor: "alice", Operation: "order.create"}
		res, err := idem.DoInTx(ctx, pool, scope, key, idem.FingerprintParts([]byte("goose")),
			func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				var orderID int64
				if err := tx.QueryRow(ctx, `INSERT INTO orders (item) VALUES ('goose') RETURNING id`).Scan(&orderID); err != nil {
					return idem.Response{}, err
				}
				payload := fmt.Sprintf(`{"order_id":%d}`, orderID)
				if _, err := tx.Exec(ctx, `INSERT INTO outbox (id, name, payload) VALUES ($1, $2, $3)`,
					idem.EventID(scope, key, "order.placed"), "order.placed", payload); err != nil {
					return idem.Response{}, err
				}
				return idem.Response{Status: 201, Body: []byte(payload)}, nil
			})
		if err != nil {
			panic(err)
		}
		return res
	}
	first := placeOrder("9b1d2c6e-0d0f-4a57-8a1e-3b5f1c2d4e6f")
	retry := placeOrder("9b1d2c6e-0d0f-4a57-8a1e-3b5f1c2d4e6f")
	fmt.Printf("placed %s, retry replayed=%t\n", first.Body, retry.Replayed)

	// The relay: publishes what is not yet published, in order, then marks
	// it. The broker here is a slice.
	type message struct {
		ID, Name string
		Payload  []byte
	}
	var broker []message
	relay := func(crashBeforeMark bool) {
		err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `SELECT id::text, name, payload FROM outbox
				WHERE published_at IS NULL ORDER BY seq LIMIT 100 FOR UPDATE SKIP LOCKED`)
			if err != nil {
				return err
			}
			batch, err := pgx.CollectRows(rows, pgx.RowToStructByPos[message])
			if err != nil {
				return err
			}
			var ids []string
			for _, m := range batch {
				broker = append(broker, m) // publish
				ids = append(ids, m.ID)
			}
			if crashBeforeMark {
				return errors.New("relay crashed")
			}
			_, err = tx.Exec(ctx, `UPDATE outbox SET published_at = now() WHERE id = ANY($1::uuid[])`, ids)
			return err
		})
		if err != nil {
			fmt.Println("relay:", err)
		}
	}
	relay(true)
	relay(false)
	relay(false) // nothing left

	// The consumer: one transaction per message, with the inbox record in
	// it.
	for _, m := range broker {
		var duplicate bool
		err := idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			duplicate, err = idem.Inbox(ctx, tx, "shipping", m.ID, m.Payload, func(ctx context.Context, tx pgx.Tx) error {
				var event struct {
					OrderID int64 `json:"order_id"`
				}
				if err := json.Unmarshal(m.Payload, &event); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `INSERT INTO shipments (order_id) VALUES ($1)`, event.OrderID)
				return err
			})
			return err
		})
		if err != nil {
			panic(err) // leave the message unacknowledged: it comes again
		}
		fmt.Printf("consumed %s %s duplicate=%t\n", m.Name, m.ID, duplicate)
	}

	var orders, events, shipments int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox),
		(SELECT count(*) FROM shipments)`).Scan(&orders, &events, &shipments); err != nil {
		panic(err)
	}
	fmt.Printf("orders %d, events %d, published %d times, shipments %d\n", orders, events, len(broker), shipments)

	// Output:
	// placed {"order_id":1}, retry replayed=true
	// relay: relay crashed
	// consumed order.placed a5d02993-20b9-812e-a8b9-e1ffdf548ba1 duplicate=false
	// consumed order.placed a5d02993-20b9-812e-a8b9-e1ffdf548ba1 duplicate=true
	// orders 1, events 1, published 2 times, shipments 1
}
