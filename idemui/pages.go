package idemui

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// page is what the layout renders around a page's content.
type page struct {
	Title    string
	Nav      string // the navigation entry of the page
	Prefix   string
	Operator string
	ReadOnly bool
	Refresh  int // seconds until the page reloads itself; 0: never
	Flash    *flash
	Body     any
	// Offers names the actions (Action values) whose forms the page
	// shows: Authorize allows them (asked with IsOffer), and the console is
	// not read-only.
	Offers map[string]bool
}

// flash is a message at the top of a page: what just happened.
type flash struct {
	Kind string // "ok" or "error"
	Text string
	Code string // the problem's code, for an error
}

// pageNames are the templates: each is templates/NAME.html with the layout.
var pageNames = []string{"overview", "unknown", "expire", "key", "search", "audit", "error", "bulk", "deliveries", "event", "status"}

// parseTemplates parses every page with the layout.
func parseTemplates() (map[string]*template.Template, error) {
	out := make(map[string]*template.Template, len(pageNames))
	for _, name := range pageNames {
		t, err := template.New(name).Funcs(funcs).ParseFS(files, "templates/layout.html", "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("idemui: template %s: %w", name, err)
		}
		out[name] = t
	}
	return out, nil
}

// render writes the page name with status.
func (c *console) render(w http.ResponseWriter, r *http.Request, status int, name string, p page) {
	p.Prefix, p.ReadOnly = c.opts.Prefix, c.opts.ReadOnly
	if p.Offers == nil {
		p.Offers = c.offers(r)
	}
	var buf bytes.Buffer
	if err := c.pages[name].ExecuteTemplate(&buf, "layout", p); err != nil {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = fmt.Fprintln(w, "the console could not render this page")
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// page renders the page name for this request.
func (q *request) page(status int, name, title, nav string, body any, fl *flash) {
	q.c.render(q.w, q.r, status, name, page{Title: title, Nav: nav, Operator: q.operator, Flash: fl, Body: body})
}

// fail answers with the problem of err.
func (q *request) fail(err error) {
	p := problemOf(err)
	if q.api {
		q.c.fail(q.w, q.r, true, p)
		return
	}
	q.c.render(q.w, q.r, p.Status, "error", page{Title: http.StatusText(p.Status), Operator: q.operator, Body: p, Offers: map[string]bool{}})
}

// url is the address of path (after the prefix) with the query vs.
func (q *request) url(path string, vs url.Values) string {
	u := q.c.opts.Prefix + path
	if len(vs) > 0 {
		sep := "?"
		if strings.Contains(path, "?") {
			sep = "&"
		}
		u += sep + vs.Encode()
	}
	return u
}

// redirect answers a successful POST with 303 See Other to path.
func (q *request) redirect(path string, vs url.Values) {
	http.Redirect(q.w, q.r, q.url(path, vs), http.StatusSeeOther)
}

func (q *request) client() *idem.Client { return q.c.client }

// done is the message a page shows after a redirect from an action: the
// one the action kept under the name the query's "flash" gives, shown once
// (see flashes); nil for any other name.
func (q *request) done() *flash {
	return q.c.flashes.take(q.r.URL.Query().Get("flash"), q.operator)
}

// redirectDone answers a successful POST with 303 See Other to path, with
// the message text to show there once.
func (q *request) redirectDone(path string, vs url.Values, text string) {
	if vs == nil {
		vs = url.Values{}
	}
	vs.Set("flash", q.c.flashes.put(flash{Kind: "ok", Text: text}, q.operator))
	q.redirect(path, vs)
}

func plural(n int64, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%s %ss", formatInt(n), what)
}

// bodies is n stored bodies, for people.
func bodies(n int64) string {
	if n == 1 {
		return "1 stored body"
	}
	return formatInt(n) + " stored bodies"
}

// The overview.

type overviewView struct {
	O          overview
	Statuses   []statusRow
	Charts     []chart
	Paused     bool
	PauseURL   string
	ResumeURL  string
	SampleNote string
	// PruneReason and PruneProblem are the prune form as it was sent and
	// why it was refused.
	PruneReason  string
	PruneProblem *problem
}

type statusRow struct {
	Status idem.Status
	Count  count
}

// refreshSeconds is how often the overview reloads itself.
const refreshSeconds = 30

func (q *request) overviewPage() {
	o, err := readOverview(q.r.Context(), q.c.opts.DB)
	if err != nil {
		q.fail(err)
		return
	}
	v := overviewView{O: o, Charts: charts(o), Paused: q.r.URL.Query().Get("refresh") == "off",
		PauseURL: q.url("/", url.Values{"refresh": {"off"}}), ResumeURL: q.url("/", nil)}
	for _, s := range statuses {
		if c, ok := o.Keys[s]; ok {
			v.Statuses = append(v.Statuses, statusRow{s, c})
		}
	}
	if o.SamplePercent < 100 {
		v.SampleNote = fmt.Sprintf("%.2g%%", o.SamplePercent)
	}
	refresh := refreshSeconds
	if v.Paused {
		refresh = 0
	}
	q.c.render(q.w, q.r, http.StatusOK, "overview", page{Title: "Overview", Nav: "overview", Operator: q.operator,
		Refresh: refresh, Flash: q.done(), Body: v})
}

// The records that need a person.

type unknownView struct {
	Filter    filterInput
	Ages      []ageOption
	Page      needsPersonPage
	NextURL   string
	FirstURL  string
	ExpireURL string
	// BulkAllURL is the confirmation of one verdict on every record the
	// filter matches.
	BulkAllURL string
	Filtered   bool
	// Newest: the list is newest first; OldestURL and NewestURL are its
	// first page in each order.
	Newest               bool
	OldestURL, NewestURL string
	PrevURL              string
	Range                string // "1–50": the places of the page's records in the list
}

type ageOption struct {
	Value, Label string
}

// ages are the ages the filter offers (any other Go duration works in the
// address).
var ages = []ageOption{{"", "any age"}, {"5m", "5 minutes"}, {"1h", "1 hour"}, {"6h", "6 hours"}, {"24h", "1 day"}, {"168h", "7 days"}}

func (q *request) unknownPage() {
	lq, err := needsPersonQuery(q.r.URL.Query())
	if err != nil {
		q.fail(err)
		return
	}
	p, err := readNeedsPerson(q.r.Context(), q.c.opts.DB, lq.f, lq.order, lq.after, lq.before, pageSize)
	if err != nil {
		q.fail(err)
		return
	}
	in := lq.in
	v := unknownView{Filter: in, Ages: ages, Page: p, ExpireURL: q.url("/expire-leases", in.query()),
		Filtered: lq.f != (audit.Filter{}), Newest: lq.order == orderNewest}
	all := in.query()
	all.Set("all", "yes")
	v.BulkAllURL = q.url("/bulk-resolve", all)
	list := func(kv ...string) string {
		vs := in.query()
		if lq.order == orderNewest {
			vs.Set("order", orderNewest)
		}
		for i := 0; i+1 < len(kv); i += 2 {
			vs.Set(kv[i], kv[i+1])
		}
		return q.url("/unknown", vs)
	}
	if p.Next != "" {
		v.NextURL = list("after", p.Next)
	}
	if p.Prev != "" {
		v.PrevURL = list("before", p.Prev)
	}
	if lq.after != "" || lq.before != "" {
		v.FirstURL = list()
	}
	oldest, newest := in.query(), in.query()
	newest.Set("order", orderNewest)
	v.OldestURL, v.NewestURL = q.url("/unknown", oldest), q.url("/unknown", newest)
	if p.First > 0 && len(p.Items) > 0 {
		v.Range = fmt.Sprintf("%s–%s", formatInt(p.First), formatInt(p.First+int64(len(p.Items))-1))
	}
	q.page(http.StatusOK, "unknown", "Needs a person", "unknown", v, q.done())
}

// listQuery is the filter, order and page position of the list of what
// needs a person.
type listQuery struct {
	in            filterInput
	f             audit.Filter
	order         string
	after, before string
}

// needsPersonQuery reads the filter, the order (oldest, the default, or
// newest) and the page position of the list.
func needsPersonQuery(vs url.Values) (listQuery, error) {
	var lq listQuery
	var err error
	if lq.in, err = filterFrom(vs); err != nil {
		return lq, err
	}
	if lq.f, err = lq.in.filter(); err != nil {
		return lq, err
	}
	if lq.order, err = one(vs, "order"); err != nil {
		return lq, err
	}
	switch lq.order {
	case "", orderOldest:
		lq.order = orderOldest
	case orderNewest:
	default:
		return lq, badRequest("invalid_filter", "The order %q is neither %q nor %q.", lq.order, orderOldest, orderNewest)
	}
	if lq.after, err = one(vs, "after"); err != nil {
		return lq, err
	}
	lq.before, err = one(vs, "before")
	return lq, err
}

type expireView struct {
	Filter   filterInput
	Leases   int64
	Cutoff   time.Time
	CutoffIn string // as the form sends it back
	BackURL  string
}

// expirable counts the reservations whose lease ran out that the query's
// filter matches, with the database time of the count.
func (q *request) expirable() (in filterInput, n int64, cutoff time.Time, err error) {
	if in, err = filterFrom(q.r.URL.Query()); err != nil {
		return in, 0, time.Time{}, err
	}
	f, err := in.filter()
	if err != nil {
		return in, 0, time.Time{}, err
	}
	err = audit.Read(q.r.Context(), q.c.opts.DB, func(ctx context.Context, db audit.Planned) error {
		n, cutoff, err = audit.ExpirableCount(ctx, db, f)
		return err
	})
	return in, n, cutoff, err
}

func (q *request) expireConfirmPage() {
	in, n, cutoff, err := q.expirable()
	if err != nil {
		q.fail(err)
		return
	}
	v := expireView{Leases: n, Cutoff: cutoff}
	v.Filter, v.CutoffIn, v.BackURL = in, v.Cutoff.UTC().Format(time.RFC3339Nano), q.url("/unknown", in.query())
	q.page(http.StatusOK, "expire", "Expire leases", "unknown", v, nil)
}

func (q *request) expirePage() {
	in, err := expireFromForm(q.r)
	if err != nil {
		q.fail(err)
		return
	}
	f, cutoff, err := in.check()
	if err != nil {
		q.fail(err)
		return
	}
	e, err := audit.ExpireLeases(q.r.Context(), q.c.opts.DB, q.client(), q.operator, f, cutoff)
	if err != nil {
		q.fail(err)
		return
	}
	if e.Changed == 0 {
		q.redirectDone("/unknown", in.query(), "No lease to expire: the reservations counted finished or were expired meanwhile. Nothing changed.")
		return
	}
	q.redirectDone("/unknown", in.query(), fmt.Sprintf("%s turned unknown: their workers are fenced, each waits for a verdict, and each record's history shows the expiry.",
		plural(e.Changed, "reservation")))
}

// A record.

type keyView struct {
	Scope      idem.Scope
	Key        string
	Found      bool
	Rec        recordJSON
	Label      string
	Class      string
	Meaning    string
	Body       bodyView
	Headers    []headerView
	Timeline   []event
	Audit      []audit.Entry
	AuditURL   string
	KeyURL     string // the page's address
	ResolveURL string // where the verdict form posts
	ForgetURL  string // where the forget form posts
	CanResolve bool
	CanForget  bool
	Resolved   bool  // an operator recorded the outcome: the token advanced past the attempt's
	Attempt    int64 // the attempt's token when Resolved, from the trail; 0 when unknown
	// Form and Forget are what the verdict and forget forms send: the
	// record's attempt, or, after a refusal, the attempt the refused form
	// was about (never silently the record's new one: that would defeat
	// the token guard).
	Form    resolveInput
	Forget  forgetInput
	Problem *problem
	Stale   *staleView // a form refused because the record holds another attempt now
	// NextURL is the page of the oldest other record that needs a person;
	// empty when none does.
	NextURL string
	// BecameUnknown is when the record's attempt became unknown
	// (Record.UnknownAt, or, for a record marked before migration 10, an
	// operator's expiry in the trail); zero when neither says. ExpiredBy
	// names the operator whose expiry did it, from the trail.
	BecameUnknown time.Time
	ExpiredBy     string
}

// staleView says which attempt a refused form was about and which the
// record holds now: tokens, and starts when the tokens are the same (a
// record Do wrote has token 0).
type staleView struct {
	Sent, Now     string
	SentAt, NowAt string
}

// event is one line of a record's timeline.
type event struct {
	When   time.Time
	What   string
	Future bool
}

func (q *request) keyPage() {
	form := resolveInput{Status: "200", ContentType: "application/json"}
	status, ct, ok, err := readShape(q.r.Context(), q.c.opts.DB, q.params.scope)
	if err != nil {
		q.fail(err)
		return
	}
	if ok {
		form.Status, form.ContentType, form.shaped = json.Number(strconv.Itoa(status)), ct, true
	}
	q.showKey(http.StatusOK, nil, form, forgetInput{}, q.done())
}

// showKey renders the record page, with the problem of a refused action
// and the verdict or forget form as it was sent (an empty token: a form
// about the record's attempt).
func (q *request) showKey(status int, p *problem, form resolveInput, forget forgetInput, fl *flash) {
	ctx := q.r.Context()
	scope, key := q.params.scope, q.params.key
	v := keyView{Scope: scope, Key: key, Form: form, Problem: p, KeyURL: q.c.opts.Prefix + keyURL(scope, key, ""),
		ResolveURL: q.c.opts.Prefix + keyURL(scope, key, "resolve"), ForgetURL: q.c.opts.Prefix + keyURL(scope, key, "forget"),
		AuditURL: q.url("/audit", url.Values{"actor": {scope.Actor}, "operation": {scope.Operation}, "key": {key}})}
	rec, err := q.c.lookup(ctx, scope, key)
	switch {
	case errors.Is(err, idem.ErrNotFound):
		if status == http.StatusOK {
			status = http.StatusNotFound
		}
	case err != nil:
		q.fail(err)
		return
	default:
		v.Found = true
	}
	entries, _, err := readAudit(ctx, q.c.opts.DB, audit.ListFilter{Scope: scope, Key: key, Limit: 20}, "")
	if err != nil {
		q.fail(err)
		return
	}
	v.Audit = entries
	if v.Found {
		now := time.Now()
		v.Rec = newRecordJSON(rec, now)
		v.Label, v.Class, v.Meaning = describe(rec, v.Rec.LeaseRanOut, v.Rec.Resumable)
		if rec.Response != nil {
			v.Body = newBodyView(rec.Response.Header, rec.Response.Body)
			v.Headers = headerViews(rec.Response.Header)
		}
		v.Resolved = rec.ResolveReason != ""
		if v.Resolved {
			v.Attempt = resolvedAttempt(entries)
		}
		v.Timeline = timeline(rec, entries, v.Attempt, now)
		v.BecameUnknown = rec.UnknownAt
		if e, ok := expiryOf(rec, entries, v.Attempt); ok {
			v.ExpiredBy = e.Operator
			if v.BecameUnknown.IsZero() {
				v.BecameUnknown = e.At
			}
		}
		offers := q.c.offers(q.r)
		v.CanResolve = (v.Rec.NeedsPerson || v.Rec.Resumable) && offers[string(ActionResolve)]
		v.CanForget = (rec.Status == idem.StatusSucceeded || rec.Status == idem.StatusRejected ||
			rec.Status == idem.StatusFailedRetryable) && offers[string(ActionForget)]
		token, createdAt := strconv.FormatInt(rec.Token, 10), rec.CreatedAt.UTC().Format(time.RFC3339Nano)
		if form.Token == "" {
			v.Form.Token = json.Number(token)
		}
		v.Forget = forgetInput{Token: json.Number(token), CreatedAt: createdAt}
		if forget.Token != "" {
			v.Forget = forgetInput{Token: json.Number(strings.TrimSpace(string(forget.Token))), CreatedAt: strings.TrimSpace(forget.CreatedAt)}
		}
		v.Forget.Reason = forget.Reason
		if p != nil && (p.Code == "fenced" || p.Code == "changed") {
			sent := staleView{Sent: strings.TrimSpace(string(form.Token)), Now: token}
			if forget.Token != "" {
				sent.Sent = string(v.Forget.Token)
				if sent.Sent == sent.Now { // the same token: the starts tell the attempts apart
					sent.SentAt, sent.NowAt = v.Forget.CreatedAt, createdAt
				}
			}
			if sent.Sent != sent.Now || sent.SentAt != sent.NowAt {
				v.Stale = &sent
			}
		}
	}
	if next, ok, err := nextNeedsPerson(ctx, q.c.opts.DB, scope, key); err != nil {
		q.fail(err)
		return
	} else if ok {
		v.NextURL = q.c.opts.Prefix + keyURL(idem.Scope{Actor: next.Actor, Operation: next.Operation}, next.Key, "")
	}
	title := "Record " + key
	q.page(status, "key", title, "", v, fl)
}

// describe is the label, style and meaning of a record's state: ranOut, a
// reservation's lease ran out; resumable, in doubt inside its window.
func describe(rec idem.Record, ranOut, resumable bool) (label, class, meaning string) {
	switch {
	case resumable:
		return "Resuming", "processing", "The work may or may not have happened, but its outside calls carry a key the receiver " +
			"still remembers: the next request with this key, or a recovery worker, makes them again and records the answer " +
			"(the receiver replays what it did). Nothing to decide unless the window ends; you may still record a verdict."
	case rec.Status == idem.StatusUnknown:
		return "Unknown outcome", "unknown", "The work may or may not have happened, and nothing runs again until someone decides. " +
			"Check the outside system (the provider's dashboard or statement) for this attempt, then record what you found below."
	case ranOut:
		return "Lease ran out", "lapsed", "The worker's lease ran out before it recorded an outcome: the work may or may not have happened. " +
			"Check the outside system for this attempt, then record what you found below."
	case rec.Status == idem.StatusProcessing:
		return "In flight", "processing", "A worker holds this key right now. Nothing to decide unless its lease runs out."
	case rec.Status == idem.StatusSucceeded:
		return "Succeeded", "succeeded", "The outcome is stored: every retry with this key gets the stored response back."
	case rec.Status == idem.StatusRejected:
		return "Rejected", "rejected", "A refusal is stored: every retry with this key gets the same refusal back."
	case rec.Status == idem.StatusFailedRetryable:
		return "Failed, retryable", "retryable", "The work certainly did not happen: the next request with this key runs again."
	}
	return string(rec.Status), "other", ""
}

// timeline is what happened to a record, in time order: its attempt, its
// lease, its outcome, what operators did, and when it expires.
func timeline(rec idem.Record, entries []audit.Entry, attempt int64, now time.Time) []event {
	var ev []event
	add := func(t time.Time, what string) {
		if !t.IsZero() {
			ev = append(ev, event{When: t, What: what, Future: t.After(now)})
		}
	}
	switch {
	case rec.ResolveReason != "" && attempt != 0:
		add(rec.CreatedAt, fmt.Sprintf("Attempt %d reserved the key", attempt))
	case rec.ResolveReason != "":
		add(rec.CreatedAt, "A reservation took the key")
	case rec.Token != 0:
		add(rec.CreatedAt, fmt.Sprintf("Attempt %d reserved the key", rec.Token))
	default:
		add(rec.CreatedAt, "The request claimed the key")
	}
	// An unknown record's lease no longer holds anyone: only a deadline
	// that passed is an event of it.
	if !rec.LeaseExpiresAt.IsZero() && (rec.Status == idem.StatusProcessing ||
		rec.Status == idem.StatusUnknown && !rec.LeaseExpiresAt.After(now)) {
		if rec.LeaseExpiresAt.After(now) {
			add(rec.LeaseExpiresAt, "The lease runs out")
		} else {
			add(rec.LeaseExpiresAt, "The lease ran out")
		}
	}
	// When the attempt became unknown, unless the trail has the operator's
	// expiry that made it so (its row says who, at the same time).
	if _, expired := expiryOf(rec, entries, attempt); !expired {
		add(rec.UnknownAt, "The attempt became unknown")
	}
	audited := slices.ContainsFunc(entries, func(e audit.Entry) bool { return e.Action == audit.ActionResolve })
	if !rec.CompletedAt.IsZero() && rec.Status != idem.StatusProcessing {
		switch {
		case rec.ResolveReason != "" && audited: // the audit row says who
		case rec.ResolveReason != "":
			add(rec.CompletedAt, "An operator recorded the outcome: "+string(rec.Status))
		default:
			add(rec.CompletedAt, "The outcome was recorded: "+string(rec.Status))
		}
	}
	for _, e := range entries {
		add(e.At, fmt.Sprintf("%s: %s", e.Operator, actionText(e)))
	}
	if rec.Status != idem.StatusProcessing && rec.Status != idem.StatusUnknown {
		add(rec.BodyExpiresAt, "The stored body's life ends (Config.BodyTTL): a retry then gets the status alone")
		add(rec.ExpiresAt, "The key expires: a request with it then runs as a new one")
	}
	if rec.Status == idem.StatusProcessing || rec.Status == idem.StatusUnknown || rec.Status == idem.StatusFailedRetryable {
		add(rec.ResumeUntil, "The window to resume ends: past it, an attempt in doubt waits for a person")
	}
	sort.SliceStable(ev, func(i, j int) bool { return ev[i].When.Before(ev[j].When) })
	return ev
}

// expiryOf finds, in entries, the operator's expiry that turned the
// record's attempt unknown: the record's token, or after a verdict the
// attempt the verdict was about (attempt, 0 when none).
func expiryOf(rec idem.Record, entries []audit.Entry, attempt int64) (audit.Entry, bool) {
	token := rec.Token
	if attempt != 0 {
		token = attempt
	}
	for _, e := range entries {
		if e.Action == audit.ActionExpireLeases && e.Key != "" && e.HasBefore && e.TokenBefore == token {
			return e, true
		}
	}
	return audit.Entry{}, false
}

// resolvedAttempt is the token of the attempt that the latest verdict in
// entries (newest first) was about; 0 when the trail has none.
func resolvedAttempt(entries []audit.Entry) int64 {
	for _, e := range entries {
		if e.Action == audit.ActionResolve && e.HasBefore {
			return e.TokenBefore
		}
	}
	return 0
}

// actionText says what an audit row records, in a few words.
func actionText(e audit.Entry) string {
	switch e.Action {
	case audit.ActionResolve:
		what := "verdict: it did not happen (retryable)"
		if e.Verdict == audit.VerdictSucceeded {
			what = "verdict: it happened (succeeded)"
		}
		if e.Key == "" {
			return "one " + what + ", on " + plural(e.Changed, "record")
		}
		return what
	case audit.ActionForget:
		return "forgot the key"
	case audit.ActionExpireLeases:
		if e.Key != "" {
			return "expired the lease: the record became unknown (one of a bulk expire; the detail has the filter and the cutoff)"
		}
		return "expired " + plural(e.Changed, "lease")
	case audit.ActionPrune:
		return "pruned " + plural(e.Changed, "expired key")
	case audit.ActionRetryEvent:
		return "sent a failed event again"
	}
	return e.Action
}

func (q *request) resolvePage() {
	in, err := resolveFromForm(q.r)
	if err != nil {
		q.refused(err, in)
		return
	}
	res, err := in.resolution()
	if err != nil {
		q.refused(err, in)
		return
	}
	if _, _, err := audit.Resolve(q.r.Context(), q.c.opts.DB, q.client(), q.operator, q.params.scope, q.params.key, res); err != nil {
		q.refused(err, in)
		return
	}
	q.redirectDone(keyURL(q.params.scope, q.params.key, ""), nil, "Verdict recorded. The record and the audit trail below show it.")
}

// refused shows the record again with why the verdict was refused, and
// the verdict form as it was sent.
func (q *request) refused(err error, form resolveInput) {
	q.refusedWith(err, form, forgetInput{})
}

// refusedWith shows the record again with why the action was refused,
// and the form that was refused as it was sent.
func (q *request) refusedWith(err error, form resolveInput, forget forgetInput) {
	p := problemOf(err)
	if p.Status >= 500 {
		q.fail(err)
		return
	}
	q.showKey(p.Status, p, form, forget, nil)
}

// refusedAction shows the record page again after Authorize refused the
// verdict or forget it was sent (problem p), with the form as it was sent:
// what the operator typed is not lost. Nothing is changed.
func (q *request) refusedAction(a Action, p *problem) {
	if q.params.key == "" {
		// A bulk verdict (bulk-resolve): its page again, with its form.
		vs, err := postForm(q.r)
		if err != nil {
			q.fail(p)
			return
		}
		in, err := bulkFrom(vs)
		if err != nil || (!in.All && len(in.Refs) == 0) {
			q.fail(p)
			return
		}
		q.showBulk(p.Status, in, p)
		return
	}
	if a == ActionForget {
		in, _ := forgetFromForm(q.r)
		q.showKey(p.Status, p, resolveInput{}, in, nil)
		return
	}
	in, _ := resolveFromForm(q.r)
	q.showKey(p.Status, p, in, forgetInput{}, nil)
}

func (q *request) forgetPage() {
	in, err := forgetFromForm(q.r)
	if err != nil {
		q.refusedWith(err, resolveInput{}, in)
		return
	}
	want, err := in.attempt()
	if err != nil {
		q.refusedWith(err, resolveInput{}, in)
		return
	}
	reason, err := in.reason()
	if err != nil {
		q.refusedWith(err, resolveInput{}, in)
		return
	}
	scope, key := q.params.scope, q.params.key
	if _, err := audit.Forget(q.r.Context(), q.c.opts.DB, q.client(), q.operator, scope, key, &want, reason); err != nil {
		q.refusedWith(err, resolveInput{}, in)
		return
	}
	q.redirectDone("/audit", url.Values{"actor": {scope.Actor}, "operation": {scope.Operation}, "key": {key}},
		"Key forgotten: the next request with it runs as a new one. The audit trail keeps a copy of the record, below.")
}

func (q *request) prunePage() {
	in, err := pruneFromForm(q.r)
	if err != nil {
		q.pruneRefused(err, in)
		return
	}
	opts, reason, err := in.options()
	if err != nil {
		q.pruneRefused(err, in)
		return
	}
	e, dropped, err := audit.Prune(q.r.Context(), q.c.opts.DB, q.client(), q.operator, opts, reason)
	if err != nil {
		q.pruneRefused(err, in)
		return
	}
	switch {
	case e.ID == 0:
		q.redirectDone("/", nil, "No expired key to delete and no stored body past its time. Nothing changed.")
	case dropped == 0:
		q.redirectDone("/", nil, fmt.Sprintf("%s deleted.", plural(e.Changed, "expired key")))
	default:
		q.redirectDone("/", nil, fmt.Sprintf("%s deleted, %s past its time dropped (Config.BodyTTL).",
			plural(e.Changed, "expired key"), bodies(dropped)))
	}
}

// pruneRefused shows the overview again with why the prune was refused,
// and the reason as it was typed.
func (q *request) pruneRefused(err error, in pruneInput) {
	p := problemOf(err)
	if p.Status >= 500 {
		q.fail(err)
		return
	}
	o, err := readOverview(q.r.Context(), q.c.opts.DB)
	if err != nil {
		q.fail(err)
		return
	}
	v := overviewView{O: o, Charts: charts(o), Paused: true, PauseURL: q.url("/", url.Values{"refresh": {"off"}}),
		ResumeURL: q.url("/", nil), PruneReason: in.Reason, PruneProblem: p}
	for _, s := range statuses {
		if c, ok := o.Keys[s]; ok {
			v.Statuses = append(v.Statuses, statusRow{s, c})
		}
	}
	q.c.render(q.w, q.r, p.Status, "overview", page{Title: "Overview", Nav: "overview", Operator: q.operator,
		Flash: &flash{Kind: "error", Text: p.Message, Code: p.Code}, Body: v})
}

// Looking a key up.

type searchView struct {
	Actor, Operation, Key string
	// ActorPrefix: the actors whose name starts with it are listed
	// (Actors), a bounded walk a page.
	ActorPrefix string
	Actors      []string
	Items       []scopeItem
	Next        string // the position of the next page
	NextURL     string
	Problem     *problem // why the search found nothing, or cannot be made
}

func (q *request) searchPage() {
	v, err := q.search(q.r.URL.Query())
	if err != nil {
		q.fail(err)
		return
	}
	status := http.StatusOK
	switch {
	case v.Problem != nil:
		status = v.Problem.Status
	case v.Key != "":
		q.redirect(keyURL(idem.Scope{Actor: v.Actor, Operation: v.Operation}, v.Key, ""), nil)
		return
	}
	q.page(status, "search", "Look up a key", "search", v, nil)
}

// search reads the search form: with actor, operation and key, whether the
// record exists; with an actor (and an operation), a page of its keys.
// What cannot be searched, or is not found, is v.Problem.
func (q *request) search(vs url.Values) (searchView, error) {
	var v searchView
	var err error
	for _, f := range []struct {
		name string
		v    *string
	}{{"actor", &v.Actor}, {"operation", &v.Operation}, {"key", &v.Key}, {"actor_prefix", &v.ActorPrefix}} {
		// Names are exact (an actor " acme " is not "acme"): never trimmed.
		if *f.v, err = one(vs, f.name); err != nil {
			return v, err
		}
	}
	after, err := one(vs, "after")
	if err != nil {
		return v, err
	}
	switch {
	case v.ActorPrefix != "" && (v.Actor != "" || v.Operation != "" || v.Key != ""):
		v.Problem = badRequest("invalid_search", "Give an actor prefix alone, or the actor (and the operation, and the key).")
		return v, nil
	case v.ActorPrefix != "":
		if !validText(v.ActorPrefix) || len(v.ActorPrefix) > idem.MaxScopeLength || !validText(after) || len(after) > idem.MaxScopeLength {
			return v, badRequest("invalid_scope", "The actor prefix is not valid.")
		}
		actors, next, err := readActors(q.r.Context(), q.c.opts.DB, v.ActorPrefix, after)
		if err != nil {
			return v, err
		}
		v.Actors, v.Next = actors, next
		if next != "" {
			v.NextURL = q.url("/search", url.Values{"actor_prefix": {v.ActorPrefix}, "after": {next}})
		}
		return v, nil
	case v.Actor == "" && v.Operation == "" && v.Key == "":
		return v, nil
	case v.Key != "" && (v.Actor == "" || v.Operation == ""):
		v.Problem = badRequest("invalid_search", "Give the actor and the operation with the key: records are found by all three (looking for a key alone would read the whole table).")
		return v, nil
	case v.Actor == "":
		v.Problem = badRequest("invalid_search", "Give the actor too: keys are listed by actor first.")
		return v, nil
	case v.Key != "":
		_, err := q.c.lookup(q.r.Context(), idem.Scope{Actor: v.Actor, Operation: v.Operation}, v.Key)
		if err != nil {
			if p := problemOf(err); p.Status < 500 {
				v.Problem = p
				if p.Code == "no_record" {
					p.Message += " The audit trail says whether an operator forgot it."
				}
				return v, nil
			}
		}
		return v, err
	}
	scope := idem.Scope{Actor: v.Actor, Operation: v.Operation}
	if !validText(v.Actor) || !validText(v.Operation) || len(v.Actor) > idem.MaxScopeLength || len(v.Operation) > idem.MaxScopeLength {
		return v, badRequest("invalid_scope", "The actor or operation is not valid.")
	}
	items, next, err := readScope(q.r.Context(), q.c.opts.DB, scope, after, pageSize)
	if err != nil {
		return v, err
	}
	v.Items, v.Next = items, next
	if next != "" {
		nv := url.Values{"actor": {v.Actor}, "after": {next}}
		if v.Operation != "" {
			nv.Set("operation", v.Operation)
		}
		v.NextURL = q.url("/search", nv)
	}
	return v, nil
}

// The audit trail.

type auditView struct {
	Filter   audit.ListFilter
	From, To string // the time range as the query gave it
	Actions  []string
	Entries  []audit.Entry
	NextURL  string
	FirstURL string
	CSVURL   string // the export of every row the filter matches
	JSONURL  string
}

func (q *request) auditPage() {
	vs := q.r.URL.Query()
	f, before, err := auditQuery(vs, pageSize)
	if err != nil {
		q.fail(err)
		return
	}
	entries, next, err := readAudit(q.r.Context(), q.c.opts.DB, f, before)
	if err != nil {
		q.fail(err)
		return
	}
	v := auditView{Filter: f, Entries: entries,
		Actions: []string{audit.ActionResolve, audit.ActionForget, audit.ActionExpireLeases, audit.ActionPrune, audit.ActionRetryEvent}}
	base := auditValues(f)
	if next != "" {
		nv := auditValues(f)
		nv.Set("before", next)
		v.NextURL = q.url("/audit", nv)
	}
	if before != "" {
		v.FirstURL = q.url("/audit", base)
	}
	v.CSVURL, v.JSONURL = q.url("/audit.csv", base), q.url("/audit.json", base)
	v.From, v.To = vs.Get("from"), vs.Get("to")
	q.page(http.StatusOK, "audit", "Audit trail", "audit", v, q.done())
}

// auditQuery reads the trail's filter and page position: operator is a
// prefix of the operator's name; from and to bound the time (from
// included, to excluded), each an RFC 3339 time or a date and time in UTC
// such as 2026-12-05 or 2026-12-05T14:30.
func auditQuery(vs url.Values, limit int) (audit.ListFilter, string, error) {
	f := audit.ListFilter{Limit: limit}
	var err error
	for _, p := range []struct {
		name string
		v    *string
	}{{"operator", &f.OperatorPrefix}, {"action", &f.Action}, {"actor", &f.Scope.Actor}, {"operation", &f.Scope.Operation}, {"key", &f.Key}} {
		// Names are exact (an actor " acme " is not "acme"): never trimmed.
		if *p.v, err = one(vs, p.name); err != nil {
			return f, "", err
		}
	}
	f.Action = strings.TrimSpace(f.Action)
	switch f.Action {
	case "", audit.ActionResolve, audit.ActionForget, audit.ActionExpireLeases, audit.ActionPrune, audit.ActionRetryEvent:
	default:
		return f, "", badRequest("invalid_filter", "The action %q is not one of resolve, forget, expire_leases, prune, retry_event.", f.Action)
	}
	for _, p := range []struct {
		name string
		v    *time.Time
	}{{"from", &f.From}, {"to", &f.To}} {
		s, err := one(vs, p.name)
		if err != nil {
			return f, "", err
		}
		if *p.v, err = parseWhen(strings.TrimSpace(s)); err != nil {
			return f, "", badRequest("invalid_filter", "The time %q (%s) is not a time such as 2026-12-05, 2026-12-05T14:30 (UTC) or 2026-12-05T14:30:00Z.", s, p.name)
		}
	}
	if !f.From.IsZero() && !f.To.IsZero() && !f.From.Before(f.To) {
		return f, "", badRequest("invalid_filter", "The time range is empty: from must be before to.")
	}
	before, err := one(vs, "before")
	return f, before, err
}

// parseWhen reads a bound of the trail's time range; "" is none.
func parseWhen(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02T15:04", "2006-01-02"} {
		if t, err := time.Parse(layout, s); err == nil {
			if y := t.Year(); y < 1 || y > 9999 {
				break
			}
			return t, nil
		}
	}
	return time.Time{}, errors.New("not a time")
}

func auditValues(f audit.ListFilter) url.Values {
	vs := url.Values{}
	for _, kv := range [][2]string{{"operator", f.OperatorPrefix}, {"action", f.Action}, {"actor", f.Scope.Actor},
		{"operation", f.Scope.Operation}, {"key", f.Key}} {
		if kv[1] != "" {
			vs.Set(kv[0], kv[1])
		}
	}
	for _, kv := range []struct {
		name string
		t    time.Time
	}{{"from", f.From}, {"to", f.To}} {
		if !kv.t.IsZero() {
			vs.Set(kv.name, kv.t.UTC().Format(time.RFC3339Nano))
		}
	}
	return vs
}

// static answers the stylesheet and the icon.
func (q *request) static() {
	ct, b := "text/css; charset=utf-8", q.c.css
	if !strings.HasSuffix(q.r.URL.Path, ".css") {
		ct, b = "image/svg+xml", q.c.favicon
	}
	q.w.Header().Set("Content-Type", ct)
	q.w.Header().Set("Cache-Control", "no-cache")
	_, _ = q.w.Write(b)
}
