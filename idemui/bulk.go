package idemui

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// A bulk verdict: one verdict, with one reason, on the records selected on
// the list of what needs a person, or on all that its filter matches
// (counted first, and acted on as of the count, as expire leases is).

// bulkView is the confirmation page of a bulk verdict.
type bulkView struct {
	Filter   filterInput
	All      bool // every record the filter matches, as of Cutoff
	Count    int64
	Capped   bool   // more match than audit.MaxBulk: the oldest MaxBulk are settled
	Cutoff   string // as the form sends it back
	Counted  time.Time
	Selected []bulkTarget
	Form     resolveInput
	Problem  *problem
	BackURL  string
	Max      int
}

// bulkTarget is a selected record, as the form carries it.
type bulkTarget struct {
	audit.Target
	Ref string // the form's value: the record and its token, encoded
}

// targetRef encodes a record and the token of its attempt for a form.
func targetRef(scope idem.Scope, key string, token int64) string {
	return encodeCursor([]any{scope.Actor, scope.Operation, key, token})
}

// decodeTarget reads a targetRef.
func decodeTarget(ref string) (bulkTarget, error) {
	var v []json.RawMessage
	bad := badRequest("invalid_form", "A selected record in the form is damaged: select the records again.")
	if decodeJSON64(ref, &v) != nil || len(v) != 4 {
		return bulkTarget{}, bad
	}
	var t audit.Target
	if json.Unmarshal(v[0], &t.Scope.Actor) != nil || json.Unmarshal(v[1], &t.Scope.Operation) != nil ||
		json.Unmarshal(v[2], &t.Key) != nil || json.Unmarshal(v[3], &t.Token) != nil || t.Token <= 0 ||
		idem.ValidateScope(t.Scope) != nil || !validText(t.Key) || t.Key == "" {
		return bulkTarget{}, bad
	}
	return bulkTarget{Target: t, Ref: ref}, nil
}

// uniqueRefs is refs without repeats, in their order: a record selected
// twice (about the same attempt) is settled once, not once and then left
// as "settled by someone else".
func uniqueRefs(refs []string) []string {
	seen := make(map[string]bool, len(refs))
	out := make([]string, 0, len(refs))
	for _, r := range refs {
		if !seen[r] {
			seen[r] = true
			out = append(out, r)
		}
	}
	return out
}

// bulkInput is a bulk verdict as the form sends it.
type bulkInput struct {
	filterInput
	All    bool
	Cutoff string
	Refs   []string
	Form   resolveInput
}

func bulkFrom(vs url.Values) (bulkInput, error) {
	var in bulkInput
	var err error
	if in.filterInput, err = filterFrom(vs); err != nil {
		return in, err
	}
	all, err := one(vs, "all")
	if err != nil {
		return in, err
	}
	in.All = all == "yes"
	if in.Cutoff, err = one(vs, "cutoff"); err != nil {
		return in, err
	}
	in.Refs = uniqueRefs(vs["r"])
	if len(in.Refs) > audit.MaxBulk {
		return in, badRequest("invalid_form", "Select at most %d records for one verdict.", audit.MaxBulk)
	}
	if in.All && len(in.Refs) > 0 {
		return in, badRequest("invalid_form", "Select records, or choose all that match the filter: not both.")
	}
	for _, f := range []struct {
		name string
		v    *string
	}{{"verdict", &in.Form.Verdict}, {"body", &in.Form.Body}, {"content_type", &in.Form.ContentType}, {"reason", &in.Form.Reason}} {
		if *f.v, err = one(vs, f.name); err != nil {
			return in, err
		}
	}
	status, err := one(vs, "status")
	in.Form.Status = json.Number(status)
	in.Form.Body = strings.ReplaceAll(in.Form.Body, "\r\n", "\n")
	return in, err
}

// bulkPage is the confirmation: what the verdict will settle, and its form.
func (q *request) bulkPage() {
	in, err := bulkFrom(q.r.URL.Query())
	if err != nil {
		q.fail(err)
		return
	}
	in.Form = resolveInput{Status: "200", ContentType: "application/json"}
	q.showBulk(http.StatusOK, in, nil)
}

