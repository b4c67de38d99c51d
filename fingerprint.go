package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"math"
	"reflect"
	"slices"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// Fingerprint identifies the content of a request: the SHA-256 of its
// canonical form. The same key with the same fingerprint is a retry; the same
// key with a different fingerprint is refused with ErrKeyReused.
type Fingerprint [32]byte

// String returns the fingerprint in lowercase hex.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// FingerprintJSON returns the SHA-256 of the canonical form of the JSON value
// v. Two requests get one fingerprint exactly when they hold the same JSON
// value:
//   - whitespace, the order of object members, escapes (\u0041 is A) and the
//     spelling of numbers do not count: 1, 1.0, 1e0 and 10e-1 are one number,
//     and -0 is 0;
//   - every other difference does. Strings are compared character by
//     character, and numbers by their exact decimal value, never through a
//     float64: 0.1 and 0.10000000000000001, 1234567890123456.7 and
//     1234567890123456.8, 9007199254740993 and 9007199254740992, 1e-400 and 0
//     all differ.
//
// The canonical form is RFC 8785 (JSON Canonicalization Scheme) with every
// number written as its exact value in RFC 8785's notation. Where RFC 8785 is
// exact, that is where every number of v is the decimal that RFC 8785 prints
// for the double nearest to it (as every integer up to 2^53 is, every number
// of at most 15 significant digits from 1e-300 to 1e300, and every Go
// float64), the fingerprint is the plain SHA-256 of the RFC 8785 text, as any
// RFC 8785 implementation computes it, so fingerprints stored for such
// documents stay valid. Any other document (one with a number that RFC 8785
// rounds, or one beyond a double's range, which RFC 8785 cannot write) is
// hashed with the prefix "idem exact JSON v1" and a NUL byte before its
// canonical text: a domain no RFC 8785 text can fall in.
//
// A []byte or json.RawMessage is taken as JSON text; any other value is
// marshalled with encoding/json first. The error wraps ErrInvalidJSON when the
// text is not JSON (RFC 8259) or v cannot be marshalled, when a string is not
// valid UTF-8 (in the text, or a Go string that encoding/json would write as
// U+FFFD) or holds an unpaired surrogate escape, when an object has a
// duplicate member name (after unescaping), when nesting is deeper than
// 10000, or when a number's exponent has more than 18 digits. Time and memory
// are linear in the length of the text.
func FingerprintJSON(v any) (Fingerprint, error) {
	var text []byte
	marshalled := false
	switch t := v.(type) {
	case []byte:
		text = t
	case json.RawMessage:
		text = t
	default:
		b, err := json.Marshal(v)
		if err != nil {
			return Fingerprint{}, fmt.Errorf("%w: %v", ErrInvalidJSON, err)
		}
		text, marshalled = b, true
	}
	if text == nil {
		return Fingerprint{}, fmt.Errorf("%w: no JSON text", ErrInvalidJSON)
	}
	// encoding/json writes a byte that is not UTF-8 as the escape \ufffd,
	// so only then can a Go string be invalid.
	if marshalled && bytes.Contains(text, []byte(`\ufffd`)) && invalidUTF8(reflect.ValueOf(v)) {
		return Fingerprint{}, fmt.Errorf("%w: a string is not valid UTF-8", ErrInvalidJSON)
	}
	var c canonicalizer
	fp, err := c.fingerprint(text)
	if err != nil {
		return Fingerprint{}, fmt.Errorf("%w: %v", ErrInvalidJSON, err)
	}
	return fp, nil
}

// FingerprintParts returns the SHA-256 of parts, each prefixed with its
// length, so that ("ab", "c") and ("a", "bc") differ. Use it for requests that
// are not JSON, or to bind a method and path to a body:
//
//	idem.FingerprintParts([]byte("POST"), []byte("/v1/draws"), body)
func FingerprintParts(parts ...[]byte) Fingerprint {
	h := sha256.New()
	var n [8]byte
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write(p)
	}
	var f Fingerprint
	h.Sum(f[:0])
	return f
}

