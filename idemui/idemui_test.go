package idemui_test

import (
	"context"
	"encoding/base64"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
)

var pay = idem.Scope{Actor: "acme", Operation: "charge"}

func TestNewRefusesBadOptions(t *testing.T) {
	t.Parallel()
	auth := func(*http.Request, idemui.Action) (string, error) { return "a", nil }
	db := &fakeBeginner{}
	for name, opts := range map[string]idemui.Options{
		"no DB":             {Authorize: auth},
		"no Authorize":      {DB: db},
		"trailing slash":    {DB: db, Authorize: auth, Prefix: "/idem/"},
		"no leading slash":  {DB: db, Authorize: auth, Prefix: "idem"},
		"dot segment":       {DB: db, Authorize: auth, Prefix: "/a/../b"},
		"space":             {DB: db, Authorize: auth, Prefix: "/a b"},
		"double slash":      {DB: db, Authorize: auth, Prefix: "//idem"},
		"query in prefix":   {DB: db, Authorize: auth, Prefix: "/idem?x"},
		"escape in prefix":  {DB: db, Authorize: auth, Prefix: "/id%2Fem"},
		"only a dot":        {DB: db, Authorize: auth, Prefix: "/."},
		"trailing dot-dot":  {DB: db, Authorize: auth, Prefix: "/a/.."},
		"script in prefix":  {DB: db, Authorize: auth, Prefix: `/"><script>`},
		"unicode in prefix": {DB: db, Authorize: auth, Prefix: "/관리"},
	} {
		if h, err := idemui.New(opts); !errors.Is(err, idemui.ErrInvalidOptions) || h != nil {
			t.Errorf("%s: New = %v, %v; want ErrInvalidOptions", name, h, err)
		}
	}
	for _, prefix := range []string{"", "/idem", "/ops/idem-console", "/v1.2/x_y~z"} {
		if _, err := idemui.New(idemui.Options{DB: db, Authorize: auth, Prefix: prefix}); err != nil {
			t.Errorf("prefix %q: %v", prefix, err)
		}
	}
}

// Every route asks Authorize once, with the action of its method: view for
// a GET, the route's action for a POST; every response carries the
// security headers.
func TestEveryRouteAskedWithItsAction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "u1", "gateway timeout")
	done := e.succeeded(pay, "done", idem.Response{Status: 201, Body: []byte(`{"id":1}`)})
	rec := e.lookup(pay, "done")
	created := rec.CreatedAt.UTC().Format(time.RFC3339Nano)
	form := "application/x-www-form-urlencoded"
	for _, tc := range []struct {
		method, path, ctype, body string
		want                      idemui.Action
		status                    int
	}{
		{"GET", "/idem/", "", "", idemui.ActionView, 200},
		{"HEAD", "/idem/", "", "", idemui.ActionView, 200},
		{"GET", "/idem/unknown", "", "", idemui.ActionView, 200},
		{"GET", "/idem/unknown?actor=acme&older_than=1h&error=timeout", "", "", idemui.ActionView, 200},
		{"GET", "/idem/expire-leases", "", "", idemui.ActionView, 200},
		{"GET", keyPath(pay, "u1"), "", "", idemui.ActionView, 200},
		{"GET", keyPath(pay, "nope"), "", "", idemui.ActionView, 404},
		{"GET", "/idem/search", "", "", idemui.ActionView, 200},
		{"GET", "/idem/search?actor=acme", "", "", idemui.ActionView, 200},
		{"GET", "/idem/search?actor=acme&operation=charge&key=u1", "", "", idemui.ActionView, 303},
		{"GET", "/idem/audit", "", "", idemui.ActionView, 200},
		{"GET", "/idem/static/console.css", "", "", idemui.ActionView, 200},
		{"GET", "/idem/nowhere", "", "", idemui.ActionView, 404},
		{"GET", "/idem/api/overview", "", "", idemui.ActionView, 200},
		{"GET", "/idem/api/unknown", "", "", idemui.ActionView, 200},
		{"GET", "/idem/api/expire-leases", "", "", idemui.ActionView, 200},
		{"GET", "/idem/api" + strings.TrimPrefix(keyPath(pay, "u1"), "/idem"), "", "", idemui.ActionView, 200},
		{"GET", "/idem/api/search?actor=acme", "", "", idemui.ActionView, 200},
		{"GET", "/idem/status?status=succeeded", "", "", idemui.ActionView, 200},
		{"GET", "/idem/api/status?status=failed_retryable", "", "", idemui.ActionView, 200},
		{"GET", "/idem/api/audit", "", "", idemui.ActionView, 200},
		{"GET", keyPath(pay, "u1") + "/resolve", "", "", idemui.ActionView, 405},
		{"POST", "/idem/", form, "", idemui.ActionView, 405},
		{"POST", "/idem/prune", form, "max_batches=1&confirm=yes&reason=ttl", idemui.ActionPrune, 303},
		{"POST", "/idem/expire-leases", form, "cutoff=" + url.QueryEscape(time.Now().UTC().Format(time.RFC3339Nano)), idemui.ActionExpireLeases, 303},
		{"POST", "/idem/api/expire-leases", "application/json", `{"cutoff":"2020-01-01T00:00:00Z"}`, idemui.ActionExpireLeases, 200},
		{"POST", "/idem/api/prune", "application/json", `{"max_batches":1,"reason":"ttl"}`, idemui.ActionPrune, 200},
		{"GET", keyPage(pay, "u1"), "", "", idemui.ActionView, 200},
		{"GET", "/idem/audit.csv", "", "", idemui.ActionView, 200},
		{"GET", "/idem/audit.json", "", "", idemui.ActionView, 200},
		{"GET", "/idem/static/favicon.svg", "", "", idemui.ActionView, 200},
		{"GET", "/idem/bulk-resolve?all=yes", "", "", idemui.ActionView, 200},
		{"GET", "/idem/api/bulk-resolve", "", "", idemui.ActionView, 200},
		{"POST", "/idem/api/bulk-resolve", "application/json", `{"all":true,"cutoff":"2020-01-01T00:00:00Z","verdict":"retryable","reason":"r"}`, idemui.ActionResolve, 200},
		{"POST", "/idem/bulk-resolve", form, "all=yes&cutoff=2020-01-01T00:00:00Z&verdict=retryable&reason=r", idemui.ActionResolve, 303},
		{"POST", keyPath(pay, "u1") + "/resolve", form,
			fmt.Sprintf("token=%d&verdict=retryable&reason=no+charge+at+the+provider", u.Token), idemui.ActionResolve, 303},
		{"POST", keyPath(pay, "done") + "/forget", form,
			forgetForm(done.Token, created, "client reused it").Encode(), idemui.ActionForget, 303},
	} {
		e.takeAsked()
		res := e.do(tc.method, tc.path, tc.ctype, tc.body)
		if res.status != tc.status {
			t.Errorf("%s %s: status %d, want %d\n%s", tc.method, tc.path, res.status, tc.status, res.body)
		}
		if asked := e.takeAsked(); !slices.Equal(asked, []idemui.Action{tc.want}) {
			t.Errorf("%s %s: Authorize asked %v, want [%s]", tc.method, tc.path, asked, tc.want)
		}
		checkSecurityHeaders(t, tc.method+" "+tc.path, res)
	}
}

func checkSecurityHeaders(t *testing.T, what string, res response) {
	t.Helper()
	csp := res.header.Get("Content-Security-Policy")
	for _, want := range []string{"default-src 'none'", "style-src 'self'", "frame-ancestors 'none'", "form-action 'self'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("%s: Content-Security-Policy %q lacks %q", what, csp, want)
		}
	}
	if strings.Contains(csp, "unsafe-inline") || strings.Contains(csp, "script-src") {
		t.Errorf("%s: Content-Security-Policy %q allows script", what, csp)
	}
	for name, want := range map[string]string{"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
		"Referrer-Policy": "no-referrer"} {
		if got := res.header.Get(name); got != want {
			t.Errorf("%s: %s %q, want %q", what, name, got, want)
		}
	}
}

// Authorize's error is a 403 that shows nothing of it, on pages and on
// the API, and nothing is read or changed.
func TestAuthorizeRefusalLeaksNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "u1", "gateway timeout")
	before := e.state()
	e.deny = true
	for _, tc := range []struct{ method, path, body string }{
		{"GET", "/idem/", ""},
		{"GET", keyPath(pay, "u1"), ""},
		{"GET", "/idem/api/unknown", ""},
		{"POST", keyPath(pay, "u1") + "/resolve", fmt.Sprintf("token=%d&verdict=retryable&reason=x", u.Token)},
		{"GET", "/idem/nowhere", ""},
		{"GET", "/idem/keys/a/b", ""},
	} {
		res := e.do(tc.method, tc.path, "application/x-www-form-urlencoded", tc.body)
		if res.status != http.StatusForbidden {
			t.Errorf("%s %s: status %d, want 403", tc.method, tc.path, res.status)
		}
		for _, leak := range []string{"7f3a", "mallory", "session", "gateway timeout", "u1"} {
			if strings.Contains(res.body, leak) {
				t.Errorf("%s %s: the 403 shows %q:\n%s", tc.method, tc.path, leak, res.body)
			}
		}
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused request changed something:\n%s\n%s", before, after)
	}
}

// The whole path of a verdict from a form: the list links to the record,
// the record shows its evidence and the form, the verdict is recorded with
// its audit row in one transaction, and the pages show both.
func TestVerdictFromTheForm(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "order-1", "gateway timeout after 30s")

	list := e.get("/idem/unknown")
	link := html.EscapeString(keyPage(pay, "order-1"))
	if list.status != 200 || !strings.Contains(list.body, `href="`+link+`"`) {
		t.Fatalf("the list does not link to the record %s:\n%s", link, list.body)
	}
	page := e.get(keyPath(pay, "order-1"))
	for _, want := range []string{"Unknown outcome", "gateway timeout after 30s", fmt.Sprintf("#%d", u.Token),
		`name="verdict" value="succeeded"`, fmt.Sprintf(`name="token" value="%d"`, u.Token)} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the record page lacks %q", want)
		}
	}

	res := e.postForm(keyPath(pay, "order-1")+"/resolve", url.Values{
		"token": {strconv.FormatInt(u.Token, 10)}, "verdict": {"succeeded"}, "status": {"201"},
		"content_type": {"application/json"}, "body": {"{\"charge\":\"ch_1\"}\r\n"}, "reason": {"  charge ch_1 captured (provider dashboard)  "},
	})
	if loc := res.header.Get("Location"); res.status != http.StatusSeeOther || !strings.HasPrefix(loc, keyPage(pay, "order-1")+"&flash=") {
		t.Fatalf("resolve: %d %s\n%s", res.status, loc, res.body)
	}
	flashURL := res.header.Get("Location")
	rec := e.lookup(pay, "order-1")
	if rec.Status != idem.StatusSucceeded || rec.Response == nil || rec.Response.Status != 201 ||
		string(rec.Response.Body) != "{\"charge\":\"ch_1\"}\n" || rec.ResolveReason != "charge ch_1 captured (provider dashboard)" ||
		rec.LastError != "gateway timeout after 30s" || rec.Token == u.Token {
		t.Fatalf("record after the verdict: %+v (%v)", rec, rec.Response)
	}
	var row struct {
		Operator, Action, Actor, Operation, Key, Verdict, Reason, Before, After string
		TokenBefore, TokenAfter, Changed                                        int64
		At, Completed                                                           time.Time
	}
	err := e.pool.QueryRow(context.Background(), `SELECT operator, action, a.actor, a.operation, a.idem_key, verdict, reason,
		status_before, status_after, token_before, token_after, changed, acted_at, k.completed_at
		FROM idem_audit a JOIN idem_keys k USING (actor, operation, idem_key)`).Scan(&row.Operator, &row.Action, &row.Actor,
		&row.Operation, &row.Key, &row.Verdict, &row.Reason, &row.Before, &row.After, &row.TokenBefore, &row.TokenAfter,
		&row.Changed, &row.At, &row.Completed)
	if err != nil {
		t.Fatal(err)
	}
	if row.Operator != "alice" || row.Action != "resolve" || row.Actor != "acme" || row.Operation != "charge" || row.Key != "order-1" ||
		row.Verdict != "succeeded" || row.Reason != rec.ResolveReason || row.Before != "unknown" || row.After != "succeeded" ||
		row.TokenBefore != u.Token || row.TokenAfter != rec.Token || row.Changed != 1 || !row.At.Equal(row.Completed) {
		t.Fatalf("audit row: %+v", row)
	}
	page = e.get(flashURL)
	for _, want := range []string{"Verdict recorded", "Succeeded", "verdict: it happened (succeeded)", "<b>alice</b>",
		html.EscapeString(`"charge": "ch_1"`)} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the record page after the verdict lacks %q", want)
		}
	}
	if strings.Contains(page.body, `name="verdict"`) {
		t.Error("the record page still offers a verdict on a decided record")
	}
	if strings.Contains(page.body, "Next record that needs a person") {
		t.Error("the page offers a next record when none needs a person")
	}
	e.unknown(pay, "order-2", "timeout")
	if page := e.get(keyPage(pay, "order-1")); !strings.Contains(page.body, `href="`+html.EscapeString(keyPage(pay, "order-2"))+`" rel="next">Next record that needs a person`) {
		t.Errorf("the page after the verdict does not lead to the next record:\n%s", page.body)
	}
}

