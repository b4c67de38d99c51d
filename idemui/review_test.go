package idemui_test

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"

	"github.com/pgidem/idem/idemui"
)

// A bulk verdict from the page by an operator who may view but not
// resolve is refused with 403 and the bulk page with what was typed (not a
// record's page, for there is no record): nothing changes.
func TestBulkVerdictRefusedByAuthorize(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.refuse = map[idemui.Action]bool{idemui.ActionResolve: true}
	e.unknown(pay, "r1", "timeout")
	r1 := e.lookup(pay, "r1")
	before := e.state()
	form := url.Values{"verdict": {"retryable"}, "reason": {"kept <typed>"}, "r": {ref(pay, "r1", r1.Token)}}
	res := e.postForm("/idem/bulk-resolve", form)
	if res.status != http.StatusForbidden || !strings.Contains(res.body, "<q>kept &lt;typed&gt;</q>") {
		t.Fatalf("a refused bulk verdict: %d\n%s", res.status, res.body)
	}
	if res := e.postForm("/idem/bulk-resolve", url.Values{"verdict": {"retryable"}}); res.status != http.StatusForbidden {
		t.Errorf("a refused bulk verdict that selects nothing: %d, not 403", res.status)
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused bulk verdict changed something:\n%s\n%s", before, after)
	}
}

// An export of the trail is bounded by the bytes it holds, not only by its
// rows: forgets keep a copy of each record, body included (up to
// MaxResponseBytes each), and 50,000 of them would not fit in memory. Past
// the bound, the export says it was cut.
func TestAuditExportBoundedInBytes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	big := strings.Repeat("x", 100<<10)
	if _, err := e.pool.Exec(ctx, `INSERT INTO idem_audit (actor, operator, action, operation, idem_key, reason, changed, detail)
		SELECT 'acme', 'dana', 'forget', 'charge', 'k' || i, 'asked', 1, jsonb_build_object('forgotten', jsonb_build_object('body', $1::text))
		FROM generate_series(1, 40) AS i`, big); err != nil {
		t.Fatal(err)
	}
	old := idemui.SetMaxExportBytes(1 << 20)
	defer idemui.SetMaxExportBytes(old)
	res := e.get("/idem/audit.csv")
	rows, err := csv.NewReader(strings.NewReader(res.body)).ReadAll()
	if res.status != 200 || err != nil || res.header.Get("Idem-Export-Truncated") == "" || len(rows) < 2 || len(rows)-1 >= 40 {
		t.Fatalf("CSV export past the bound: %d, %d rows, truncated %q, %v", res.status, len(rows), res.header.Get("Idem-Export-Truncated"), err)
	}
	if n, _ := strconv.Atoi(res.header.Get("Idem-Export-Truncated")); n != len(rows)-1 {
		t.Errorf("Idem-Export-Truncated %q for %d rows", res.header.Get("Idem-Export-Truncated"), len(rows)-1)
	}
	if len(res.body) > 2<<20 {
		t.Errorf("the export holds %d bytes, for a bound of 1 MiB", len(res.body))
	}
	var out struct {
		Entries   []json.RawMessage `json:"entries"`
		Truncated bool              `json:"truncated"`
	}
	res = e.get("/idem/audit.json")
	if err := json.Unmarshal([]byte(res.body), &out); err != nil || !out.Truncated || len(out.Entries) == 0 || len(out.Entries) >= 40 {
		t.Fatalf("JSON export past the bound: %v, %d entries, truncated %v", err, len(out.Entries), out.Truncated)
	}
}

