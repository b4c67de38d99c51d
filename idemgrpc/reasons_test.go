package idemgrpc_test

import (
	"testing"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/rpcidem"
)

// TestReasonsMatchTheProtocol: the constants are spelled out here, so that
// go doc shows them; they must be the values the interceptors send.
func TestReasonsMatchTheProtocol(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{idemgrpc.ErrorDomain, rpcidem.ErrorDomain},
		{idemgrpc.ReasonKeyMissing, rpcidem.ReasonKeyMissing},
		{idemgrpc.ReasonKeyInvalid, rpcidem.ReasonKeyInvalid},
		{idemgrpc.ReasonKeyReused, rpcidem.ReasonKeyReused},
		{idemgrpc.ReasonInProgress, rpcidem.ReasonInProgress},
		{idemgrpc.ReasonOutcomeUnknown, rpcidem.ReasonOutcomeUnknown},
		{idemgrpc.ReasonResponseExpired, rpcidem.ReasonResponseExpired},
		{idemgrpc.ReasonStoreUnavailable, rpcidem.ReasonStoreUnavailable},
	} {
		if c.got != c.want {
			t.Errorf("%q, want %q", c.got, c.want)
		}
	}
}