// The verdict form offers the shape of the operation's answers (status and
// content type of a succeeded record) as its default, and stores a 204
// without a body.
func TestVerdictFormShape(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "order-2", "timeout")
	page := e.get(keyPage(pay, "order-2"))
	if !strings.Contains(page.body, `name="status" value="200"`) || strings.Contains(page.body, "as other records of this operation") {
		t.Fatalf("the form without another record:\n%s", page.body)
	}
	e.succeeded(pay, "order-1", idem.Response{Status: 201, Header: map[string][]string{"Content-Type": {"application/vnd.acme+json"}}, Body: []byte(`{}`)})
	page = e.get(keyPage(pay, "order-2"))
	for _, want := range []string{`name="status" value="201"`, `name="content_type" value="application/vnd.acme&#43;json"`, "as other records of this operation"} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the form lacks %q", want)
		}
	}
	res := e.postForm(keyURLFor(pay, "order-2", "resolve"), url.Values{"token": {strconv.FormatInt(u.Token, 10)}, "verdict": {"succeeded"},
		"status": {"204"}, "content_type": {"application/json"}, "reason": {"deleted at the provider"}})
	if res.status != http.StatusSeeOther {
		t.Fatalf("a 204 verdict: %d\n%s", res.status, res.body)
	}
	if rec := e.lookup(pay, "order-2"); rec.Response == nil || rec.Response.Status != 204 || len(rec.Response.Body) != 0 {
		t.Fatalf("the 204 stored: %+v", rec.Response)
	}
}

// A verdict about an attempt that is no longer the record's is refused and
// says why; nothing changes, and no audit row is written.
func TestStaleTokenRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "order-2", "timeout")
	// Another operator decided first (through the API).
	res := e.postJSON("/idem/api"+strings.TrimPrefix(keyPath(pay, "order-2"), "/idem")+"/resolve",
		map[string]any{"token": u.Token, "verdict": "retryable", "reason": "declined at the provider"})
	if res.status != 200 {
		t.Fatalf("first verdict: %d %s", res.status, res.body)
	}
	before := e.state()
	res = e.postForm(keyPath(pay, "order-2")+"/resolve", url.Values{
		"token": {strconv.FormatInt(u.Token, 10)}, "verdict": {"succeeded"}, "body": {`{}`}, "reason": {"captured"},
	})
	if res.status != http.StatusConflict || !strings.Contains(res.body, "Refused:") ||
		!strings.Contains(res.body, fmt.Sprintf("token %d was resolved or replaced", u.Token)) {
		t.Fatalf("stale verdict: %d\n%s", res.status, res.body)
	}
	if !strings.Contains(res.body, `<q>captured</q>`) {
		t.Error("the refused form lost the operator's reason")
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused verdict changed something:\n%s\n%s", before, after)
	}
	res = e.postJSON("/idem/api"+strings.TrimPrefix(keyPath(pay, "order-2"), "/idem")+"/resolve",
		map[string]any{"token": u.Token, "verdict": "retryable", "reason": "again"})
	if res.status != http.StatusConflict || res.code() != "fenced" {
		t.Fatalf("stale verdict through the API: %d %s", res.status, res.body)
	}
}

// A form refused because the record moved on to another attempt is shown
// again about the attempt it was about (never silently about the new one),
// and the page says which attempt the record holds now.
func TestRefusedFormSaysWhichAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	apiPath := func(key string) string { return "/idem/api" + strings.TrimPrefix(keyPath(pay, key), "/idem") }
	// A verdict: another operator decides, and a new attempt of the key ends
	// in doubt again before this form is sent.
	old := e.unknown(pay, "order-9", "timeout")
	if res := e.postJSON(apiPath("order-9")+"/resolve",
		map[string]any{"token": old.Token, "verdict": "retryable", "reason": "declined"}); res.status != 200 {
		t.Fatalf("first verdict: %d %s", res.status, res.body)
	}
	now := e.unknown(pay, "order-9", "timeout again")
	res := e.postForm(keyPath(pay, "order-9")+"/resolve", url.Values{
		"token": {strconv.FormatInt(old.Token, 10)}, "verdict": {"retryable"}, "reason": {"not charged"}})
	if res.status != http.StatusConflict {
		t.Fatalf("stale verdict: %d\n%s", res.status, res.body)
	}
	for _, want := range []string{
		fmt.Sprintf("Record a verdict on attempt #%d", old.Token),
		fmt.Sprintf(`name="token" value="%d"`, old.Token),
		fmt.Sprintf("Your form was about attempt #%d, the record now holds #%d", old.Token, now.Token),
		`href="` + html.EscapeString(keyPage(pay, "order-9")) + `"`,
	} {
		if !strings.Contains(res.body, want) {
			t.Errorf("the refused verdict's page lacks %q", want)
		}
	}
	if bad := fmt.Sprintf("Record a verdict on attempt #%d", now.Token); strings.Contains(res.body, bad) {
		t.Errorf("the refused form names the record's new attempt (%q) but sends the old token", bad)
	}
	// A forget: the key was forgotten and used again before this form is sent.
	first := e.succeeded(pay, "paid", idem.Response{Status: 200})
	firstAt := e.lookup(pay, "paid").CreatedAt.UTC().Format(time.RFC3339Nano)
	if res := e.postJSON(apiPath("paid")+"/forget", map[string]any{"token": first.Token, "created_at": firstAt, "reason": "reused"}); res.status != 200 {
		t.Fatalf("first forget: %d %s", res.status, res.body)
	}
	second := e.succeeded(pay, "paid", idem.Response{Status: 200})
	res = e.postForm(keyPath(pay, "paid")+"/forget", forgetForm(first.Token, firstAt, "reused again"))
	if res.status != http.StatusConflict {
		t.Fatalf("stale forget: %d\n%s", res.status, res.body)
	}
	for _, want := range []string{
		fmt.Sprintf(`name="token" value="%d"`, first.Token),
		`name="created_at" value="` + firstAt + `"`,
		fmt.Sprintf("Your form was about attempt #%d, the record now holds #%d", first.Token, second.Token),
	} {
		if !strings.Contains(res.body, want) {
			t.Errorf("the refused forget's page lacks %q", want)
		}
	}
	if bad := fmt.Sprintf(`name="token" value="%d"`, second.Token); strings.Contains(res.body, bad) {
		t.Errorf("the refused forget form was swapped to the record's new attempt (%q)", bad)
	}
}

// lastingDB is a database handle that, once armed, begins only so many
// more transactions and fails every Begin after them, as a database that
// goes away.
type lastingDB struct {
	next idem.Beginner
	left atomic.Int64 // Begins left; negative: not armed
}

func (d *lastingDB) Begin(ctx context.Context) (pgx.Tx, error) {
	if d.left.Load() >= 0 && d.left.Add(-1) < 0 {
		return nil, errors.New("the database went away")
	}
	return d.next.Begin(ctx)
}

// A verdict through the API that committed is answered as committed, with
// its audit row and the record as the verdict left it, even when the
// database cannot be reached any more right after the commit.
func TestResolveAPIAnswersTheCommittedChange(t *testing.T) {
	t.Parallel()
	db := &lastingDB{}
	db.left.Store(-1)
	e := newEnv(t, func(o *idemui.Options) { db.next = o.DB; o.DB = db })
	u := e.unknown(pay, "order-10", "timeout")
	db.left.Store(1)
	res := e.postJSON("/idem/api"+strings.TrimPrefix(keyPath(pay, "order-10"), "/idem")+"/resolve",
		map[string]any{"token": u.Token, "verdict": "retryable", "reason": "not charged"})
	db.left.Store(-1)
	rec := e.lookup(pay, "order-10")
	if rec.Status != idem.StatusFailedRetryable {
		t.Fatalf("the verdict did not commit: %+v (answer %d %s)", rec, res.status, res.body)
	}
	var out struct {
		Record struct {
			Status idem.Status
			Token  int64
		}
		Audit struct {
			ID          int64
			Verdict     string
			TokenBefore int64 `json:"token_before"`
			TokenAfter  int64 `json:"token_after"`
		}
	}
	if err := json.Unmarshal([]byte(res.body), &out); res.status != 200 || err != nil {
		t.Fatalf("a committed verdict answered %d (%v):\n%s", res.status, err, res.body)
	}
	if out.Record.Status != idem.StatusFailedRetryable || out.Record.Token != rec.Token || out.Audit.ID == 0 ||
		out.Audit.Verdict != "retryable" || out.Audit.TokenBefore != u.Token || out.Audit.TokenAfter != rec.Token {
		t.Fatalf("the answer does not show the committed verdict: %+v\n%s", out, res.body)
	}
}

