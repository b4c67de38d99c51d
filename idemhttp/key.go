package idemhttp

import (
	"errors"

	"github.com/pgidem/idem/internal/keyhdr"
)

// HeaderKey is the request header that carries the idempotency key.
const HeaderKey = "Idempotency-Key"

// HeaderReplayed is the response header set to "true" on a replayed response.
const HeaderReplayed = "Idempotent-Replayed"

// Errors of the Idempotency-Key header. The middleware answers them with a
// 400 problem; they are exported for code that parses the header itself.
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
