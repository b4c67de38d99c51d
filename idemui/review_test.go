package idemui_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/pgidem/idem/idemui"
)

// A bulk verdict from the page by an operator who may view but not
// resolve is refused with 403 and the bulk page with what was typed (not a
// record's page, for there is no record): nothing changes.
func TestBulkVerdictRefusedByAuthorize(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.refuse = map[idemui.Action]bool{idemui.ActionResolve: true}
	e.unknown(pay, "r1", "timeout")
	r1 := e.lookup(pay, "r1")
	before := e.state()
	form := url.Values{"verdict": {"retryable"}, "reason": {"kept <typed>"}, "r": {ref(pay, "r1", r1.Token)}}
	res := e.postForm("/idem/bulk-resolve", form)
	if res.status != http.StatusForbidden || !strings.Contains(res.body, "<q>kept &lt;typed&gt;</q>") {
		t.Fatalf("a refused bulk verdict: %d\n%s", res.status, res.body)
	}
	if res := e.postForm("/idem/bulk-resolve", url.Values{"verdict": {"retryable"}}); res.status != http.StatusForbidden {
		t.Errorf("a refused bulk verdict that selects nothing: %d, not 403", res.status)
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused bulk verdict changed something:\n%s\n%s", before, after)
	}
}