// Bad input is a typed 400, and nothing changes.
func TestBadInputChangesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "order-3", "timeout")
	done := e.succeeded(pay, "done", idem.Response{Status: 200, Body: []byte(`{}`)})
	doneAt := e.lookup(pay, "done").CreatedAt.UTC().Format(time.RFC3339Nano)
	tok := strconv.FormatInt(u.Token, 10)
	resolve := keyPath(pay, "order-3") + "/resolve"
	apiResolve := "/idem/api" + strings.TrimPrefix(resolve, "/idem")
	form := "application/x-www-form-urlencoded"
	good := url.Values{"token": {tok}, "verdict": {"retryable"}, "reason": {"checked"}}
	with := func(k, v string) string {
		vs := url.Values{}
		for name, v := range good {
			vs[name] = v
		}
		vs.Set(k, v)
		return vs.Encode()
	}
	before := e.state()
	for _, tc := range []struct {
		name, method, path, ctype, body, code string
	}{
		{"unescaped key path", "GET", "/idem/keys/acme/charge/a/b/c", "", "", "invalid_path"},
		{"unescaped key path POST", "POST", "/idem/keys/acme/charge/a/b/resolve", form, good.Encode(), "invalid_path"},
		{"too short a path", "GET", "/idem/keys/acme/charge", "", "", "invalid_path"},
		{"operation too long", "GET", "/idem/api/keys/acme/" + strings.Repeat("o", 256) + "/x", "", "", "invalid_scope"},
		{"invalid key", "GET", "/idem/api/keys/acme/charge/has%20space", "", "", "invalid_key"},
		{"invalid UTF-8 actor", "GET", "/idem/api/keys/%FF/charge/x", "", "", "invalid_scope"},
		{"bad token", "POST", resolve, form, with("token", "abc"), "invalid_token"},
		{"zero token", "POST", resolve, form, with("token", "0"), "invalid_token"},
		{"negative token", "POST", resolve, form, with("token", "-4"), "invalid_token"},
		{"token overflow", "POST", resolve, form, with("token", "99999999999999999999"), "invalid_token"},
		{"unknown verdict", "POST", resolve, form, with("verdict", "maybe"), "invalid_verdict"},
		{"no verdict", "POST", resolve, form, with("verdict", ""), "invalid_verdict"},
		{"no reason", "POST", resolve, form, with("reason", "   "), "invalid_reason"},
		{"reason too long", "POST", resolve, form, with("reason", strings.Repeat("x", idem.MaxReasonLength+1)), "invalid_reason"},
		{"token twice", "POST", resolve, form, good.Encode() + "&token=" + tok, "invalid_form"},
		{"not a form", "POST", resolve, "text/plain", good.Encode(), "invalid_form"},
		{"oversized body", "POST", resolve, form, with("body", strings.Repeat("x", 5<<20)), "body_too_large"},
		{"bad status", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"succeeded","status":42,"reason":"r"}`, "invalid_status"},
		{"informational status", "POST", resolve, form, with("verdict", "succeeded") + "&status=101", "invalid_status"},
		{"status 600", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"succeeded","status":600,"reason":"r"}`, "invalid_status"},
		{"status 199", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"succeeded","status":199,"reason":"r"}`, "invalid_status"},
		{"204 with a body", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"succeeded","status":204,"body":"x","reason":"r"}`, "invalid_status"},
		{"304 with a body", "POST", resolve, form, with("verdict", "succeeded") + "&status=304&body=x", "invalid_status"},
		{"body not JSON", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"succeeded","body":"{","content_type":"application/json","reason":"r"}`, "invalid_body"},
		{"bad content type", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"succeeded","body":"x","content_type":"a b","reason":"r"}`, "invalid_response"},
		{"unknown JSON field", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"retryable","reason":"r","force":true}`, "invalid_json"},
		{"two JSON values", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"retryable","reason":"r"} {}`, "invalid_json"},
		{"oversized JSON", "POST", apiResolve, "application/json", `{"token":` + tok + `,"verdict":"succeeded","reason":"r","body":"` + strings.Repeat("x", 5<<20) + `"}`, "body_too_large"},
		{"forget without attempt", "POST", keyPath(pay, "done") + "/forget", form, "confirm=yes&reason=r&token=" + strconv.FormatInt(done.Token, 10), "invalid_attempt"},
		{"forget bad token", "POST", keyPath(pay, "done") + "/forget", form, "confirm=yes&reason=r&token=x&created_at=2026-01-01T00:00:00Z", "invalid_token"},
		{"forget confirm twice", "POST", strings.Replace(keyPage(pay, "done"), "/key?", "/key/forget?", 1), form,
			forgetForm(done.Token, doneAt, "reused").Encode() + "&confirm=no", "not_confirmed"},
		{"forget page unconfirmed", "POST", strings.Replace(keyPage(pay, "done"), "/key?", "/key/forget?", 1), form,
			url.Values{"token": {strconv.FormatInt(done.Token, 10)}, "created_at": {doneAt}, "reason": {"reused"}}.Encode(), "not_confirmed"},
		{"forget page without reason", "POST", keyPath(pay, "done") + "/forget", form, forgetForm(done.Token, doneAt, "  ").Encode(), "invalid_reason"},
		{"forget API without reason", "POST", "/idem/api" + strings.TrimPrefix(keyPath(pay, "done"), "/idem") + "/forget", "application/json",
			`{"token":` + strconv.FormatInt(done.Token, 10) + `,"created_at":"` + doneAt + `"}`, "invalid_reason"},
		{"forget API reason too long", "POST", "/idem/api" + strings.TrimPrefix(keyPath(pay, "done"), "/idem") + "/forget", "application/json",
			`{"token":` + strconv.FormatInt(done.Token, 10) + `,"created_at":"` + doneAt + `","reason":"` + strings.Repeat("x", idem.MaxReasonLength+1) + `"}`, "invalid_reason"},
		{"prune page unconfirmed", "POST", "/idem/prune", form, "reason=ttl", "not_confirmed"},
		{"prune page without reason", "POST", "/idem/prune", form, "confirm=yes", "invalid_reason"},
		{"prune API without reason", "POST", "/idem/api/prune", "application/json", `{"max_batches":1}`, "invalid_reason"},
		{"key query without key", "GET", "/idem/key?actor=acme&operation=charge", "", "", "invalid_path"},
		{"key query key twice", "GET", keyPage(pay, "done") + "&key=other", "", "", "invalid_form"},
		{"audit bad from", "GET", "/idem/api/audit?from=yesterday", "", "", "invalid_filter"},
		{"audit empty range", "GET", "/idem/api/audit?from=2026-12-05&to=2026-12-04", "", "", "invalid_filter"},
		{"audit export bad to", "GET", "/idem/audit.csv?to=soon", "", "", "invalid_filter"},
		{"expire without cutoff", "POST", "/idem/expire-leases", form, "actor=acme", "invalid_cutoff"},
		{"expire bad age", "POST", "/idem/api/expire-leases", "application/json", `{"older_than":"-1h","cutoff":"2026-01-01T00:00:00Z"}`, "invalid_filter"},
		{"expire NUL actor", "POST", "/idem/api/expire-leases", "application/json", `{"actor":"a\u0000b","cutoff":"2026-01-01T00:00:00Z"}`, "invalid_filter"},
		{"list bad age", "GET", "/idem/api/unknown?older_than=soon", "", "", "invalid_filter"},
		{"list bad cursor", "GET", "/idem/api/unknown?after=%25%25", "", "", "invalid_cursor"},
		{"list bad limit", "GET", "/idem/api/unknown?limit=0", "", "", "invalid_limit"},
		{"audit bad action", "GET", "/idem/api/audit?action=drop", "", "", "invalid_filter"},
		{"audit bad cursor", "GET", "/idem/api/audit?before=bm9wZQ", "", "", "invalid_cursor"},
		{"prune too many", "POST", "/idem/api/prune", "application/json", `{"max_batches":1000,"reason":"r"}`, "invalid_prune"},
		{"search key alone", "GET", "/idem/api/search?key=x", "", "", "invalid_search"},
	} {
		res := e.do(tc.method, tc.path, tc.ctype, tc.body)
		if res.status != http.StatusBadRequest {
			t.Errorf("%s: status %d, want 400\n%.400s", tc.name, res.status, res.body)
			continue
		}
		if strings.Contains(tc.path, "/api/") {
			if got := res.code(); got != tc.code {
				t.Errorf("%s: code %q, want %q (%s)", tc.name, got, tc.code, res.body)
			}
		} else if !strings.Contains(res.body, "<code>"+tc.code+"</code>") && !strings.Contains(res.body, `data-code="`+tc.code+`"`) {
			t.Errorf("%s: the page names neither the problem nor %q:\n%.600s", tc.name, tc.code, res.body)
		}
	}
	if after := e.state(); after != before {
		t.Fatalf("bad input changed something:\n%s\n%s", before, after)
	}
}

// With ReadOnly the pages offer no form and every POST is refused with 405.
func TestReadOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(o *idemui.Options) { o.ReadOnly = true })
	u := e.unknown(pay, "order-4", "timeout")
	e.succeeded(pay, "done", idem.Response{Status: 200})
	e.lapsed(pay, "lapsed")
	for _, path := range []string{"/idem/", "/idem/unknown", keyPath(pay, "order-4"), keyPath(pay, "done"), "/idem/expire-leases"} {
		res := e.get(path)
		if res.status != 200 || strings.Contains(res.body, "<form method=\"post\"") || strings.Contains(res.body, "Count them") ||
			!strings.Contains(res.body, "Read-only") {
			t.Errorf("%s offers a form in read-only mode (or does not say read-only):\n%s", path, res.body)
		}
	}
	if res := e.get("/idem/expire-leases"); !strings.Contains(res.body, "<b>1</b> reservation's lease ran out") ||
		!strings.Contains(res.body, "This console is read-only") {
		t.Errorf("the read-only confirmation page does not show the count and say that it cannot expire:\n%s", res.body)
	}
	before := e.state()
	for _, tc := range []struct{ path, ctype, body string }{
		{keyPath(pay, "order-4") + "/resolve", "application/x-www-form-urlencoded", fmt.Sprintf("token=%d&verdict=retryable&reason=x", u.Token)},
		{"/idem/api" + strings.TrimPrefix(keyPath(pay, "order-4"), "/idem") + "/resolve", "application/json", fmt.Sprintf(`{"token":%d,"verdict":"retryable","reason":"x"}`, u.Token)},
		{"/idem/prune", "application/x-www-form-urlencoded", ""},
		{"/idem/expire-leases", "application/x-www-form-urlencoded", "cutoff=2030-01-01T00:00:00Z"},
	} {
		res := e.do("POST", tc.path, tc.ctype, tc.body)
		if res.status != http.StatusMethodNotAllowed || res.header.Get("Allow") != "GET, HEAD" {
			t.Errorf("POST %s in read-only mode: %d (Allow %q)", tc.path, res.status, res.header.Get("Allow"))
		}
	}
	// Every method other than GET and HEAD, on any address: a route or not,
	// a bad one, the API's root.
	for _, tc := range []struct{ method, path string }{
		{"POST", "/idem/nowhere"}, {"POST", "/idem/api/"}, {"POST", "/idem/api/nowhere"}, {"POST", "/idem/keys/a/b"},
		{"POST", "/idem/api/keys/a/b/c/d/e"}, {"POST", "/idem/"}, {"POST", "/idem/unknown"}, {"PUT", "/idem/expire-leases"},
		{"DELETE", keyPath(pay, "done")}, {"PATCH", "/idem/api/overview"}, {"OPTIONS", "/idem/"},
	} {
		res := e.do(tc.method, tc.path, "application/x-www-form-urlencoded", "")
		code := ""
		if strings.HasPrefix(tc.path, "/idem/api/") {
			code = res.code()
		} else if strings.Contains(res.body, `<code>read_only</code>`) {
			code = "read_only"
		}
		if res.status != http.StatusMethodNotAllowed || res.header.Get("Allow") != "GET, HEAD" || code != "read_only" {
			t.Errorf("%s %s in read-only mode: %d (Allow %q, code %q), want 405 read_only", tc.method, tc.path, res.status,
				res.header.Get("Allow"), code)
		}
	}
	if after := e.state(); after != before {
		t.Fatalf("read-only mode changed something:\n%s\n%s", before, after)
	}
}

// A POST from another origin is refused, whatever it carries.
func TestCrossOriginPostRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "order-5", "timeout")
	body := fmt.Sprintf("token=%d&verdict=retryable&reason=x", u.Token)
	before := e.state()
	for _, h := range [][]string{
		{"Sec-Fetch-Site", "cross-site"},
		{"Origin", "https://evil.example"},
	} {
		res := e.do("POST", keyPath(pay, "order-5")+"/resolve", "application/x-www-form-urlencoded", body, h...)
		if res.status != http.StatusForbidden || !strings.Contains(res.body, "cross_origin") {
			t.Errorf("cross-origin POST (%s): %d\n%s", h, res.status, res.body)
		}
	}
	if after := e.state(); after != before {
		t.Fatalf("a cross-origin POST changed something:\n%s\n%s", before, after)
	}
	res := e.do("POST", keyPath(pay, "order-5")+"/resolve", "application/x-www-form-urlencoded", body, "Sec-Fetch-Site", "same-origin")
	if res.status != http.StatusSeeOther {
		t.Fatalf("same-origin POST: %d\n%s", res.status, res.body)
	}
}

// Every stored value is escaped: a body, an error, a header, a reason, a
// key that hold markup show as text.
func TestStoredValuesShownAsText(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	xss := []string{`<script>alert(1)</script>`, `"><img src=x onerror=alert(1)>`}
	scope := idem.Scope{Actor: `<b>acme</b>`, Operation: `"><svg onload=alert(1)>`}
	key := `"><img/src=x/onerror=alert(1)>`
	e.succeeded(scope, key, idem.Response{Status: 200,
		Header: map[string][]string{"Content-Type": {"text/html"}, "X-Note": {xss[1]}},
		Body:   []byte(xss[0] + xss[1])})
	u := e.unknown(scope, "k2", xss[0])
	if _, err := e.pool.Exec(context.Background(), `UPDATE idem_keys SET last_error = $1 WHERE idem_key = 'k2'`, xss[1]); err != nil {
		t.Fatal(err)
	}
	res := e.postJSON("/idem/api"+strings.TrimPrefix(keyPath(scope, "k2"), "/idem")+"/resolve",
		map[string]any{"token": u.Token, "verdict": "succeeded", "body": xss[0], "content_type": "text/html", "reason": xss[1]})
	if res.status != 200 {
		t.Fatalf("resolve: %d %s", res.status, res.body)
	}
	e.name = `<script>alert("operator")</script>`
	for _, path := range []string{keyPath(scope, key), keyPath(scope, "k2"), "/idem/audit", "/idem/unknown",
		"/idem/search?actor=" + url.QueryEscape(scope.Actor)} {
		res := e.get(path)
		if res.status != 200 {
			t.Fatalf("GET %s: %d\n%s", path, res.status, res.body)
		}
		if m := regexp.MustCompile(`(?i)<(script|img|svg)|<b>acme`).FindString(res.body); m != "" {
			t.Errorf("GET %s renders stored markup %q:\n%s", path, m, res.body)
		}
	}
	page := e.get(keyPath(scope, key))
	if !strings.Contains(page.body, html.EscapeString(xss[0])) {
		t.Errorf("the stored body is not shown as text:\n%s", page.body)
	}
}

