package idemgrpc_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/rpcproto/rpctest"
)

// The behaviour idemgrpc shares with idemconnect, on a pgx pool and on
// database/sql with pgx's stdlib driver and lib/pq.
func TestSuite(t *testing.T) { rpctest.Run(t, transport{}) }

// UnaryServerInterceptorSQL on a Citus coordinator, with and without Options.Citus
// (skipped without IDEM_CITUS_URL; .ci/citus starts a cluster).
func TestCitusSQL(t *testing.T) { rpctest.RunCitus(t, transport{}) }

// OK is not a refusal: UnaryServerInterceptor panics at start-up.
func TestOKRefusalPanics(t *testing.T) {
	defer func() {
		if r := recover(); r == nil {
			t.Error("no panic")
		}
	}()
	idemgrpc.UnaryServerInterceptor(&pgxpool.Pool{}, idemgrpc.Options{Scope: scopeFromMetadata, RefusalCodes: []codes.Code{codes.OK}})
}
