package idemhttp

import (
	"errors"
	"net/http"

	"github.com/pgidem/idem/internal/keyhdr"
)

// HeaderKey is the request header that carries the idempotency key.
const HeaderKey = "Idempotency-Key"

// HeaderReplayed is the response header set to "true" on a replayed response.
const HeaderReplayed = "Idempotent-Replayed"

// HeaderKeyLifetime is idem's own response header (not the IETF draft's)
// telling the client how long the server remembers its key: the key's TTL
// (Config.TTLFor, else Config.TTL) in whole seconds, counted from the first
// request that carried the key. The middleware sets it on every stored
// response, fresh or replayed; within that time a retry with the same key
// gets the stored response (or, past Config.BodyTTL, a 410 saying its body
// is gone: the operation does not run again), after it the key is a new
// request.
const HeaderKeyLifetime = "Idem-Key-Lifetime"

// Errors of the Idempotency-Key header, returned by ParseKey. The
// middleware answers them with a 400 problem.
var (
	// ErrMissingKey means a covered request has no Idempotency-Key header
	// and Options.KeyOptional is false.
	ErrMissingKey = errors.New("idemhttp: missing Idempotency-Key header")
	// ErrMultipleKeys means the request has more than one Idempotency-Key
	// header, or a bare value that holds a comma (two values joined into one
	// line by a proxy).
	ErrMultipleKeys = errors.New("idemhttp: more than one Idempotency-Key")
	// ErrMalformedKey means the header value is neither a bare key nor a
	// valid structured-field string (RFC 8941).
	ErrMalformedKey = errors.New("idemhttp: malformed Idempotency-Key header")
)

// ParseKey returns the idempotency key of a request's Idempotency-Key
// header, read as the middleware reads it: for a handler that calls idem
// itself (idem.DoInTx, idem.Reserve) rather than through Middleware. The
// error wraps ErrMissingKey when there is no such header, ErrMultipleKeys
// for more than one (or a bare value holding a comma), and ErrMalformedKey
// for a value it cannot read; answer them with 400.
//
// Both forms are accepted: a structured-field string (RFC 8941), as the
// IETF draft specifies, "8e03978e-40d5", with any parameters ignored; and a
// bare key, as real clients send, 8e03978e-40d5. ParseKey only extracts the
// key: check its length and alphabet with idem.ValidateKey (or the
// Client's), as Do does.
func ParseKey(h http.Header) (string, error) { return parseKey(h.Values(HeaderKey)) }

// parseKey returns the idempotency key held by the values of the
// Idempotency-Key header (one entry per header line). It returns
// ErrMissingKey for no line, ErrMultipleKeys for more than one, and
// ErrMalformedKey for a value it cannot read. The forms it accepts are
// keyhdr.Parse's: a bare key, or an RFC 8941 string with optional
// parameters.
//
// parseKey only extracts the key; the caller checks its length and alphabet
// with idem's ValidateKey.
func parseKey(values []string) (string, error) {
	key, err := keyhdr.Parse(values)
	return key, keyhdr.Wrap(err, ErrMissingKey, ErrMultipleKeys, ErrMalformedKey)
}