// An audit row that cannot be written rolls the change back.
func TestAuditFailureRollsBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "order-6", "timeout")
	done := e.succeeded(pay, "done", idem.Response{Status: 200})
	e.lapsed(pay, "lapsed")
	if _, err := e.pool.Exec(context.Background(), `
		CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'audit is down'; END $$;
		CREATE TRIGGER refuse BEFORE INSERT ON idem_audit FOR EACH ROW EXECUTE FUNCTION refuse();`); err != nil {
		t.Fatal(err)
	}
	before := e.state()
	rec := e.lookup(pay, "done")
	for _, tc := range []struct{ path, body string }{
		{keyPath(pay, "order-6") + "/resolve", fmt.Sprintf("token=%d&verdict=retryable&reason=x", u.Token)},
		{keyPath(pay, "done") + "/forget", forgetForm(done.Token, rec.CreatedAt.Format(time.RFC3339Nano), "reused").Encode()},
		{"/idem/expire-leases", "cutoff=" + url.QueryEscape(time.Now().Add(time.Hour).UTC().Format(time.RFC3339Nano))},
	} {
		res := e.postForm(tc.path, mustParseQuery(t, tc.body))
		if res.status != http.StatusInternalServerError || !strings.Contains(res.body, "audit is down") {
			t.Errorf("POST %s with the audit failing: %d\n%s", tc.path, res.status, res.body)
		}
	}
	if after := e.state(); after != before {
		t.Fatalf("a change whose audit row failed committed:\n%s\n%s", before, after)
	}
}

func mustParseQuery(t *testing.T, s string) url.Values {
	t.Helper()
	vs, err := url.ParseQuery(s)
	if err != nil {
		t.Fatal(err)
	}
	return vs
}

// Forget names the attempt it is about: a record that changed since is
// refused; a finished one is forgotten with its audit row, which keeps the
// reason and a copy of the record, shown on the audit page. A refused form
// keeps the reason typed.
func TestForget(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	done := e.succeeded(pay, "done", idem.Response{Status: 201, Header: map[string][]string{"Content-Type": {"application/json"}},
		Body: []byte(`{"charge":"ch_9"}`)})
	rec := e.lookup(pay, "done")
	u := e.unknown(pay, "order-7", "timeout")
	forget := func(key string, token int64, created time.Time) response {
		return e.postForm(keyURLFor(pay, key, "forget"), forgetForm(token, created.UTC().Format(time.RFC3339Nano), "client reused order-7's key"))
	}
	page := e.get(keyPage(pay, "done"))
	for _, want := range []string{`name="reason"`, `name="confirm" value="yes" required`, html.EscapeString(keyURLFor(pay, "done", "forget"))} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the forget form lacks %q", want)
		}
	}
	before := e.state()
	if res := forget("done", done.Token+1, rec.CreatedAt); res.status != 409 || !strings.Contains(res.body, "changed since it was shown") {
		t.Fatalf("forget of another attempt: %d\n%s", res.status, res.body)
	}
	if res := forget("done", done.Token, rec.CreatedAt.Add(time.Microsecond)); res.status != 409 {
		t.Fatalf("forget of another start: %d\n%s", res.status, res.body)
	}
	if res := forget("order-7", u.Token, e.lookup(pay, "order-7").CreatedAt); res.status != 409 ||
		!strings.Contains(res.body, "Record a verdict instead") {
		t.Fatalf("forget of an unknown outcome: %d\n%s", res.status, res.body)
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused forget changed something:\n%s\n%s", before, after)
	}
	// Unconfirmed: refused, and the reason typed is still in the form.
	unconfirmed := forgetForm(done.Token, rec.CreatedAt.UTC().Format(time.RFC3339Nano), "asked by ops <ticket 42>")
	unconfirmed.Del("confirm")
	if res := e.postForm(keyURLFor(pay, "done", "forget"), unconfirmed); res.status != 400 ||
		!strings.Contains(res.body, `data-code="not_confirmed"`) || !strings.Contains(res.body, "asked by ops &lt;ticket 42&gt;</textarea>") {
		t.Fatalf("an unconfirmed forget: %d\n%s", res.status, res.body)
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused forget changed something:\n%s\n%s", before, after)
	}
	res := forget("done", done.Token, rec.CreatedAt)
	if res.status != http.StatusSeeOther {
		t.Fatalf("forget: %d\n%s", res.status, res.body)
	}
	if _, err := idem.Lookup(context.Background(), e.pool, pay, "done"); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("after forget: %v", err)
	}
	var reason, status, fingerprint, body string
	var token int64
	if err := e.pool.QueryRow(context.Background(), `SELECT reason, detail->'forgotten'->>'status', detail->'forgotten'->>'fingerprint',
		(detail->'forgotten'->>'token')::bigint, detail->'forgotten'->'response'->>'body' FROM idem_audit WHERE action = 'forget'`).Scan(
		&reason, &status, &fingerprint, &token, &body); err != nil {
		t.Fatal(err)
	}
	if reason != "client reused order-7's key" || status != "succeeded" || fingerprint != rec.Fingerprint.String() ||
		token != done.Token || body != `{"charge":"ch_9"}` {
		t.Fatalf("the forget's row: reason %q, status %q, fingerprint %q, token %d, body %q", reason, status, fingerprint, token, body)
	}
	page = e.get(res.header.Get("Location"))
	for _, want := range []string{"Key forgotten", "forgot the key", fmt.Sprintf("#%d", done.Token), "client reused order-7&#39;s key",
		"Copy of the deleted record", rec.Fingerprint.String(), "status 201", html.EscapeString(`{\"charge\":\"ch_9\"}`)} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the audit page after forget lacks %q", want)
		}
	}
	if again := e.get(res.header.Get("Location")); strings.Contains(again.body, "Key forgotten") {
		t.Error("the flash message is shown again on a refresh")
	}
	if res := forget("done", done.Token, rec.CreatedAt); res.status != 404 {
		t.Fatalf("forget again: %d", res.status)
	}
}

// The list of records that need a person: unknown outcomes and lapsed
// leases, oldest first, filtered, paged by cursor.
func TestNeedsPersonListFiltersAndPages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	other := idem.Scope{Actor: "globex", Operation: "refund"}
	e.unknown(pay, "a1", "gateway timeout")
	e.lapsed(pay, "a2")
	e.unknown(other, "b1", "connection reset by peer")
	e.unknown(pay, "a3", "GATEWAY TIMEOUT (502)")
	e.reserve(pay, "live", time.Hour)                    // in flight: nobody's yet
	e.succeeded(pay, "done", idem.Response{Status: 200}) // finished
	if _, err := e.pool.Exec(context.Background(), `UPDATE idem_keys SET created_at = created_at - interval '2 hours'
		WHERE idem_key IN ('a1', 'b1')`); err != nil {
		t.Fatal(err)
	}
	list := func(query string) (keys []string, next string, matched int64) {
		t.Helper()
		res := e.get("/idem/api/unknown?" + query)
		if res.status != 200 {
			t.Fatalf("list %s: %d %s", query, res.status, res.body)
		}
		var out struct {
			Records []struct {
				Key         string `json:"key"`
				LeaseRanOut bool   `json:"lease_ran_out"`
			}
			Next    string
			Matched struct{ N int64 }
		}
		if err := json.Unmarshal([]byte(res.body), &out); err != nil {
			t.Fatal(err)
		}
		for _, r := range out.Records {
			k := r.Key
			if r.LeaseRanOut {
				k += "(lapsed)"
			}
			keys = append(keys, k)
		}
		return keys, out.Next, out.Matched.N
	}
	for query, want := range map[string][]string{
		"":                         {"a1", "b1", "a2(lapsed)", "a3"},
		"actor=acme":               {"a1", "a2(lapsed)", "a3"},
		"operation=refund":         {"b1"},
		"older_than=1h":            {"a1", "b1"},
		"error=gateway+timeout":    {"a1", "a3"},
		"actor=acme&older_than=1h": {"a1"},
		"actor=nobody":             nil,
	} {
		got, _, matched := list(query)
		if !slices.Equal(got, want) || matched != int64(len(want)) {
			t.Errorf("list %q: %v (matched %d), want %v", query, got, matched, want)
		}
	}
	var all []string
	for next, pages := "", 0; ; pages++ {
		q := "limit=3"
		if next != "" {
			q += "&after=" + next
		}
		keys, n, _ := list(q)
		all = append(all, keys...)
		if n == "" {
			if pages != 1 {
				t.Errorf("%d pages of 3 for 4 records", pages+1)
			}
			break
		}
		next = n
	}
	if !slices.Equal(all, []string{"a1", "b1", "a2(lapsed)", "a3"}) {
		t.Errorf("paged: %v", all)
	}
	page := e.get("/idem/unknown?actor=acme")
	if !strings.Contains(page.body, "Lease ran out") || !strings.Contains(page.body, "3</b> records match") {
		t.Errorf("the list page:\n%s", page.body)
	}
}