// Pages of what needs a person, and of the trail, neither skip nor repeat
// a row at their edges when every row has the same time (records created
// in one transaction, audit rows of one bulk action).
func TestPagesWithEqualTimes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	var all []string
	for i := range 11 {
		scope := idem.Scope{Actor: fmt.Sprintf("a%d", i%3), Operation: "charge"}
		key := fmt.Sprintf("k%02d", i)
		e.unknown(scope, key, "timeout")
		all = append(all, scope.Actor+"/"+key)
	}
	if _, err := e.pool.Exec(ctx, `UPDATE idem_keys SET created_at = timestamptz '2026-01-01 12:00Z'`); err != nil {
		t.Fatal(err)
	}
	type page struct {
		Records []struct{ Actor, Key string }
		Next    string
		Prev    string
	}
	walk := func(query, dir string) []string {
		t.Helper()
		var seen []string
		pos := ""
		for range 20 {
			res := e.get("/idem/api/unknown?limit=4" + query + pos)
			var p page
			if err := json.Unmarshal([]byte(res.body), &p); err != nil || res.status != 200 {
				t.Fatalf("%s%s: %d %s", query, pos, res.status, res.body)
			}
			var ks []string
			for _, r := range p.Records {
				ks = append(ks, r.Actor+"/"+r.Key)
			}
			next := p.Next
			if dir == "before" {
				seen = append(ks, seen...)
				next = p.Prev
			} else {
				seen = append(seen, ks...)
			}
			if next == "" {
				return seen
			}
			pos = "&" + dir + "=" + next
		}
		t.Fatalf("%s: more than 20 pages", query)
		return nil
	}
	oldest := walk("", "after")
	newest := walk("&order=newest", "after")
	sorted := slices.Clone(all)
	slices.SortFunc(sorted, func(a, b string) int {
		pa, pb := strings.SplitN(a, "/", 2), strings.SplitN(b, "/", 2)
		return cmp.Or(cmp.Compare(pa[0], pb[0]), cmp.Compare(pa[1], pb[1]))
	})
	if strings.Join(oldest, " ") != strings.Join(sorted, " ") {
		t.Errorf("oldest first: %v, want %v", oldest, sorted)
	}
	slices.Reverse(sorted)
	if strings.Join(newest, " ") != strings.Join(sorted, " ") {
		t.Errorf("newest first: %v, want %v", newest, sorted)
	}

	// The trail: 11 rows at one time.
	for i := range 11 {
		if _, err := e.pool.Exec(ctx, `INSERT INTO idem_audit (actor, operator, action, operation, idem_key, reason, changed, acted_at)
			VALUES ('acme', 'dana', 'resolve', 'charge', $1, 'r', 1, timestamptz '2026-01-01 12:00Z')`, fmt.Sprintf("r%02d", i)); err != nil {
			t.Fatal(err)
		}
	}
	var seen []string
	pos := ""
	for range 20 {
		res := e.get("/idem/api/audit?limit=4" + pos)
		var p struct {
			Entries []struct{ Key string }
			Next    string
		}
		if err := json.Unmarshal([]byte(res.body), &p); err != nil || res.status != 200 {
			t.Fatalf("audit%s: %d %s", pos, res.status, res.body)
		}
		for _, en := range p.Entries {
			seen = append(seen, en.Key)
		}
		if p.Next == "" {
			break
		}
		pos = "&before=" + p.Next
	}
	if got := strings.Join(seen, " "); got != "r10 r09 r08 r07 r06 r05 r04 r03 r02 r01 r00" {
		t.Errorf("the trail's pages: %s", got)
	}
}

// A bulk verdict over a filter settles what needed a person at the count:
// a record its worker marked unknown after the count, while its lease still
// ran then, is left (Record.UnknownAt says when), as is a reservation whose
// lease is still running; one whose lease had run out by the count is
// settled however it became unknown since.
func TestBulkVerdictMarkedUnknownAfterCount(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	e.unknown(pay, "counted", "timeout")
	late := e.reserve(pay, "late", time.Hour)
	lapsed := e.lapsed(pay, "lapsed")
	e.reserve(pay, "running", time.Hour)
	confirm := e.get("/idem/bulk-resolve?actor=acme&all=yes")
	m := regexp.MustCompile(`name="cutoff" value="([^"]+)"`).FindStringSubmatch(confirm.body)
	if m == nil || !strings.Contains(confirm.body, "<b>2</b> records need a person") ||
		!strings.Contains(confirm.body, "marks unknown after the count while its lease still ran then") {
		t.Fatalf("the confirmation:\n%s", confirm.body)
	}
	for _, r := range []idem.Reservation{late, lapsed} {
		if err := idem.MarkUnknown(ctx, e.pool, r, "timeout"); err != nil {
			t.Fatal(err)
		}
	}
	res := e.postForm("/idem/bulk-resolve", url.Values{"actor": {"acme"}, "all": {"yes"}, "cutoff": {m[1]},
		"verdict": {"retryable"}, "reason": {"nothing charged"}})
	if res.status != http.StatusSeeOther {
		t.Fatalf("the bulk verdict: %d\n%s", res.status, res.body)
	}
	for key, want := range map[string]idem.Status{"counted": idem.StatusFailedRetryable, "late": idem.StatusUnknown,
		"lapsed": idem.StatusFailedRetryable, "running": idem.StatusProcessing} {
		if got := e.lookup(pay, key).Status; got != want {
			t.Errorf("%s: %s, want %s", key, got, want)
		}
	}
}

