package idemui

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// Every input is checked before anything is read or changed: a value that
// is wrong is a 400 with a code, and nothing changes.

// one returns the single value of name in vs ("" when absent); a name given
// twice is a problem.
func one(vs url.Values, name string) (string, error) {
	switch v := vs[name]; len(v) {
	case 0:
		return "", nil
	case 1:
		if !validText(v[0]) {
			return "", badRequest("invalid_form", "The field %s is not valid text.", name)
		}
		return v[0], nil
	}
	return "", badRequest("invalid_form", "The field %s is given more than once.", name)
}

// filterInput is the filter of the records that need a person, as the
// query string or a JSON body gives it.
type filterInput struct {
	Actor     string `json:"actor"`
	Operation string `json:"operation"`
	OlderThan string `json:"older_than"` // a Go duration: 30m, 1h, 24h; empty for any age
	Error     string `json:"error"`
	State     string `json:"state"` // "unknown", "lapsed", or empty for both
}

// filterFrom reads a filterInput from vs.
func filterFrom(vs url.Values) (filterInput, error) {
	var in filterInput
	var err error
	for _, f := range []struct {
		name string
		v    *string
	}{{"actor", &in.Actor}, {"operation", &in.Operation}, {"older_than", &in.OlderThan}, {"error", &in.Error}, {"state", &in.State}} {
		if *f.v, err = one(vs, f.name); err != nil {
			return in, err
		}
	}
	return in, nil
}

// filter checks in and returns the audit.Filter it means.
func (in filterInput) filter() (audit.Filter, error) {
	// Names are exact (an actor " acme " is not "acme"): never trimmed.
	f := audit.Filter{Actor: in.Actor, Operation: in.Operation, ErrorText: strings.TrimSpace(in.Error),
		State: strings.TrimSpace(in.State)}
	if s := strings.TrimSpace(in.OlderThan); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d < 0 {
			return f, badRequest("invalid_filter", "The age %q is not a duration such as 30m, 1h or 24h.", s)
		}
		f.MinAge = d
	}
	if err := f.Check(); err != nil {
		return f, badRequest("invalid_filter", "%s.", message(err))
	}
	return f, nil
}

// query is in as a query string.
func (in filterInput) query() url.Values {
	vs := url.Values{}
	for _, kv := range [][2]string{{"actor", in.Actor}, {"operation", in.Operation}, {"older_than", in.OlderThan}, {"error", in.Error}, {"state", in.State}} {
		if kv[1] != "" {
			vs.Set(kv[0], kv[1])
		}
	}
	return vs
}

// encodeCursor and decodeCursor carry a page's position in a query string:
// base64url of JSON.
func encodeCursor(v any) string {
	b, _ := json.Marshal(v)
	return base64.RawURLEncoding.EncodeToString(b)
}

// A cursor is a page's position; check refuses one the console never
// writes (no time, no record's names: {} or null, say), which would
// otherwise be read as a position before everything or after nothing.
type cursor interface{ check() error }

// decodeCursor reads a position encodeCursor wrote into cur, and checks
// it.
func decodeCursor(s string, cur cursor) error {
	if err := decodeJSON64(s, cur); err != nil || cur.check() != nil {
		return errDamagedCursor()
	}
	return nil
}

