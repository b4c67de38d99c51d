// Package idemui is the operator's console for idem: one http.Handler,
// mounted under a prefix of the service's own server, with which people in
// support or finance settle the outcomes idem left in doubt. It shows the
// keys by status and the outcomes of the last 24 hours, lists the records
// that need a person (unknown outcomes, and reservations whose lease ran
// out) with their evidence, takes a verdict on one attempt (Resolve), forgets
// a finished key, expires the leases that ran out and prunes expired keys,
// and keeps an audit trail of every change: one row (operator, action,
// scope, key, token before and after, verdict, reason, time) in idem's
// idem_audit table, written in the same transaction as the change.
//
//	h, err := idemui.New(idemui.Options{
//		DB:     pool,
//		Prefix: "/idem",
//		Authorize: func(r *http.Request, a idemui.Action) (string, error) {
//			user, err := auth.User(r) // the service's own authentication
//			if err != nil || !user.Can(string(a)) {
//				return "", errors.New("not allowed")
//			}
//			return user.Name, nil
//		},
//	})
//	mux.Handle("/idem/", h)
//
// The pages are HTML rendered on the server (html/template) with their
// stylesheet embedded: no script, no request to another origin, nothing to
// build. The same data and actions are JSON under {prefix}/api/ (see the
// console guide, docs/console.md).
//
// Security: Authorize is called for every request, with the action it asks
// for (ActionView for every GET), before anything is read; its error is a
// 403 page that says nothing of the error. A page also asks it which
// actions to offer (IsOffer reports such a call), and hides the forms of
// the others. Forget and prune take a reason and, on the pages, a
// confirmation; a verdict or forget waits at most a few seconds for a
// record another transaction holds, then says it is busy (409). Messages
// after an action are kept on the server and shown once, never read from
// the address; records are linked with their names in the query, which no
// browser cleans as it does "." and ".." path segments. A request that changes something
// needs an operator name from Authorize, which goes into the audit trail.
// Cross-origin POSTs are refused (http.CrossOriginProtection); every
// response carries a Content-Security-Policy that allows only this origin's
// stylesheet and images (no script at all), X-Frame-Options DENY,
// Referrer-Policy no-referrer and Cache-Control no-store. Every stored
// value is escaped: a stored body is shown as text, never rendered. With
// ReadOnly, the forms are hidden and every request other than GET and HEAD
// is refused with 405, whatever its address (after the cross-origin check
// and Authorize).
//
// At scale: every page reads through an index of idem_keys or a bounded
// sample of its pages, never the whole table; counts that would need the
// whole table are estimated from that sample, and the page says so.
package idemui

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"regexp"
	"strings"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// Action is what a request asks to do; Authorize decides.
type Action string

// The actions. ActionView is every GET (pages, their JSON, the
// stylesheet); the others change records and write the audit trail, whose
// action column holds these names.
const (
	ActionView         Action = "view"
	ActionResolve      Action = "resolve"
	ActionForget       Action = "forget"
	ActionExpireLeases Action = "expire_leases"
	ActionPrune        Action = "prune"
	// ActionRetryEvent sends a failed event of the outbox again (the
	// deliveries page).
	ActionRetryEvent Action = "retry_event"
)

// Options configure the console.
type Options struct {
	// DB is where idem's table is: a *pgxpool.Pool, usually the service's
	// own. Required.
	DB idem.Beginner

	// Client supplies the configuration of the idem calls the console makes
	// (TTL, key limits, isolation level). nil means the defaults of the
	// package-level functions.
	Client *idem.Client

	// Prefix is the path under which the handler is mounted, without a
	// trailing slash ("/idem" for mux.Handle("/idem/", h)); empty for the
	// root. Segments of letters, digits and . _ ~ - only.
	Prefix string

	// Authorize decides every request: it is called with the request and
	// the action it asks for, and returns the operator's name (recorded in
	// the audit trail) or an error, which refuses the request with 403 and
	// is not shown. It is also asked, for a page being shown, which actions
	// the page may offer (IsOffer(r) is then true, and an error only hides
	// that action's form). Required. A request that changes something is refused
	// too when the name is empty, longer than 255 bytes or not valid text.
	Authorize func(r *http.Request, a Action) (operator string, err error)

	// ReadOnly hides every form and refuses every request other than GET
	// and HEAD with 405 Method Not Allowed.
	ReadOnly bool
}

