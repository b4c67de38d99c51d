// Package keyhdr reads the idempotency key out of the values of an
// Idempotency-Key header (HTTP) or idempotency-key metadata entry (gRPC,
// Connect): a bare key or an RFC 8941 structured-field string. It is the one
// parser idemhttp, idemgrpc and idemconnect share; the key's length and
// alphabet are checked afterwards by idem's ValidateKey.
package keyhdr

import (
	"errors"
	"fmt"
	"strings"
)

// Kind tells why Parse refused the values.
type Kind int

// The kinds of Error.
const (
	Missing   Kind = iota + 1 // no value
	Multiple                  // more than one value, or a bare value with a comma
	Malformed                 // neither a bare key nor a valid sf-string
)

// Error is Parse's error: its Kind, and a detail for the message (empty for
// Missing). Callers wrap their own sentinel error for the kind around the
// detail.
type Error struct {
	Kind   Kind
	Detail string
}

func (e *Error) Error() string {
	switch e.Kind {
	case Missing:
		return "no key"
	case Multiple:
		return "more than one key: " + e.Detail
	}
	return "malformed key: " + e.Detail
}

// Parse returns the idempotency key held by values, the entries of the
// header (one per header line or metadata value). It returns an *Error of
// kind Missing for no entry, Multiple for more than one, and Malformed for a
// value it cannot read.
//
// Two forms are accepted, after optional whitespace around the value is
// dropped:
//   - a structured-field Item whose bare item is a String (RFC 8941
//     section 3.3.3), as the IETF draft specifies: "8e03978e-40d5"; any
//     parameters after it (;a=1) are parsed and ignored;
//   - a bare key, as real clients send (UUIDs, 1754..._Ab-9_x): the whole
//     value, which must not start with a double quote or hold a comma.
//
// Parse only extracts the key; the caller checks its length and alphabet
// with idem's ValidateKey.
func Parse(values []string) (string, error) {
	switch len(values) {
	case 0:
		return "", &Error{Kind: Missing}
	case 1:
	default:
		return "", &Error{Kind: Multiple, Detail: fmt.Sprintf("%d header lines", len(values))}
	}
	v := strings.Trim(values[0], " \t")
	if !strings.HasPrefix(v, `"`) {
		if strings.Contains(v, ",") {
			return "", &Error{Kind: Multiple, Detail: "a bare key must not hold a comma"}
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
		return "", &Error{Kind: Malformed, Detail: err.Error()}
	}
	return key, nil
}

// Format returns the value that carries key (checked by idem's ValidateKey)
// in the header or metadata entry, so that Parse reads key back: key itself
// when it is a bare key (no comma, no leading double quote), else key as an
// RFC 8941 string, its double quotes and backslashes escaped.
func Format(key string) string {
	if !strings.HasPrefix(key, `"`) && !strings.Contains(key, ",") && strings.Trim(key, " \t") == key {
		return key
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
}

// Wrap turns an error of Parse into one that wraps the caller's sentinel
// for its kind (missing, multiple, malformed), with Parse's detail after
// it; other errors, and nil, are returned as they are.
func Wrap(err error, missing, multiple, malformed error) error {
	var e *Error
	if !errors.As(err, &e) {
		return err
	}
	sentinel := map[Kind]error{Missing: missing, Multiple: multiple, Malformed: malformed}[e.Kind]
	if e.Detail == "" {
		return sentinel
	}
	return fmt.Errorf("%w: %s", sentinel, e.Detail)
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
		for p.i < len(p.s) && (IsTchar(p.s[p.i]) || p.s[p.i] == ':' || p.s[p.i] == '/') {
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

// IsTchar reports whether c is an RFC 9110 tchar, a byte of a token.
func IsTchar(c byte) bool {
	return isAlpha(c) || isDigit(c) || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

func isBase64(c byte) bool {
	return isAlpha(c) || isDigit(c) || c == '+' || c == '/' || c == '='
}
