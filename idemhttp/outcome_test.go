package idemhttp_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// A key whose reservation's outcome is unknown is answered 409
// IDEMPOTENCY_OUTCOME_UNKNOWN, and nothing runs.
func TestOutcomeUnknownIs409(t *testing.T) {
	t.Parallel()
	fp := idem.FingerprintParts([]byte("charge"))
	e := newEnv(t, envConfig{opts: idemhttp.Options{
		Operation:   func(*http.Request) string { return "payment.create" },
		Fingerprint: func(*http.Request, []byte) (idem.Fingerprint, error) { return fp, nil },
	}})
	ctx := context.Background()
	scope := idem.Scope{Actor: "alice", Operation: "payment.create"}
	r, err := idem.Reserve(ctx, e.pool, scope, "pay-1", fp, time.Minute)
	if err == nil {
		err = idem.MarkUnknown(ctx, e.pool, r, "gateway timeout")
	}
	if err != nil {
		t.Fatal(err)
	}
	before := e.state()
	got := e.do(call{path: "/items", actor: "alice", key: "pay-1", body: `{}`})
	if got.status != http.StatusConflict || got.problem(t) != idemhttp.CodeOutcomeUnknown {
		t.Fatalf("got %s, want 409 %s", got, idemhttp.CodeOutcomeUnknown)
	}
	if after := e.state(); after != before {
		t.Fatalf("state %+v, before %+v", after, before)
	}
}
