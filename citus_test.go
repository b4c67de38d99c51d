package idem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/pgidem/idem"
)

// On PostgreSQL without the citus extension, Distribute refuses with
// ErrUnsupported and changes nothing; idem_keys stays a plain table and
// every call keeps working. (The Citus suite is internal/testkit/citustest.)
func TestDistributeWithoutCitus(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	err := idem.Distribute(ctx, pool)
	if !errors.Is(err, idem.ErrUnsupported) {
		t.Fatalf("Distribute on PostgreSQL: %v, want ErrUnsupported", err)
	}
	if err := idem.Distribute(ctx, nil); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("Distribute(nil): %v, want ErrInvalidArgument", err)
	}
	var kind string
	if err := pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE relname = 'idem_keys'`).Scan(&kind); err != nil || kind != "r" {
		t.Fatalf("idem_keys: relkind %q, %v", kind, err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate after the refusal: %v", err)
	}
}
