package uitest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// newConsoleWith is a console whose Options mod changes (its Authorize,
// say).
func newConsoleWith(t *testing.T, mod func(*idemui.Options)) *console {
	t.Helper()
	c := &console{pool: pgtest.Pool(t, idem.Migrate)}
	opts := idemui.Options{DB: c.pool, Prefix: "/idem",
		Authorize: func(*http.Request, idemui.Action) (string, error) { return "dana.kim", nil }}
	mod(&opts)
	h, err := idemui.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/idem/", h)
	c.srv = httptest.NewServer(mux)
	t.Cleanup(c.srv.Close)
	return c
}

// unknownKey makes the record of (scope, key) an unknown outcome.
func (c *console) unknownKey(t *testing.T, scope idem.Scope, key, reason string) idem.Reservation {
	t.Helper()
	ctx := context.Background()
	r, err := idem.Reserve(ctx, c.pool, scope, key, idem.FingerprintParts([]byte("seed")), time.Hour)
	if err == nil {
		err = idem.MarkUnknown(ctx, c.pool, r, reason)
	}
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// succeededKey stores a succeeded outcome for (scope, key).
func (c *console) succeededKey(t *testing.T, scope idem.Scope, key, body string) {
	t.Helper()
	_, err := idem.DoInTx(context.Background(), c.pool, scope, key, idem.FingerprintParts([]byte("seed")),
		func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: []byte(body)}, nil
		})
	if err != nil {
		t.Fatal(err)
	}
}

// Records keyed ".", ".." and "a/b" open from the list: their links hold
// the key in the query, which Chromium does not clean as it does path
// segments.
func TestDotKeysOpenFromTheList(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, false)
	scope := idem.Scope{Actor: "..", Operation: "."}
	for _, key := range []string{".", "..", "a/b", "%2F"} {
		c.unknownKey(t, scope, key, "timeout")
	}
	for i, key := range []string{".", "..", "a/b", "%2F"} {
		step(t, ctx, "open the list", chromedp.Navigate(c.url("/unknown")), chromedp.WaitVisible(chromedp.CSS("td.key a")))
		click := chromedp.Evaluate[bool](fmt.Sprintf(`(() => { document.querySelectorAll('td.key a')[%d].click(); return true })()`, i))
		res, err := chromedp.RunResponse(ctx, func(ctx context.Context, tg *chromedp.Target) (chromedp.Void, error) {
			_, err := click(ctx, tg)
			return chromedp.Void{}, err
		})
		if err != nil || res.Status != http.StatusOK {
			t.Fatalf("follow the link of %q: %v, %v", key, res, err)
		}
		if got := eval[string](t, ctx, `document.querySelector('h1.keytitle code').textContent`); got != key {
			t.Errorf("the link of %q opened the record of %q (%s)", key, got, eval[string](t, ctx, `location.href`))
		}
		if !strings.Contains(text(t, ctx), "Record a verdict on attempt") {
			t.Errorf("the page of %q offers no verdict", key)
		}
	}
}

