package idem

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

// checkCall validates the arguments every entry point shares.
func (c *Client) checkCall(scope Scope, key string, fn func(ctx context.Context, tx pgx.Tx) (Response, error)) error {
	if err := c.checkTarget(scope, key); err != nil {
		return err
	}
	if fn == nil {
		return fmt.Errorf("%w: nil function", ErrInvalidArgument)
	}
	return nil
}

// checkTarget validates the scope and key of a call.
func (c *Client) checkTarget(scope Scope, key string) error {
	if err := c.ValidateKey(key); err != nil {
		return err
	}
	return ValidateScope(scope)
}

// MaxScopeLength is the longest Actor or Operation, in bytes.
const MaxScopeLength = 255

// ValidateScope reports whether scope can be used: Actor and Operation must be
// non-empty valid UTF-8 of at most MaxScopeLength bytes without NUL bytes.
// The error wraps ErrInvalidScope.
func ValidateScope(scope Scope) error {
	for _, f := range [...]struct{ name, v string }{{"actor", scope.Actor}, {"operation", scope.Operation}} {
		switch {
		case f.v == "":
			return fmt.Errorf("%w: empty %s", ErrInvalidScope, f.name)
		case len(f.v) > MaxScopeLength:
			return fmt.Errorf("%w: %s is %d bytes, limit %d", ErrInvalidScope, f.name, len(f.v), MaxScopeLength)
		case checkHeaderText(f.v) != nil:
			return fmt.Errorf("%w: %s: %v", ErrInvalidScope, f.name, checkHeaderText(f.v))
		}
	}
	return nil
}

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
func (c *Client) ValidateKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty key", ErrInvalidKey)
	case len(key) < c.cfg.MinKeyLength:
		return fmt.Errorf("%w: key is %d bytes, at least %d required", ErrInvalidKey, len(key), c.cfg.MinKeyLength)
	case len(key) > c.cfg.MaxKeyLength:
		return fmt.Errorf("%w: key is %d bytes, limit %d", ErrInvalidKey, len(key), c.cfg.MaxKeyLength)
	}
	for i := 0; i < len(key); i++ {
		if b := key[i]; b < 0x21 || b > 0x7e {
			return fmt.Errorf("%w: byte %d is 0x%02x; keys hold visible ASCII (0x21-0x7E) only", ErrInvalidKey, i, b)
		}
	}
	return nil
}

// checkHeaderText reports whether s can be stored in a jsonb column and read
// back unchanged.
func checkHeaderText(s string) error {
	if !utf8.ValidString(s) {
		return errors.New("not valid UTF-8")
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return errors.New("holds a NUL byte")
		}
	}
	return nil
}

// isNil reports whether v is nil or an interface holding a nil pointer (a
// nil *pgxpool.Pool passed as a Beginner, say), which would panic on use.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Chan, reflect.Func, reflect.Interface, reflect.Slice:
		return rv.IsNil()
	}
	return false
}
