package pgxdriver

import (
	"testing"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// The span's statements take the TTL Settings.TTL gives: TTLFor's when it
// gives one, TTLMicros otherwise.
func TestTTLOfIsSettingsTTL(t *testing.T) {
	for _, s := range []driver.Settings{
		{TTLMicros: 5e6},
		{TTLMicros: 5e6, TTLFor: func(op string) time.Duration {
			if op == "long" {
				return time.Hour
			}
			return 0
		}},
	} {
		d := &Driver{ttl: s}
		for _, op := range []string{"long", "other"} {
			if got, want := d.ttlOf(op), s.TTL(op); got != want {
				t.Errorf("ttlOf(%q) = %d, Settings.TTL %d", op, got, want)
			}
		}
	}
}