// The console's "expire leases" makes exactly the transition of
// idem.ExpireLeases, on what the filter matches and the count saw.
func TestExpireLeasesAsTheLibraryDoes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lib, con := newEnv(t, nil), newEnv(t, nil)
	for _, e := range []*env{lib, con} {
		e.lapsed(pay, "l1")
		e.lapsed(pay, "l2")
		e.unknown(pay, "u1", "timeout")
		e.reserve(pay, "live", time.Hour)
	}
	if n, err := idem.ExpireLeases(ctx, lib.pool, 100); err != nil || n != 2 {
		t.Fatalf("ExpireLeases: %d, %v", n, err)
	}
	count := con.get("/idem/api/expire-leases")
	var c struct {
		Leases int64
		Cutoff string
	}
	if err := json.Unmarshal([]byte(count.body), &c); err != nil || c.Leases != 2 {
		t.Fatalf("count: %s (%v)", count.body, err)
	}
	// A lease that runs out after the count is not the count's.
	con.lapsed(pay, "after-count")
	page := con.get("/idem/expire-leases")
	if !strings.Contains(page.body, "<b>3</b> reservations") || !strings.Contains(page.body, "Expire 3 leases") {
		t.Errorf("the confirmation page:\n%s", page.body)
	}
	res := con.postJSON("/idem/api/expire-leases", map[string]any{"cutoff": c.Cutoff})
	if res.status != 200 || !strings.Contains(res.body, `"expired": 2`) {
		t.Fatalf("expire: %d %s", res.status, res.body)
	}
	// The rows as they are, apart from the times of their making.
	rows := func(e *env) string {
		var s string
		if err := e.pool.QueryRow(ctx, `SELECT string_agg(format('%s %s %s %s token>0:%s lease:%s completed:%s',
			idem_key, status, last_error, response_status, token > 0, lease_expires_at IS NOT NULL, completed_at IS NOT NULL),
			E'\n' ORDER BY idem_key) FROM idem_keys WHERE idem_key <> 'after-count'`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	if a, b := rows(lib), rows(con); a != b {
		t.Fatalf("ExpireLeases:\n%s\nthe console:\n%s", a, b)
	}
	for _, k := range []string{"l1", "l2"} {
		if l, c := lib.lookup(pay, k), con.lookup(pay, k); l.Status != idem.StatusUnknown || c.Status != idem.StatusUnknown ||
			c.LastError != l.LastError {
			t.Fatalf("%s: library %+v, console %+v", k, l, c)
		}
	}
	if rec := con.lookup(pay, "after-count"); rec.Status != idem.StatusProcessing {
		t.Fatalf("a lease that ran out after the count was expired: %+v", rec)
	}
	var detail string
	var bulkID int64
	if err := con.pool.QueryRow(ctx, `SELECT operator || ' ' || action || ' ' || changed || ' ' || detail::text, id FROM idem_audit
		WHERE idem_key = ''`).Scan(&detail, &bulkID); err != nil ||
		!strings.HasPrefix(detail, "alice expire_leases 2 ") || !strings.Contains(detail, c.Cutoff[:19]) {
		t.Fatalf("audit row: %q, %v", detail, err)
	}
	// Each record it changed has a row of its own, and its page shows it.
	var each string
	if err := con.pool.QueryRow(ctx, `SELECT string_agg(format('%s %s %s %s>%s %s bulk:%s cutoff:%s lease:%s', operator, action, idem_key,
		status_before, status_after, changed, (detail->>'bulk_id')::bigint = $1, detail->>'cutoff' IS NOT NULL,
		detail->>'lease_expires_at' IS NOT NULL), E'\n' ORDER BY idem_key) FROM idem_audit WHERE idem_key <> ''`, bulkID).Scan(&each); err != nil ||
		each != "alice expire_leases l1 processing>unknown 1 bulk:t cutoff:t lease:t\n"+
			"alice expire_leases l2 processing>unknown 1 bulk:t cutoff:t lease:t" {
		t.Fatalf("the records' rows:\n%s (%v)", each, err)
	}
	l1 := con.get(keyPage(pay, "l1"))
	for _, want := range []string{"alice: expired the lease: the record became unknown", "The lease ran out", "<dt>Lease</dt><dd>last deadline", "Filter and cutoff",
		"<dt>Became unknown</dt>", "alice expired its lease"} {
		if !strings.Contains(l1.body, want) {
			t.Errorf("the page of an expired record lacks %q:\n%s", want, l1.body)
		}
	}
	if strings.Contains(l1.body, "No operator has acted") || strings.Contains(l1.body, "<dt>Expires</dt>") {
		t.Errorf("the page of an expired record says no operator acted, or that prune removes it:\n%s", l1.body)
	}
	// Filtered: only what the filter matches.
	other := idem.Scope{Actor: "globex", Operation: "charge"}
	con.lapsed(other, "g1")
	res = con.postForm("/idem/expire-leases", url.Values{"actor": {"globex"},
		"cutoff": {time.Now().Add(time.Minute).UTC().Format(time.RFC3339Nano)}})
	if res.status != http.StatusSeeOther || !strings.HasPrefix(res.header.Get("Location"), "/idem/unknown?actor=globex&flash=") ||
		!strings.Contains(con.flashed(res).body, "1 reservation turned unknown") {
		t.Fatalf("filtered expire: %d %s", res.status, res.header.Get("Location"))
	}
	if a, g := con.lookup(pay, "after-count"), con.lookup(other, "g1"); a.Status != idem.StatusProcessing || g.Status != idem.StatusUnknown {
		t.Fatalf("filtered expire: acme %s, globex %s", a.Status, g.Status)
	}
	// Nothing left to expire under the filter: no change, no row.
	rows0 := con.auditRows()
	res = con.postForm("/idem/expire-leases", url.Values{"actor": {"globex"},
		"cutoff": {time.Now().UTC().Format(time.RFC3339Nano)}})
	if res.status != http.StatusSeeOther || !strings.Contains(con.flashed(res).body, "No lease to expire") || con.auditRows() != rows0 {
		t.Fatalf("expire with nothing to do: %d %s", res.status, res.header.Get("Location"))
	}
}

func TestPrune(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.succeeded(pay, "old", idem.Response{Status: 200})
	e.succeeded(pay, "fresh", idem.Response{Status: 200})
	e.unknown(pay, "u", "timeout")
	if _, err := e.pool.Exec(context.Background(), `UPDATE idem_keys SET expires_at = now() - interval '1 hour'
		WHERE idem_key IN ('old', 'u')`); err != nil {
		t.Fatal(err)
	}
	before := e.state()
	if res := e.postForm("/idem/prune", url.Values{"reason": {"ttl <past>"}}); res.status != 400 ||
		!strings.Contains(res.body, "ttl &lt;past&gt;</textarea>") || e.state() != before {
		t.Fatalf("an unconfirmed prune: %d\n%s", res.status, res.body)
	}
	res := e.postForm("/idem/prune", url.Values{"reason": {"ttl past"}, "confirm": {"yes"}})
	if res.status != http.StatusSeeOther || !strings.HasPrefix(res.header.Get("Location"), "/idem/?flash=") {
		t.Fatalf("prune: %d %s", res.status, res.header.Get("Location"))
	}
	flashURL := res.header.Get("Location")
	if _, err := idem.Lookup(context.Background(), e.pool, pay, "old"); !errors.Is(err, idem.ErrNotFound) {
		t.Fatal("the expired key was not pruned")
	}
	e.lookup(pay, "u")
	res = e.postJSON("/idem/api/prune", map[string]any{"reason": "ttl"})
	if res.status != 200 || !strings.Contains(res.body, `"pruned": 0`) || e.auditRows() != 1 {
		t.Fatalf("prune with nothing to prune: %d %s (%d audit rows)", res.status, res.body, e.auditRows())
	}
	if page := e.get(flashURL); !strings.Contains(page.body, "1 expired key deleted") {
		t.Errorf("the overview after prune:\n%s", page.body)
	}
	// The message is shown once, and one made up in the address never.
	for _, path := range []string{flashURL, "/idem/?done=pruned&n=99999", "/idem/?flash=AAAAAAAAAAAAAAAAAAAAAA"} {
		if page := e.get(path); strings.Contains(page.body, `class="flash`) {
			t.Errorf("%s shows a message:\n%s", path, page.body)
		}
	}
	var reason string
	if err := e.pool.QueryRow(context.Background(), `SELECT reason FROM idem_audit`).Scan(&reason); err != nil || reason != "ttl past" {
		t.Fatalf("the prune's reason: %q, %v", reason, err)
	}
}

// Keys and scopes with any visible character, a / included, make
// addresses that lead back to them.
func TestKeyAddresses(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	scope := idem.Scope{Actor: "tenant/7", Operation: "pay?now#1"}
	for _, key := range []string{"a/b/c", ".", "..", "%2F", "x?y#z", "ümlaut-free~key", "a%20b"} {
		if err := idem.ValidateKey(key); err != nil {
			continue // not a key (the ü)
		}
		e.unknown(scope, key, "timeout")
		res := e.get(keyPath(scope, key))
		if res.status != 200 || !strings.Contains(res.body, "<code>"+html.EscapeString(key)+"</code>") {
			t.Errorf("key %q at %s: %d\n%.500s", key, keyPath(scope, key), res.status, res.body)
		}
	}
	list := e.get("/idem/unknown")
	for _, key := range []string{"a/b/c", ".", ".."} {
		if link := html.EscapeString(keyPage(scope, key)); !strings.Contains(list.body, `href="`+link+`"`) {
			t.Errorf("the list does not link %q as %s", key, link)
		}
		if res := e.get(keyPage(scope, key)); res.status != 200 || !strings.Contains(res.body, "<code>"+html.EscapeString(key)+"</code>") {
			t.Errorf("key %q at %s: %d", key, keyPage(scope, key), res.status)
		}
	}
}

func TestOverview(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.unknown(pay, "u1", "timeout")
	e.lapsed(pay, "l1")
	e.reserve(pay, "live", time.Hour)
	e.succeeded(pay, "s1", idem.Response{Status: 200})
	e.succeeded(pay, "s2", idem.Response{Status: 200})
	res := e.get("/idem/api/overview")
	type count struct{ N int64 }
	var o struct {
		NeedsPerson   count `json:"needs_person"`
		Unknown       count
		LeaseRanOut   count `json:"lease_ran_out"`
		InFlight      count `json:"in_flight"`
		TotalKeys     count `json:"total_keys"`
		Keys          map[string]count
		SamplePercent float64 `json:"sample_percent"`
		Hourly        map[string][24]int64
	}
	if err := json.Unmarshal([]byte(res.body), &o); err != nil {
		t.Fatal(err, res.body)
	}
	if o.NeedsPerson.N != 2 || o.Unknown.N != 1 || o.LeaseRanOut.N != 1 || o.InFlight.N != 1 || o.TotalKeys.N != 5 ||
		o.Keys["succeeded"].N != 2 || o.Keys["processing"].N != 2 || o.SamplePercent != 100 || o.Hourly["succeeded"][0] != 2 ||
		o.Hourly["unknown"][0] != 1 {
		t.Fatalf("overview: %s", res.body)
	}
	page := e.get("/idem/")
	for _, want := range []string{`<meta http-equiv="refresh" content="30">`, "Pause", "Exact counts", "<svg", "Need a person"} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the overview lacks %q", want)
		}
	}
	if page := e.get("/idem/?refresh=off"); strings.Contains(page.body, `http-equiv="refresh"`) || !strings.Contains(page.body, "Resume") {
		t.Error("a paused overview refreshes")
	}
}

func TestSearchAndAudit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	for i := range 7 {
		e.succeeded(pay, fmt.Sprintf("k%d", i), idem.Response{Status: 200})
	}
	res := e.get("/idem/search?actor=acme&operation=charge&key=k3")
	if res.status != http.StatusSeeOther || res.header.Get("Location") != keyPage(pay, "k3") {
		t.Fatalf("search for a key: %d %s", res.status, res.header.Get("Location"))
	}
	if res := e.get("/idem/search?actor=acme&operation=charge&key=nope"); res.status != 404 || !strings.Contains(res.body, "No record holds this key") {
		t.Fatalf("search for a missing key: %d", res.status)
	}
	res = e.get("/idem/search?actor=acme")
	if res.status != 200 || strings.Count(res.body, `class="key"`) != 7 {
		t.Fatalf("keys of an actor: %d\n%s", res.status, res.body)
	}
	for i := range 3 {
		rec := e.lookup(pay, fmt.Sprintf("k%d", i))
		e.name = fmt.Sprintf("op%d", i%2)
		r := e.postForm(keyPath(pay, rec.Key)+"/forget", forgetForm(rec.Token, rec.CreatedAt.Format(time.RFC3339Nano), "reused"))
		if r.status != http.StatusSeeOther {
			t.Fatalf("forget: %d %s", r.status, r.body)
		}
	}
	var out struct {
		Entries []struct{ Operator, Key string }
		Next    string
	}
	res = e.get("/idem/api/audit?limit=2")
	if err := json.Unmarshal([]byte(res.body), &out); err != nil || len(out.Entries) != 2 || out.Entries[0].Key != "k2" || out.Next == "" {
		t.Fatalf("audit page 1: %s", res.body)
	}
	res = e.get("/idem/api/audit?limit=2&before=" + out.Next)
	out.Entries, out.Next = nil, ""
	if err := json.Unmarshal([]byte(res.body), &out); err != nil || len(out.Entries) != 1 || out.Entries[0].Key != "k0" || out.Next != "" {
		t.Fatalf("audit page 2: %s", res.body)
	}
	res = e.get("/idem/api/audit?operator=op1")
	out.Entries = nil
	if err := json.Unmarshal([]byte(res.body), &out); err != nil || len(out.Entries) != 1 || out.Entries[0].Key != "k1" {
		t.Fatalf("audit by operator: %s", res.body)
	}
}

// The trail filters by operator prefix and time range, and exports what
// the filter matches as CSV and JSON.
func TestAuditFiltersAndExport(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	for i, op := range []string{"ops.dana", "ops.sam", "finance.kim"} {
		key := fmt.Sprintf("k%d", i)
		e.succeeded(pay, key, idem.Response{Status: 200})
		rec := e.lookup(pay, key)
		e.name = op
		reason := "reused by the client"
		if i == 1 {
			reason = "=HYPERLINK(\"http://evil\")"
		}
		if r := e.postForm(keyURLFor(pay, key, "forget"), forgetForm(rec.Token, rec.CreatedAt.Format(time.RFC3339Nano), reason)); r.status != http.StatusSeeOther {
			t.Fatalf("forget: %d %s", r.status, r.body)
		}
		// Each row a day apart, from 2026-01-01.
		if _, err := e.pool.Exec(ctx, `UPDATE idem_audit SET acted_at = timestamptz '2026-01-01 12:00Z' + $1 * interval '1 day'
			WHERE idem_key = $2`, i, key); err != nil {
			t.Fatal(err)
		}
	}
	keys := func(path string) string {
		t.Helper()
		res := e.get(path)
		var out struct{ Entries []struct{ Key string } }
		if err := json.Unmarshal([]byte(res.body), &out); err != nil || res.status != 200 {
			t.Fatalf("%s: %d %s", path, res.status, res.body)
		}
		var ks []string
		for _, en := range out.Entries {
			ks = append(ks, en.Key)
		}
		return strings.Join(ks, " ")
	}
	for path, want := range map[string]string{
		"/idem/api/audit?operator=ops.":                                   "k1 k0",
		"/idem/api/audit?operator=ops.s":                                  "k1",
		"/idem/api/audit?operator=OPS":                                    "",
		"/idem/api/audit?from=2026-01-02":                                 "k2 k1",
		"/idem/api/audit?to=2026-01-02T12:00":                             "k0",
		"/idem/api/audit?from=2026-01-02T00:00:00Z&to=2026-01-03":         "k1",
		"/idem/audit.json?operator=ops.&from=2026-01-01T12:00:00.000001Z": "k1",
		"/idem/audit.json":                                                "k2 k1 k0",
	} {
		if got := keys(path); got != want {
			t.Errorf("%s: keys %q, want %q", path, got, want)
		}
	}
	res := e.get("/idem/audit.csv?operator=ops.")
	if res.status != 200 || !strings.HasPrefix(res.header.Get("Content-Type"), "text/csv") ||
		!strings.HasPrefix(res.header.Get("Content-Disposition"), "attachment;") {
		t.Fatalf("CSV export: %d %v", res.status, res.header)
	}
	rows, err := csv.NewReader(strings.NewReader(res.body)).ReadAll()
	if err != nil || len(rows) != 3 || rows[0][2] != "operator" || rows[1][2] != "ops.sam" || rows[2][2] != "ops.dana" ||
		rows[1][12] != "'=HYPERLINK(\"http://evil\")" || !strings.Contains(rows[2][14], `"forgotten"`) {
		t.Fatalf("CSV export: %v\n%s", err, res.body)
	}
	e.name = "viewer"
	page := e.get("/idem/audit?operator=ops.&from=2026-01-02")
	for _, want := range []string{`href="/idem/audit.csv?from=2026-01-02T00%3A00%3A00Z&amp;operator=ops."`, `value="2026-01-02"`, "ops.sam", "Copy of the deleted record"} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the audit page lacks %q:\n%s", want, page.body)
		}
	}
	if strings.Contains(page.body, "ops.dana") || strings.Contains(page.body, "finance.kim") {
		t.Errorf("the filtered audit page shows rows outside the filter:\n%s", page.body)
	}
}

