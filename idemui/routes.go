package idemui

import (
	"net/url"
	"strings"

	"github.com/pgidem/idem"
)

// Request body limits: a verdict carries the response to store (idem's
// default limit is 1 MiB, which form encoding may triple); the other forms
// are small.
const (
	maxVerdictBody = 4 << 20
	maxFormBody    = 64 << 10
)

// route is what a path leads to: the handler of each method, the action
// a POST asks for, and the parameters or the problem of the path.
type route struct {
	get, post func(*request)
	action    Action
	maxBody   int64
	params    keyParams
	problem   *problem
}

// keyParams are the scope and key of a /keys/ path.
type keyParams struct {
	scope idem.Scope
	key   string
}

// match finds the route of path, the escaped path after the prefix, with
// the query vs.
func match(path string, vs url.Values) route {
	api := strings.HasPrefix(path, "/api/")
	rest := path
	if api {
		rest = strings.TrimPrefix(path, "/api")
	}
	if tail, ok := strings.CutPrefix(rest, "/keys/"); ok {
		return matchKey(tail, api)
	}
	if tail, ok := strings.CutPrefix(rest, "/key"); ok && (tail == "" || tail == "/resolve" || tail == "/forget") {
		return matchKeyQuery(tail, vs, api)
	}
	type pair struct{ get, post func(*request) }
	var p pair
	var action Action
	maxBody := int64(maxFormBody)
	switch rest {
	case "/":
		if api {
			return route{}
		}
		p = pair{get: (*request).overviewPage}
	case "/overview":
		if !api {
			return route{}
		}
		p = pair{get: (*request).overviewAPI}
	case "/unknown":
		p = pair{get: pick(api, (*request).unknownPage, (*request).unknownAPI)}
	case "/expire-leases":
		p = pair{get: pick(api, (*request).expireConfirmPage, (*request).expireCountAPI),
			post: pick(api, (*request).expirePage, (*request).expireAPI)}
		action = ActionExpireLeases
	case "/bulk-resolve":
		p = pair{get: pick(api, (*request).bulkPage, (*request).bulkCountAPI), post: pick(api, (*request).bulkResolvePage, (*request).bulkResolveAPI)}
		action = ActionResolve
		maxBody = maxVerdictBody
	case "/prune":
		p = pair{post: pick(api, (*request).prunePage, (*request).pruneAPI)}
		action = ActionPrune
	case "/deliveries":
		p = pair{get: pick(api, (*request).deliveriesPage, nil)}
	case "/event":
		p = pair{get: pick(api, (*request).eventPage, nil), post: pick(api, (*request).retryEventPage, nil)}
		action = ActionRetryEvent
	case "/search":
		p = pair{get: pick(api, (*request).searchPage, (*request).searchAPI)}
	case "/status":
		p = pair{get: pick(api, (*request).statusPage, (*request).statusAPI)}
	case "/audit":
		p = pair{get: pick(api, (*request).auditPage, (*request).auditAPI)}
	case "/audit.csv", "/audit.json":
		if api {
			return route{}
		}
		p = pair{get: (*request).auditExport}
	case "/static/console.css", "/favicon.ico", "/static/favicon.svg":
		if api {
			return route{}
		}
		p = pair{get: (*request).static}
	default:
		return route{}
	}
	return route{get: p.get, post: p.post, action: action, maxBody: maxBody}
}

// pick is page or api.
func pick(api bool, page, json func(*request)) func(*request) {
	if api {
		return json
	}
	return page
}

// matchKey finds the route of a /keys/ path: tail is
// {actor}/{operation}/{key}, each path-escaped, and for a POST
// /resolve or /forget after them.
func matchKey(tail string, api bool) route {
	segs := strings.Split(tail, "/")
	rt := route{get: pick(api, (*request).keyPage, (*request).keyAPI)}
	if len(segs) == 4 {
		switch segs[3] {
		case "resolve":
			rt = route{post: pick(api, (*request).resolvePage, (*request).resolveAPI), action: ActionResolve, maxBody: maxVerdictBody}
		case "forget":
			rt = route{post: pick(api, (*request).forgetPage, (*request).forgetAPI), action: ActionForget, maxBody: maxFormBody}
		}
	}
	if len(segs) != 3 && (len(segs) != 4 || rt.action == "") {
		rt.problem = badRequest("invalid_path",
			"A record's address is keys/{actor}/{operation}/{key}, each part path-escaped (a / inside one is %%2F); this one has %d parts.", len(segs))
		return rt
	}
	var parts [3]string
	for i := range parts {
		v, err := url.PathUnescape(segs[i])
		if err != nil || v == "" {
			rt.problem = badRequest("invalid_path", "Part %d of the record's address is empty or not path-escaped correctly.", i+1)
			return rt
		}
		parts[i] = v
	}
	rt.params = keyParams{scope: idem.Scope{Actor: parts[0], Operation: parts[1]}, key: parts[2]}
	if err := idem.ValidateScope(rt.params.scope); err != nil {
		rt.problem = badRequest("invalid_scope", "The actor or operation in the address is not valid: %v.", err)
	}
	return rt
}

// matchKeyQuery finds the route of a record named in the query (actor,
// operation, key): /key, and /key/resolve or /key/forget for a POST. Its
// addresses hold no part of the key in the path, so that no browser or
// proxy takes a key such as "..", "." or "a/b" for a path to clean.
func matchKeyQuery(tail string, vs url.Values, api bool) route {
	rt := route{get: pick(api, (*request).keyPage, (*request).keyAPI)}
	switch tail {
	case "/resolve":
		rt = route{post: pick(api, (*request).resolvePage, (*request).resolveAPI), action: ActionResolve, maxBody: maxVerdictBody}
	case "/forget":
		rt = route{post: pick(api, (*request).forgetPage, (*request).forgetAPI), action: ActionForget, maxBody: maxFormBody}
	}
	var parts [3]string
	for i, name := range []string{"actor", "operation", "key"} {
		v, err := one(vs, name)
		if err == nil && v == "" {
			err = badRequest("invalid_path", "The record's address names no %s: it is key?actor=...&operation=...&key=....", name)
		}
		if err != nil {
			rt.problem = problemOf(err)
			return rt
		}
		parts[i] = v
	}
	rt.params = keyParams{scope: idem.Scope{Actor: parts[0], Operation: parts[1]}, key: parts[2]}
	if err := idem.ValidateScope(rt.params.scope); err != nil {
		rt.problem = badRequest("invalid_scope", "The actor or operation in the address is not valid: %v.", err)
	}
	return rt
}

// keyURL is the address of the page of the record of (scope, key) after
// the prefix, or of its action ("resolve", "forget") with action: the
// names in the query, where browsers never clean dot segments.
func keyURL(scope idem.Scope, key, action string) string {
	path := "/key"
	if action != "" {
		path += "/" + action
	}
	return path + "?" + url.Values{"actor": {scope.Actor}, "operation": {scope.Operation}, "key": {key}}.Encode()
}