// One valid 255-byte actor, key, operation and operator: every page wraps
// them, at 1280 and at 375 pixels wide, with no horizontal scrolling.
func TestLongNamesWrapOnEveryPage(t *testing.T) {
	ctx := browser(t)
	long := strings.Repeat("m", 200) + "-merchant-" + strings.Repeat("x", 45)
	operator := strings.Repeat("o", 240) + ".operations"
	c := newConsoleWith(t, func(o *idemui.Options) {
		o.Authorize = func(*http.Request, idemui.Action) (string, error) { return operator, nil }
	})
	scope := idem.Scope{Actor: long, Operation: strings.Repeat("p", 255)}
	keyName := strings.Repeat("k", 255)
	r := c.unknownKey(t, scope, keyName, "gateway timeout after 30s "+strings.Repeat("e", 300))
	c.unknownKey(t, scope, "short", "timeout")
	c.succeededKey(t, scope, "done-"+strings.Repeat("d", 200), `{"id":"`+strings.Repeat("i", 400)+`"}`)
	if _, err := idem.Reserve(context.Background(), c.pool, scope, "lapsed", idem.FingerprintParts([]byte("x")), time.Microsecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Millisecond)
	// An audit row of each kind, with the long names.
	step(t, ctx, "open the record", chromedp.Navigate(c.url("/key?actor="+long+"&operation="+scope.Operation+"&key="+keyName)),
		chromedp.WaitVisible(chromedp.CSS("form")))
	step(t, ctx, "record a verdict",
		chromedp.Click(chromedp.CSS(`input[name="verdict"][value="retryable"]`)),
		chromedp.SetValue(chromedp.CSS(`textarea[name="reason"]`), strings.Repeat("checked-", 60)))
	if res, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("button.primary"))); err != nil || res.Status != 200 {
		t.Fatalf("the verdict: %v, %v (token %d)", res, err, r.Token)
	}
	step(t, ctx, "count the leases", chromedp.Navigate(c.url("/expire-leases?actor="+long)), chromedp.WaitVisible(chromedp.CSS("button.danger")))
	if res, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("button.danger"))); err != nil || res.Status != 200 {
		t.Fatalf("expire: %v, %v", res, err)
	}
	pages := []string{
		"/", "/unknown", "/unknown?actor=" + long, "/expire-leases?actor=" + long, "/search?actor=" + long,
		"/bulk-resolve?all=yes&actor=" + long, "/unknown?order=newest",
		"/search?actor=" + long + "&operation=" + scope.Operation, "/audit", "/audit?actor=" + long,
		"/key?actor=" + long + "&operation=" + scope.Operation + "&key=" + keyName,
		"/key?actor=" + long + "&operation=" + scope.Operation + "&key=short",
		"/key?actor=" + long + "&operation=" + scope.Operation + "&key=done-" + strings.Repeat("d", 200),
		"/status?status=succeeded", "/status?status=unknown", "/search?actor_prefix=" + long[:150],
	}
	for _, width := range []int64{1280, 375} {
		step(t, ctx, "set the width", chromedp.EmulateViewport(width, 900))
		for _, path := range pages {
			step(t, ctx, "open "+path, chromedp.Navigate(c.url(path)), chromedp.WaitVisible(chromedp.CSS("main")))
			scroll := eval[int](t, ctx, `document.documentElement.scrollWidth`)
			inner := eval[int](t, ctx, `window.innerWidth`)
			if scroll > inner {
				t.Errorf("%d px: %.80s… is %d px wide", width, path, scroll)
			}
			if !strings.Contains(text(t, ctx), "Signed in as") {
				t.Errorf("%d px: %.80s… does not say who is signed in", width, path)
			}
		}
		if width == 375 {
			step(t, ctx, "open the list", chromedp.Navigate(c.url("/unknown")), chromedp.WaitVisible(chromedp.CSS("main")))
			screenshotTop(t, ctx, "unknown-375")
		}
	}
}

// Forget asks for a reason and a confirmation; the audit trail keeps a
// copy of the record it deleted, and shows it.
func TestForgetWithConfirmation(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, false)
	c.seed(t)
	key := "pay_dup_8c1e"
	c.succeededKey(t, payments, key, `{"id":"ch_8c1e","amount":12000,"currency":"KRW","status":"captured"}`)
	step(t, ctx, "open the record", chromedp.Navigate(c.url("/key?actor=shop-1024&operation=payment.create&key="+key)),
		chromedp.WaitVisible(chromedp.CSS("button.danger")))
	// Without the box ticked, the browser does not send the form.
	step(t, ctx, "give a reason only",
		chromedp.SetValue(chromedp.CSS(`textarea[name="reason"]`), "Client reused the key for a second order (ticket 4411)"),
		chromedp.Click(chromedp.CSS("button.danger")))
	time.Sleep(300 * time.Millisecond)
	if _, err := idem.Lookup(context.Background(), c.pool, payments, key); err != nil {
		t.Fatalf("an unconfirmed forget was sent: %v", err)
	}
	step(t, ctx, "tick the box", chromedp.Click(chromedp.CSS(`input[name="confirm"]`)))
	screenshot(t, ctx, "forget")
	res, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("button.danger")))
	if err != nil || res.Status != http.StatusOK {
		t.Fatalf("forget: %v, %v", res, err)
	}
	if _, err := idem.Lookup(context.Background(), c.pool, payments, key); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("after forget: %v", err)
	}
	step(t, ctx, "open the copy", chromedp.Click(chromedp.CSS("details.detail summary")))
	txt := text(t, ctx)
	for _, want := range []string{"Key forgotten", "Client reused the key for a second order (ticket 4411)", "Copy of the deleted record",
		"ch_8c1e", "status 201"} {
		if !strings.Contains(txt, want) {
			t.Errorf("the audit trail after forget lacks %q:\n%s", want, txt)
		}
	}
	screenshot(t, ctx, "audit-forget")
	// A refresh does not say it again, and a message made up in the
	// address is never shown.
	for _, path := range []string{"", "/?done=pruned&n=99999", "/unknown?done=expired&n=99999", "/?flash=AAAAAAAAAAAAAAAAAAAAAA"} {
		if path == "" {
			step(t, ctx, "refresh", chromedp.Reload())
		} else {
			step(t, ctx, "open "+path, chromedp.Navigate(c.url(path)), chromedp.WaitVisible(chromedp.CSS("main")))
		}
		if n := eval[int](t, ctx, `document.querySelectorAll('.flash').length`); n != 0 {
			t.Errorf("%q shows a message: %s", path, eval[string](t, ctx, `document.querySelector('.flash').textContent`))
		}
	}
}