// A Beginner for New's checks, which never begin.
type fakeBeginner struct{ idem.Beginner }

// Attempts in doubt inside their window (ReserveOptions.ResumeWithin) are
// a recovery worker's, not a person's: the overview counts them apart, the
// list of what needs a person and its count leave them out, the expire
// action (filtered or not) leaves them as they are, and their page says
// they resume, and still takes a verdict.
func TestResumingIsNotAPersons(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	window := idem.ReserveOptions{Lease: time.Millisecond, ResumeWithin: time.Hour}
	if _, err := idem.ReserveWith(ctx, e.pool, pay, "w-lapsed", fp, window); err != nil {
		t.Fatal(err)
	}
	r, err := idem.ReserveWith(ctx, e.pool, pay, "w-unknown", fp, idem.ReserveOptions{Lease: time.Minute, ResumeWithin: time.Hour})
	if err == nil {
		err = idem.MarkUnknown(ctx, e.pool, r, "no answer")
	}
	if err != nil {
		t.Fatal(err)
	}
	e.unknown(pay, "u1", "timeout")
	e.lapsed(pay, "l1")
	time.Sleep(2 * time.Millisecond)

	var o struct {
		NeedsPerson       struct{ N int64 } `json:"needs_person"`
		Unknown, Resuming struct{ N int64 }
		LeaseRanOut       struct{ N int64 } `json:"lease_ran_out"`
		Keys              map[string]struct{ N int64 }
	}
	res := e.get("/idem/api/overview")
	if err := json.Unmarshal([]byte(res.body), &o); err != nil {
		t.Fatal(err, res.body)
	}
	if o.NeedsPerson.N != 2 || o.Unknown.N != 1 || o.LeaseRanOut.N != 1 || o.Resuming.N != 2 ||
		o.Keys["unknown"].N != 2 || o.Keys["processing"].N != 2 {
		t.Fatalf("overview: %s", res.body)
	}
	if page := e.get("/idem/"); !strings.Contains(page.body, "Resuming") {
		t.Error("the overview does not count what resumes")
	}
	list := e.get("/idem/api/unknown")
	for key, want := range map[string]bool{"u1": true, "l1": true, "w-lapsed": false, "w-unknown": false} {
		if got := strings.Contains(list.body, `"key": "`+key+`"`) || strings.Contains(list.body, `"key":"`+key+`"`); got != want {
			t.Errorf("the list of what needs a person holds %s: %t\n%s", key, got, list.body)
		}
	}
	if !strings.Contains(list.body, `"n": 2`) && !strings.Contains(list.body, `"n":2`) {
		t.Errorf("the count of what needs a person: %s", list.body)
	}
	count := e.get("/idem/api/expire-leases")
	if !strings.Contains(count.body, `"leases": 1`) && !strings.Contains(count.body, `"leases":1`) {
		t.Fatalf("expirable: %s", count.body)
	}
	res = e.postForm("/idem/expire-leases", url.Values{"actor": {pay.Actor},
		"cutoff": {time.Now().Add(time.Minute).UTC().Format(time.RFC3339Nano)}})
	if res.status != http.StatusSeeOther || !strings.Contains(e.flashed(res).body, "1 reservation turned unknown") {
		t.Fatalf("filtered expire: %d %s", res.status, res.header.Get("Location"))
	}
	if rec := e.lookup(pay, "w-lapsed"); rec.Status != idem.StatusProcessing {
		t.Fatalf("the expire action turned an attempt inside its window unknown: %+v", rec)
	}
	for _, key := range []string{"w-lapsed", "w-unknown"} {
		page := e.get(keyPath(pay, key))
		if !strings.Contains(page.body, "Resuming") || !strings.Contains(page.body, "Resume window") ||
			!strings.Contains(page.body, `name="verdict"`) {
			t.Errorf("the page of %s:\n%.3000s", key, page.body)
		}
	}
}

// The console guide's table of the JSON API names every field that each
// route answers with: the test fills the records so that the fields left
// out when empty are there, and looks each name up in the route's row.
func TestAPIFieldsDocumented(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../docs/console.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{} // a route, without its query, and the rest of its row
	for _, line := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(line, "| `GET api/") || strings.HasPrefix(line, "| `POST api/") {
			cells := strings.SplitN(line, "|", 3)
			route, _, _ := strings.Cut(strings.Trim(strings.TrimSpace(cells[1]), "`"), "?")
			rows[route] = cells[2]
		}
	}
	ctx := context.Background()
	e := newEnv(t, nil)
	api := func(key string) string { return "/idem/api" + strings.TrimPrefix(keyPath(pay, key), "/idem") }
	if _, err := idem.ReserveWith(ctx, e.pool, pay, "resuming", fp,
		idem.ReserveOptions{Lease: time.Microsecond, ResumeWithin: time.Hour}); err != nil {
		t.Fatal(err)
	}
	e.lapsed(pay, "lapsed")
	e.unknown(pay, "open", "gateway timeout")
	decided := e.unknown(pay, "decided", "timeout")
	e.succeeded(pay, "binary", idem.Response{Status: 200, Body: []byte{0xff, 0xfe}})
	forget := e.succeeded(pay, "forget-me", idem.Response{Status: 200})
	e.reserve(pay, "in-flight", time.Hour)

	var count struct{ Cutoff string }
	expirable := e.get("/idem/api/expire-leases")
	if err := json.Unmarshal([]byte(expirable.body), &count); err != nil {
		t.Fatal(err)
	}
	answers := []struct {
		route string
		res   response
		skip  []string // fields documented elsewhere: not looked into
	}{
		{"POST api/keys/{actor}/{operation}/{key}/resolve", e.postJSON(api("decided")+"/resolve", map[string]any{
			"token": decided.Token, "verdict": "succeeded", "status": 201, "body": `{"ok":true}`,
			"content_type": "application/json", "reason": "captured"}), []string{"record", "audit"}},
		{"POST api/keys/{actor}/{operation}/{key}/forget", e.postJSON(api("forget-me")+"/forget", map[string]any{
			"token": forget.Token, "created_at": e.lookup(pay, "forget-me").CreatedAt.Format(time.RFC3339Nano), "reason": "reused"}), []string{"audit"}},
		{"GET api/expire-leases", expirable, nil},
		{"POST api/expire-leases", e.postJSON("/idem/api/expire-leases", map[string]any{"cutoff": count.Cutoff}), []string{"audit"}},
		{"POST api/prune", e.postJSON("/idem/api/prune", map[string]any{"reason": "ttl"}), []string{"audit"}},
		{"GET api/overview", e.get("/idem/api/overview"), []string{"keys", "hourly"}},
		{"GET api/unknown", e.get("/idem/api/unknown?limit=1"), nil},
		{"GET api/keys/{actor}/{operation}/{key}", e.get(api("resuming")), []string{"audit", "header"}},
		{"GET api/keys/{actor}/{operation}/{key}", e.get(api("decided")), []string{"audit", "header"}},
		{"GET api/keys/{actor}/{operation}/{key}", e.get(api("binary")), []string{"audit", "header"}},
		{"GET api/search", e.get("/idem/api/search?actor=acme"), nil},
		{"GET api/status", e.get("/idem/api/status?status=succeeded"), nil},
		{"GET api/search", e.get("/idem/api/search?actor_prefix=ac"), nil},
		{"GET api/audit", e.get("/idem/api/audit?limit=1"), []string{"detail"}},
		{"GET api/audit", e.get("/idem/api/audit?action=resolve"), []string{"detail"}},
		{"GET api/key", e.get("/idem/api/key?actor=acme&operation=charge&key=decided"), []string{"record", "audit"}},
		{"GET api/bulk-resolve", e.get("/idem/api/bulk-resolve?actor=acme"), nil},
		{"POST api/bulk-resolve", e.postJSON("/idem/api/bulk-resolve", map[string]any{"verdict": "retryable", "reason": "outage",
			"records": []map[string]any{{"actor": "acme", "operation": "charge", "key": "open", "token": e.lookup(pay, "open").Token},
				{"actor": "acme", "operation": "charge", "key": "lapsed", "token": 999}}}), []string{"audit"}},
	}
	seen := map[string]bool{}
	for _, a := range answers {
		row, ok := rows[a.route]
		if !ok {
			t.Errorf("docs/console.md has no row for %s", a.route)
			continue
		}
		if a.res.status != 200 {
			t.Fatalf("%s: %d %s", a.route, a.res.status, a.res.body)
		}
		var v any
		if err := json.Unmarshal([]byte(a.res.body), &v); err != nil {
			t.Fatalf("%s: %v", a.route, err)
		}
		var missing []string
		for _, name := range fieldNames(v, a.skip) {
			seen[name] = true
			if !strings.Contains(row, "`"+name+"`") && !slices.Contains(missing, name) {
				missing = append(missing, name)
			}
		}
		if len(missing) > 0 {
			t.Errorf("%s answers with %q, which its row in docs/console.md does not name", a.route, missing)
		}
	}
	// The fields left out when empty were there to be checked.
	for _, name := range []string{"now", "oldest_needs_person", "oldest_in_flight", "resumable", "resume_until", "completed_at",
		"lease_expires_at", "unknown_at", "last_error", "resolve_reason", "response", "header", "body", "body_base64", "next", "token_before",
		"verdict", "detail", "expired"} {
		if !seen[name] {
			t.Errorf("no answer had %q to check", name)
		}
	}
}

// fieldNames is the names of the fields of the JSON value v and of the
// objects in it, apart from inside the fields named in skip and inside
// counts ({"n": ...}, documented once).
func fieldNames(v any, skip []string) []string {
	var out []string
	switch v := v.(type) {
	case map[string]any:
		for name, f := range v {
			out = append(out, name)
			if obj, ok := f.(map[string]any); slices.Contains(skip, name) || ok && obj["n"] != nil {
				continue
			}
			out = append(out, fieldNames(f, skip)...)
		}
	case []any:
		for _, f := range v {
			out = append(out, fieldNames(f, skip)...)
		}
	}
	return out
}

// Authorize is asked (with IsOffer) which actions a page offers: the forms
// of the others are hidden, and a refused POST shows the page again with
// what the operator typed, changing nothing.
func TestAuthorizeDecidesWhatIsOffered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "order-4", "timeout")
	e.succeeded(pay, "done", idem.Response{Status: 200})
	e.refuse = map[idemui.Action]bool{idemui.ActionResolve: true, idemui.ActionPrune: true}
	before := e.state()

	e.takeAsked()
	page := e.get(keyPage(pay, "order-4"))
	if page.status != 200 || strings.Contains(page.body, `name="verdict"`) {
		t.Fatalf("the verdict form is offered to an operator who may not resolve:\n%s", page.body)
	}
	if asked := e.takeAsked(); !slices.Equal(asked, []idemui.Action{idemui.ActionView}) {
		t.Errorf("the page was authorized as %v", asked)
	}
	e.mu.Lock()
	offered := slices.Clone(e.offered)
	e.mu.Unlock()
	if !slices.Contains(offered, idemui.ActionResolve) {
		t.Errorf("Authorize was not asked whether to offer a verdict: %v", offered)
	}
	if page := e.get(keyPage(pay, "done")); !strings.Contains(page.body, `name="confirm"`) {
		t.Errorf("the forget form is hidden from an operator who may forget")
	}
	if page := e.get("/idem/"); strings.Contains(page.body, `action="/idem/prune"`) {
		t.Errorf("the prune form is offered to an operator who may not prune")
	}
	if page := e.get("/idem/unknown"); !strings.Contains(page.body, "Count them") {
		t.Errorf("the expire link is hidden from an operator who may expire leases")
	}
	res := e.postForm(keyURLFor(pay, "order-4", "resolve"), url.Values{"token": {strconv.FormatInt(u.Token, 10)},
		"verdict": {"retryable"}, "reason": {"no charge in the provider's dashboard <ch_4>"}})
	if res.status != http.StatusForbidden || !strings.Contains(res.body, "no charge in the provider&#39;s dashboard &lt;ch_4&gt;") ||
		strings.Contains(res.body, errSecret.Error()) {
		t.Fatalf("a refused verdict: %d\n%s", res.status, res.body)
	}
	e.mu.Lock()
	e.refuse[idemui.ActionForget] = true
	e.mu.Unlock()
	if page := e.get(keyPage(pay, "done")); strings.Contains(page.body, `name="confirm"`) {
		t.Errorf("the forget form is offered to an operator who may not forget")
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused action changed something:\n%s\n%s", before, after)
	}
}

