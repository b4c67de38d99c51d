package uitest

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// chromium finds the browser: $IDEM_CHROMIUM, or Debian's chromium
// (which .ci/run installs). Without one the browser tests skip.
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("IDEM_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("no Chromium (install Debian's chromium package, or set IDEM_CHROMIUM): the browser tests need one")
	return ""
}

// browser starts a headless Chromium of its own (a fresh profile, nothing
// fetched in the background) for one test, and returns a context that
// drives one tab of it.
func browser(t *testing.T) context.Context {
	t.Helper()
	profile := t.TempDir()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromium(t)),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("no-default-browser-check", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("font-render-hinting", "none"),
		chromedp.UserDataDir(profile),
		chromedp.WindowSize(1280, 900),
	}
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
	})
	// Start the browser without a deadline: the deadline of a first Run
	// would stop it.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("starting %s: %v", chromium(t), err)
	}
	return ctx
}

// step runs actions with a deadline.
func step(t *testing.T, ctx context.Context, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// eval evaluates a JavaScript expression in the page.
func eval[T any](t *testing.T, ctx context.Context, expr string) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr))
	if err != nil {
		t.Fatalf("evaluate %s: %v", expr, err)
	}
	return v
}

// text is the visible text of the page.
func text(t *testing.T, ctx context.Context) string {
	return eval[string](t, ctx, `document.body.innerText`)
}

// artifacts is where screenshots go: $IDEM_UI_ARTIFACTS, or a directory
// under the system's temporary directory that outlives the test (CI keeps
// it as an artifact; the test logs its path).
func artifacts(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("IDEM_UI_ARTIFACTS")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "idem-ui-artifacts")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// screenshot saves the whole page as name.png in the artifacts directory.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	shoot(t, ctx, name, chromedp.FullScreenshot(100))
}

// screenshotTop saves what the window shows of the page (its top).
func screenshotTop(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	shoot(t, ctx, name, chromedp.CaptureScreenshot())
}

func shoot(t *testing.T, ctx context.Context, name string, capture chromedp.Action[[]byte]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	png, err := chromedp.Run(ctx, capture)
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	path := filepath.Join(artifacts(t), name+".png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot %s", path)
}

// console is a console mounted at /idem/ of a test server on a fresh
// database.
type console struct {
	pool *pgxpool.Pool
	srv  *httptest.Server
}

func newConsole(t *testing.T, readOnly bool) *console {
	t.Helper()
	c := &console{pool: pgtest.Pool(t, idem.Migrate)}
	h, err := idemui.New(idemui.Options{DB: c.pool, Prefix: "/idem", ReadOnly: readOnly,
		Authorize: func(*http.Request, idemui.Action) (string, error) { return "dana.kim", nil }})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/idem/", h)
	c.srv = httptest.NewServer(mux)
	t.Cleanup(c.srv.Close)
	return c
}

func (c *console) url(path string) string { return c.srv.URL + "/idem" + path }

// Scopes and keys of the seeded data: a payments service with a few
// merchants.
var (
	payments = idem.Scope{Actor: "shop-1024", Operation: "payment.create"}
	refunds  = idem.Scope{Actor: "shop-2048", Operation: "refund.create"}
	payouts  = idem.Scope{Actor: "acme-travel", Operation: "payout.send"}
)

// seeded is what seed made.
type seeded struct {
	unknown idem.Reservation // the record the tests settle
}

// seed fills the console's database with a day of a payments service: many
// succeeded payments spread over the last 24 hours, some refusals and
// retryable failures, a few unknown outcomes and leases that ran out.
func (c *console) seed(t *testing.T) seeded {
	t.Helper()
	ctx := context.Background()
	var s seeded
	fp := idem.FingerprintParts([]byte("seed"))
	reserve := func(scope idem.Scope, key string, lease time.Duration) idem.Reservation {
		r, err := idem.Reserve(ctx, c.pool, scope, key, fp, lease)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	complete := func(r idem.Reservation, status int, body string) {
		err := idem.InTx(ctx, c.pool, func(ctx context.Context, tx pgx.Tx) error {
			return idem.Complete(ctx, tx, r, idem.Response{Status: status,
				Header: map[string][]string{"Content-Type": {"application/json"}}, Body: []byte(body)})
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	scopes := []idem.Scope{payments, refunds, payouts}
	for i := range 180 {
		scope := scopes[i%3]
		key := fmt.Sprintf("%s_%08x", strings.SplitN(scope.Operation, ".", 2)[0], 0x5eed0000+i*7919)
		if i%17 == 3 {
			// A refusal, stored by Do.
			_, err := idem.DoInTx(ctx, c.pool, scope, key, fp, func(context.Context, pgx.Tx) (idem.Response, error) {
				return idem.Response{}, idem.RejectJSON(402, map[string]any{"error": map[string]string{
					"code": "card_declined", "message": "The card was declined."}})
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		switch {
		case i%17 == 3:
		case i%23 == 5:
			r := reserve(scope, key, time.Minute)
			if err := idem.FailRetryable(ctx, c.pool, r, "card declined: insufficient funds"); err != nil {
				t.Fatal(err)
			}
		default:
			complete(reserve(scope, key, time.Minute), 201, fmt.Sprintf(`{"id":"ch_%08x","amount":%d,"currency":"KRW","status":"captured"}`, i*7919, 12000+i*100))
		}
		// Spread the day: the i-th outcome some minutes further back.
		back := time.Duration(i*8) * time.Minute
		if _, err := c.pool.Exec(ctx, `UPDATE idem_keys SET created_at = created_at - $1 * interval '1 microsecond',
			completed_at = completed_at - $1 * interval '1 microsecond' WHERE idem_key = $2`, back.Microseconds(), key); err != nil {
			t.Fatal(err)
		}
	}
	for i, e := range []struct {
		scope  idem.Scope
		key    string
		reason string
		back   time.Duration
	}{
		{payments, "pay_7Hq2c9XkLm", "gateway timeout after 30s (no response from the card network)", 3*time.Hour + 12*time.Minute},
		{payouts, "payout_2024-12-01_0042", "connection reset by peer while reading the provider's response", 95 * time.Minute},
		{refunds, "refund_c81f/attempt-2", "provider answered 504 Gateway Timeout", 41 * time.Minute},
		{payments, "pay_Q8sd02LkPz", "gateway timeout after 30s (no response from the card network)", 7 * time.Minute},
	} {
		r := reserve(e.scope, e.key, time.Hour)
		if err := idem.MarkUnknown(ctx, c.pool, r, e.reason); err != nil {
			t.Fatal(err)
		}
		if _, err := c.pool.Exec(ctx, `UPDATE idem_keys SET created_at = created_at - $1 * interval '1 microsecond' WHERE idem_key = $2`,
			e.back.Microseconds(), e.key); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			s.unknown = r
		}
	}
	reserve(payouts, "payout_2024-12-01_0043", time.Microsecond) // its lease ran out
	reserve(payments, "pay_live_0001", 5*time.Minute)            // in flight
	time.Sleep(time.Millisecond)
	if _, err := c.pool.Exec(ctx, `ANALYZE idem_keys`); err != nil {
		t.Fatal(err)
	}
	return s
}