// decodeJSON64 reads base64url of JSON into v.
func decodeJSON64(s string, v any) error {
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

func errDamagedCursor() *problem {
	return badRequest("invalid_cursor", "The page position in the address is damaged: start again from the first page.")
}

// cursorName reports whether s can be a name (actor, operation or key)
// in a position: one a record has.
func cursorName(s string) bool { return s != "" && len(s) <= 4096 && validText(s) }

// cursorTime reports whether t can be the time in a position: one
// PostgreSQL stored.
func cursorTime(t time.Time) bool { y := t.Year(); return !t.IsZero() && y >= 1 && y <= 9999 }

// needsPersonCursor is the position after a record of the list.
type needsPersonCursor struct {
	CreatedAt time.Time `json:"t"`
	Actor     string    `json:"a"`
	Operation string    `json:"o"`
	Key       string    `json:"k"`
	N         int64     `json:"n,omitempty"` // the record's place in the list, from 1; 0: not known
}

func (cur *needsPersonCursor) check() error {
	if !cursorTime(cur.CreatedAt) || !cursorName(cur.Actor) || !cursorName(cur.Operation) || !cursorName(cur.Key) || cur.N < 0 {
		return errDamagedCursor()
	}
	return nil
}

// limitFrom reads a page size from vs: def when absent, at most 500.
func limitFrom(vs url.Values, def int) (int, error) {
	s, err := one(vs, "limit")
	if err != nil || s == "" {
		return def, err
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 || n > 500 {
		return 0, badRequest("invalid_limit", "The limit %q is not a number from 1 to 500.", s)
	}
	return n, nil
}

// resolveInput is a verdict as the form or the JSON body gives it.
type resolveInput struct {
	Token       json.Number `json:"token"`
	Verdict     string      `json:"verdict"`
	Status      json.Number `json:"status"`
	Body        string      `json:"body"`
	ContentType string      `json:"content_type"`
	Reason      string      `json:"reason"`
	// shaped: Status and ContentType are how other records of the
	// operation were answered (the form's default).
	shaped bool
}

// Shaped reports whether the form's status and content type are how other
// records of the operation were answered.
func (in resolveInput) Shaped() bool { return in.shaped }

// resolveFromForm reads a resolveInput from a posted form. Browsers send a
// textarea's line breaks as CRLF: the body's are turned into LF, as the
// operator typed or pasted them.
func resolveFromForm(r *http.Request) (resolveInput, error) {
	var in resolveInput
	vs, err := postForm(r)
	if err != nil {
		return in, err
	}
	var token, status string
	for _, f := range []struct {
		name string
		v    *string
	}{{"token", &token}, {"verdict", &in.Verdict}, {"status", &status}, {"body", &in.Body},
		{"content_type", &in.ContentType}, {"reason", &in.Reason}} {
		if *f.v, err = one(vs, f.name); err != nil {
			return in, err
		}
	}
	in.Token, in.Status = json.Number(token), json.Number(status)
	in.Body = strings.ReplaceAll(in.Body, "\r\n", "\n")
	return in, nil
}

// resolution checks in and returns the idem.Resolution it means.
func (in resolveInput) resolution() (idem.Resolution, error) {
	var res idem.Resolution
	token, err := strconv.ParseInt(strings.TrimSpace(string(in.Token)), 10, 64)
	if err != nil || token <= 0 {
		return res, badRequest("invalid_token", "The token %q is not the positive number of an attempt (the record page shows it).", string(in.Token))
	}
	res.Token = token
	if res.Reason, err = reasonOf(in.Reason, "Say why (what you checked, and where): the reason is stored with the record and in the audit trail."); err != nil {
		return res, err
	}
	switch in.Verdict {
	case audit.VerdictRetryable:
		res.Retryable = true
		return res, nil
	case audit.VerdictSucceeded:
	default:
		return res, badRequest("invalid_verdict", "The verdict %q is neither %q nor %q.", in.Verdict, audit.VerdictSucceeded, audit.VerdictRetryable)
	}
	resp := &idem.Response{Status: http.StatusOK, Body: []byte(in.Body)}
	if s := strings.TrimSpace(string(in.Status)); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 200 || n > 599 {
			return res, badRequest("invalid_status", "The response status %q is not a status a client can be answered again: a number from 200 to 599.", s)
		}
		resp.Status = n
	}
	if (resp.Status == http.StatusNoContent || resp.Status == http.StatusNotModified) && in.Body != "" {
		return res, badRequest("invalid_status", "A %d answer has no body, and this one has %d bytes: clear the body, or give the status the service answered with it.", resp.Status, len(in.Body))
	}
	if ct := strings.TrimSpace(in.ContentType); ct != "" && in.Body != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || !validText(ct) || strings.ContainsAny(ct, "\r\n") {
			return res, badRequest("invalid_response", "The content type %q is not a media type such as application/json.", ct)
		}
		if (mt == "application/json" || strings.HasSuffix(mt, "+json")) && !json.Valid(resp.Body) {
			return res, badRequest("invalid_body", "The body is not valid JSON, and the content type says %s: fix the body or the content type.", mt)
		}
		resp.Header = map[string][]string{"Content-Type": {ct}}
	}
	res.Succeeded = resp
	return res, nil
}

// reasonOf checks an operator's reason: required (missing says ask),
// valid text, at most idem.MaxReasonLength bytes.
func reasonOf(s, ask string) (string, error) {
	reason := strings.TrimSpace(s)
	switch {
	case reason == "":
		return "", badRequest("invalid_reason", "%s", ask)
	case len(reason) > idem.MaxReasonLength:
		return "", badRequest("invalid_reason", "The reason is longer than %d bytes.", idem.MaxReasonLength)
	case !validText(reason):
		return "", badRequest("invalid_reason", "The reason is not valid text.")
	}
	return reason, nil
}

// confirmed refuses a page's form for a destructive action that was not
// confirmed (the box ticked): the API's callers confirm by calling.
func confirmed(vs url.Values, what string) error {
	if v, err := one(vs, "confirm"); err != nil || v != "yes" {
		return badRequest("not_confirmed", "Tick the box to confirm that you mean to %s. Nothing changed.", what)
	}
	return nil
}

// forgetInput names the attempt a forget is about, and why.
type forgetInput struct {
	Token     json.Number `json:"token"`
	CreatedAt string      `json:"created_at"`
	Reason    string      `json:"reason"`
}

// forgetFromForm reads a forgetInput from the posted form, which must be
// confirmed.
func forgetFromForm(r *http.Request) (forgetInput, error) {
	var in forgetInput
	vs, err := postForm(r)
	if err != nil {
		return in, err
	}
	token, err := one(vs, "token")
	if err != nil {
		return in, err
	}
	in.Token = json.Number(token)
	if in.CreatedAt, err = one(vs, "created_at"); err != nil {
		return in, err
	}
	if in.Reason, err = one(vs, "reason"); err != nil {
		return in, err
	}
	return in, confirmed(vs, "forget this key")
}

