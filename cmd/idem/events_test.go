package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// idem events show prints an event; retry sends a failed one again with
// its audit row, and refuses (exit 4) an event that is not failed, (exit
// 3) a missing one, (exit 2) a retry without a reason, writing nothing.
func TestCLIEvents(t *testing.T) {
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return idem.Publish(ctx, tx, idem.Event{ID: "ev-1", Topic: "payment.succeeded", Destination: "billing", Payload: []byte(`{}`)})
	}); err != nil {
		t.Fatal(err)
	}
	auditRows := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_audit WHERE action = 'retry_event'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	out, errOut, code := runCLI(t, url, "events", "show", "billing", "ev-1")
	if code != 0 || !strings.Contains(out, "event ev-1 for billing (payment.succeeded): pending") {
		t.Fatalf("events show: exit %d\n%s%s", code, out, errOut)
	}
	if _, errOut, code := runCLI(t, url, "events", "retry", "billing", "ev-1", "--reason", "r", "--operator", "sam"); code != exitRefused {
		t.Fatalf("events retry of a pending event: exit %d, %s", code, errOut)
	}
	if _, errOut, code := runCLI(t, url, "events", "show", "billing", "nope"); code != exitNotFound {
		t.Fatalf("events show of a missing event: exit %d, %s", code, errOut)
	}
	if _, _, code := runCLI(t, url, "events", "retry", "billing", "ev-1", "--operator", "sam"); code != exitUsage {
		t.Fatalf("events retry without a reason: exit %d", code)
	}
	if n := auditRows(); n != 0 {
		t.Fatalf("refused retries wrote %d audit rows", n)
	}

	if _, err := pool.Exec(ctx, `UPDATE idem_events SET status = 'failed', failed_at = now(), last_error = 'timeout'`); err != nil {
		t.Fatal(err)
	}
	if out, errOut, code := runCLI(t, url, "--json", "events", "retry", "billing", "ev-1", "--reason", "receiver back", "--operator", "sam"); code != 0 {
		t.Fatalf("events retry: exit %d\n%s%s", code, out, errOut)
	}
	if n := auditRows(); n != 1 {
		t.Fatalf("%d audit rows after the retry, want 1", n)
	}
	if out, _, code := runCLI(t, url, "audit", "list", "--action", "retry_event"); code != 0 || !strings.Contains(out, "sam") {
		t.Fatalf("audit list --action retry_event: exit %d\n%s", code, out)
	}
	out, _, code = runCLI(t, url, "--json", "events", "show", "billing", "ev-1")
	var shown map[string]any
	if code != 0 || json.Unmarshal([]byte(out), &shown) != nil || shown["status"] != "pending" || shown["retry_reason"] != "receiver back" {
		t.Fatalf("events show after the retry: exit %d, %s", code, out)
	}
}