// A message after an action is shown to the operator who acted, once: the
// address that carries its name, opened by another operator (a link
// pasted into a chat, a proxy's log), shows nothing.
func TestFlashOnlyForItsOperator(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.succeeded(pay, "f1", idem.Response{Status: 200})
	rec := e.lookup(pay, "f1")
	res := e.postForm(keyURLFor(pay, "f1", "forget"), forgetForm(rec.Token, rec.CreatedAt.Format(time.RFC3339Nano), "asked"))
	if res.status != http.StatusSeeOther {
		t.Fatalf("forget: %d %s", res.status, res.body)
	}
	e.name = "mallory"
	if page := e.flashed(res); strings.Contains(page.body, "Key forgotten") {
		t.Errorf("another operator was shown alice's message")
	}
	e.name = "alice"
	if page := e.flashed(res); !strings.Contains(page.body, "Key forgotten") {
		t.Errorf("alice was not shown her message after another operator opened its address")
	}
	if page := e.flashed(res); strings.Contains(page.body, "Key forgotten") {
		t.Errorf("the message was shown twice")
	}
}

// A bulk verdict that meets a record another transaction holds changes
// nothing, and says which record was held: among 500, "this record" names
// none.
func TestBulkVerdictBusyNamesTheRecord(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	free := e.unknown(pay, "free", "timeout")
	held := e.unknown(pay, "held-one", "timeout")
	before := e.state()
	holder, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SELECT 1 FROM idem_keys WHERE idem_key = 'held-one' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	res := e.postJSON("/idem/api/bulk-resolve", map[string]any{"verdict": "retryable", "reason": "no charge",
		"records": []map[string]any{
			{"actor": pay.Actor, "operation": pay.Operation, "key": "free", "token": free.Token},
			{"actor": pay.Actor, "operation": pay.Operation, "key": "held-one", "token": held.Token},
		}})
	if res.status != http.StatusConflict || res.code() != "busy" || !strings.Contains(res.body, "held-one") {
		t.Fatalf("a bulk verdict over a held record: %d %s", res.status, res.body)
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if after := e.state(); after != before {
		t.Fatalf("a busy bulk verdict changed something:\n%s\n%s", before, after)
	}
}

// Names are exact in every filter: an actor with a space at either end is
// another actor than the trimmed one, and the trail, the list of what needs
// a person (and so a bulk verdict over it) and the search filtered by it
// show its records only.
func TestFiltersKeepSpacesOfNames(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	spaced := idem.Scope{Actor: " acme ", Operation: "charge"}
	for _, scope := range []idem.Scope{pay, spaced} {
		e.succeeded(scope, "done", idem.Response{Status: 200})
		rec := e.lookup(scope, "done")
		if r := e.postForm(keyURLFor(scope, "done", "forget"), forgetForm(rec.Token, rec.CreatedAt.Format(time.RFC3339Nano), "asked")); r.status != http.StatusSeeOther {
			t.Fatalf("forget %q: %d %s", scope.Actor, r.status, r.body)
		}
		e.unknown(scope, "open", "timeout")
	}
	var audit struct{ Entries []struct{ Actor string } }
	res := e.get("/idem/api/audit?" + url.Values{"actor": {" acme "}}.Encode())
	if err := json.Unmarshal([]byte(res.body), &audit); err != nil || len(audit.Entries) != 1 || audit.Entries[0].Actor != " acme " {
		t.Errorf("the trail of actor %q: %v %s", " acme ", err, res.body)
	}
	var list struct{ Records []struct{ Actor string } }
	res = e.get("/idem/api/unknown?" + url.Values{"actor": {" acme "}}.Encode())
	if err := json.Unmarshal([]byte(res.body), &list); err != nil || len(list.Records) != 1 || list.Records[0].Actor != " acme " {
		t.Errorf("what needs a person of actor %q: %v %s", " acme ", err, res.body)
	}
	var keys struct{ Keys []struct{ Actor string } }
	res = e.get("/idem/api/search?" + url.Values{"actor": {" acme "}}.Encode())
	if err := json.Unmarshal([]byte(res.body), &keys); err != nil || len(keys.Keys) != 1 || keys.Keys[0].Actor != " acme " {
		t.Errorf("the keys of actor %q: %v %s", " acme ", err, res.body)
	}
}

// An operator name that could forge what a terminal or a page shows
// (control characters, invisible format characters such as a zero-width
// space or a bidi override, line separators) is refused as any unusable
// name is: 403, the forms hidden, nothing changed.
func TestOperatorNameThatForgesRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.succeeded(pay, "f1", idem.Response{Status: 200})
	rec := e.lookup(pay, "f1")
	before := e.state()
	for _, name := range []string{"dana\x1b[8m", "dana\u200b.kim", "dana\u202emik", "dana\u2028kim", "dana\u0085"} {
		e.name = name
		res := e.postForm(keyURLFor(pay, "f1", "forget"), forgetForm(rec.Token, rec.CreatedAt.Format(time.RFC3339Nano), "asked"))
		if res.status != http.StatusForbidden {
			t.Errorf("operator %q: %d, not 403\n%.300s", name, res.status, res.body)
		}
		if page := e.get(keyPage(pay, "f1")); strings.Contains(page.body, `name="confirm"`) {
			t.Errorf("operator %q is offered the forget form", name)
		}
	}
	if after := e.state(); after != before {
		t.Fatalf("a refused operator changed something:\n%s\n%s", before, after)
	}
}