// exactDomain precedes the canonical text of a document that RFC 8785 would
// round. RFC 8785 text never holds a NUL byte (control characters are
// escaped), and starts with one of {["-0123456789tfn, so no such text can
// begin with this prefix.
const exactDomain = "idem exact JSON v1\x00"

// maxDepth bounds the nesting of arrays and objects, as encoding/json does.
const maxDepth = 10000

// A canonicalizer parses one JSON text into a tree, checking it on the way,
// and writes the tree's canonical form. The tree is flat: nodes in document
// order, each container followed by its subtree.
type canonicalizer struct {
	text    []byte
	nodes   []node
	members []member // each object's members, contiguous, sorted by name
	pending []member // members of the objects being parsed
	names   []byte   // names that hold escapes, unescaped
	depth   int
	inexact bool // a number differs from what RFC 8785 would write for it

	// The canonical text is written to out, and from there to h (created
	// once out holds flushSize bytes), so a large document needs no copy of
	// its own.
	out []byte
	h   hash.Hash
}

const flushSize = 4096

func (c *canonicalizer) flush() {
	if c.h == nil {
		c.h = sha256.New()
	}
	c.h.Write(c.out)
	c.out = c.out[:0]
}

// A node is one JSON value: for a string, number or literal its span in the
// text; for an array or object the index of the node after its subtree in
// next, and for an object its members' range in members.
type node struct {
	kind       byte // '{', '[', '"', '0' (number), 't', 'f', 'n'
	esc        bool // a string that holds escapes
	start, end int32
	next       int32
}

// A member is an object member: the name's span in the text (quotes
// included), the unescaped name's span in the text or in names, and the
// node of its value.
type member struct {
	raw0, raw1 int32
	key0, key1 int32
	keyInNames bool
	value      int32
}

func (c *canonicalizer) key(m member) []byte {
	if m.keyInNames {
		return c.names[m.key0:m.key1]
	}
	return c.text[m.key0:m.key1]
}

// syntaxError is an error at a byte offset of the text. It never quotes the
// text, which may hold anything the client sent.
func syntaxError(offset int, msg string) error {
	return fmt.Errorf("offset %d: %s", offset, msg)
}

// fingerprint returns the SHA-256 of the canonical text of text, preceded
// by exactDomain if a number is inexact in RFC 8785.
func (c *canonicalizer) fingerprint(text []byte) (Fingerprint, error) {
	if len(text) > math.MaxInt32-1 {
		return Fingerprint{}, errors.New("text longer than 2 GiB")
	}
	c.text = text
	// Every value but the first follows a comma or an opening bracket, and
	// every member a colon; a value takes two bytes with its separator, a
	// member five ("":0,): one allocation each, at most 8 bytes of nodes and
	// 5 of members a byte of text.
	c.nodes = make([]node, 0, min(len(text)/2+1,
		1+bytes.Count(text, []byte(","))+bytes.Count(text, []byte("["))+bytes.Count(text, []byte("{"))))
	c.members = make([]member, 0, min(len(text)/5+1, bytes.Count(text, []byte(":"))))
	i, err := c.value(skipSpace(text, 0))
	if err != nil {
		return Fingerprint{}, err
	}
	if i = skipSpace(text, i); i != len(text) {
		return Fingerprint{}, syntaxError(i, "unexpected data after the value")
	}
	c.out = make([]byte, 0, min(len(exactDomain)+len(text), 2*flushSize))
	if c.inexact {
		c.out = append(c.out, exactDomain...)
	}
	c.write(0)
	if c.h == nil {
		return sha256.Sum256(c.out), nil
	}
	c.flush()
	var fp Fingerprint
	c.h.Sum(fp[:0])
	return fp, nil
}

