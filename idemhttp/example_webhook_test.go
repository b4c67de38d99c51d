package idemhttp_test

import (
	"context"
	"fmt"
	"net/http/httptest"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// A payment service sends "payment.succeeded" to a shop as a Standard
// Webhook; the shop's handler marks the order paid once per webhook-id,
// however often the webhook is delivered. (In a service the relay calls
// Send, for each event published with idem.Publish.)
func ExampleWebhookHandler() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the shop's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `CREATE TABLE paid (payment text PRIMARY KEY)`); err != nil {
		panic(err)
	}
	const secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" // shared by the sender and the shop

	// The shop: verified, then run once per webhook-id in one transaction.
	shop := idemhttp.WebhookHandler(pool, idemhttp.WebhookOptions{Secrets: []string{secret}, Consumer: "payments"},
		func(ctx context.Context, tx pgx.Tx, w idemhttp.Webhook) error {
			_, err := tx.Exec(ctx, `INSERT INTO paid (payment) VALUES ($1::json->>'payment')`, w.Body)
			return err
		})
	srv := httptest.NewServer(shop)
	defer srv.Close()

	// The payment service's sender: the shop's URL and secret.
	sender := idemhttp.WebhookSender{
		Endpoint: func(ctx context.Context, destination string) (idemhttp.Endpoint, error) {
			return idemhttp.Endpoint{URL: srv.URL, Secrets: []string{secret}}, nil
		},
	}
	ev := idem.Event{
		ID:          idem.EventID(idem.Scope{Actor: "alice", Operation: "POST /v1/payments"}, "pay-1", "payment.succeeded"),
		Topic:       "payment.succeeded",
		Destination: "shop",
		Payload:     []byte(`{"payment":"pay_1"}`),
	}
	for attempt := 1; attempt <= 3; attempt++ { // the relay's redeliveries
		err := sender.Send(ctx, idem.Delivery{Event: ev, Attempt: attempt})
		fmt.Println("attempt", attempt, "delivered:", err == nil)
	}

	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM paid`).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("orders marked paid:", n)
	// Output:
	// attempt 1 delivered: true
	// attempt 2 delivered: true
	// attempt 3 delivered: true
	// orders marked paid: 1
}