// One verdict over all that the filter matches: counted first, acted on as
// of the count (a record that needs a person only after it is left, also
// one in flight then that its worker marked unknown since; one whose lease
// had run out then is the count's however it became unknown; one someone
// else settled meanwhile is left too), each record with its audit
// row and one row for the action; then over a selection, where a record
// whose attempt changed is left.
func TestBulkVerdict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	other := idem.Scope{Actor: "globex", Operation: "charge"}
	e.unknown(pay, "b1", "timeout")
	e.unknown(pay, "b2", "timeout")
	b3 := e.unknown(pay, "b3", "timeout")
	e.lapsed(pay, "b4")
	e.unknown(other, "g1", "timeout")
	b6 := e.reserve(pay, "b6", time.Hour)
	b7 := e.lapsed(pay, "b7")

	page := e.get("/idem/unknown?actor=acme")
	if !strings.Contains(page.body, `action="/idem/bulk-resolve"`) || strings.Count(page.body, `name="r"`) != 5 {
		t.Fatalf("the list offers no selection:\n%s", page.body)
	}
	confirm := e.get("/idem/bulk-resolve?actor=acme&all=yes")
	m := regexp.MustCompile(`name="cutoff" value="([^"]+)"`).FindStringSubmatch(confirm.body)
	if confirm.status != 200 || !strings.Contains(confirm.body, "<b>5</b> records need a person") || m == nil {
		t.Fatalf("the confirmation:\n%s", confirm.body)
	}
	cutoff := m[1]
	// After the count: another record needs a person, two workers mark
	// their attempts unknown (b6's lease ran then, b7's had run out), and
	// someone settles b3.
	time.Sleep(time.Millisecond)
	e.unknown(pay, "b5", "timeout")
	for _, r := range []idem.Reservation{b6, b7} {
		if err := idem.MarkUnknown(ctx, e.pool, r, "timeout"); err != nil {
			t.Fatal(err)
		}
	}
	if err := idem.Resolve(ctx, e.pool, pay, "b3", idem.Resolution{Token: b3.Token, Retryable: true, Reason: "elsewhere"}); err != nil {
		t.Fatal(err)
	}
	form := url.Values{"actor": {"acme"}, "all": {"yes"}, "cutoff": {cutoff}, "verdict": {"retryable"}, "reason": {"provider outage: nothing was charged"}}
	before := e.state()
	for name, bad := range map[string]url.Values{
		"no reason":  {"actor": {"acme"}, "all": {"yes"}, "cutoff": {cutoff}, "verdict": {"retryable"}},
		"no verdict": {"actor": {"acme"}, "all": {"yes"}, "cutoff": {cutoff}, "reason": {"r"}},
		"no cutoff":  {"actor": {"acme"}, "all": {"yes"}, "verdict": {"retryable"}, "reason": {"r"}},
		"nothing":    {"verdict": {"retryable"}, "reason": {"r"}},
		"bad ref":    {"r": {"bm9wZQ"}, "verdict": {"retryable"}, "reason": {"r"}},
		"bad status": {"actor": {"acme"}, "all": {"yes"}, "cutoff": {cutoff}, "verdict": {"succeeded"}, "status": {"101"}, "reason": {"kept <me>"}},
	} {
		res := e.postForm("/idem/bulk-resolve", bad)
		if res.status != 400 {
			t.Errorf("%s: %d\n%.400s", name, res.status, res.body)
		}
		if name == "bad status" && !strings.Contains(res.body, "kept &lt;me&gt;</textarea>") {
			t.Errorf("a refused bulk verdict loses the reason typed:\n%s", res.body)
		}
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused bulk verdict changed something:\n%s\n%s", before, after)
	}
	res := e.postForm("/idem/bulk-resolve", form)
	if res.status != http.StatusSeeOther || !strings.Contains(e.flashed(res).body, "4 records settled with one verdict") {
		t.Fatalf("the bulk verdict: %d %s", res.status, res.header.Get("Location"))
	}
	for key, want := range map[string]idem.Status{"b1": idem.StatusFailedRetryable, "b2": idem.StatusFailedRetryable,
		"b4": idem.StatusFailedRetryable, "b5": idem.StatusUnknown, "b6": idem.StatusUnknown, "b7": idem.StatusFailedRetryable} {
		if rec := e.lookup(pay, key); rec.Status != want || (want != idem.StatusUnknown && rec.ResolveReason != "provider outage: nothing was charged") {
			t.Errorf("%s after the bulk verdict: %s %q", key, rec.Status, rec.ResolveReason)
		}
	}
	if rec := e.lookup(pay, "b3"); rec.ResolveReason != "elsewhere" {
		t.Errorf("the record someone else settled was settled again: %+v", rec)
	}
	if rec := e.lookup(other, "g1"); rec.Status != idem.StatusUnknown {
		t.Errorf("a record outside the filter was settled: %s", rec.Status)
	}
	var rows string
	if err := e.pool.QueryRow(ctx, `SELECT string_agg(format('%s %s %s %s', action, coalesce(nullif(idem_key, ''), '*'), changed,
		coalesce(detail->>'cutoff' IS NOT NULL, false)), E'\n' ORDER BY idem_key) FROM idem_audit`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != "resolve * 4 t\nresolve b1 1 f\nresolve b2 1 f\nresolve b4 1 f\nresolve b7 1 f" {
		t.Fatalf("the audit rows:\n%s", rows)
	}
	// A selection: b5, and g1 about an attempt it no longer holds.
	b5, g1 := e.lookup(pay, "b5"), e.lookup(other, "g1")
	sel := url.Values{"verdict": {"succeeded"}, "status": {"201"}, "body": {`{"ok":true}`}, "content_type": {"application/json"},
		"reason": {"captured"}, "r": {ref(pay, "b5", b5.Token), ref(other, "g1", g1.Token+1)}}
	if page := e.get("/idem/bulk-resolve?" + url.Values{"r": sel["r"]}.Encode()); !strings.Contains(page.body, "<b>2</b> selected records") {
		t.Fatalf("the confirmation of a selection:\n%s", page.body)
	}
	res = e.postForm("/idem/bulk-resolve", sel)
	if res.status != http.StatusSeeOther || !strings.Contains(e.flashed(res).body, "1 record settled with one verdict: it happened") ||
		e.lookup(pay, "b5").Status != idem.StatusSucceeded || e.lookup(other, "g1").Status != idem.StatusUnknown {
		t.Fatalf("the selection's verdict: %d", res.status)
	}
}

// ref is a record and its token as the list's checkboxes carry them.
func ref(scope idem.Scope, key string, token int64) string {
	b, _ := json.Marshal([]any{scope.Actor, scope.Operation, key, token})
	return base64.RawURLEncoding.EncodeToString(b)
}

// The list of what needs a person filters by state, and the overview's
// cards lead to it.
func TestNeedsPersonByState(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.unknown(pay, "u1", "timeout")
	e.lapsed(pay, "l1")
	page := e.get("/idem/")
	for _, want := range []string{`href="/idem/unknown?state=unknown"`, `href="/idem/unknown?state=lapsed"`} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the overview lacks %s", want)
		}
	}
	for state, want := range map[string]string{"unknown": "u1", "lapsed": "l1", "": "l1 u1"} {
		res := e.get("/idem/api/unknown?state=" + state)
		var out struct{ Records []struct{ Key string } }
		if err := json.Unmarshal([]byte(res.body), &out); err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, r := range out.Records {
			keys = append(keys, r.Key)
		}
		slices.Sort(keys)
		if got := strings.Join(keys, " "); got != want {
			t.Errorf("state %q: %q, want %q", state, got, want)
		}
	}
	if res := e.get("/idem/api/unknown?state=maybe"); res.status != 400 || res.code() != "invalid_filter" {
		t.Errorf("a bad state: %d %s", res.status, res.body)
	}
	if res := e.get("/idem/api/expire-leases?state=unknown"); !strings.Contains(res.body, `"leases": 0`) {
		t.Errorf("leases to expire among unknown outcomes: %s", res.body)
	}
	if res := e.get("/idem/api/expire-leases?state=lapsed"); !strings.Contains(res.body, `"leases": 1`) {
		t.Errorf("leases to expire among lapsed ones: %s", res.body)
	}
}

// The list goes oldest or newest first, page by page in both directions,
// and says where each page is in it.
func TestNeedsPersonOrderAndPages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	for i := range 7 {
		e.unknown(pay, fmt.Sprintf("k%d", i), "timeout")
		time.Sleep(time.Millisecond)
	}
	type page struct {
		Records    []struct{ Key string }
		First      int64
		Next, Prev string
	}
	get := func(query string) page {
		t.Helper()
		res := e.get("/idem/api/unknown?limit=3" + query)
		var p page
		if err := json.Unmarshal([]byte(res.body), &p); err != nil || res.status != 200 {
			t.Fatalf("%s: %d %s", query, res.status, res.body)
		}
		return p
	}
	keys := func(p page) string {
		var ks []string
		for _, r := range p.Records {
			ks = append(ks, r.Key)
		}
		return fmt.Sprintf("%d:%s", p.First, strings.Join(ks, ","))
	}
	for _, order := range []struct{ q, pages string }{{"", "1:k0,k1,k2 4:k3,k4,k5 7:k6"}, {"&order=newest", "1:k6,k5,k4 4:k3,k2,k1 7:k0"}} {
		var seen []string
		var pages []page
		p := get(order.q)
		for {
			seen = append(seen, keys(p))
			pages = append(pages, p)
			if p.Next == "" {
				break
			}
			p = get(order.q + "&after=" + p.Next)
		}
		if got := strings.Join(seen, " "); got != order.pages {
			t.Errorf("order %q forwards: %s, want %s", order.q, got, order.pages)
		}
		if pages[0].Prev != "" || pages[1].Prev == "" {
			t.Errorf("order %q: the first page has a previous one, or the second none", order.q)
		}
		// And back, from the last page.
		seen = nil
		p = pages[len(pages)-1]
		for p.Prev != "" {
			p = get(order.q + "&before=" + p.Prev)
			seen = append(seen, keys(p))
		}
		want := strings.Fields(order.pages)
		if got := strings.Join(seen, " "); got != want[1]+" "+want[0] {
			t.Errorf("order %q backwards: %s", order.q, got)
		}
	}
	page1 := e.get("/idem/unknown?order=newest")
	for _, want := range []string{"newest first: <b>1–7</b> of 7", `<b>Newest first</b>`, `href="/idem/unknown">Oldest first</a>`} {
		if !strings.Contains(page1.body, want) {
			t.Errorf("the newest-first page lacks %q", want)
		}
	}
	if res := e.get("/idem/api/unknown?order=random"); res.status != 400 || res.code() != "invalid_filter" {
		t.Errorf("a bad order: %d %s", res.status, res.body)
	}
	if res := e.get("/idem/api/unknown?after=x&before=y"); res.status != 400 {
		t.Errorf("after and before: %d", res.status)
	}
}

// A verdict on a record another transaction holds waits a few seconds at
// most, then says the record is busy, and changes nothing.
func TestBusyRecordSaysSo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	u := e.unknown(pay, "held", "timeout")
	before := e.state()
	holder, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SELECT 1 FROM idem_keys WHERE idem_key = 'held' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	res := e.postJSON("/idem/api/key/resolve?"+url.Values{"actor": {pay.Actor}, "operation": {pay.Operation}, "key": {"held"}}.Encode(),
		map[string]any{"token": u.Token, "verdict": "retryable", "reason": "no charge"})
	if res.status != http.StatusConflict || res.code() != "busy" {
		t.Fatalf("a verdict on a held record: %d %s", res.status, res.body)
	}
	page := e.postForm(keyURLFor(pay, "held", "resolve"), url.Values{"token": {strconv.FormatInt(u.Token, 10)},
		"verdict": {"retryable"}, "reason": {"no charge, typed"}})
	if page.status != http.StatusConflict || !strings.Contains(page.body, `data-code="busy"`) || !strings.Contains(page.body, "no charge, typed") {
		t.Fatalf("the page of a verdict on a held record: %d\n%s", page.status, page.body)
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if after := e.state(); after != before {
		t.Fatalf("a busy verdict changed something:\n%s\n%s", before, after)
	}
}

