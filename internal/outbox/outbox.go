// Package outbox holds what idem's and idemsql's Publish share: the checks
// of an event and the stored form of its header. The fronts wrap its errors
// with idem.ErrInvalidEvent. It also lists events for operators (List: the
// idem command's events list and the console's deliveries page).
package outbox

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"
)

// Limits of an event (idem.MaxEventIDLength, idem.MaxEventPayload,
// idem.MaxEventHeader).
const (
	MaxName    = 255     // ID, Topic, Destination, in bytes
	MaxPayload = 1 << 20 // Payload, in bytes
	MaxHeader  = 1 << 16 // Header as stored (JSON), in bytes
)

// Check validates an event's fields and returns its header as stored: a
// JSON object of string arrays, nil for no header (nil or empty).
func Check(id, topic, destination string, payload []byte, header map[string][]string) ([]byte, error) {
	for _, f := range [...]struct{ name, v string }{{"ID", id}, {"Topic", topic}, {"Destination", destination}} {
		if err := checkName(f.name, f.v); err != nil {
			return nil, err
		}
	}
	if len(payload) > MaxPayload {
		return nil, fmt.Errorf("the Payload is %d bytes, over %d", len(payload), MaxPayload)
	}
	if len(header) == 0 {
		return nil, nil
	}
	for name, values := range header {
		if name == "" || !isToken(name) {
			return nil, fmt.Errorf("the Header name %q is not an RFC 9110 token", name)
		}
		for _, v := range values {
			if !utf8.ValidString(v) || strings.ContainsFunc(v, headerCTL) {
				return nil, fmt.Errorf("the Header %s: value %q is not valid text or holds a control character (RFC 9110 allows only a tab)", name, v)
			}
		}
	}
	b, err := json.Marshal(header) // keys sorted: the same header, the same bytes
	if err != nil {
		return nil, err
	}
	if len(b) > MaxHeader {
		return nil, fmt.Errorf("the Header is %d bytes as JSON, over %d", len(b), MaxHeader)
	}
	return b, nil
}

// headerCTL reports whether r may not be in an HTTP field value (RFC 9110:
// a control character other than a tab), which net/http would refuse to
// send.
func headerCTL(r rune) bool { return r < 0x20 && r != '\t' || r == 0x7f }

// checkName checks an ID, a Topic or a Destination: 1 to MaxName bytes of
// valid UTF-8 without control characters (they travel in HTTP headers and
// logs).
func checkName(field, v string) error {
	switch {
	case v == "":
		return fmt.Errorf("%s is empty", field)
	case len(v) > MaxName:
		return fmt.Errorf("%s is %d bytes, over %d", field, len(v), MaxName)
	case !utf8.ValidString(v):
		return fmt.Errorf("%s is not valid UTF-8", field)
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f {
			return fmt.Errorf("%s %q holds a control character", field, v)
		}
	}
	return nil
}

// isToken reports whether s is an RFC 9110 token.
func isToken(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0 {
			continue
		}
		return false
	}
	return true
}

// DecodeHeader is the header as stored, back ("" for none).
func DecodeHeader(s string) (map[string][]string, error) {
	if s == "" {
		return nil, nil
	}
	var h map[string][]string
	err := json.Unmarshal([]byte(s), &h)
	return h, err
}
