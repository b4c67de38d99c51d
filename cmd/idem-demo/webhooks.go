package main

// The payments' events: each payment publishes payment.succeeded in the
// transaction that records it (insertPayment); an idem.Relay delivers it as
// a Standard Webhook (idemhttp.WebhookSender) to a receiver the demo runs
// itself (idemhttp.WebhookHandler), which processes each webhook-id once.

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

const (
	// paymentSucceeded is the topic of the event every payment publishes.
	paymentSucceeded = "payment.succeeded"
	// billingDestination is the destination of the payments' events: the
	// demo's receiver.
	billingDestination = "billing"
)

// publishPaymentSucceeded publishes the payment.succeeded event of the
// payment (user, key) in tx, the transaction that records the payment. Its
// ID is idem.EventID's, so every writer of the payment publishes the same
// event, once.
func publishPaymentSucceeded(ctx context.Context, tx pgx.Tx, user, key string, c gatewayCharge) error {
	payload, err := json.Marshal(map[string]any{
		"type": paymentSucceeded,
		"data": map[string]any{
			"paymentId": paymentID(c), "customerId": c.CustomerID,
			"amountCents": c.AmountCents, "currency": c.Currency,
		},
	})
	if err != nil {
		return err
	}
	return idem.Publish(ctx, tx, idem.Event{
		ID:          idem.EventID(idem.Scope{Actor: user, Operation: paymentOperation}, key, paymentSucceeded),
		Topic:       paymentSucceeded,
		Destination: billingDestination,
		Payload:     payload,
	})
}

// receiver is the demo's webhook receiver: an HTTP server on loopback whose
// handler is idemhttp.WebhookHandler, recording each webhook it processes
// in payment_webhooks (no unique constraint there: a webhook processed
// twice would show as two rows).
type receiver struct {
	srv    *httptest.Server
	secret string
	// loseReplies is how many of the next webhooks are processed and then
	// have their answer lost (the connection closes instead); lost counts
	// them.
	loseReplies, lost atomic.Int32
}

// newReceiver creates payment_webhooks and starts a receiver with a fresh
// secret.
func newReceiver(ctx context.Context, pool *pgxpool.Pool) (*receiver, error) {
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS payment_webhooks (
		webhook_id  text        NOT NULL,
		payment_id  text        NOT NULL,
		received_at timestamptz NOT NULL DEFAULT now())`)
	if err != nil {
		return nil, fmt.Errorf("create payment_webhooks: %w", err)
	}
	key := make([]byte, 32)
	rand.Read(key)
	rc := &receiver{secret: "whsec_" + base64.StdEncoding.EncodeToString(key)}
	h := idemhttp.WebhookHandler(pool, idemhttp.WebhookOptions{
		Secrets: []string{rc.secret},
		Logger:  slog.New(slog.DiscardHandler),
	}, func(ctx context.Context, tx pgx.Tx, w idemhttp.Webhook) error {
		var ev struct {
			Data struct {
				PaymentID string `json:"paymentId"`
			} `json:"data"`
		}
		if err := json.Unmarshal(w.Body, &ev); err != nil {
			return idem.Reject(idem.Response{}) // not ours to retry
		}
		_, err := tx.Exec(ctx, `INSERT INTO payment_webhooks (webhook_id, payment_id) VALUES ($1, $2)`, w.ID, ev.Data.PaymentID)
		return err
	})
	rc.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if rc.loseReplies.Add(-1) < 0 {
			rc.loseReplies.Add(1)
			h.ServeHTTP(w, r)
			return
		}
		// Processed, and the answer lost with the connection: the
		// sender cannot tell, and sends the webhook again.
		h.ServeHTTP(httptest.NewRecorder(), r)
		rc.lost.Add(1)
		if hj, ok := w.(http.Hijacker); ok {
			if conn, _, err := hj.Hijack(); err == nil {
				conn.Close()
			}
		}
	}))
	return rc, nil
}

func (rc *receiver) close() { rc.srv.Close() }

// endpoint is the WebhookSender's Endpoint: every destination is the
// receiver.
func (rc *receiver) endpoint(context.Context, string) (idemhttp.Endpoint, error) {
	return idemhttp.Endpoint{URL: rc.srv.URL + "/webhooks/payments", Secrets: []string{rc.secret}}, nil
}

// startRelay runs a relay that delivers the events to rc until the
// returned stop is called; stop waits for the relay to return.
func startRelay(ctx context.Context, pool *pgxpool.Pool, rc *receiver) (stop func() error, err error) {
	relay, err := idem.NewRelay(pool, idem.RelayOptions{
		Sender:       idemhttp.WebhookSender{Endpoint: rc.endpoint},
		Schedule:     []time.Duration{0, 50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond},
		PollInterval: 20 * time.Millisecond,
		Logger:       slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	return func() error {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
		return nil
	}, nil
}

// eventCounts are the payments' events and what became of them.
type eventCounts struct {
	published, delivered, failed int
	// webhooks is how many times the receiver's fn committed; processed,
	// how many distinct webhook-ids it processed.
	webhooks, processed int
}

func (c eventCounts) String() string {
	return fmt.Sprintf("published %d, delivered %d, processed once %d", c.published, c.delivered, c.processedOnce())
}

// processedOnce is how many events the receiver processed exactly once
// (all of them, or none, when one was processed twice).
func (c eventCounts) processedOnce() int {
	if c.webhooks != c.processed {
		return 0
	}
	return c.processed
}

func countEvents(ctx context.Context, pool *pgxpool.Pool) (c eventCounts, err error) {
	err = pool.QueryRow(ctx, `SELECT count(*),
			count(*) FILTER (WHERE status = 'delivered'),
			count(*) FILTER (WHERE status = 'failed')
		FROM idem_events WHERE destination = $1 AND topic = $2`, billingDestination, paymentSucceeded).
		Scan(&c.published, &c.delivered, &c.failed)
	if err != nil {
		return c, err
	}
	err = pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT webhook_id) FROM payment_webhooks`).Scan(&c.webhooks, &c.processed)
	return c, err
}

