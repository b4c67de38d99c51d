package idemui

import (
	"net/http"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// The JSON API: the pages' data and actions for automation, under
// {prefix}/api/. Errors are {"error": {"code": ..., "message": ...}} with
// the status of the problem; docs/console.md lists the routes and codes.

// entryJSON is a row of the trail as the API shows it.
type entryJSON struct {
	ID           int64       `json:"id"`
	At           time.Time   `json:"at"`
	Operator     string      `json:"operator"`
	Action       string      `json:"action"`
	Actor        string      `json:"actor,omitempty"`
	Operation    string      `json:"operation,omitempty"`
	Key          string      `json:"key,omitempty"`
	TokenBefore  *int64      `json:"token_before,omitempty"`
	TokenAfter   *int64      `json:"token_after,omitempty"`
	StatusBefore idem.Status `json:"status_before,omitempty"`
	StatusAfter  idem.Status `json:"status_after,omitempty"`
	Verdict      string      `json:"verdict,omitempty"`
	Reason       string      `json:"reason,omitempty"`
	Changed      int64       `json:"changed"`
	Detail       any         `json:"detail,omitempty"`
}

func newEntryJSON(e audit.Entry) entryJSON {
	out := entryJSON{ID: e.ID, At: e.At, Operator: e.Operator, Action: e.Action, Actor: e.Scope.Actor,
		Operation: e.Scope.Operation, Key: e.Key, StatusBefore: e.StatusBefore, StatusAfter: e.StatusAfter,
		Verdict: e.Verdict, Reason: e.Reason, Changed: e.Changed}
	if e.HasBefore {
		t := e.TokenBefore
		out.TokenBefore = &t
	}
	if e.HasAfter {
		t := e.TokenAfter
		out.TokenAfter = &t
	}
	if e.Detail != nil {
		out.Detail = e.Detail
	}
	return out
}

func entriesJSON(es []audit.Entry) []entryJSON {
	out := make([]entryJSON, 0, len(es))
	for _, e := range es {
		out = append(out, newEntryJSON(e))
	}
	return out
}

func (q *request) ok(v any) { writeJSON(q.w, http.StatusOK, v) }

func (q *request) overviewAPI() {
	o, err := readOverview(q.r.Context(), q.c.opts.DB)
	if err != nil {
		q.fail(err)
		return
	}
	q.ok(o)
}

func (q *request) unknownAPI() {
	vs := q.r.URL.Query()
	lq, err := needsPersonQuery(vs)
	if err != nil {
		q.fail(err)
		return
	}
	limit, err := limitFrom(vs, pageSize)
	if err != nil {
		q.fail(err)
		return
	}
	p, err := readNeedsPerson(q.r.Context(), q.c.opts.DB, lq.f, lq.order, lq.after, lq.before, limit)
	if err != nil {
		q.fail(err)
		return
	}
	if p.Items == nil {
		p.Items = []needsPersonItem{}
	}
	q.ok(p)
}

func (q *request) expireCountAPI() {
	_, n, cutoff, err := q.expirable()
	if err != nil {
		q.fail(err)
		return
	}
	q.ok(map[string]any{"leases": n, "cutoff": cutoff.UTC().Format(time.RFC3339Nano)})
}

func (q *request) expireAPI() {
	var in expireInput
	if err := decodeJSON(q.r, &in); err != nil {
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
	out := map[string]any{"expired": e.Changed}
	if e.ID != 0 {
		out["audit"] = newEntryJSON(e)
	}
	q.ok(out)
}

func (q *request) pruneAPI() {
	var in pruneInput
	if err := decodeJSON(q.r, &in); err != nil {
		q.fail(err)
		return
	}
	opts, reason, err := in.options()
	if err != nil {
		q.fail(err)
		return
	}
	e, dropped, err := audit.Prune(q.r.Context(), q.c.opts.DB, q.client(), q.operator, opts, reason)
	if err != nil {
		q.fail(err)
		return
	}
	out := map[string]any{"pruned": e.Changed, "bodies_dropped": dropped}
	if e.ID != 0 {
		out["audit"] = newEntryJSON(e)
	}
	q.ok(out)
}

func (q *request) keyAPI() {
	ctx := q.r.Context()
	rec, err := q.c.lookup(ctx, q.params.scope, q.params.key)
	if err != nil {
		q.fail(err)
		return
	}
	entries, _, err := readAudit(ctx, q.c.opts.DB, audit.ListFilter{Scope: q.params.scope, Key: q.params.key, Limit: 20}, "")
	if err != nil {
		q.fail(err)
		return
	}
	q.ok(map[string]any{"record": newRecordJSON(rec, time.Now()), "audit": entriesJSON(entries)})
}

func (q *request) resolveAPI() {
	var in resolveInput
	if err := decodeJSON(q.r, &in); err != nil {
		q.fail(err)
		return
	}
	res, err := in.resolution()
	if err != nil {
		q.fail(err)
		return
	}
	// The record is read in the verdict's own transaction: once that
	// commits, the answer is the committed change, never an error.
	e, rec, err := audit.Resolve(q.r.Context(), q.c.opts.DB, q.client(), q.operator, q.params.scope, q.params.key, res)
	if err != nil {
		q.fail(err)
		return
	}
	q.ok(map[string]any{"record": newRecordJSON(rec, time.Now()), "audit": newEntryJSON(e)})
}

func (q *request) forgetAPI() {
	var in forgetInput
	if err := decodeJSON(q.r, &in); err != nil {
		q.fail(err)
		return
	}
	want, err := in.attempt()
	if err != nil {
		q.fail(err)
		return
	}
	reason, err := in.reason()
	if err != nil {
		q.fail(err)
		return
	}
	e, err := audit.Forget(q.r.Context(), q.c.opts.DB, q.client(), q.operator, q.params.scope, q.params.key, &want, reason)
	if err != nil {
		q.fail(err)
		return
	}
	q.ok(map[string]any{"forgotten": true, "audit": newEntryJSON(e)})
}

func (q *request) searchAPI() {
	v, err := q.search(q.r.URL.Query())
	if err != nil {
		q.fail(err)
		return
	}
	switch {
	case v.Problem != nil:
		q.fail(v.Problem)
	case v.ActorPrefix != "":
		actors := v.Actors
		if actors == nil {
			actors = []string{}
		}
		out := map[string]any{"actors": actors}
		if v.Next != "" {
			out["next"] = v.Next
		}
		q.ok(out)
	case v.Actor == "":
		q.fail(badRequest("invalid_search", "Give an actor (and an operation, and a key)."))
	case v.Key != "":
		q.keyAPIFor(idem.Scope{Actor: v.Actor, Operation: v.Operation}, v.Key)
	default:
		items := v.Items
		if items == nil {
			items = []scopeItem{}
		}
		out := map[string]any{"keys": items}
		if v.Next != "" {
			out["next"] = v.Next
		}
		q.ok(out)
	}
}

// keyAPIFor answers with the record of (scope, key), as keyAPI does.
func (q *request) keyAPIFor(scope idem.Scope, key string) {
	q.params = keyParams{scope: scope, key: key}
	q.keyAPI()
}

func (q *request) auditAPI() {
	vs := q.r.URL.Query()
	limit, err := limitFrom(vs, pageSize)
	if err != nil {
		q.fail(err)
		return
	}
	f, before, err := auditQuery(vs, limit)
	if err != nil {
		q.fail(err)
		return
	}
	entries, next, err := readAudit(q.r.Context(), q.c.opts.DB, f, before)
	if err != nil {
		q.fail(err)
		return
	}
	out := map[string]any{"entries": entriesJSON(entries)}
	if next != "" {
		out["next"] = next
	}
	q.ok(out)
}
