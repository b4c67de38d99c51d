//go:build ignore

// What the blocks of docs/webhooks.md use: a service's pool and mux, its
// table of webhook endpoints, and the payment events it receives.
// Compiled only with those blocks, by TestDocsCompile.
package snippets

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

var (
	ctx  = context.Background()
	pool *pgxpool.Pool  // the service's pool, from pgxpool.New
	mux  *http.ServeMux // the service's routes
)

// endpointRow reads a destination's endpoint (URL, secrets) from the
// service's own table; errNoEndpoint when there is none.
func endpointRow(ctx context.Context, destination string) (url string, secrets []string, err error) {
	return "", nil, nil
}

// errNoEndpoint: the destination has no endpoint, and never will.
var errNoEndpoint error

// paymentEvent is the body of the payment webhooks the service receives.
type paymentEvent struct {
	Type string `json:"type"`
	Data struct {
		PaymentID string `json:"paymentId"`
	} `json:"data"`
}