// showBulk renders the confirmation page for in, with the problem of a
// refused verdict and the form as it was sent.
func (q *request) showBulk(status int, in bulkInput, p *problem) {
	v := bulkView{Filter: in.filterInput, All: in.All, Form: in.Form, Problem: p, Max: audit.MaxBulk,
		BackURL: q.url("/unknown", in.filterInput.query())}
	switch {
	case in.All:
		f, err := in.filter()
		if err != nil {
			q.fail(err)
			return
		}
		var cutoff time.Time
		err = audit.Read(q.r.Context(), q.c.opts.DB, func(ctx context.Context, db audit.Planned) error {
			v.Count, cutoff, err = audit.NeedsPersonCount(ctx, db, f, audit.MaxBulk+1)
			return err
		})
		if err != nil {
			q.fail(err)
			return
		}
		if v.Count > audit.MaxBulk {
			v.Count, v.Capped = audit.MaxBulk, true
		}
		v.Cutoff, v.Counted = cutoff.UTC().Format(time.RFC3339Nano), cutoff
	case len(in.Refs) > 0:
		for _, r := range in.Refs {
			t, err := decodeTarget(r)
			if err != nil {
				q.fail(err)
				return
			}
			v.Selected = append(v.Selected, t)
		}
		v.Count = int64(len(v.Selected))
	default:
		q.fail(badRequest("invalid_form", "Select records on the list, or choose all that match the filter."))
		return
	}
	q.page(status, "bulk", "One verdict on many records", "unknown", v, nil)
}

// bulkResolvePage records the verdict, and leads back to the list.
func (q *request) bulkResolvePage() {
	vs, err := postForm(q.r)
	if err != nil {
		q.fail(err)
		return
	}
	in, err := bulkFrom(vs)
	if err != nil {
		q.fail(err)
		return
	}
	refuse := func(err error) {
		p := problemOf(err)
		if p.Status >= 500 {
			q.fail(err)
			return
		}
		q.showBulk(p.Status, in, p)
	}
	form := in.Form
	form.Token = "1" // each record's own token is used
	res, err := form.resolution()
	if err != nil {
		refuse(err)
		return
	}
	targets, detail, err := q.bulkTargets(in)
	if err != nil {
		refuse(err)
		return
	}
	if len(targets) == 0 {
		q.redirectDone("/unknown", in.filterInput.query(), "Nothing to settle: the records counted were settled meanwhile. Nothing changed.")
		return
	}
	b, err := audit.ResolveMany(q.r.Context(), q.c.opts.DB, q.client(), q.operator, targets, res, detail)
	if err != nil {
		refuse(err)
		return
	}
	what := "it happened (succeeded)"
	if res.Retryable {
		what = "it did not happen (retryable)"
	}
	msg := fmt.Sprintf("%s settled with one verdict: %s.", plural(b.Entry.Changed, "record"), what)
	if n := len(b.Skipped); n > 0 {
		msg += fmt.Sprintf(" %s left as they were: someone else decided, or a new attempt holds the key.", plural(int64(n), "record"))
	}
	q.redirectDone("/unknown", in.filterInput.query(), msg)
}

// bulkTargets is what a bulk verdict acts on: the records selected, each
// about the attempt shown, or those the filter matched as of the cutoff of
// the count (at most audit.MaxBulk, oldest first), with the detail the
// audit row keeps of the choice.
func (q *request) bulkTargets(in bulkInput) ([]audit.Target, map[string]any, error) {
	if !in.All {
		if len(in.Refs) == 0 {
			return nil, nil, badRequest("invalid_form", "Select records on the list, or choose all that match the filter.")
		}
		var out []audit.Target
		for _, r := range in.Refs {
			t, err := decodeTarget(r)
			if err != nil {
				return nil, nil, err
			}
			out = append(out, t.Target)
		}
		return out, map[string]any{"selected": len(out)}, nil
	}
	f, err := in.filter()
	if err != nil {
		return nil, nil, err
	}
	cutoff, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(in.Cutoff))
	if err != nil || cutoff.Year() < 1 || cutoff.Year() > 9999 {
		return nil, nil, badRequest("invalid_cutoff", "The cutoff %q is not the time of a count: count the records again.", in.Cutoff)
	}
	var out []audit.Target
	err = audit.Read(q.r.Context(), q.c.opts.DB, func(ctx context.Context, db audit.Planned) error {
		out, err = audit.NeedsPersonAt(ctx, db, f, cutoff, audit.MaxBulk)
		return err
	})
	return out, map[string]any{"filter": f, "cutoff": cutoff.UTC()}, err
}

