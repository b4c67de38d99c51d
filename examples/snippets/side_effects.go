//go:build ignore

// What the blocks of docs/side-effects.md use: a service's pool and the
// client of an outside system (a card gateway). Compiled only with those
// blocks, by TestDocsCompile.
package snippets

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

var (
	ctx         = context.Background()
	pool        *pgxpool.Pool    // the service's pool, from pgxpool.New
	scope       idem.Scope       // the authenticated user and the operation
	key         string           // the client's Idempotency-Key
	fp          idem.Fingerprint // idem.FingerprintJSON of the request's body
	amountCents int64
	gateway     cardGateway
)

// cardGateway is the client of a card gateway: it cannot join the
// database's transaction.
type cardGateway interface {
	// Charge charges once per idempotency key, if the gateway takes one.
	Charge(ctx context.Context, idempotencyKey string, amountCents int64) (charge, error)
}

type charge struct {
	ID      string
	Receipt []byte // the response to store and replay
}

// certainlyNotSent reports whether the charge certainly did not reach the
// gateway (refused before sending, connection refused): then it may run
// again. A timeout is not certain.
func certainlyNotSent(err error) bool { return errors.Is(err, errNotSent) }

var errNotSent = errors.New("gateway: not sent")
