package idemhttp

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// HeaderKey is the request header that carries the idempotency key.
const HeaderKey = "Idempotency-Key"

// HeaderReplayed is the response header set to "true" on a replayed response.
const HeaderReplayed = "Idempotent-Replayed"

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
// ErrMalformedKey for a value it cannot read.
//
// Two forms are accepted, after optional whitespace around the value is
// dropped:
//   - a structured-field Item whose bare item is a String (RFC 8941
//     section 3.3.3), as the IETF draft specifies: "8e03978e-40d5"; any
//     parameters after it (;a=1) are parsed and ignored;
//   - a bare key, as real clients send (UUIDs, 1754..._Ab-9_x): the whole
//     value, which must not start with a double quote or hold a comma.
//
// parseKey only extracts the key; the caller checks its length and alphabet
// with idem's ValidateKey.
func parseKey(values []string) (string, error) {
	switch len(values) {
	case 0:
		return "", ErrMissingKey
	case 1:
	default:
		return "", fmt.Errorf("%w: %d header lines", ErrMultipleKeys, len(values))
	}
	v := strings.Trim(values[0], " \t")
	if !strings.HasPrefix(v, `"`) {
		if strings.Contains(v, ",") {
			return "", fmt.Errorf("%w: a bare key must not hold a comma", ErrMultipleKeys)
		}
		return v, nil
	}
	p := &sfParser{s: v}
	key, err := p.string()
	if err == nil {
		err = p.parameters()
	}
	if err == nil && p.i != len(p.s) {
		err = fmt.Errorf("unexpected %q after the string", p.s[p.i:])
	}
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrMalformedKey, err)
	}
	return key, nil
}

// sfParser reads the parts of an RFC 8941 Item that parseKey needs: a
// String, then parameters whose values are any bare item.
type sfParser struct {
	s string
	i int
}

func (p *sfParser) peek() (byte, bool) {
	if p.i < len(p.s) {
		return p.s[p.i], true
	}
	return 0, false
}

// string parses sf-string (RFC 8941 section 4.2.5).
func (p *sfParser) string() (string, error) {
	if c, ok := p.peek(); !ok || c != '"' {
		return "", errors.New("expected a string")
	}
	p.i++
	var b strings.Builder
	for p.i < len(p.s) {
		c := p.s[p.i]
		p.i++
		switch {
		case c == '\\':
			if p.i == len(p.s) {
				return "", errors.New("string ends after a backslash")
			}
			next := p.s[p.i]
			p.i++
			if next != '"' && next != '\\' {
				return "", fmt.Errorf("invalid escape \\%c in string", next)
			}
			b.WriteByte(next)
		case c == '"':
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("byte 0x%02x not allowed in a string", c)
		default:
			b.WriteByte(c)
		}
	}
	return "", errors.New("unterminated string")
}

// parameters parses *( ";" *SP parameter ) (RFC 8941 section 4.2.3.2).
func (p *sfParser) parameters() error {
	for {
		if c, ok := p.peek(); !ok || c != ';' {
			return nil
		}
		p.i++
		for p.i < len(p.s) && p.s[p.i] == ' ' {
			p.i++
		}
		if err := p.key(); err != nil {
			return err
		}
		if c, ok := p.peek(); ok && c == '=' {
			p.i++
			if err := p.bareItem(); err != nil {
				return err
			}
		}
	}
}

// key parses a parameter key: ( lcalpha / "*" ) *( lcalpha / DIGIT / "_" /
// "-" / "." / "*" ).
func (p *sfParser) key() error {
	c, ok := p.peek()
	if !ok || !(isLower(c) || c == '*') {
		return errors.New("expected a parameter key")
	}
	p.i++
	for p.i < len(p.s) {
		c := p.s[p.i]
		if !(isLower(c) || isDigit(c) || c == '_' || c == '-' || c == '.' || c == '*') {
			break
		}
		p.i++
	}
	return nil
}

// bareItem parses a parameter value: an Integer, Decimal, String, Token,
// Byte Sequence or Boolean (RFC 8941 section 4.2.3.1).
func (p *sfParser) bareItem() error {
	c, ok := p.peek()
	switch {
	case !ok:
		return errors.New("expected a parameter value")
	case c == '-' || isDigit(c):
		return p.number()
	case c == '"':
		_, err := p.string()
		return err
	case c == '*' || isAlpha(c):
		p.i++
		for p.i < len(p.s) && (isTchar(p.s[p.i]) || p.s[p.i] == ':' || p.s[p.i] == '/') {
			p.i++
		}
		return nil
	case c == ':':
		p.i++
		for p.i < len(p.s) && isBase64(p.s[p.i]) {
			p.i++
		}
		if c, ok := p.peek(); !ok || c != ':' {
			return errors.New("unterminated byte sequence")
		}
		p.i++
		return nil
	case c == '?':
		p.i++
		if c, ok := p.peek(); !ok || (c != '0' && c != '1') {
			return errors.New("invalid boolean")
		}
		p.i++
		return nil
	default:
		return fmt.Errorf("unexpected %q in a parameter value", c)
	}
}

// number parses an Integer or Decimal (RFC 8941 section 4.2.4).
func (p *sfParser) number() error {
	if p.s[p.i] == '-' {
		p.i++
	}
	intDigits, fracDigits, dot := 0, 0, false
scan:
	for ; p.i < len(p.s); p.i++ {
		switch c := p.s[p.i]; {
		case isDigit(c) && !dot:
			intDigits++
		case isDigit(c):
			fracDigits++
		case c == '.' && !dot:
			dot = true
		default:
			break scan
		}
	}
	switch {
	case intDigits == 0:
		return errors.New("number without digits")
	case !dot && intDigits > 15:
		return errors.New("integer with more than 15 digits")
	case dot && (intDigits > 12 || fracDigits < 1 || fracDigits > 3):
		return errors.New("invalid decimal")
	}
	return nil
}

func isLower(c byte) bool { return 'a' <= c && c <= 'z' }
func isDigit(c byte) bool { return '0' <= c && c <= '9' }
func isAlpha(c byte) bool { return isLower(c) || ('A' <= c && c <= 'Z') }

func isTchar(c byte) bool {
	return isAlpha(c) || isDigit(c) || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

func isBase64(c byte) bool {
	return isAlpha(c) || isDigit(c) || c == '+' || c == '/' || c == '='
}
