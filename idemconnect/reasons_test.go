package idemconnect_test

import (
	"testing"

	"github.com/pgidem/idem/idemconnect"
	"github.com/pgidem/idem/internal/rpcidem"
)

// TestReasonsMatchTheProtocol: the constants are spelled out here, so that
// go doc shows them; they must be the values the interceptors send.
func TestReasonsMatchTheProtocol(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{idemconnect.ErrorDomain, rpcidem.ErrorDomain},
		{idemconnect.ReasonKeyMissing, rpcidem.ReasonKeyMissing},
		{idemconnect.ReasonKeyInvalid, rpcidem.ReasonKeyInvalid},
		{idemconnect.ReasonKeyReused, rpcidem.ReasonKeyReused},
		{idemconnect.ReasonInProgress, rpcidem.ReasonInProgress},
		{idemconnect.ReasonOutcomeUnknown, rpcidem.ReasonOutcomeUnknown},
		{idemconnect.ReasonResponseExpired, rpcidem.ReasonResponseExpired},
		{idemconnect.ReasonStoreUnavailable, rpcidem.ReasonStoreUnavailable},
	} {
		if c.got != c.want {
			t.Errorf("%q, want %q", c.got, c.want)
		}
	}
}
