package uitest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"

	"github.com/pgidem/idem"
)

// An operator opens the overview, follows an unknown outcome from the
// list, reads its evidence, records a verdict, and sees the record and the
// audit trail change. The screenshots of each page are the test's
// artifacts (and, with IDEM_UI_ARTIFACTS=docs/console, the guide's).
func TestSettleAnUnknownOutcome(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, false)
	s := c.seed(t)

	step(t, ctx, "open the overview", chromedp.Navigate(c.url("/")), chromedp.WaitVisible(chromedp.CSS(".cards")))
	if txt := text(t, ctx); !strings.Contains(txt, "Need a person") || !strings.Contains(txt, "Outcomes in the last 24 hours") {
		t.Fatalf("overview:\n%s", txt)
	}
	if n := eval[int](t, ctx, `document.querySelectorAll('svg rect.bar').length`); n != 4*24 {
		t.Errorf("the overview draws %d bars, want 96", n)
	}
	screenshot(t, ctx, "overview")
	step(t, ctx, "open the records of one status", chromedp.Navigate(c.url("/status?status=succeeded")), chromedp.WaitVisible(chromedp.CSS("main")))
	if txt := text(t, ctx); !strings.Contains(txt, "Signed in as") {
		t.Fatalf("the status list:\n%s", txt)
	}
	screenshotTop(t, ctx, "status")
	step(t, ctx, "back to the overview", chromedp.Navigate(c.url("/")), chromedp.WaitVisible(chromedp.CSS(".cards")))

	if _, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("a.card.alert"))); err != nil {
		t.Fatalf("follow the card to the list: %v", err)
	}
	if txt := text(t, ctx); !strings.Contains(txt, "5 records need a person") || !strings.Contains(txt, "Lease ran out") {
		t.Fatalf("the list:\n%s", txt)
	}
	screenshot(t, ctx, "unknown")

	// The oldest first: the payment that timed out three hours ago.
	if _, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("td.key a"))); err != nil {
		t.Fatalf("follow the record: %v", err)
	}
	txt := text(t, ctx)
	for _, want := range []string{"pay_7Hq2c9XkLm", "Unknown outcome", "gateway timeout after 30s (no response from the card network)",
		fmt.Sprintf("#%d", s.unknown.Token), "Record a verdict on attempt"} {
		if !strings.Contains(txt, want) {
			t.Errorf("the record page lacks %q", want)
		}
	}
	step(t, ctx, "fill in the verdict",
		chromedp.Click(chromedp.CSS(`input[name="verdict"][value="succeeded"]`)),
		chromedp.SetValue(chromedp.CSS(`input[name="status"]`), "201"),
		chromedp.SetValue(chromedp.CSS(`textarea[name="body"]`), `{"id":"ch_3PqL9x","amount":12000,"currency":"KRW","status":"captured"}`),
		chromedp.SetValue(chromedp.CSS(`textarea[name="reason"]`), "Captured at the provider: charge ch_3PqL9x, 12,000 KRW (dashboard, 14:05)"),
	)
	screenshot(t, ctx, "record")
	res, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("button.primary")))
	if err != nil || res.Status != http.StatusOK {
		t.Fatalf("submit the verdict: %v, %v", res, err)
	}
	txt = text(t, ctx)
	for _, want := range []string{"Verdict recorded", "Succeeded", "dana.kim", "verdict: it happened (succeeded)",
		`"id": "ch_3PqL9x"`, "Captured at the provider"} {
		if !strings.Contains(txt, want) {
			t.Errorf("after the verdict the page lacks %q:\n%s", want, txt)
		}
	}
	if n := eval[int](t, ctx, `document.querySelectorAll('input[name="verdict"]').length`); n != 0 {
		t.Error("the decided record still offers a verdict")
	}
	screenshot(t, ctx, "record-resolved")
	rec, err := idem.Lookup(context.Background(), c.pool, payments, "pay_7Hq2c9XkLm")
	if err != nil || rec.Status != idem.StatusSucceeded || rec.Response == nil || rec.Response.Status != 201 {
		t.Fatalf("the record after the verdict: %+v, %v", rec, err)
	}

	step(t, ctx, "open the audit trail", chromedp.Navigate(c.url("/audit")), chromedp.WaitVisible(chromedp.CSS("table.audit")))
	if txt := text(t, ctx); !strings.Contains(txt, "dana.kim") || !strings.Contains(txt, "pay_7Hq2c9XkLm") ||
		!strings.Contains(txt, fmt.Sprintf("#%d → #%d", s.unknown.Token, rec.Token)) {
		t.Fatalf("the audit trail:\n%s", txt)
	}
	screenshot(t, ctx, "audit")

	step(t, ctx, "list a merchant's keys", chromedp.Navigate(c.url("/search?actor=shop-1024&operation=payment.create")),
		chromedp.WaitVisible(chromedp.CSS("table.list")))
	screenshotTop(t, ctx, "search")

	step(t, ctx, "count the leases to expire", chromedp.Navigate(c.url("/expire-leases")), chromedp.WaitVisible(chromedp.CSS(".confirm")))
	if txt := text(t, ctx); !strings.Contains(txt, "1 reservation's lease ran out") {
		t.Fatalf("the confirmation:\n%s", txt)
	}
	screenshot(t, ctx, "expire")
	if _, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("button.danger"))); err != nil {
		t.Fatal(err)
	}
	if txt := text(t, ctx); !strings.Contains(txt, "1 reservation turned unknown") {
		t.Fatalf("after expiring:\n%s", txt)
	}
}

