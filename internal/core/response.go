package core

import (
	"encoding/json"
	"errors"
	"strings"
	"unicode/utf8"

	"github.com/pgidem/idem/internal/driver"
)

// reply checks that resp can be stored and replayed exactly, and returns
// it as it is written: its header encoded for the response_headers column
// as JSON text, or NULL when resp has no header map. (Text rather than
// bytes: in pgx's exec and simple-protocol modes, which PgBouncer setups
// use, a []byte argument is sent as bytea and would not read as JSON.) A
// nil body is written as an empty one.
func (c *Client[TTx, TDB]) reply(resp Response) (driver.Reply, error) {
	if resp.Status != 0 && (resp.Status < 100 || resp.Status > 999) {
		return driver.Reply{}, errorf("idem: %w: status %d is neither 0 nor a 3-digit HTTP status", ErrInvalidResponse, resp.Status)
	}
	size := len(resp.Body)
	for name, values := range resp.Header {
		if name == "" {
			return driver.Reply{}, errorf("idem: %w: empty header name", ErrInvalidResponse)
		}
		if !isToken(name) {
			return driver.Reply{}, errorf("idem: %w: header name %q is not an HTTP token (RFC 9110: letters, digits and !#$%%&'*+-.^_`|~)", ErrInvalidResponse, name)
		}
		size += len(name)
		for _, v := range values {
			if err := checkHeaderField(v); err != nil {
				// The value stays out of the error, which may be logged.
				return driver.Reply{}, errorf("idem: %w: header %q has a value that cannot be replayed (%v)", ErrInvalidResponse, name, err)
			}
			size += len(v)
		}
	}
	if size > c.cfg.MaxResponseBytes {
		return driver.Reply{}, errorf("idem: %w: %d bytes, limit %d", ErrResponseTooLarge, size, c.cfg.MaxResponseBytes)
	}
	r := driver.Reply{Status: int32(resp.Status), Body: resp.Body}
	if r.Body == nil {
		r.Body = []byte{}
	}
	if resp.Header == nil {
		return r, nil // stored as NULL
	}
	var sb strings.Builder
	sb.Grow(size + 8*len(resp.Header) + 2)
	writeHeaderJSON(&sb, resp.Header)
	r.Headers, r.HasHeaders = sb.String(), true
	return r, nil
}

// isToken reports whether s is a token of RFC 9110 (section 5.6.2), which a
// header name must be: one or more letters, digits or !#$%&'*+-.^_`|~.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// checkHeaderField reports whether s can be stored as a header value and
// replayed as one: valid UTF-8 without CR, LF or NUL, which would
// split or end a header line in any consumer that writes it out. (The
// checks of checkText and the line breaks, in one pass.)
func checkHeaderField(s string) error {
	if !utf8.ValidString(s) {
		return errors.New("not valid UTF-8")
	}
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case 0:
			return errors.New("holds a NUL byte")
		case '\r', '\n':
			return errors.New("holds a CR or LF")
		}
	}
	return nil
}

// replay turns a stored response into a replayed Result.
func replay(st driver.Stored) (Result, error) {
	res := Result{Replayed: true}
	res.Status = int(st.Status)
	if st.Gone {
		return res, errorf("idem: %w: the operation finished with status %d; its body was dropped after Config.BodyTTL", ErrResponseGone, st.Status)
	}
	res.Body = st.Body
	if res.Body == nil {
		res.Body = []byte{} // as the call that stored it returned it (some drivers read an empty bytea as nil)
	}
	if st.Headers != nil {
		if err := json.Unmarshal(st.Headers, &res.Header); err != nil {
			return Result{}, errorf("idem: stored response headers: %w", err)
		}
	}
	return res, nil
}

// writeHeaderJSON writes h as a JSON object of string arrays, as
// encoding/json would write it but without its reflection and allocations. A
// nil value slice is written as null, so it reads back as nil. Names and
// values are valid UTF-8 without NUL bytes (checkText).
func writeHeaderJSON(b *strings.Builder, h map[string][]string) {
	b.WriteByte('{')
	first := true
	for name, values := range h {
		if !first {
			b.WriteByte(',')
		}
		first = false
		writeJSONString(b, name)
		b.WriteByte(':')
		if values == nil {
			b.WriteString("null")
			continue
		}
		b.WriteByte('[')
		for i, v := range values {
			if i > 0 {
				b.WriteByte(',')
			}
			writeJSONString(b, v)
		}
		b.WriteByte(']')
	}
	b.WriteByte('}')
}

// writeJSONString writes s as a JSON string. s is valid UTF-8, so only
// quotes, backslashes and control characters need escaping.
func writeJSONString(b *strings.Builder, s string) {
	const hex = "0123456789abcdef"
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20:
			b.WriteString(`\u00`)
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&0xf])
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
}
