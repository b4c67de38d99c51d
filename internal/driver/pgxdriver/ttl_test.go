package pgxdriver

import (
	"testing"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// The span's statements take the TTLs Settings gives: the key's TTL is
// TTLFor's when it gives one, TTLMicros otherwise (Settings.TTL); the
// body's is BodyTTLMicros when it is shorter than the key's, otherwise 0
// (Settings.BodyTTL).
func TestTTLOfIsSettingsTTL(t *testing.T) {
	ttlFor := func(op string) time.Duration {
		if op == "long" {
			return time.Hour
		}
		return 0
	}
	bodyFor := func(op string) time.Duration {
		if op == "long" {
			return time.Minute
		}
		return 0
	}
	for _, s := range []driver.Settings{
		{TTLMicros: 5e6},
		{TTLMicros: 5e6, TTLFor: ttlFor},
		{TTLMicros: 5e6, BodyTTLMicros: 6e6},
		{TTLMicros: 5e6, BodyTTLMicros: 5e6},
		{TTLMicros: 5e6, TTLFor: ttlFor, BodyTTLMicros: 60e6},
		{TTLMicros: 5e6, BodyTTLFor: bodyFor},
		{TTLMicros: 5e6, BodyTTLMicros: 2e6, BodyTTLFor: bodyFor},
		{TTLMicros: 5e6, TTLFor: ttlFor, BodyTTLMicros: 2e6, BodyTTLFor: bodyFor},
	} {
		d := &Driver{ttl: s}
		for _, op := range []string{"long", "other"} {
			ttl, body := d.ttlOf(op)
			if want := s.TTL(op); ttl != want {
				t.Errorf("ttlOf(%q) = %d, Settings.TTL %d", op, ttl, want)
			}
			if want := s.BodyTTL(op, s.TTL(op)); body != want {
				t.Errorf("ttlOf(%q)'s body = %d, Settings.BodyTTL %d", op, body, want)
			}
		}
	}
}
