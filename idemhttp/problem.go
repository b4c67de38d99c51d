package idemhttp

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// Problem codes: the "code" member of the application/problem+json (RFC
// 9457) responses the middleware and StatusHandler write themselves. None of
// these responses is stored. Only after CodeStoreUnavailable and CodeTimeout
// can the request have committed (its COMMIT's outcome unknown); every other
// one changed nothing.
const (
	// CodeKeyMissing (400): a covered request without an Idempotency-Key
	// header, when a key is required.
	CodeKeyMissing = "IDEMPOTENCY_KEY_MISSING"
	// CodeKeyInvalid (400): the header is malformed, appears more than once,
	// or holds a key of the wrong length or alphabet.
	CodeKeyInvalid = "IDEMPOTENCY_KEY_INVALID"
	// CodeKeyReused (422): the key was used before for a different request
	// (another body, path or query) in the same scope.
	CodeKeyReused = "IDEMPOTENCY_KEY_REUSED"
	// CodeInProgress (409, with Retry-After): a request with this key is
	// still running; retry later with the same key.
	CodeInProgress = "REQUEST_IN_PROGRESS"
	// CodeOutcomeUnknown (409): the key belongs to a reservation whose work
	// outside the database may or may not have happened (idem.Reserve,
	// idem.ErrOutcomeUnknown). It does not run again until an operator
	// reconciles it; a retry with the same key then replays or runs.
	CodeOutcomeUnknown = "IDEMPOTENCY_OUTCOME_UNKNOWN"
	// CodeResponseExpired (410): the request with this key DID run and
	// finished, but its stored response was dropped after
	// idem.Config.BodyTTL while the key is still remembered
	// (idem.ErrResponseGone): nothing ran again. Do not retry with a new
	// key (that would run the operation twice); read the result through
	// the API instead. The detail names the status the request finished
	// with.
	CodeResponseExpired = "IDEMPOTENCY_RESPONSE_EXPIRED"
	// CodeBodyTooLarge (413): the request body is over Options.MaxBodyBytes.
	CodeBodyTooLarge = "REQUEST_BODY_TOO_LARGE"
	// CodeBodyUnreadable (400): the request body could not be read.
	CodeBodyUnreadable = "REQUEST_BODY_UNREADABLE"
	// CodeBadRequest (400): Options.Fingerprint refused the request.
	CodeBadRequest = "BAD_REQUEST"
	// CodeUnauthenticated (401): Options.Actor returned an error or an
	// unusable actor.
	CodeUnauthenticated = "UNAUTHENTICATED"
	// CodeStoreUnavailable (503, with Retry-After): the database could not be
	// reached or failed while the request ran. The handler's writes, if it
	// ran, were not committed, or the commit's outcome is unknown; a retry
	// with the same key either replays or runs afresh.
	CodeStoreUnavailable = "STORE_UNAVAILABLE"
	// CodeTimeout (503, with Retry-After): the request did not finish within
	// Options.Timeout. Its transaction was rolled back, or the outcome of
	// its commit is unknown; a retry with the same key either replays or
	// runs afresh.
	CodeTimeout = "REQUEST_TIMEOUT"
	// CodeInternal (500): anything else, such as a handler panic, a response
	// too large to store, or a database error; nothing was stored.
	CodeInternal = "INTERNAL_ERROR"

	// Codes of StatusHandler only.

	// CodeKeyNotFound (404): the status URL names no request of the caller
	// that is running or stored (see StatusHandler); sending the request
	// again with the same key runs it.
	CodeKeyNotFound = "IDEMPOTENCY_KEY_NOT_FOUND"
	// CodeMethodNotAllowed (405, with Allow): the status URL answers GET
	// and HEAD only.
	CodeMethodNotAllowed = "METHOD_NOT_ALLOWED"
)

// ContentTypeProblem is the media type of the middleware's error responses.
const ContentTypeProblem = "application/problem+json"

// problem is an RFC 9457 problem details object with the "code" extension.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Code   string `json:"code"`
	Detail string `json:"detail,omitempty"`
	// StoredStatus is the status the request finished with, in a 410
	// IDEMPOTENCY_RESPONSE_EXPIRED (an extension member, RFC 9457).
	StoredStatus int `json:"stored_status,omitempty"`
}

// writeProblem writes a problem response. retryAfter, when positive, is sent
// as Retry-After in whole seconds (rounded up).
func writeProblem(w http.ResponseWriter, status int, code, detail string, retryAfter time.Duration) {
	writeProblemDoc(w, problem{Status: status, Code: code, Detail: detail}, retryAfter)
}

// writeProblemDoc writes p, its type and title filled in.
func writeProblemDoc(w http.ResponseWriter, p problem, retryAfter time.Duration) {
	status := p.Status
	p.Type, p.Title = "about:blank", http.StatusText(status)
	body, _ := json.Marshal(p)
	h := w.Header()
	h.Set("Content-Type", ContentTypeProblem)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("Cache-Control", "no-store")
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.FormatInt(ceilSeconds(retryAfter), 10))
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
