package idem

import "github.com/pgidem/idem/internal/core"

// MaxScopeLength is the longest Actor or Operation, in bytes.
const MaxScopeLength = 255

// ValidateScope reports whether scope can be used: Actor and Operation must be
// non-empty valid UTF-8 of at most MaxScopeLength bytes without NUL bytes.
// The error wraps ErrInvalidScope.
func ValidateScope(scope Scope) error { return publicErr(core.ValidateScope(core.Scope(scope))) }

// ValidateScope is the package-level ValidateScope: a scope's limits do not
// depend on the client's Config. It is here so that a Client checks both
// halves of a call's target, as Do does.
func (c *Client) ValidateScope(scope Scope) error { return ValidateScope(scope) }

// ValidateKey reports whether key is a valid idempotency key under the
// package defaults: 1 to 255 bytes of visible ASCII (0x21-0x7E), so no
// spaces, control characters or non-ASCII. The error wraps ErrInvalidKey.
func ValidateKey(key string) error { return defaultClient.ValidateKey(key) }

// ValidateKey is the package-level ValidateKey with this client's key length
// bounds.
func (c *Client) ValidateKey(key string) error { return publicErr(c.c.ValidateKey(key)) }
