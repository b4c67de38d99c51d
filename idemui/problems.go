package idemui

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// problem is an answer other than success: the HTTP status, a code that
// automation can rely on (the JSON API's "code"; the console guide lists
// them), and a message for people.
type problem struct {
	Status  int    `json:"-"`
	Code    string `json:"code"`
	Message string `json:"message"`
}

func (p *problem) Error() string { return p.Code + ": " + p.Message }

// badRequest is a 400: the request itself is wrong, and nothing changed.
func badRequest(code, format string, args ...any) *problem {
	return &problem{Status: http.StatusBadRequest, Code: code, Message: fmt.Sprintf(format, args...)}
}

// problemOf maps an error of idem or of the audit trail to a problem.
func problemOf(err error) *problem {
	var p *problem
	var tooBig *http.MaxBytesError
	var busy *audit.BusyError
	switch {
	case errors.As(err, &p):
		return p
	case errors.As(err, &tooBig):
		return badRequest("body_too_large", "The request is larger than %d bytes. Nothing changed.", tooBig.Limit)
	case errors.Is(err, idem.ErrInvalidKey):
		return badRequest("invalid_key", "The key is not valid: %s.", message(err))
	case errors.Is(err, idem.ErrInvalidScope):
		return badRequest("invalid_scope", "The actor or operation is not valid: %s.", message(err))
	case errors.Is(err, idem.ErrInvalidResponse), errors.Is(err, idem.ErrResponseTooLarge):
		return badRequest("invalid_response", "The response cannot be stored: %s. Nothing changed.", message(err))
	case errors.Is(err, idem.ErrInvalidArgument):
		return badRequest("invalid_argument", "%s. Nothing changed.", message(err))
	case errors.Is(err, idem.ErrEventNotFound):
		return &problem{Status: http.StatusNotFound, Code: "no_event", Message: "No such event in the outbox (it may have been pruned). Nothing changed."}
	case errors.Is(err, idem.ErrEventNotFailed):
		return &problem{Status: http.StatusConflict, Code: "not_failed", Message: "Only a failed event can be sent again; this one is not failed (any more). Nothing changed."}
	case errors.Is(err, idem.ErrNotFound):
		return &problem{Status: http.StatusNotFound, Code: "no_record",
			Message: "No record holds this key: it was never used, or it was pruned or forgotten."}
	case errors.Is(err, idem.ErrFenced):
		return &problem{Status: http.StatusConflict, Code: "fenced",
			Message: "Refused: the verdict was about an attempt that is no longer the record's (" + detail(err, idem.ErrFenced) +
				"). Someone else decided, or a new attempt holds the key. Nothing changed: look at the record again."}
	case errors.Is(err, idem.ErrNotResolvable):
		return &problem{Status: http.StatusConflict, Code: "not_resolvable",
			Message: "Refused: the outcome of this record is not in doubt (" + detail(err, idem.ErrNotResolvable) + "). Nothing changed."}
	case errors.As(err, &busy):
		return &problem{Status: http.StatusConflict, Code: "busy",
			Message: fmt.Sprintf("Refused: another transaction held the record %s · %s · %s for more than %s (a worker, or another operator). Nothing changed, on any record: try again in a moment, or leave that record out.",
				busy.Target.Scope.Actor, busy.Target.Scope.Operation, busy.Target.Key, audit.LockTimeout)}
	case errors.Is(err, audit.ErrBusy):
		return &problem{Status: http.StatusConflict, Code: "busy",
			Message: fmt.Sprintf("Refused: another transaction held this record for more than %s (a worker, or another operator). Nothing changed: try again in a moment.", audit.LockTimeout)}
	case errors.Is(err, audit.ErrChanged):
		return &problem{Status: http.StatusConflict, Code: "changed",
			Message: "Refused: the record changed since it was shown (" + detail(err, audit.ErrChanged) + "). Nothing changed: look at it again."}
	case errors.Is(err, idem.ErrOutcomeUnknown):
		return &problem{Status: http.StatusConflict, Code: "outcome_unknown",
			Message: "Refused: the outcome of this record is unknown; forgetting it could run its work twice. Record a verdict instead. Nothing changed."}
	case errors.Is(err, idem.ErrInProgress):
		return &problem{Status: http.StatusConflict, Code: "in_progress",
			Message: "Refused: the key is in flight right now. Nothing changed; try again once it has finished."}
	case idem.Unavailable(err):
		return &problem{Status: http.StatusServiceUnavailable, Code: "unavailable",
			Message: "The database cannot be reached right now. If this was a change, it did not happen; try again."}
	}
	return &problem{Status: http.StatusInternalServerError, Code: "internal",
		Message: "Something went wrong: " + message(err) + ". If this was a change, it did not happen."}
}

// message is err's text without the library's "idem: " prefixes.
func message(err error) string {
	s := err.Error()
	for strings.HasPrefix(s, "idem: ") {
		s = strings.TrimPrefix(s, "idem: ")
	}
	return s
}

// detail is what err says beyond the sentinel it wraps.
func detail(err, sentinel error) string {
	s := message(err)
	if rest, ok := strings.CutPrefix(s, message(sentinel)+": "); ok {
		return rest
	}
	return s
}

// fail answers with p: JSON for the API, an HTML page otherwise.
func (c *console) fail(w http.ResponseWriter, r *http.Request, api bool, p *problem) {
	if api {
		writeJSON(w, p.Status, map[string]*problem{"error": p})
		return
	}
	// An error page offers no action: Authorize is not asked.
	c.render(w, r, p.Status, "error", page{Title: http.StatusText(p.Status), Body: p, Offers: map[string]bool{}})
}

// writeJSON answers with v as JSON.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// validText reports whether s is text PostgreSQL can hold: valid UTF-8
// without NUL.
func validText(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return false
		}
	}
	return true
}
