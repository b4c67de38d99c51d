package uitest

import (
	"context"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// An operator finds a failed event on the deliveries page, reads its
// attempt log and sends it again, with a reason, from the page.
func TestRetryAFailedEvent(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, false)
	bg := context.Background()
	if err := pgx.BeginFunc(bg, c.pool, func(tx pgx.Tx) error {
		return idem.Publish(bg, tx, idem.Event{ID: "evt_9f2c", Topic: "payment.succeeded", Destination: "billing",
			Payload: []byte(`{"paymentId":"pay_1"}`)})
	}); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`UPDATE idem_events SET status = 'failed', failed_at = now(), attempts = 1, last_error = 'POST https://billing.example: 503 Service Unavailable'`,
		`INSERT INTO idem_event_attempts (destination, event_id, attempt, started_at, duration_micros, error, permanent, claim)
		 VALUES ('billing', 'evt_9f2c', 1, now(), 2300, 'POST https://billing.example: 503 Service Unavailable', false, 1)`,
	} {
		if _, err := c.pool.Exec(bg, q); err != nil {
			t.Fatal(err)
		}
	}

	step(t, ctx, "open the deliveries", chromedp.Navigate(c.url("/deliveries")), chromedp.WaitVisible(chromedp.CSS("table.events")))
	if txt := text(t, ctx); !strings.Contains(txt, "evt_9f2c") || !strings.Contains(txt, "503 Service Unavailable") {
		t.Fatalf("deliveries:\n%s", txt)
	}
	screenshot(t, ctx, "deliveries")
	if _, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("table.events a"))); err != nil {
		t.Fatalf("follow the event: %v", err)
	}
	if txt := text(t, ctx); !strings.Contains(txt, "failed") || !strings.Contains(txt, "Attempts") {
		t.Fatalf("the event page:\n%s", txt)
	}
	step(t, ctx, "fill in the retry",
		chromedp.SetValue(chromedp.CSS(`input[name="reason"]`), "billing deployed the fix"),
		chromedp.Click(chromedp.CSS(`input[name="confirm"]`)))
	screenshot(t, ctx, "event")
	if _, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("button.danger"))); err != nil {
		t.Fatalf("submit: %v", err)
	}
	if txt := text(t, ctx); !strings.Contains(txt, "Event sent again") || !strings.Contains(txt, "billing deployed the fix") {
		t.Fatalf("after the retry:\n%s", txt)
	}
	rec, err := idem.LookupEvent(bg, c.pool, "evt_9f2c", "billing")
	if err != nil || rec.Status != idem.EventPending {
		t.Fatalf("the event after the retry: %+v, %v", rec, err)
	}
	var n int
	if err := c.pool.QueryRow(bg, `SELECT count(*) FROM idem_audit WHERE action = 'retry_event' AND operator = 'dana.kim'`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d retry_event audit rows, %v", n, err)
	}
}
