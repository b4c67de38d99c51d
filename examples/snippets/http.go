//go:build ignore

// What the blocks of docs/http.md use: a service's mux, pool and
// authentication. Compiled only with those blocks, by TestDocsCompile.
package snippets

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

var (
	ctx  = context.Background()
	pool *pgxpool.Pool // the service's pool, from pgxpool.New
	mux  = http.NewServeMux()
)

// userFromToken is the service's authentication: the verified user of the
// request's bearer token.
func userFromToken(r *http.Request) (string, error) {
	user, ok := verify(r.Header.Get("Authorization"))
	if !ok {
		return "", errors.New("not authenticated")
	}
	return user, nil
}

func verify(authorization string) (user string, ok bool) { return "", false }

// order is the body of POST /v1/orders.
type order struct {
	Item     string `json:"item"`
	Quantity int    `json:"quantity"`
}

// parseOrder reads and checks an order's JSON body.
func parseOrder(body io.Reader) (order, error) {
	var o order
	if err := json.NewDecoder(body).Decode(&o); err != nil {
		return order{}, err
	}
	if o.Item == "" || o.Quantity < 1 {
		return order{}, errors.New("invalid order")
	}
	return o, nil
}

// writeProblem writes an application/problem+json answer.
func writeProblem(w http.ResponseWriter, status int, detail string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"status": status, "detail": detail})
}

// orders is the handler of POST /v1/orders (see createOrder in docs/http.md).
var orders http.Handler = http.NotFoundHandler()

// paymentAttempts is the handler of POST /v1/payment-attempts.
var paymentAttempts http.Handler = http.NotFoundHandler()
