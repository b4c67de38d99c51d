package idemhttp_test

import (
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

// A handler that swallows a failed statement and answers 201 is answered
// 500 (a server error, never stored), with the reason logged: its
// transaction was aborted by a statement it did not report. Concurrent
// duplicates get the same, or wait.
func TestHandlerHidingAFailedStatement(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			r := e.do(call{path: "/hide", actor: "alice", key: "hidden", body: `{}`})
			if r.status == http.StatusConflict {
				return // a duplicate waited in vain
			}
			if r.status != http.StatusInternalServerError || r.problem(t) != idemhttp.CodeInternal {
				t.Errorf("%s", r)
			}
		})
	}
	wg.Wait()
	if !strings.Contains(e.logs.String(), "aborted by a statement it did not report") {
		t.Errorf("the reason is not logged:\n%s", e.logs.String())
	}
	if s := e.state(); s.effects != 0 || s.keys != 0 {
		t.Fatalf("left %+v", s)
	}
}
