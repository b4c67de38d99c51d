package idemui_test

import (
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
)

// The deliveries page lists failed and overdue events, an event's page
// shows its attempt log and the retry form; a retry needs the action's
// authorization, the confirmation and a reason (each refusal changes
// nothing), and writes the audit row retry_event, labelled on the audit
// page.
func TestDeliveries(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := t.Context()
	for _, id := range []string{"ev-failed", "ev-overdue", "ev-fresh"} {
		if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			return idem.Publish(ctx, tx, idem.Event{ID: id, Topic: "payment.succeeded", Destination: "billing", Payload: []byte(`{}`)})
		}); err != nil {
			t.Fatal(err)
		}
	}
	for _, q := range []string{
		`UPDATE idem_events SET status = 'failed', failed_at = now(), attempts = 1, last_error = 'receiver <down>' WHERE id = 'ev-failed'`,
		`INSERT INTO idem_event_attempts (destination, event_id, attempt, started_at, duration_micros, error, permanent, claim)
		 VALUES ('billing', 'ev-failed', 1, now(), 1500, 'receiver <down>', false, 1)`,
		`UPDATE idem_events SET next_attempt_at = now() - interval '1 hour' WHERE id = 'ev-overdue'`,
		`UPDATE idem_events SET next_attempt_at = now() + interval '1 hour' WHERE id = 'ev-fresh'`,
	} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	page := e.get("/idem/deliveries")
	if page.status != 200 || !strings.Contains(page.body, "ev-failed") || !strings.Contains(page.body, "ev-overdue") ||
		strings.Contains(page.body, "ev-fresh") || !strings.Contains(page.body, "receiver &lt;down&gt;") {
		t.Fatalf("deliveries: %d\n%s", page.status, page.body)
	}
	if other := e.get("/idem/deliveries?destination=ledger"); strings.Contains(other.body, "ev-failed") {
		t.Fatalf("deliveries for ledger shows billing's events:\n%s", other.body)
	}
	eventURL := "/idem/event?" + url.Values{"destination": {"billing"}, "id": {"ev-failed"}}.Encode()
	ev := e.get(eventURL)
	for _, want := range []string{"failed", "receiver &lt;down&gt;", `name="reason"`, `name="confirm" value="yes" required`} {
		if !strings.Contains(ev.body, want) {
			t.Errorf("the event page lacks %q:\n%s", want, ev.body)
		}
	}
	if missing := e.get("/idem/event?destination=billing&id=nope"); missing.status != 404 {
		t.Errorf("a missing event: %d", missing.status)
	}

	form := func(id, reason, confirm string) url.Values {
		return url.Values{"destination": {"billing"}, "id": {id}, "reason": {reason}, "confirm": {confirm}}
	}
	before := e.state() + e.eventsState()
	for _, c := range []struct {
		vs     url.Values
		status int
	}{
		{form("ev-failed", "receiver back", ""), 400},
		{form("ev-failed", " ", "yes"), 400},
		{form("ev-overdue", "receiver back", "yes"), 409},
		{form("nope", "receiver back", "yes"), 404},
		{url.Values{"reason": {"r"}, "confirm": {"yes"}}, 400},
	} {
		if res := e.postForm("/idem/event", c.vs); res.status != c.status {
			t.Errorf("retry %v: %d, want %d\n%s", c.vs, res.status, c.status, res.body)
		}
	}
	e.refuse = map[idemui.Action]bool{idemui.ActionRetryEvent: true}
	if res := e.postForm("/idem/event", form("ev-failed", "receiver back", "yes")); res.status != 403 {
		t.Errorf("retry without the authorization: %d", res.status)
	}
	if ev := e.get(eventURL); strings.Contains(ev.body, `name="reason"`) {
		t.Error("the retry form is offered to an operator who may not retry")
	}
	e.refuse = nil
	if after := e.state() + e.eventsState(); after != before || e.retryRows() != 0 {
		t.Fatalf("a refused retry changed something:\n%s\n%s", before, after)
	}

	done := e.flashed(e.postForm("/idem/event", form("ev-failed", "receiver back", "yes")))
	if !strings.Contains(done.body, "Event sent again") || !strings.Contains(done.body, "pending") {
		t.Fatalf("after the retry:\n%s", done.body)
	}
	if n := e.retryRows(); n != 1 {
		t.Fatalf("%d retry_event audit rows, want 1", n)
	}
	rec, err := idem.LookupEvent(ctx, e.pool, "ev-failed", "billing")
	if err != nil || rec.Status != idem.EventPending || rec.RetryReason != "receiver back" {
		t.Fatalf("after the retry: %+v, %v", rec, err)
	}
	audit := e.get("/idem/audit?action=retry_event")
	if audit.status != 200 || !strings.Contains(audit.body, "retry_event") || !strings.Contains(audit.body, "Event sent again") ||
		!strings.Contains(audit.body, "sent a failed event again") || !strings.Contains(audit.body, `href="/idem/event?destination=billing&amp;id=ev-failed"`) {
		t.Fatalf("audit page:\n%s", audit.body)
	}
}

func (e *env) retryRows() int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(e.t.Context(), `SELECT count(*) FROM idem_audit WHERE action = 'retry_event'`).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) eventsState() string {
	e.t.Helper()
	var s string
	if err := e.pool.QueryRow(e.t.Context(), `SELECT coalesce(string_agg(ev::text, E'\n' ORDER BY destination, id), '') FROM idem_events ev`).Scan(&s); err != nil {
		e.t.Fatal(err)
	}
	return s
}
