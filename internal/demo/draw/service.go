package draw

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Operation is the idem operation name of a draw: keys are unique per
// (user, Operation, key).
const Operation = "draw"

// Service runs idempotent draws.
type Service struct {
	db idem.Beginner
}

// NewService returns a Service that opens its transactions on db, typically
// a *pgxpool.Pool.
func NewService(db idem.Beginner) *Service {
	return &Service{db: db}
}

// Draw runs the draw described by the JSON body for user, once per key.
//
// The body is parsed and validated first; an invalid body returns an error
// wrapping ErrInvalidRequest and claims nothing. Otherwise the fingerprint is
// the SHA-256 of the canonical (RFC 8785) body, and Execute runs under
// idem.DoInTx with scope {user, "draw"}: the first call with a key draws and
// stores the response; a retry with the same body gets that response back
// with Replayed set; the same key with a different body returns
// idem.ErrKeyReused and changes nothing. Refusals (insufficient points, out of
// stock, unknown box) are stored and replayed like successes.
func (s *Service) Draw(ctx context.Context, user, key string, body []byte) (idem.Result, error) {
	req, err := ParseRequest(body)
	if err != nil {
		return idem.Result{}, err
	}
	fp, err := idem.FingerprintJSON(body)
	if err != nil {
		return idem.Result{}, fmt.Errorf("%w: %v", ErrInvalidRequest, err)
	}
	scope := idem.Scope{Actor: user, Operation: Operation}
	return idem.DoInTx(ctx, s.db, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return Execute(ctx, tx, user, req)
	})
}
