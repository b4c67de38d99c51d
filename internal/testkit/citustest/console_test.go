package citustest_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
	"github.com/pgidem/idem/internal/audit"
	"github.com/pgidem/idem/internal/testkit/citustest"
)

// The console on Citus, with idem_audit distributed by actor and
// co-located with idem_keys (as Distribute leaves it): every page answers,
// and a verdict and a filtered expiry commit with their audit rows.
func TestConsole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := citustest.New(t, nil)
	p := pool(t, db.URL)
	if column, colocated := distribution(t, p, "idem_audit"); column != idem.DistributionColumn || !colocated {
		t.Fatalf("after Distribute, idem_audit is distributed by %q, co-located with idem_keys: %v", column, colocated)
	}
	scope := idem.Scope{Actor: "alice", Operation: "charge"}
	r, err := idem.Reserve(ctx, p, scope, "u1", fp("x"), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, p, r, "timeout"); err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Reserve(ctx, p, idem.Scope{Actor: "bob", Operation: "charge"}, "l1", fp("x"), time.Microsecond); err != nil {
		t.Fatal(err)
	}
	h, err := idemui.New(idemui.Options{DB: p, Prefix: "/idem",
		Authorize: func(*http.Request, idemui.Action) (string, error) { return "sam", nil }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	call := func(method, path, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		res, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	time.Sleep(time.Millisecond)
	for _, path := range []string{"/idem/", "/idem/unknown", "/idem/unknown?actor=alice&error=time",
		"/idem/expire-leases", "/idem/keys/alice/charge/u1", "/idem/search?actor=alice", "/idem/audit",
		"/idem/status?status=unknown", "/idem/status?status=failed_retryable"} {
		if status, body := call("GET", path, ""); status != 200 {
			t.Errorf("GET %s: %d\n%.500s", path, status, body)
		}
	}
	// A search by actor prefix is a recursive walk, which Citus refuses: a
	// clear answer, not an internal error.
	if status, body := call("GET", "/idem/api/search?actor_prefix=al", ""); status != http.StatusNotImplemented ||
		!strings.Contains(body, `"unsupported"`) {
		t.Errorf("a search by actor prefix on Citus: %d\n%.500s", status, body)
	}
	// The sizes are the shards' (the coordinator's table is empty).
	if status, body := call("GET", "/idem/api/overview", ""); status != 200 || strings.Contains(body, `"table_bytes": 0`) ||
		!strings.Contains(body, `"unknown": {
    "n": 1
  }`) {
		t.Errorf("overview: %d\n%s", status, body)
	}
	if status, body := call("POST", "/idem/keys/alice/charge/u1/resolve",
		url.Values{"token": {strconv.FormatInt(r.Token, 10)}, "verdict": {"retryable"}, "reason": {"no charge"}}.Encode()); status != 303 {
		t.Fatalf("resolve: %d\n%s", status, body)
	}
	e, err := audit.ExpireLeases(ctx, p, nil, "sam", audit.Filter{Actor: "bob"}, time.Now().Add(time.Minute))
	if err != nil || e.Changed != 1 {
		t.Fatalf("expire: %+v, %v", e, err)
	}
	// The verdict's row, and the expiry's: one for the action, one for the
	// record it changed (on the record's node).
	if n := count(t, p, `SELECT count(*) FROM idem_audit`); n != 3 {
		t.Fatalf("%d audit rows, want 3", n)
	}
	if rec, err := idem.Lookup(ctx, p, scope, "u1"); err != nil || rec.Status != idem.StatusFailedRetryable {
		t.Fatalf("after the verdict: %+v, %v", rec, err)
	}
}