// ErrInvalidOptions means New was given Options it cannot run with: no DB,
// no Authorize, or a Prefix that is not a clean path.
var ErrInvalidOptions = errors.New("idemui: invalid options")

//go:embed templates/*.html static/*
var files embed.FS

// prefixPattern is what Options.Prefix may be.
var prefixPattern = regexp.MustCompile(`^(/[A-Za-z0-9._~-]+)*$`)

// New returns the console's handler. It returns ErrInvalidOptions when
// opts.DB or opts.Authorize is nil or opts.Prefix is not a clean path.
func New(opts Options) (http.Handler, error) {
	switch {
	case opts.DB == nil:
		return nil, fmt.Errorf("%w: Options.DB is required", ErrInvalidOptions)
	case opts.Authorize == nil:
		return nil, fmt.Errorf("%w: Options.Authorize is required: the console changes records, and every request must be authorized", ErrInvalidOptions)
	case !prefixPattern.MatchString(opts.Prefix) || strings.Contains(opts.Prefix, "/./") || strings.HasSuffix(opts.Prefix, "/.") ||
		strings.Contains(opts.Prefix, "/../") || strings.HasSuffix(opts.Prefix, "/.."):
		return nil, fmt.Errorf("%w: Options.Prefix %q must be empty or a path such as /idem (no trailing slash, no dot segments)", ErrInvalidOptions, opts.Prefix)
	}
	pages, err := parseTemplates()
	if err != nil {
		return nil, err
	}
	css, err := fs.ReadFile(files, "static/console.css")
	if err != nil {
		return nil, err
	}
	favicon, err := fs.ReadFile(files, "static/favicon.svg")
	if err != nil {
		return nil, err
	}
	client := opts.Client
	if client == nil {
		if client, err = idem.New(idem.Config{}); err != nil {
			return nil, err
		}
	}
	return &console{opts: opts, client: client, pages: pages, css: css, favicon: favicon, cop: http.NewCrossOriginProtection()}, nil
}

// console is the handler New returns.
type console struct {
	opts   Options
	client *idem.Client // opts.Client, or one with the defaults
	pages  map[string]*template.Template
	css    []byte
	// favicon is the console's icon (SVG).
	favicon []byte
	cop     *http.CrossOriginProtection
	flashes flashes
}

// contentSecurityPolicy allows this origin's stylesheet and images, and
// nothing else: no script, no frame, no form to another origin.
const contentSecurityPolicy = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; " +
	"frame-ancestors 'none'; base-uri 'none'"

// SetSecurityHeaders sets on h the headers that every answer of the
// console carries (Content-Security-Policy, X-Frame-Options DENY,
// X-Content-Type-Options nosniff, Referrer-Policy no-referrer,
// Cache-Control no-store, Cross-Origin-Opener-Policy same-origin): for the
// answers that a wrapper of the handler makes itself, such as its own 401.
func SetSecurityHeaders(h http.Header) {
	h.Set("Content-Security-Policy", contentSecurityPolicy)
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
}