// A selection that names a record twice settles it once and leaves none
// "settled by someone else": the count and the audit row say 1 of 1.
func TestBulkVerdictSelectionTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, nil)
	u := e.unknown(pay, "twice", "timeout")
	r := ref(pay, "twice", u.Token)
	res := e.postJSON("/idem/api/bulk-resolve", map[string]any{"verdict": "retryable", "reason": "no charge",
		"records": []map[string]any{
			{"actor": pay.Actor, "operation": pay.Operation, "key": "twice", "token": u.Token},
			{"actor": pay.Actor, "operation": pay.Operation, "key": "twice", "token": u.Token},
		}})
	var out struct {
		Resolved int
		Skipped  []json.RawMessage
	}
	if err := json.Unmarshal([]byte(res.body), &out); err != nil || res.status != 200 || out.Resolved != 1 || len(out.Skipped) != 0 {
		t.Fatalf("a selection naming a record twice: %d %s", res.status, res.body)
	}
	var detail string
	if err := e.pool.QueryRow(ctx, `SELECT detail::text FROM idem_audit WHERE idem_key = '' AND action = 'resolve'`).Scan(&detail); err != nil ||
		!strings.Contains(detail, `"records": 1`) || !strings.Contains(detail, `"skipped": 0`) {
		t.Errorf("the bulk row's detail: %v %s", err, detail)
	}
	if page := e.get("/idem/bulk-resolve?" + url.Values{"r": {r, r}}.Encode()); !strings.Contains(page.body, "<b>1</b> selected record") {
		t.Errorf("the confirmation of a selection naming a record twice:\n%s", page.body)
	}
}

// A bulk verdict that both selects records and asks for all that match is
// ambiguous: refused (400), nothing changed, rather than one of the two
// silently ignored.
func TestBulkVerdictSelectionAndAllRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	u := e.unknown(pay, "one", "timeout")
	e.unknown(pay, "two", "timeout")
	count := e.get("/idem/api/bulk-resolve?actor=acme")
	var c struct{ Cutoff string }
	if err := json.Unmarshal([]byte(count.body), &c); err != nil || c.Cutoff == "" {
		t.Fatalf("the count: %v %s", err, count.body)
	}
	before := e.state()
	res := e.postJSON("/idem/api/bulk-resolve", map[string]any{"verdict": "retryable", "reason": "no charge",
		"actor": "acme", "all": true, "cutoff": c.Cutoff,
		"records": []map[string]any{{"actor": pay.Actor, "operation": pay.Operation, "key": "one", "token": u.Token}}})
	if res.status != http.StatusBadRequest {
		t.Errorf("records and all: %d %s", res.status, res.body)
	}
	page := e.postForm("/idem/bulk-resolve", url.Values{"verdict": {"retryable"}, "reason": {"no charge"}, "actor": {"acme"},
		"all": {"yes"}, "cutoff": {c.Cutoff}, "r": {ref(pay, "one", u.Token)}})
	if page.status != http.StatusBadRequest {
		t.Errorf("the form with records and all: %d", page.status)
	}
	if after := e.state(); after != before {
		t.Fatalf("an ambiguous bulk verdict changed something:\n%s\n%s", before, after)
	}
}