// bulkJSON is a bulk verdict as the API takes it: the records (each with
// the token of its attempt), or all that the filter matched as of the
// cutoff of a count (GET api/bulk-resolve), and the verdict.
type bulkJSON struct {
	filterInput
	All     bool   `json:"all"`
	Cutoff  string `json:"cutoff"`
	Records []struct {
		Actor     string `json:"actor"`
		Operation string `json:"operation"`
		Key       string `json:"key"`
		Token     int64  `json:"token"`
	} `json:"records"`
	Verdict     string      `json:"verdict"`
	Status      json.Number `json:"status"`
	Body        string      `json:"body"`
	ContentType string      `json:"content_type"`
	Reason      string      `json:"reason"`
}

func (q *request) bulkCountAPI() {
	in, err := filterFrom(q.r.URL.Query())
	if err != nil {
		q.fail(err)
		return
	}
	f, err := in.filter()
	if err != nil {
		q.fail(err)
		return
	}
	var n int64
	var cutoff time.Time
	err = audit.Read(q.r.Context(), q.c.opts.DB, func(ctx context.Context, db audit.Planned) error {
		n, cutoff, err = audit.NeedsPersonCount(ctx, db, f, audit.MaxBulk+1)
		return err
	})
	if err != nil {
		q.fail(err)
		return
	}
	q.ok(map[string]any{"records": min(n, audit.MaxBulk), "more": n > audit.MaxBulk, "cutoff": cutoff.UTC().Format(time.RFC3339Nano)})
}

func (q *request) bulkResolveAPI() {
	var in bulkJSON
	if err := decodeJSON(q.r, &in); err != nil {
		q.fail(err)
		return
	}
	if len(in.Records) > audit.MaxBulk {
		q.fail(badRequest("invalid_json", "Give at most %d records for one verdict.", audit.MaxBulk))
		return
	}
	if in.All && len(in.Records) > 0 {
		q.fail(badRequest("invalid_json", "Give records, or all: true with a filter and the cutoff of its count: not both."))
		return
	}
	b := bulkInput{filterInput: in.filterInput, All: in.All, Cutoff: in.Cutoff,
		Form: resolveInput{Token: "1", Verdict: in.Verdict, Status: in.Status, Body: in.Body, ContentType: in.ContentType, Reason: in.Reason}}
	for _, r := range in.Records {
		b.Refs = append(b.Refs, targetRef(idem.Scope{Actor: r.Actor, Operation: r.Operation}, r.Key, r.Token))
	}
	b.Refs = uniqueRefs(b.Refs)
	res, err := b.Form.resolution()
	if err != nil {
		q.fail(err)
		return
	}
	targets, detail, err := q.bulkTargets(b)
	if err != nil {
		q.fail(err)
		return
	}
	out := map[string]any{"resolved": 0, "skipped": []any{}}
	if len(targets) > 0 {
		bulk, err := audit.ResolveMany(q.r.Context(), q.c.opts.DB, q.client(), q.operator, targets, res, detail)
		if err != nil {
			q.fail(err)
			return
		}
		out["resolved"] = bulk.Entry.Changed
		skipped := make([]map[string]any, 0, len(bulk.Skipped))
		for _, s := range bulk.Skipped {
			skipped = append(skipped, map[string]any{"actor": s.Scope.Actor, "operation": s.Scope.Operation, "key": s.Key, "token": s.Token})
		}
		out["skipped"] = skipped
		if bulk.Entry.ID != 0 {
			out["audit"] = newEntryJSON(bulk.Entry)
		}
	}
	q.ok(out)
}
