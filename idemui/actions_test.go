package idemui_test

import (
	"testing"

	"github.com/pgidem/idem/idemui"
	"github.com/pgidem/idem/internal/audit"
)

// TestActionsMatchTheAuditTrail: the constants are spelled out here, so that
// go doc shows them; they must be the actions the audit trail stores.
func TestActionsMatchTheAuditTrail(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{string(idemui.ActionResolve), audit.ActionResolve},
		{string(idemui.ActionForget), audit.ActionForget},
		{string(idemui.ActionExpireLeases), audit.ActionExpireLeases},
		{string(idemui.ActionPrune), audit.ActionPrune},
	} {
		if c.got != c.want {
			t.Errorf("%q, want %q", c.got, c.want)
		}
	}
}