// Forms are shown only for the actions Authorize allows.
func TestFormsHiddenByAuthorize(t *testing.T) {
	ctx := browser(t)
	c := newConsoleWith(t, func(o *idemui.Options) {
		o.Authorize = func(r *http.Request, a idemui.Action) (string, error) {
			if a == idemui.ActionView {
				return "viewer", nil
			}
			return "", errors.New("support staff may only look")
		}
	})
	c.seed(t)
	for _, path := range []string{"/", "/unknown", "/expire-leases", "/key?actor=shop-1024&operation=payment.create&key=pay_7Hq2c9XkLm"} {
		step(t, ctx, "open "+path, chromedp.Navigate(c.url(path)), chromedp.WaitVisible(chromedp.CSS("main")))
		if n := eval[int](t, ctx, `document.querySelectorAll('form[method="post"], textarea, button.danger').length`); n != 0 {
			t.Errorf("%s: %d forms for an operator who may only look", path, n)
		}
	}
	if !strings.Contains(text(t, ctx), "Unknown outcome") {
		t.Errorf("the record page:\n%s", text(t, ctx))
	}
}

// One verdict on every record a filter matches: counted, confirmed, and
// recorded on each.
func TestBulkVerdictOverAFilter(t *testing.T) {
	ctx := browser(t)
	c := newConsole(t, false)
	c.seed(t)
	step(t, ctx, "filter the list", chromedp.Navigate(c.url("/unknown?actor=shop-1024")), chromedp.WaitVisible(chromedp.CSS(".bulkbar")))
	if _, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS(".bulkbar a.button"))); err != nil {
		t.Fatalf("open the confirmation: %v", err)
	}
	if txt := text(t, ctx); !strings.Contains(txt, "2 records need a person under the filter") {
		t.Fatalf("the confirmation:\n%s", txt)
	}
	step(t, ctx, "give the verdict",
		chromedp.Click(chromedp.CSS(`input[name="verdict"][value="retryable"]`)),
		chromedp.SetValue(chromedp.CSS(`textarea[name="reason"]`), "Card network outage 14:00-14:20: no charge reached the provider (status page)"))
	screenshot(t, ctx, "bulk")
	res, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS("button.primary")))
	if err != nil || res.Status != http.StatusOK {
		t.Fatalf("submit: %v, %v", res, err)
	}
	if txt := text(t, ctx); !strings.Contains(txt, "2 records settled with one verdict: it did not happen") {
		t.Fatalf("after the bulk verdict:\n%s", txt)
	}
	for _, key := range []string{"pay_7Hq2c9XkLm", "pay_Q8sd02LkPz"} {
		rec, err := idem.Lookup(context.Background(), c.pool, payments, key)
		if err != nil || rec.Status != idem.StatusFailedRetryable {
			t.Errorf("%s after the bulk verdict: %+v, %v", key, rec, err)
		}
	}
	if rec, err := idem.Lookup(context.Background(), c.pool, refunds, "refund_c81f/attempt-2"); err != nil || rec.Status != idem.StatusUnknown {
		t.Errorf("a record outside the filter: %+v, %v", rec, err)
	}
}