// forgetReason checks the reason of a forget.
func (in forgetInput) reason() (string, error) {
	return reasonOf(in.Reason, "Say why this key is forgotten (who asked, and what the client reused it for): the reason is kept in the audit trail with a copy of the record.")
}

// attempt checks in and returns the attempt it names.
func (in forgetInput) attempt() (audit.Attempt, error) {
	token, err := strconv.ParseInt(strings.TrimSpace(string(in.Token)), 10, 64)
	if err != nil || token < 0 {
		return audit.Attempt{}, badRequest("invalid_token", "The token %q is not the number of the attempt to forget (the record page shows it; 0 for a record Do wrote).", string(in.Token))
	}
	at, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(in.CreatedAt))
	if err != nil {
		return audit.Attempt{}, badRequest("invalid_attempt", "The attempt's start %q is not a time such as 2026-12-02T10:04:05.123456Z (the record page sends it).", in.CreatedAt)
	}
	return audit.Attempt{Token: token, CreatedAt: at}, nil
}

// expireInput is a confirmed "expire leases": the filter and the cutoff of
// the count that was shown.
type expireInput struct {
	filterInput
	Cutoff string `json:"cutoff"`
}

func expireFromForm(r *http.Request) (expireInput, error) {
	var in expireInput
	vs, err := postForm(r)
	if err != nil {
		return in, err
	}
	if in.filterInput, err = filterFrom(vs); err != nil {
		return in, err
	}
	in.Cutoff, err = one(vs, "cutoff")
	return in, err
}

// check returns the filter and the cutoff.
func (in expireInput) check() (audit.Filter, time.Time, error) {
	f, err := in.filter()
	if err != nil {
		return f, time.Time{}, err
	}
	cutoff, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(in.Cutoff))
	if err != nil || cutoff.Year() < 1 || cutoff.Year() > 9999 {
		return f, time.Time{}, badRequest("invalid_cutoff",
			"The cutoff %q is not the time of a count (ask for the count first: GET expire-leases).", in.Cutoff)
	}
	return f, cutoff, nil
}

// pruneInput bounds an audited prune, and says why.
type pruneInput struct {
	BatchSize  json.Number `json:"batch_size"`
	MaxBatches json.Number `json:"max_batches"`
	Reason     string      `json:"reason"`
}

// pruneFromForm reads a pruneInput from the posted form, which must be
// confirmed.
func pruneFromForm(r *http.Request) (pruneInput, error) {
	var in pruneInput
	vs, err := postForm(r)
	if err != nil {
		return in, err
	}
	bs, err := one(vs, "batch_size")
	if err != nil {
		return in, err
	}
	mb, err := one(vs, "max_batches")
	if err != nil {
		return in, err
	}
	in.BatchSize, in.MaxBatches = json.Number(bs), json.Number(mb)
	if in.Reason, err = one(vs, "reason"); err != nil {
		return in, err
	}
	return in, confirmed(vs, "delete the expired keys")
}

// Defaults and bounds of an audited prune from the console.
const (
	pruneBatchSize  = 1000
	pruneMaxBatches = 10
)

// options checks in and returns the options and the reason of the prune.
func (in pruneInput) options() (idem.PruneOptions, string, error) {
	opts := idem.PruneOptions{BatchSize: pruneBatchSize, MaxBatches: pruneMaxBatches}
	for _, f := range []struct {
		name string
		v    json.Number
		max  int
		out  *int
	}{{"batch_size", in.BatchSize, 10000, &opts.BatchSize}, {"max_batches", in.MaxBatches, 100, &opts.MaxBatches}} {
		if f.v == "" {
			continue
		}
		n, err := strconv.Atoi(string(f.v))
		if err != nil || n <= 0 || n > f.max {
			return opts, "", badRequest("invalid_prune", "%s %q is not a number from 1 to %d.", f.name, string(f.v), f.max)
		}
		*f.out = n
	}
	reason, err := reasonOf(in.Reason, "Say why the expired keys are deleted now: the reason is kept in the audit trail.")
	return opts, reason, err
}

// postForm parses the body of a form POST. Only
// application/x-www-form-urlencoded is taken.
func postForm(r *http.Request) (url.Values, error) {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "application/x-www-form-urlencoded" {
		return nil, badRequest("invalid_form", "Send the form as application/x-www-form-urlencoded.")
	}
	if err := r.ParseForm(); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, problemOf(tooBig)
		}
		return nil, badRequest("invalid_form", "The form cannot be read: %v.", err)
	}
	return r.PostForm, nil
}

// decodeJSON reads the JSON body of an API POST into v: one object, no
// unknown fields.
func decodeJSON(r *http.Request, v any) error {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "application/json" {
		return badRequest("invalid_json", "Send the body as application/json.")
	}
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return problemOf(tooBig)
		}
		return badRequest("invalid_json", "The body is not the JSON object this route takes: %v.", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return badRequest("invalid_json", "The body holds more than one JSON value.")
	}
	return nil
}
