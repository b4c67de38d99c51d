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

// match finds the route of path, the escaped path after the prefix.
func match(path string) route {
	api := strings.HasPrefix(path, "/api/")
	rest := path
	if api {
		rest = strings.TrimPrefix(path, "/api")
	}
	if tail, ok := strings.CutPrefix(rest, "/keys/"); ok {
		return matchKey(tail, api)
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
	case "/prune":
		p = pair{post: pick(api, (*request).prunePage, (*request).pruneAPI)}
		action = ActionPrune
	case "/search":
		p = pair{get: pick(api, (*request).searchPage, (*request).searchAPI)}
	case "/audit":
		p = pair{get: pick(api, (*request).auditPage, (*request).auditAPI)}
	case "/static/console.css":
		if api {
			return route{}
		}
		p = pair{get: (*request).stylesheet}
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

// escapeSegment path-escapes one part of an address: a / becomes %2F, and
// a part that is "." or ".." is escaped whole, so that no path cleaning
// takes it for a dot segment.
func escapeSegment(s string) string {
	switch s {
	case ".":
		return "%2E"
	case "..":
		return "%2E%2E"
	}
	return url.PathEscape(s)
}

// keyPath is the address of the record of (scope, key) after the prefix.
func keyPath(scope idem.Scope, key string) string {
	return "/keys/" + escapeSegment(scope.Actor) + "/" + escapeSegment(scope.Operation) + "/" + escapeSegment(key)
}
