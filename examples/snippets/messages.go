//go:build ignore

// What the blocks of docs/messages.md use: a service's pool, its types, and
// a message from a broker. Compiled only with those blocks, by
// TestDocsCompile.
package snippets

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

var (
	ctx        = context.Background()
	pool       *pgxpool.Pool    // the service's pool, from pgxpool.New
	user       string           // the authenticated user: the key's actor
	key        string           // the caller's idempotency key
	fp         idem.Fingerprint // idem.FingerprintJSON of the request
	item       string
	id         int64
	outOfStock bool
	msg        message
	orderJSON  []byte // the order, as the event's payload
	broker     queue  // where events go: a broker's client, a webhook sender
)

// Order is what placing an order returns.
type Order struct {
	ID   int64  `json:"id"`
	Item string `json:"item"`
}

// OutOfStock is the refusal of an order for an item out of stock.
type OutOfStock struct {
	Item string `json:"item"`
}

// message is a delivery from a broker or a webhook sender.
type message struct {
	ID      string
	Payload []byte
}

// Ack acknowledges the delivery: the broker will not redeliver it.
func (m message) Ack() {}

// queue is a broker's client.
type queue struct{}

// Publish sends body to topic, with id for the consumers' deduplication.
func (queue) Publish(ctx context.Context, topic, id string, body []byte) error { return nil }

var _ = time.Second
