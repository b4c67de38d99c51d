package main

import (
	"context"
	"encoding/json"
	"slices"
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

// idem events list filters by status (overdue too) and destination, limits,
// prints JSON, escapes the stored strings it prints, and refuses (exit 2)
// a bad status or limit.
func TestCLIEventsList(t *testing.T) {
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	publish := func(id, destination string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return idem.Publish(ctx, tx, idem.Event{ID: id, Topic: "payment.succeeded", Destination: destination, Payload: []byte(`{}`)})
		}); err != nil {
			t.Fatal(err)
		}
	}
	publish("ev-pending", "billing")
	publish("ev-failed", "billing")
	publish("ev-overdue", "ledger")
	publish("ev-delivered", "ledger")
	for _, q := range []string{
		`UPDATE idem_events SET status = 'failed', failed_at = now(), last_error = E'timeout\x1b[2J' WHERE id = 'ev-failed'`,
		`UPDATE idem_events SET next_attempt_at = now() - interval '1 hour' WHERE id = 'ev-overdue'`,
		`UPDATE idem_events SET next_attempt_at = now() + interval '1 hour' WHERE id = 'ev-pending'`,
		`UPDATE idem_events SET status = 'delivered', delivered_at = now() WHERE id = 'ev-delivered'`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	ids := func(args ...string) []string {
		t.Helper()
		out, errOut, code := runCLI(t, url, append([]string{"--json", "events", "list"}, args...)...)
		var rows []map[string]any
		if code != 0 || json.Unmarshal([]byte(out), &rows) != nil {
			t.Fatalf("events list %v: exit %d\n%s%s", args, code, out, errOut)
		}
		var got []string
		for _, r := range rows {
			got = append(got, r["id"].(string))
		}
		return got
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "ev-delivered ev-failed ev-overdue ev-pending"},
		{[]string{"--status", "failed"}, "ev-failed"},
		{[]string{"--status", "overdue"}, "ev-overdue"},
		{[]string{"--status", "overdue", "--destination", "billing"}, ""},
		{[]string{"--status", "pending"}, "ev-overdue ev-pending"},
		{[]string{"--status", "delivered"}, "ev-delivered"},
		{[]string{"--destination", "ledger"}, "ev-delivered ev-overdue"},
		{[]string{"--status", "pending", "--destination", "billing"}, "ev-pending"},
	} {
		got := ids(c.args...)
		slices.Sort(got)
		if strings.Join(got, " ") != c.want {
			t.Errorf("events list %v: %v, want %s", c.args, got, c.want)
		}
	}
	if got := ids("--limit", "2"); len(got) != 2 {
		t.Errorf("events list --limit 2: %v", got)
	}

	out, errOut, code := runCLI(t, url, "events", "list", "--status", "failed")
	if code != 0 || !strings.Contains(out, `last error "timeout\x1b[2J"`) || strings.Contains(out, "\x1b") {
		t.Fatalf("events list --status failed: exit %d, the error not escaped:\n%q%s", code, out, errOut)
	}
	for _, args := range [][]string{{"--status", "lost"}, {"--limit", "0"}, {"--limit", "10001"}, {"extra"}} {
		if _, _, code := runCLI(t, url, append([]string{"events", "list"}, args...)...); code != exitUsage {
			t.Errorf("events list %v: exit %d, want %d", args, code, exitUsage)
		}
	}
}