// awaitDelivered waits until every published event is delivered or failed,
// for at most 15 seconds.
func awaitDelivered(ctx context.Context, pool *pgxpool.Pool) (eventCounts, error) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	for {
		c, err := countEvents(ctx, pool)
		if err != nil {
			return c, err
		}
		if c.delivered+c.failed == c.published {
			return c, nil
		}
		select {
		case <-ctx.Done():
			return c, fmt.Errorf("%d of %d events still pending: %w", c.published-c.delivered-c.failed, c.published, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// paymentEvents: the payments so far published their events; a relay
// delivers them to the receiver, which loses its first two answers (the
// redeliveries are acknowledged, fn does not run again). The relay stops, a
// payment is made meanwhile, and a new relay delivers its event.
func (d *demo) paymentEvents(ctx context.Context) (string, bool, error) {
	s, err := d.payments(ctx)
	if err != nil {
		return "", false, err
	}
	rc, err := newReceiver(ctx, d.pool)
	if err != nil {
		return "", false, err
	}
	defer rc.close()
	rc.loseReplies.Store(2)

	stop, err := startRelay(ctx, d.pool, rc)
	if err != nil {
		return "", false, err
	}
	first, err := awaitDelivered(ctx, d.pool)
	if stopErr := stop(); err == nil {
		err = stopErr
	}
	if err != nil {
		return "", false, err
	}

	// No relay runs: the payment's event waits in the outbox.
	if _, _, err := s.pay(ctx, user, "demo-pay-events", demoPayment, ""); err != nil {
		return "", false, err
	}
	waiting, err := countEvents(ctx, d.pool)
	if err != nil {
		return "", false, err
	}
	stop, err = startRelay(ctx, d.pool, rc)
	if err != nil {
		return "", false, err
	}
	c, err := awaitDelivered(ctx, d.pool)
	if stopErr := stop(); err == nil {
		err = stopErr
	}
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("%s; %d answers lost, relay restarted with 1 pending", c, rc.lost.Load())
	ok := first.published > 0 && first.delivered == first.published &&
		waiting.published == first.published+1 && waiting.delivered == first.delivered &&
		c.delivered == c.published && c.failed == 0 && c.processedOnce() == c.published &&
		rc.lost.Load() == 2
	return what, ok, nil
}