// When a record became unknown, on its page and in the API: the worker's
// MarkUnknown records it (no operator named), a verdict keeps it, and a
// record marked before migration 10 says it is not recorded.
func TestRecordBecameUnknown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	r := e.unknown(pay, "u1", "gateway timeout")
	rec := e.lookup(pay, "u1")
	if rec.UnknownAt.IsZero() {
		t.Fatalf("MarkUnknown recorded no time: %+v", rec)
	}
	apiUnknownAt := func() string {
		t.Helper()
		var out struct {
			Record struct {
				UnknownAt *time.Time `json:"unknown_at"`
			} `json:"record"`
		}
		res := e.get("/idem/api/key?actor=acme&operation=charge&key=u1")
		if err := json.Unmarshal([]byte(res.body), &out); err != nil || res.status != 200 {
			t.Fatalf("api/key: %d %s (%v)", res.status, res.body, err)
		}
		if out.Record.UnknownAt == nil {
			return ""
		}
		return out.Record.UnknownAt.Format(time.RFC3339Nano)
	}
	if got := apiUnknownAt(); got != rec.UnknownAt.Format(time.RFC3339Nano) {
		t.Errorf("api/key unknown_at %q, want %s", got, rec.UnknownAt.Format(time.RFC3339Nano))
	}
	page := e.get(keyPage(pay, "u1"))
	for _, want := range []string{"<dt>Became unknown</dt>", "The attempt became unknown"} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the page of an unknown record lacks %q:\n%s", want, page.body)
		}
	}
	if strings.Contains(page.body, "not recorded") || strings.Contains(page.body, "expired its lease") {
		t.Errorf("the page of a record its worker marked says the time is not recorded, or names an operator:\n%s", page.body)
	}
	if err := idem.Resolve(ctx, e.pool, pay, "u1", idem.Resolution{Token: r.Token, Retryable: true, Reason: "not charged"}); err != nil {
		t.Fatal(err)
	}
	if got := apiUnknownAt(); got != rec.UnknownAt.Format(time.RFC3339Nano) {
		t.Errorf("after the verdict, api/key unknown_at %q, want %s", got, rec.UnknownAt.Format(time.RFC3339Nano))
	}
	if page := e.get(keyPage(pay, "u1")); !strings.Contains(page.body, "<dt>Became unknown</dt>") {
		t.Errorf("the page of a settled record no longer says when it became unknown:\n%s", page.body)
	}
	// Marked before the column existed.
	e.unknown(pay, "u2", "gateway timeout")
	if _, err := e.pool.Exec(ctx, `UPDATE idem_keys SET unknown_at = NULL WHERE idem_key = 'u2'`); err != nil {
		t.Fatal(err)
	}
	if page := e.get(keyPage(pay, "u2")); !strings.Contains(page.body, "<dt>Became unknown</dt><dd><span class=\"muted\">not recorded") ||
		strings.Contains(page.body, "The attempt became unknown") {
		t.Errorf("the page of a record without unknown_at:\n%s", page.body)
	}
}

// The records of one status across actors: failed ones newest outcome
// first (their own partial index), the others the latest expiry first; pages through
// the API; the overview's counts link to them; a bad status or position is
// refused.
func TestKeysByStatus(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	other := idem.Scope{Actor: "globex", Operation: "refund"}
	e.succeeded(pay, "s1", idem.Response{Status: 201})
	e.succeeded(other, "s2", idem.Response{Status: 201})
	if err := idem.FailRetryable(ctx, e.pool, e.reserve(other, "f1", time.Hour), "card declined"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Millisecond)
	// Failed by a verdict (no error of its own: its lease ran out).
	f2 := e.lapsed(pay, "f2")
	if err := idem.Resolve(ctx, e.pool, pay, "f2", idem.Resolution{Token: f2.Token, Retryable: true, Reason: "not charged"}); err != nil {
		t.Fatal(err)
	}
	// Succeeded by a verdict: in the failed index, not in the list.
	u := e.unknown(pay, "v1", "timeout")
	if err := idem.Resolve(ctx, e.pool, pay, "v1", idem.Resolution{Token: u.Token, Succeeded: &idem.Response{Status: 201}, Reason: "charged"}); err != nil {
		t.Fatal(err)
	}
	e.unknown(pay, "u1", "timeout")

	type page struct {
		Keys []struct {
			Actor, Key, Status string
		}
		Next string
	}
	list := func(query string) (string, page) {
		t.Helper()
		res := e.get("/idem/api/status?" + query)
		var p page
		if err := json.Unmarshal([]byte(res.body), &p); err != nil || res.status != 200 {
			t.Fatalf("api/status?%s: %d %s", query, res.status, res.body)
		}
		var got []string
		for _, k := range p.Keys {
			got = append(got, k.Actor+"/"+k.Key+":"+k.Status)
		}
		return strings.Join(got, " "), p
	}
	got, p := list("status=failed_retryable&limit=1")
	if got != "acme/f2:failed_retryable" || p.Next == "" {
		t.Fatalf("the first page of failed records: %s (next %q)", got, p.Next)
	}
	if got, p := list("status=failed_retryable&limit=1&after=" + url.QueryEscape(p.Next)); got != "globex/f1:failed_retryable" {
		t.Fatalf("the second page of failed records: %s (next %q)", got, p.Next)
	} else if p.Next != "" {
		if got, _ := list("status=failed_retryable&limit=1&after=" + url.QueryEscape(p.Next)); got != "" {
			t.Fatalf("past the last failed record: %s", got)
		}
	}
	if got, p := list("status=succeeded"); got != "acme/v1:succeeded globex/s2:succeeded acme/s1:succeeded" || p.Next != "" {
		t.Fatalf("the succeeded records: %s (next %q)", got, p.Next)
	}
	if got, _ := list("status=succeeded&limit=2"); got != "acme/v1:succeeded globex/s2:succeeded" {
		t.Fatalf("a page of succeeded records: %s", got)
	}
	if got, _ := list("status=unknown"); got != "acme/u1:unknown" {
		t.Fatalf("the unknown records: %s", got)
	}
	pageRes := e.get("/idem/status?status=failed_retryable")
	for _, want := range []string{">globex<", ">f1<", ">f2<"} {
		if !strings.Contains(pageRes.body, want) {
			t.Errorf("the page of failed records lacks %q:\n%s", want, pageRes.body)
		}
	}
	if strings.Contains(pageRes.body, ">v1<") || strings.Contains(pageRes.body, ">s1<") {
		t.Errorf("the page of failed records lists others:\n%s", pageRes.body)
	}
	if ov := e.get("/idem/"); !strings.Contains(ov.body, `href="/idem/status?status=failed_retryable"`) ||
		!strings.Contains(ov.body, `href="/idem/status?status=succeeded"`) {
		t.Errorf("the overview's counts are not links:\n%s", ov.body)
	}
	for _, bad := range []struct{ path, code string }{
		{"/idem/api/status", "invalid_status"},
		{"/idem/api/status?status=done", "invalid_status"},
		{"/idem/api/status?status=succeeded&after=nope", "invalid_cursor"},
		{"/idem/api/status?status=failed_retryable&after=nope", "invalid_cursor"},
		{"/idem/api/status?status=succeeded&limit=0", "invalid_limit"},
	} {
		if res := e.get(bad.path); res.status != 400 || res.code() != bad.code {
			t.Errorf("%s: %d %s, want 400 %s", bad.path, res.status, res.body, bad.code)
		}
	}
	if res := e.get("/idem/status?status=done"); res.status != 400 {
		t.Errorf("the page of a bad status: %d", res.status)
	}
}

// A rare status across many keys: a page reads a bounded part of the
// table and says so (walked, and where to go on), the next page goes on
// from there and finds the record.
func TestKeysByStatusWalksABoundedPart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	// 6000 succeeded keys, and one rejected key expiring before them all.
	if _, err := e.pool.Exec(ctx, `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body,
		created_at, completed_at, expires_at)
		SELECT 'acme', 'charge', 'k' || i, '\x00'::bytea, CASE WHEN i = 0 THEN 'rejected' ELSE 'succeeded' END, 200, '\x'::bytea,
			now(), now(), now() + interval '1 hour' + i * interval '1 ms'
		FROM generate_series(0, 6000) AS i`); err != nil {
		t.Fatal(err)
	}
	var p struct {
		Keys   []struct{ Key string }
		Walked bool
		Next   string
	}
	res := e.get("/idem/api/status?status=rejected")
	if err := json.Unmarshal([]byte(res.body), &p); err != nil || len(p.Keys) != 0 || !p.Walked || p.Next == "" {
		t.Fatalf("the first page: %s (%v)", res.body, err)
	}
	if page := e.get("/idem/status?status=rejected"); !strings.Contains(page.body, "None among the keys this page read") ||
		!strings.Contains(page.body, `rel="next"`) {
		t.Fatalf("the first page:\n%s", page.body)
	}
	res = e.get("/idem/api/status?status=rejected&after=" + url.QueryEscape(p.Next))
	p.Keys, p.Walked, p.Next = nil, false, ""
	if err := json.Unmarshal([]byte(res.body), &p); err != nil || len(p.Keys) != 1 || p.Keys[0].Key != "k0" || p.Walked || p.Next != "" {
		t.Fatalf("the second page: %s (%v)", res.body, err)
	}
}

// Actors found by the start of their name, byte for byte, through the
// primary key (a hop from each actor to the next): a page passes a bounded
// number of actors and says where the next goes on; an actor prefix goes
// alone, and a bad one is refused.
func TestSearchByActorPrefix(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	for _, actor := range []string{"acme", "acme-eu", "acmex", "ac", "beta", "Acme"} {
		e.succeeded(idem.Scope{Actor: actor, Operation: "charge"}, "k1", idem.Response{Status: 201})
	}
	e.succeeded(idem.Scope{Actor: "acme", Operation: "refund"}, "k2", idem.Response{Status: 201})
	type page struct {
		Actors []string
		Next   string
	}
	find := func(query string) page {
		t.Helper()
		res := e.get("/idem/api/search?" + query)
		var p page
		if err := json.Unmarshal([]byte(res.body), &p); err != nil || res.status != 200 {
			t.Fatalf("api/search?%s: %d %s", query, res.status, res.body)
		}
		return p
	}
	p := find("actor_prefix=acme")
	slices.Sort(p.Actors)
	if strings.Join(p.Actors, " ") != "acme acme-eu acmex" || p.Next != "" {
		t.Fatalf("actors starting with acme: %+v", p)
	}
	if page := e.get("/idem/search?actor_prefix=acme"); !strings.Contains(page.body, `href="/idem/search?actor=acme-eu"`) {
		t.Fatalf("the page of actors:\n%s", page.body)
	}
	// Past the bound of one page: 1000 more actors before the one sought.
	if _, err := e.pool.Exec(ctx, `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body,
		created_at, completed_at, expires_at)
		SELECT 'm' || lpad(i::text, 4, '0'), 'charge', 'k', '\x00'::bytea, 'succeeded', 200, '\x'::bytea, now(), now(), now() + interval '1 hour'
		FROM generate_series(1, 1000) AS i
		UNION ALL SELECT 'zz-sought', 'charge', 'k', '\x00'::bytea, 'succeeded', 200, '\x'::bytea, now(), now(), now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	p = find("actor_prefix=zz")
	if len(p.Actors) != 0 || p.Next == "" {
		t.Fatalf("the first page past the bound: %+v", p)
	}
	if p = find("actor_prefix=zz&after=" + url.QueryEscape(p.Next)); strings.Join(p.Actors, " ") != "zz-sought" || p.Next != "" {
		t.Fatalf("the next page: %+v", p)
	}
	for _, bad := range []struct{ query, code string }{
		{"actor_prefix=ac&actor=acme", "invalid_search"},
		{"actor_prefix=a%FF", "invalid_form"},
		{"actor_prefix=" + strings.Repeat("a", 256), "invalid_scope"},
	} {
		if res := e.get("/idem/api/search?" + bad.query); res.status != 400 || res.code() != bad.code {
			t.Errorf("%s: %d %s, want 400 %s", bad.query, res.status, res.body, bad.code)
		}
	}
}
