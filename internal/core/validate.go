package core

import (
	"errors"
	"time"
	"unicode/utf8"
)

// checkTarget validates the scope and key of a call.
func (c *Client[TTx, TDB]) checkTarget(scope Scope, key string) error {
	if err := c.ValidateKey(key); err != nil {
		return err
	}
	if err := ValidateScope(scope); err != nil {
		return err
	}
	if c.cfg.TTLFor != nil {
		if t := c.cfg.TTLFor(scope.Operation); t != 0 && t < time.Microsecond {
			return errorf("idem: %w: TTLFor(%q) is %s; a TTL must be at least 1µs (0: TTL)", ErrInvalidConfig, scope.Operation, t)
		}
	}
	if c.cfg.BodyTTLFor != nil {
		if t := c.cfg.BodyTTLFor(scope.Operation); t != 0 && t < time.Microsecond {
			return errorf("idem: %w: BodyTTLFor(%q) is %s; a body's life must be at least 1µs (0: BodyTTL)", ErrInvalidConfig, scope.Operation, t)
		}
	}
	return nil
}

// ValidateScope reports whether scope can be used: Actor and Operation must be
// non-empty valid UTF-8 of at most MaxScopeLength bytes without NUL bytes.
// The error wraps ErrInvalidScope.
func ValidateScope(scope Scope) error {
	for _, f := range [...]struct{ name, v string }{{"actor", scope.Actor}, {"operation", scope.Operation}} {
		switch {
		case f.v == "":
			return errorf("idem: %w: empty %s", ErrInvalidScope, f.name)
		case len(f.v) > MaxScopeLength:
			return errorf("idem: %w: %s is %d bytes, limit %d", ErrInvalidScope, f.name, len(f.v), MaxScopeLength)
		case checkText(f.v) != nil:
			return errorf("idem: %w: %s: %v", ErrInvalidScope, f.name, checkText(f.v))
		}
	}
	return nil
}

// ValidateKey reports whether key is a valid idempotency key under this
// client's key length bounds: visible ASCII (0x21-0x7E) only. The error
// wraps ErrInvalidKey.
func (c *Client[TTx, TDB]) ValidateKey(key string) error {
	switch {
	case key == "":
		return errorf("idem: %w: empty key", ErrInvalidKey)
	case len(key) < c.cfg.MinKeyLength:
		return errorf("idem: %w: key is %d bytes, at least %d required", ErrInvalidKey, len(key), c.cfg.MinKeyLength)
	case len(key) > c.cfg.MaxKeyLength:
		return errorf("idem: %w: key is %d bytes, limit %d", ErrInvalidKey, len(key), c.cfg.MaxKeyLength)
	}
	for i := 0; i < len(key); i++ {
		if b := key[i]; b < 0x21 || b > 0x7e {
			return errorf("idem: %w: byte %d is 0x%02x; keys hold visible ASCII (0x21-0x7E) only", ErrInvalidKey, i, b)
		}
	}
	return nil
}

// checkText reports whether s can be stored in a jsonb or text column and
// read back unchanged: valid UTF-8 without NUL bytes.
func checkText(s string) error {
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

// checkReason validates a reason to store.
func checkReason(reason string) error {
	if len(reason) > MaxReasonLength {
		return errorf("idem: %w: reason is %d bytes, limit %d", ErrInvalidArgument, len(reason), MaxReasonLength)
	}
	if err := checkText(reason); err != nil {
		return errorf("idem: %w: reason %v", ErrInvalidArgument, err)
	}
	return nil
}

// checkReservation validates a Reservation given back to the library.
func (c *Client[TTx, TDB]) checkReservation(r Reservation) error {
	if r.Token <= 0 {
		return errorf("idem: %w: the Reservation holds no token (a zero value, or a replay)", ErrInvalidArgument)
	}
	return c.checkTarget(r.Scope, r.Key)
}

// checkLimit validates the limit of ExpireLeases, ListUnknown and
// ListResumable.
func checkLimit(limit int) error {
	if limit <= 0 {
		return errorf("idem: %w: limit %d must be positive", ErrInvalidArgument, limit)
	}
	return nil
}

// PostgreSQL's range of timestamptz: 4713 BC to 294276 AD.
var (
	minTimestamp = time.Date(-4712, 1, 1, 0, 0, 0, 0, time.UTC)
	maxTimestamp = time.Date(294277, 1, 1, 0, 0, 0, 0, time.UTC)
)

// checkCursor validates the Record after which ListUnknown or
// ListResumable continues: its names must be text PostgreSQL can hold
// (valid UTF-8 without NUL), its CreatedAt within PostgreSQL's range.
func checkCursor(after *Record) error {
	for _, f := range [...]struct{ name, v string }{
		{"actor", after.Scope.Actor}, {"operation", after.Scope.Operation}, {"key", after.Key},
	} {
		if err := checkText(f.v); err != nil {
			return errorf("idem: %w: cursor %s %v", ErrInvalidArgument, f.name, err)
		}
	}
	if t := after.CreatedAt; t.Before(minTimestamp) || !t.Before(maxTimestamp) {
		return errorf("idem: %w: cursor CreatedAt %s is outside PostgreSQL's range", ErrInvalidArgument, t.UTC().Format(time.RFC3339))
	}
	return nil
}