func (c *console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	SetSecurityHeaders(w.Header())

	path, ok := strings.CutPrefix(r.URL.EscapedPath(), c.opts.Prefix)
	if !ok || path == "" {
		path = "" // outside the prefix: no route
	}
	api := strings.HasPrefix(path, "/api/")
	if err := c.cop.Check(r); err != nil {
		c.fail(w, r, api, &problem{Status: http.StatusForbidden, Code: "cross_origin",
			Message: "This request came from another site, so it was refused. Nothing changed."})
		return
	}
	rt := match(path, r.URL.Query())
	safe := r.Method == http.MethodGet || r.Method == http.MethodHead
	action := ActionView
	if !safe && rt.action != "" {
		action = rt.action
	}
	operator, err := c.opts.Authorize(r, action)
	if err != nil {
		forbidden := &problem{Status: http.StatusForbidden, Code: "forbidden", Message: "You are not allowed to do this here. Nothing changed."}
		if !api && !safe && rt.problem == nil && (rt.action == ActionResolve || rt.action == ActionForget) && !c.opts.ReadOnly {
			// A refused verdict or forget from the record's page: the page
			// again, with what the operator typed, if they may see it.
			if viewer, err := c.opts.Authorize(r, ActionView); err == nil {
				r.Body = http.MaxBytesReader(w, r.Body, rt.maxBody)
				req := &request{r: r, w: w, c: c, operator: viewer, params: rt.params}
				req.refusedAction(rt.action, forbidden)
				return
			}
		}
		c.fail(w, r, api, forbidden)
		return
	}
	if c.opts.ReadOnly && !safe {
		// Whatever the address: a read-only console takes GET and HEAD only.
		w.Header().Set("Allow", "GET, HEAD")
		c.fail(w, r, api, &problem{Status: http.StatusMethodNotAllowed, Code: "read_only",
			Message: "This console is read-only: it changes nothing."})
		return
	}
	req := &request{r: r, w: w, c: c, operator: operator, api: api, params: rt.params}
	switch {
	case rt.problem != nil:
		c.fail(w, r, api, rt.problem)
		return
	case rt.get == nil && rt.post == nil:
		c.fail(w, r, api, &problem{Status: http.StatusNotFound, Code: "not_found", Message: "There is no such page."})
		return
	case safe && rt.get != nil:
		rt.get(req)
		return
	case safe:
		w.Header().Set("Allow", http.MethodPost)
		c.fail(w, r, api, &problem{Status: http.StatusMethodNotAllowed, Code: "method_not_allowed",
			Message: "This address only takes a POST."})
		return
	case r.Method != http.MethodPost || rt.post == nil:
		w.Header().Set("Allow", "GET, HEAD")
		c.fail(w, r, api, &problem{Status: http.StatusMethodNotAllowed, Code: "method_not_allowed",
			Message: "This address only takes a GET."})
		return
	}
	if err := checkOperator(operator); err != nil {
		c.fail(w, r, api, &problem{Status: http.StatusForbidden, Code: "forbidden",
			Message: "The service's authorization gave no usable operator name for this action, and the audit trail needs one. Nothing changed."})
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, rt.maxBody)
	rt.post(req)
}

// offerKey marks the context of a request passed to Authorize only to ask
// whether a page offers an action.
type offerKey struct{}

// IsOffer reports whether Authorize is called with r only to ask whether
// the page being shown offers the action (its form, button or link):
// nothing is done with it, and an error only hides that form. Every action
// that is then sent is authorized again, as itself.
func IsOffer(r *http.Request) bool {
	v, _ := r.Context().Value(offerKey{}).(bool)
	return v
}

// offers asks Authorize, for r, which of the actions that change records
// a page may offer: none on a read-only console.
func (c *console) offers(r *http.Request) map[string]bool {
	out := make(map[string]bool, 5)
	if c.opts.ReadOnly {
		return out
	}
	ask := r.WithContext(context.WithValue(r.Context(), offerKey{}, true))
	for _, a := range []Action{ActionResolve, ActionForget, ActionExpireLeases, ActionPrune, ActionRetryEvent} {
		op, err := c.opts.Authorize(ask, a)
		out[string(a)] = err == nil && checkOperator(op) == nil
	}
	return out
}

// checkOperator refuses an operator name the audit trail cannot hold.
func checkOperator(operator string) error {
	return audit.CheckOperator(operator)
}

// request is one request being served.
type request struct {
	r        *http.Request
	w        http.ResponseWriter
	c        *console
	operator string
	api      bool
	params   keyParams
}

// lookup reads the record of (scope, key).
func (c *console) lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error) {
	return c.client.Lookup(ctx, c.opts.DB, scope, key)
}