// The console's nav marks the page a page belongs to, as a sub-page marks
// the list it is reached from (a bulk verdict or an expiry marks "Needs a
// person", an event "Deliveries"): a list of one status is reached from
// the overview's counts, so it marks the overview, not "Look up a key".
func TestNavMarksWhereThePageBelongs(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	nav := regexp.MustCompile(`(?s)<nav aria-label="Console">(.*?)</nav>`)
	current := regexp.MustCompile(`<a href="[^"]*" aria-current="page">([^<]*)</a>`)
	for _, tc := range []struct{ path, want string }{
		{"/idem/", "Overview"},
		{"/idem/status?status=succeeded", "Overview"},
		{"/idem/status?status=failed_retryable", "Overview"},
		{"/idem/status?status=unknown", "Overview"},
		{"/idem/unknown", "Needs a person"},
		{"/idem/expire-leases", "Needs a person"},
		{"/idem/deliveries", "Deliveries"},
		{"/idem/search", "Look up a key"},
		{"/idem/audit", "Audit trail"},
	} {
		res := e.get(tc.path)
		m := nav.FindStringSubmatch(res.body)
		if res.status != http.StatusOK || m == nil {
			t.Errorf("%s: %d, no nav:\n%.600s", tc.path, res.status, res.body)
			continue
		}
		var got []string
		for _, c := range current.FindAllStringSubmatch(m[1], -1) {
			got = append(got, c[1])
		}
		if len(got) != 1 || got[0] != tc.want {
			t.Errorf("%s marks %q in the nav, want %q", tc.path, got, tc.want)
		}
	}
}

// A page position that is valid JSON but names no position ({}, null, a
// time without the record's names) is refused as damaged (400
// invalid_cursor) by every list that takes one, page and API alike,
// rather than read as a position before everything (an empty page) or
// after nothing; nothing changes.
func TestEmptyCursorRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.unknown(pay, "u1", "timeout")
	e.succeeded(pay, "s1", idem.Response{Status: 201})
	if err := idem.FailRetryable(context.Background(), e.pool, e.reserve(pay, "f1", time.Hour), "card declined"); err != nil {
		t.Fatal(err)
	}
	u := e.unknown(pay, "u2", "timeout")
	if res := e.postJSON("/idem/api"+strings.TrimPrefix(keyPath(pay, "u2"), "/idem")+"/resolve",
		map[string]any{"token": u.Token, "verdict": "retryable", "reason": "not charged"}); res.status != http.StatusOK {
		t.Fatalf("a verdict for the trail: %d %s", res.status, res.body)
	}
	b64 := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	cursors := []string{"e30", b64("null"), b64(`{"x":1}`), b64(`{"t":"2026-12-05T00:00:00Z"}`),
		b64(`{"t":"2026-12-05T00:00:00Z","a":"","o":"","k":""}`), b64(`{"o":"charge"}`), b64(`{"i":7}`)}
	lists := []string{
		"/idem/unknown?after=", "/idem/unknown?before=", "/idem/api/unknown?after=", "/idem/api/unknown?before=",
		"/idem/search?actor=acme&after=", "/idem/api/search?actor=acme&after=",
		"/idem/search?actor=acme&operation=charge&after=", "/idem/api/search?actor=acme&operation=charge&after=",
		"/idem/status?status=succeeded&after=", "/idem/api/status?status=succeeded&after=",
		"/idem/status?status=failed_retryable&after=", "/idem/api/status?status=failed_retryable&after=",
		"/idem/audit?before=", "/idem/api/audit?before=",
	}
	before := e.state()
	for _, list := range lists {
		for _, c := range cursors {
			path := list + c
			res := e.get(path)
			if res.status != http.StatusBadRequest {
				t.Errorf("%s: status %d, want 400\n%.400s", path, res.status, res.body)
				continue
			}
			if strings.Contains(path, "/api/") {
				if got := res.code(); got != "invalid_cursor" {
					t.Errorf("%s: code %q, want invalid_cursor (%s)", path, got, res.body)
				}
			} else if !strings.Contains(res.body, "<code>invalid_cursor</code>") && !strings.Contains(res.body, `data-code="invalid_cursor"`) {
				t.Errorf("%s: the page does not name invalid_cursor:\n%.600s", path, res.body)
			}
		}
	}
	if after := e.state(); after != before {
		t.Fatalf("a damaged position changed something:\n%s\n%s", before, after)
	}
}
