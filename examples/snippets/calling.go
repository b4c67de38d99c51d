//go:build ignore

// What the blocks of docs/calling.md use: a service's pool, the request it
// serves, and the outside services it calls (a card gateway over HTTP, a
// ledger over gRPC, an orders service over Connect). Compiled only with
// those blocks, by TestDocsCompile.
package snippets

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemhttp"
)

var (
	ctx        = context.Background()
	pool       *pgxpool.Pool    // the service's pool, from pgxpool.New
	scope      idem.Scope       // the authenticated user and the operation
	key        string           // the client's Idempotency-Key
	fp         idem.Fingerprint // idem.FingerprintJSON of the request's body
	body       []byte           // the charge to send
	gatewayURL string           // the card gateway's base URL
	target     = "ledger:443"   // the gRPC ledger's address
	ordersURL  string           // the Connect orders service's base URL
)

// pendingTransfer is an operation the service keeps in its own table until
// it is done, with the key of its outgoing call.
type pendingTransfer struct {
	ID      int64
	CallKey string
}

// savePending stores op in the service's table (in tx, with the rest of
// the request's writes).
func savePending(ctx context.Context, tx pgx.Tx, op pendingTransfer) error { return nil }

// keptRequest reads the body of the pending operation (scope, key), which
// the service kept before its first attempt.
func keptRequest(scope idem.Scope, key string) []byte { return nil }

// resend sends body again for r with r's call key, and records the outcome
// (Complete, FailRetryable or MarkUnknown).
func resend(ctx context.Context, r idem.Reservation, body []byte) {}

// newOrdersClient stands for a generated Connect client constructor
// (ordersv1connect.NewOrderServiceClient).
func newOrdersClient(httpClient connect.HTTPClient, baseURL string, opts ...connect.ClientOption) any {
	return nil
}