// A verdict about an attempt that someone else settled meanwhile is
// refused, and the page says why.
func TestStaleTokenShowsTheRefusal(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, false)
	c.seed(t)
	step(t, ctx, "open the record", chromedp.Navigate(c.url("/keys/acme-travel/payout.send/payout_2024-12-01_0042")),
		chromedp.WaitVisible(chromedp.CSS("form")))
	rec, err := idem.Lookup(context.Background(), c.pool, payouts, "payout_2024-12-01_0042")
	if err != nil {
		t.Fatal(err)
	}
	// Another operator, elsewhere, decides first.
	if err := idem.Resolve(context.Background(), c.pool, payouts, "payout_2024-12-01_0042",
		idem.Resolution{Token: rec.Token, Retryable: true, Reason: "not sent: the bank has no such payout"}); err != nil {
		t.Fatal(err)
	}
	step(t, ctx, "fill in a verdict on the old attempt",
		chromedp.Click(chromedp.CSS(`input[name="verdict"][value="succeeded"]`)),
		chromedp.SetValue(chromedp.CSS(`textarea[name="body"]`), `{"payout":"po_1"}`),
		chromedp.SetValue(chromedp.CSS(`textarea[name="reason"]`), "Paid out per the bank statement"))
	res, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("button.primary")))
	if err != nil || res.Status != http.StatusConflict {
		t.Fatalf("submit: %v, %v", res, err)
	}
	txt := text(t, ctx)
	for _, want := range []string{"Refused:", fmt.Sprintf("token %d was resolved or replaced", rec.Token), "Nothing changed",
		"Paid out per the bank statement", "Failed, retryable"} {
		if !strings.Contains(txt, want) {
			t.Errorf("the refusal lacks %q:\n%s", want, txt)
		}
	}
	screenshot(t, ctx, "stale-token")
	after, err := idem.Lookup(context.Background(), c.pool, payouts, "payout_2024-12-01_0042")
	if err != nil || after.Status != idem.StatusFailedRetryable || after.ResolveReason != "not sent: the bank has no such payout" {
		t.Fatalf("the record after the refusal: %+v, %v", after, err)
	}
}

// A stored body, error or key that holds markup is shown as text: no
// script runs, no dialog opens, no element is made of it.
func TestStoredMarkupDoesNotRun(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, false)
	bg := context.Background()
	scope := idem.Scope{Actor: "shop-1024", Operation: "payment.create"}
	key := `"><img/src=x/onerror=alert(3)>`
	body := `<script>window.__pwned=1;alert(1)</script>"><img src=x onerror="window.__pwned=2;alert(2)">`
	r, err := idem.Reserve(bg, c.pool, scope, key, idem.FingerprintParts([]byte("x")), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(bg, c.pool, r, `<script>alert("error")</script>`); err != nil {
		t.Fatal(err)
	}
	if err := idem.Resolve(bg, c.pool, scope, key, idem.Resolution{Token: r.Token, Reason: `"><img src=x onerror=alert(4)>`,
		Succeeded: &idem.Response{Status: 200, Header: map[string][]string{"Content-Type": {"text/html"}}, Body: []byte(body)}}); err != nil {
		t.Fatal(err)
	}
	var dialogs atomic.Int64
	go func() {
		for _, err := range chromedp.Events(ctx, page.JavascriptDialogOpening) {
			if err != nil {
				return
			}
			dialogs.Add(1)
			_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: true})
		}
	}()
	for _, path := range []string{
		"/keys/shop-1024/payment.create/" + escapeSegment(key),
		"/search?actor=shop-1024",
		"/audit",
	} {
		step(t, ctx, "open "+path, chromedp.Navigate(c.url(path)), chromedp.WaitVisible(chromedp.CSS("main")))
		if n := eval[int](t, ctx, `document.querySelectorAll('script, main img, main svg[onload]').length`); n != 0 {
			t.Errorf("%s: %d elements made of stored markup", path, n)
		}
		if v := eval[string](t, ctx, `String(window.__pwned)`); v != "undefined" {
			t.Errorf("%s: a stored script ran (window.__pwned = %s)", path, v)
		}
	}
	step(t, ctx, "back to the record", chromedp.Navigate(c.url("/keys/shop-1024/payment.create/"+escapeSegment(key))),
		chromedp.WaitVisible(chromedp.CSS("pre.body")))
	if got := eval[string](t, ctx, `document.querySelector('pre.body').textContent`); got != body {
		t.Errorf("the body shown is %q, want the stored text %q", got, body)
	}
	screenshot(t, ctx, "stored-markup")
	if n := dialogs.Load(); n != 0 {
		t.Fatalf("%d dialogs opened", n)
	}
}