func skipSpace(text []byte, i int) int {
	for i < len(text) {
		switch text[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// value parses the value at text[i:] into a node and returns the offset after
// it.
func (c *canonicalizer) value(i int) (int, error) {
	if i >= len(c.text) {
		return i, syntaxError(i, "unexpected end of JSON")
	}
	switch ch := c.text[i]; {
	case ch == '{' || ch == '[':
		return c.container(i)
	case ch == '"':
		end, esc, err := c.str(i)
		if err != nil {
			return i, err
		}
		c.nodes = append(c.nodes, node{kind: '"', esc: esc, start: int32(i), end: int32(end)})
		return end, nil
	case ch == '-' || isDigit(ch):
		end, err := c.number(i)
		if err != nil {
			return i, err
		}
		c.nodes = append(c.nodes, node{kind: '0', start: int32(i), end: int32(end)})
		return end, nil
	}
	for _, lit := range [...]string{"true", "false", "null"} {
		if bytes.HasPrefix(c.text[i:], []byte(lit)) {
			c.nodes = append(c.nodes, node{kind: lit[0], start: int32(i), end: int32(i + len(lit))})
			return i + len(lit), nil
		}
	}
	return i, syntaxError(i, "invalid character")
}

// container parses the array or object at text[i:].
func (c *canonicalizer) container(i int) (int, error) {
	if c.depth++; c.depth > maxDepth {
		return i, syntaxError(i, fmt.Sprintf("nesting deeper than %d", maxDepth))
	}
	defer func() { c.depth-- }()
	open, closing := c.text[i], byte(']')
	if open == '{' {
		closing = '}'
	}
	self := len(c.nodes)
	c.nodes = append(c.nodes, node{kind: open})
	base := len(c.pending)
	i = skipSpace(c.text, i+1)
	if i < len(c.text) && c.text[i] == closing {
		i++
	} else {
		for {
			if open == '{' {
				m, end, err := c.name(i)
				if err != nil {
					return i, err
				}
				if i = skipSpace(c.text, end); i >= len(c.text) || c.text[i] != ':' {
					return i, syntaxError(i, "expected a colon after an object member name")
				}
				m.value = int32(len(c.nodes))
				if len(c.pending) == cap(c.pending) {
					c.pending = slices.Grow(c.pending, len(c.pending)+8) // double
				}
				c.pending = append(c.pending, m)
				i = skipSpace(c.text, i+1)
			}
			var err error
			if i, err = c.value(i); err != nil {
				return i, err
			}
			if i = skipSpace(c.text, i); i < len(c.text) && c.text[i] == ',' {
				i = skipSpace(c.text, i+1)
				continue
			}
			if i < len(c.text) && c.text[i] == closing {
				i++
				break
			}
			return i, syntaxError(i, "expected a comma or "+string(closing))
		}
	}
	n := &c.nodes[self]
	n.next = int32(len(c.nodes))
	if open == '{' {
		ms := c.pending[base:]
		slices.SortFunc(ms, func(a, b member) int { return compareUTF16(c.key(a), c.key(b)) })
		for k := 1; k < len(ms); k++ {
			if bytes.Equal(c.key(ms[k-1]), c.key(ms[k])) {
				return i, syntaxError(int(ms[k].raw0), "duplicate object member name")
			}
		}
		n.start, n.end = int32(len(c.members)), int32(len(c.members)+len(ms))
		c.members = append(c.members, ms...)
		c.pending = c.pending[:base]
	}
	return i, nil
}

// name parses the object member name at text[i:].
func (c *canonicalizer) name(i int) (member, int, error) {
	if i >= len(c.text) || c.text[i] != '"' {
		return member{}, i, syntaxError(i, "expected an object member name")
	}
	end, esc, err := c.str(i)
	if err != nil {
		return member{}, i, err
	}
	m := member{raw0: int32(i), raw1: int32(end), key0: int32(i + 1), key1: int32(end - 1)}
	if esc {
		m.keyInNames, m.key0 = true, int32(len(c.names))
		c.names = unescape(c.names, c.text[i+1:end-1])
		m.key1 = int32(len(c.names))
	}
	return m, end, nil
}

// str checks the string at text[i:] and returns the offset after it and
// whether it holds escapes.
func (c *canonicalizer) str(i int) (int, bool, error) {
	text, esc := c.text, false
	for j := i + 1; j < len(text); {
		switch ch := text[j]; {
		case ch == '"':
			return j + 1, esc, nil
		case ch == '\\':
			esc = true
			_, n, err := escape(text, j)
			if err != nil {
				return i, esc, err
			}
			j += n
		case ch < 0x20:
			return i, esc, syntaxError(j, "control character in a string")
		case ch < utf8.RuneSelf:
			j++
		default:
			r, n := utf8.DecodeRune(text[j:])
			if r == utf8.RuneError && n == 1 {
				return i, esc, syntaxError(j, "invalid UTF-8")
			}
			j += n
		}
	}
	return i, esc, syntaxError(len(text), "unterminated string")
}

// escape decodes the escape sequence at text[i:] (text[i] is a backslash) and
// returns the character and the length of the sequence. A \u escape of a
// surrogate must be the first half of a pair.
func escape(text []byte, i int) (rune, int, error) {
	if i+1 >= len(text) {
		return 0, 0, syntaxError(i, "unterminated escape")
	}
	switch text[i+1] {
	case '"', '\\', '/':
		return rune(text[i+1]), 2, nil
	case 'b':
		return '\b', 2, nil
	case 'f':
		return '\f', 2, nil
	case 'n':
		return '\n', 2, nil
	case 'r':
		return '\r', 2, nil
	case 't':
		return '\t', 2, nil
	case 'u':
		r, ok := hex4(text, i+2)
		if !ok {
			return 0, 0, syntaxError(i, "invalid \\u escape")
		}
		if !utf16.IsSurrogate(r) {
			return r, 6, nil
		}
		if r < 0xdc00 && i+7 < len(text) && text[i+6] == '\\' && text[i+7] == 'u' {
			if lo, ok := hex4(text, i+8); ok && lo >= 0xdc00 && lo <= 0xdfff {
				return utf16.DecodeRune(r, lo), 12, nil
			}
		}
		return 0, 0, syntaxError(i, "unpaired surrogate escape")
	}
	return 0, 0, syntaxError(i, "invalid escape")
}

func hex4(text []byte, i int) (rune, bool) {
	if i+4 > len(text) {
		return 0, false
	}
	var r rune
	for _, ch := range text[i : i+4] {
		switch {
		case isDigit(ch):
			r = r<<4 | rune(ch-'0')
		case 'a' <= ch && ch <= 'f':
			r = r<<4 | rune(ch-'a'+10)
		case 'A' <= ch && ch <= 'F':
			r = r<<4 | rune(ch-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}

// unescape appends the characters of the checked string content s to dst.
func unescape(dst, s []byte) []byte {
	for i := 0; i < len(s); {
		if s[i] != '\\' {
			dst = append(dst, s[i])
			i++
			continue
		}
		r, n, _ := escape(s, i)
		dst = utf8.AppendRune(dst, r)
		i += n
	}
	return dst
}

// compareUTF16 compares two names as RFC 8785 sorts them, by their UTF-16
// code units. That is the order of their UTF-8 bytes, except that characters
// from U+E000 to U+FFFF (lead byte 0xEE or 0xEF) come after those beyond
// U+FFFF (lead byte 0xF0 to 0xF4), whose surrogates are 0xD800 to 0xDFFF. Two
// valid UTF-8 names first differ either at a lead byte of both or inside
// characters of one length.
func compareUTF16(a, b []byte) int {
	for i := 0; i < len(a) && i < len(b); i++ {
		x, y := a[i], b[i]
		switch {
		case x == y:
			continue
		case (x == 0xee || x == 0xef) && y >= 0xf0:
			return 1
		case (y == 0xee || y == 0xef) && x >= 0xf0:
			return -1
		}
		return int(x) - int(y)
	}
	return len(a) - len(b)
}

func isDigit(ch byte) bool { return '0' <= ch && ch <= '9' }

// number checks the number at text[i:] (RFC 8259 section 6), notes whether
// RFC 8785 would write it exactly, and returns the offset after it.
func (c *canonicalizer) number(i int) (int, error) {
	text, j := c.text, i
	digits := func() int {
		k := j
		for j < len(text) && isDigit(text[j]) {
			j++
		}
		return j - k
	}
	if text[j] == '-' {
		j++
	}
	switch n := digits(); {
	case n == 0:
		return i, syntaxError(j, "invalid number")
	case n > 1 && text[j-n] == '0':
		return i, syntaxError(j-n, "number with a leading zero")
	}
	if j < len(text) && text[j] == '.' {
		j++
		if digits() == 0 {
			return i, syntaxError(j, "invalid number")
		}
	}
	if j < len(text) && (text[j] == 'e' || text[j] == 'E') {
		j++
		if j < len(text) && (text[j] == '+' || text[j] == '-') {
			j++
		}
		k := j
		if digits() == 0 {
			return i, syntaxError(j, "invalid number")
		}
		for k < j-1 && text[k] == '0' {
			k++
		}
		if j-k > 18 {
			return i, syntaxError(k, "number exponent has more than 18 digits")
		}
	}
	if !c.inexact {
		var buf [32]byte
		if d := parseDecimal(text[i:j], buf[:0]); !d.rfc8785Exact() {
			c.inexact = true
		}
	}
	return j, nil
}

// A decimal is the exact value of a JSON number: 0.digits × 10^point, digits
// without leading or trailing zeros (none for zero, whatever the sign).
type decimal struct {
	neg    bool
	digits []byte
	point  int64
}

// parseDecimal returns the value of the checked JSON number lit; its digits
// are appended to buf.
func parseDecimal(lit, buf []byte) decimal {
	d := decimal{neg: lit[0] == '-'}
	if d.neg {
		lit = lit[1:]
	}
	mantissa, exp := lit, int64(0)
	if k := bytes.IndexAny(lit, "eE"); k >= 0 {
		e := lit[k+1:]
		neg := e[0] == '-'
		if e[0] == '-' || e[0] == '+' {
			e = e[1:]
		}
		for _, ch := range e { // at most 18 significant digits
			exp = exp*10 + int64(ch-'0')
		}
		if neg {
			exp = -exp
		}
		mantissa = lit[:k]
	}
	intPart, frac, _ := bytes.Cut(mantissa, []byte("."))
	buf = slices.Grow(buf, len(mantissa))
	// The value is intPart.frac × 10^exp.
	point := int64(len(intPart)) + exp
	for _, part := range [2][]byte{intPart, frac} {
		for _, ch := range part {
			if ch == '0' && len(buf) == 0 {
				point-- // a leading zero
				continue
			}
			buf = append(buf, ch)
		}
	}
	d.digits = bytes.TrimRight(buf, "0")
	if len(d.digits) == 0 {
		return decimal{}
	}
	d.point = point
	return d
}

// rfc8785Exact reports whether RFC 8785 writes d as d: whether d is the
// shortest decimal that identifies the double nearest to it, which RFC 8785
// (as ECMAScript) prints for it.
func (d decimal) rfc8785Exact() bool {
	switch k := len(d.digits); {
	case k == 0:
		return true // zero, which RFC 8785 writes as 0 (-0 included)
	case k <= 15 && d.point >= -300 && d.point <= 300:
		// A normal double holds any decimal of 15 significant digits
		// apart from every other such decimal, so none shorter or of the
		// same length is nearer.
		return true
	case k > 17 || d.point > 310 || d.point < -330:
		// The shortest form has at most 17 digits; beyond 1e310 lies
		// infinity, below 1e-330 zero.
		return false
	}
	var buf [48]byte
	s := append(append(append(buf[:0], "0."...), d.digits...), 'e')
	s = strconv.AppendInt(s, d.point, 10)
	f, err := strconv.ParseFloat(string(s), 64)
	if err != nil || f == 0 {
		return false
	}
	short := strconv.AppendFloat(buf[:0], math.Abs(f), 'e', -1, 64) // d.ddde±xx
	mant, exp, _ := bytes.Cut(short, []byte("e"))
	e, _ := strconv.Atoi(string(exp))
	mant = bytes.TrimRight(bytes.Replace(mant, []byte("."), nil, 1), "0")
	return bytes.Equal(mant, d.digits) && int64(e)+1 == d.point
}

// appendTo appends d as ECMAScript writes numbers (RFC 8785 section
// 3.2.2.3), which for the digits of a double is exactly RFC 8785's form:
// plain from 1e-6 up to 1e21, in exponent notation outside.
func (d decimal) appendTo(out []byte) []byte {
	k, n := int64(len(d.digits)), d.point
	if k == 0 {
		return append(out, '0')
	}
	if d.neg {
		out = append(out, '-')
	}
	switch {
	case k <= n && n <= 21:
		out = append(out, d.digits...)
		for range n - k {
			out = append(out, '0')
		}
	case 0 < n && n <= 21:
		out = append(append(append(out, d.digits[:n]...), '.'), d.digits[n:]...)
	case -6 < n && n <= 0:
		out = append(out, "0."...)
		for range -n {
			out = append(out, '0')
		}
		out = append(out, d.digits...)
	default:
		out = append(out, d.digits[0])
		if k > 1 {
			out = append(append(out, '.'), d.digits[1:]...)
		}
		out = append(out, 'e')
		if n-1 >= 0 {
			out = append(out, '+')
		}
		out = strconv.AppendInt(out, n-1, 10)
	}
	return out
}

// write appends the canonical form of the value at nodes[i] to out and
// returns the index of the node after it.
func (c *canonicalizer) write(i int32) int32 {
	if len(c.out) >= flushSize {
		c.flush()
	}
	n := c.nodes[i]
	switch n.kind {
	case '[':
		c.out = append(c.out, '[')
		for j := i + 1; j < n.next; {
			if j > i+1 {
				c.out = append(c.out, ',')
			}
			j = c.write(j)
		}
		c.out = append(c.out, ']')
		return n.next
	case '{':
		c.out = append(c.out, '{')
		for k, m := range c.members[n.start:n.end] {
			if k > 0 {
				c.out = append(c.out, ',')
			}
			c.writeString(c.text[m.raw0:m.raw1])
			c.out = append(c.out, ':')
			c.write(m.value)
		}
		c.out = append(c.out, '}')
		return n.next
	case '"':
		switch s := c.text[n.start:n.end]; {
		case n.esc:
			c.writeString(s)
		case len(s) >= flushSize:
			c.flush()
			c.h.Write(s) // already canonical
		default:
			c.out = append(c.out, s...)
		}
	case '0':
		var buf [32]byte
		c.out = parseDecimal(c.text[n.start:n.end], buf[:0]).appendTo(c.out)
	default:
		c.out = append(c.out, c.text[n.start:n.end]...) // true, false, null
	}
	return i + 1
}

// writeString appends the checked string s (quotes included) as RFC 8785
// writes strings (section 3.2.2.2): the characters themselves, except \" and
// \\, the short escapes \b \t \n \f \r and \u00xx for other control
// characters.
func (c *canonicalizer) writeString(s []byte) {
	out := append(c.out, '"')
	for i := 1; i < len(s)-1; {
		if len(out) >= flushSize {
			c.out = out
			c.flush()
			out = c.out
		}
		if s[i] != '\\' {
			out = append(out, s[i])
			i++
			continue
		}
		r, n, _ := escape(s, i)
		i += n
		switch r {
		case '"', '\\':
			out = append(out, '\\', byte(r))
		case '\b':
			out = append(out, `\b`...)
		case '\t':
			out = append(out, `\t`...)
		case '\n':
			out = append(out, `\n`...)
		case '\f':
			out = append(out, `\f`...)
		case '\r':
			out = append(out, `\r`...)
		default:
			if r < 0x20 {
				out = append(out, '\\', 'u', '0', '0', "0123456789abcdef"[r>>4], "0123456789abcdef"[r&0xf])
			} else {
				out = utf8.AppendRune(out, r)
			}
		}
	}
	c.out = append(out, '"')
}

var (
	jsonMarshaler = reflect.TypeFor[json.Marshaler]()
	textMarshaler = reflect.TypeFor[encoding.TextMarshaler]()
)

// invalidUTF8 reports whether v holds a string that is not valid UTF-8
// where encoding/json writes it, which it does as U+FFFD. Output of a
// json.Marshaler is JSON text and checked as such.
func invalidUTF8(v reflect.Value) bool { return (&utf8Walk{}).invalid(v) }

// A utf8Walk is one invalidUTF8 check. It walks each pointer, map and slice
// once: encoding/json refuses the cycles it follows, but the walk also
// enters parts that encoding/json leaves out (a field that a shallower one
// of the same name hides), where a cycle would never end.
type utf8Walk struct{ seen map[walked]bool }

// walked identifies a pointer, map or slice: by its type too, as a struct
// and its first field share an address, and by whether it was reached
// through an unexported field (where its methods cannot be called, so
// that a walk there checks less than one through an exported field).
type walked struct {
	t   reflect.Type
	ptr uintptr
	len int
	ro  bool
}

func (w *utf8Walk) invalid(v reflect.Value) bool {
	if !v.IsValid() {
		return false
	}
	t := v.Type()
	if (v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface) && v.IsNil() {
		return false
	}
	switch v.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice:
		if v.IsNil() {
			break
		}
		k := walked{t: t, ptr: v.Pointer(), ro: !v.CanInterface()}
		if v.Kind() == reflect.Slice {
			k.len = v.Len()
		}
		if w.seen[k] {
			return false // walked already, or being walked
		}
		if w.seen == nil {
			w.seen = make(map[walked]bool)
		}
		w.seen[k] = true
	}
	if v.CanInterface() {
		if t.Implements(jsonMarshaler) || v.CanAddr() && reflect.PointerTo(t).Implements(jsonMarshaler) {
			return false
		}
		var tm encoding.TextMarshaler
		if t.Implements(textMarshaler) {
			tm, _ = v.Interface().(encoding.TextMarshaler)
		} else if v.CanAddr() && reflect.PointerTo(t).Implements(textMarshaler) {
			tm, _ = v.Addr().Interface().(encoding.TextMarshaler)
		}
		if tm != nil {
			b, err := tm.MarshalText()
			return err == nil && !utf8.Valid(b)
		}
	}
	switch v.Kind() {
	case reflect.String:
		return !utf8.ValidString(v.String())
	case reflect.Pointer, reflect.Interface:
		return w.invalid(v.Elem())
	case reflect.Struct:
		for i := range t.NumField() {
			f := t.Field(i)
			if f.Tag.Get("json") == "-" || !f.IsExported() && !embeddedStruct(f) {
				continue // left out by encoding/json
			}
			if w.invalid(v.Field(i)) {
				return true
			}
		}
	case reflect.Map:
		for it := v.MapRange(); it.Next(); {
			if invalidKey(it.Key()) {
				return true
			}
			if w.invalid(it.Value()) {
				return true
			}
		}
	case reflect.Slice, reflect.Array:
		if e := reflect.PointerTo(t.Elem()); t.Elem().Kind() == reflect.Uint8 &&
			!e.Implements(jsonMarshaler) && !e.Implements(textMarshaler) {
			return false // base64, or numbers
		}
		for i := range v.Len() {
			if w.invalid(v.Index(i)) {
				return true
			}
		}
	}
	return false
}

// invalidKey reports whether encoding/json writes the map key k as a
// string that is not valid UTF-8: a string kind as it is, any other key
// that is an encoding.TextMarshaler as its text (a json.Marshaler too), and
// the rest as numbers.
func invalidKey(k reflect.Value) bool {
	switch {
	case k.Kind() == reflect.String:
		return !utf8.ValidString(k.String())
	case !k.CanInterface() || k.Kind() == reflect.Pointer && k.IsNil():
		return false
	}
	if tm, ok := k.Interface().(encoding.TextMarshaler); ok {
		b, err := tm.MarshalText()
		return err == nil && !utf8.Valid(b)
	}
	return false
}

// embeddedStruct reports whether f embeds a struct or a pointer to one,
// whose fields encoding/json promotes even when f is unexported (an
// unexported embedded field of another type it leaves out).
func embeddedStruct(f reflect.StructField) bool {
	t := f.Type
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return f.Anonymous && t.Kind() == reflect.Struct
}