// ReadOnly hides every form, and the server refuses a POST made anyway.
func TestReadOnlyConsole(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, true)
	s := c.seed(t)
	for _, path := range []string{"/", "/unknown", "/keys/shop-1024/payment.create/pay_7Hq2c9XkLm"} {
		step(t, ctx, "open "+path, chromedp.Navigate(c.url(path)), chromedp.WaitVisible(chromedp.CSS("main")))
		if n := eval[int](t, ctx, `document.querySelectorAll('form[method="post"], textarea, button.danger').length`); n != 0 {
			t.Errorf("%s: %d forms in read-only mode", path, n)
		}
		if !strings.Contains(text(t, ctx), "Read-only") {
			t.Errorf("%s does not say it is read-only", path)
		}
	}
	screenshot(t, ctx, "read-only")
	// A form made in the page, posted to the console anyway.
	script := fmt.Sprintf(`(() => {
		const f = document.createElement('form');
		f.method = 'post';
		f.action = location.pathname + '/resolve';
		for (const [k, v] of Object.entries({token: '%d', verdict: 'retryable', reason: 'forced'})) {
			const i = document.createElement('input'); i.type = 'hidden'; i.name = k; i.value = v; f.appendChild(i);
		}
		document.body.appendChild(f);
		f.submit();
		return true;
	})()`, s.unknown.Token)
	res, err := chromedp.RunResponse(ctx, func(ctx context.Context, tg *chromedp.Target) (chromedp.Void, error) {
		_, err := chromedp.Evaluate[bool](script)(ctx, tg)
		return chromedp.Void{}, err
	})
	if err != nil || res.Status != http.StatusMethodNotAllowed {
		t.Fatalf("a POST to a read-only console: %v, %v", res, err)
	}
	if txt := text(t, ctx); !strings.Contains(txt, "read-only") {
		t.Errorf("the refusal:\n%s", txt)
	}
	rec, err := idem.Lookup(context.Background(), c.pool, payments, "pay_7Hq2c9XkLm")
	if err != nil || rec.Status != idem.StatusUnknown {
		t.Fatalf("the record after a refused POST: %+v, %v", rec, err)
	}
}

// A form on another site that posts a verdict to the console is refused.
func TestCrossOriginPostRefused(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, false)
	s := c.seed(t)
	target := c.url("/keys/shop-1024/payment.create/pay_7Hq2c9XkLm/resolve")
	evil := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, `<!doctype html><title>Win a prize</title>
<form method="post" action="%s">
<input type="hidden" name="token" value="%d"><input type="hidden" name="verdict" value="retryable">
<input type="hidden" name="reason" value="csrf">
<button id="go">Claim your prize</button></form>`, target, s.unknown.Token)
	}))
	// Another site: localhost, while the console is at 127.0.0.1.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	evil.Listener = ln
	evil.Start()
	t.Cleanup(evil.Close)
	evilURL := strings.Replace(evil.URL, "127.0.0.1", "localhost", 1)
	step(t, ctx, "open the other site", chromedp.Navigate(evilURL), chromedp.WaitVisible(chromedp.ID("go")))
	res, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.ID("go")))
	if err != nil || res.Status != http.StatusForbidden {
		t.Fatalf("the cross-site POST: %v, %v", res, err)
	}
	if txt := text(t, ctx); !strings.Contains(txt, "came from another site") {
		t.Errorf("the refusal:\n%s", txt)
	}
	rec, err := idem.Lookup(context.Background(), c.pool, payments, "pay_7Hq2c9XkLm")
	if err != nil || rec.Status != idem.StatusUnknown {
		t.Fatalf("the record after a cross-site POST: %+v, %v", rec, err)
	}
	var n int
	if err := c.pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_audit`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("audit rows after a refused POST: %d, %v", n, err)
	}
}

// escapeSegment path-escapes one part of a record's address.
func escapeSegment(s string) string {
	return url.PathEscape(s)
}
