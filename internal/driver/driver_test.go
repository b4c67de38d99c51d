package driver_test

import (
	"testing"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// TestRowJudge: what KeyGet's statement computed until 2026-12-06, now in
// Go from its times: expires_at <= now(), lease_expires_at IS NOT NULL,
// coalesce((extract(epoch FROM lease_expires_at - now()) * 1000)::bigint, 0)
// (numeric to bigint rounds half away from zero), and body_gone kept for
// finished rows that kept their response_status.
func TestRowJudge(t *testing.T) {
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	at := func(us int64) time.Time { return now.Add(time.Duration(us) * time.Microsecond) }
	for _, c := range []struct {
		name            string
		expires, lease  time.Time
		expired, leased bool
		leftMs          int64
	}{
		{"live", at(1), time.Time{}, false, false, 0},
		{"expires now", now, time.Time{}, true, false, 0},
		{"expired", at(-1), time.Time{}, true, false, 0},
		{"lease ends now", at(1e9), now, false, true, 0},
		{"lease 1.499 ms", at(1e9), at(1499), false, true, 1},
		{"lease 1.5 ms", at(1e9), at(1500), false, true, 2},
		{"lease 0.499 ms ago", at(1e9), at(-499), false, true, 0},
		{"lease 1.5 ms ago", at(1e9), at(-1500), false, true, -2},
		{"lease 2 days", at(1e9), now.Add(48 * time.Hour), false, true, 172_800_000},
	} {
		var r driver.Row
		r.Judge(driver.KeyTimes{Now: now, ExpiresAt: c.expires, LeaseExpiresAt: c.lease}, false)
		if r.Expired != c.expired || r.Leased != c.leased || r.LeaseLeftMs != c.leftMs {
			t.Errorf("%s: expired %v leased %v left %d ms, want %v %v %d", c.name,
				r.Expired, r.Leased, r.LeaseLeftMs, c.expired, c.leased, c.leftMs)
		}
	}

	stored := driver.Stored{Valid: true, Status: 201, Headers: []byte(`{}`), Body: []byte("ok")}
	for _, c := range []struct {
		status string
		stored driver.Stored
		gone   bool
	}{
		{"succeeded", stored, true},
		{"rejected", stored, true},
		{"failed_retryable", stored, false},
		{"processing", driver.Stored{}, false},
		{"succeeded", driver.Stored{}, false},
	} {
		r := driver.Row{Status: c.status, Stored: c.stored}
		r.Judge(driver.KeyTimes{Now: now, ExpiresAt: at(1)}, true)
		if r.Stored.Gone != c.gone || (c.gone && (r.Stored.Body != nil || r.Stored.Headers != nil || r.Stored.Status != 201)) {
			t.Errorf("%s with %+v: %+v, want gone %v", c.status, c.stored, r.Stored, c.gone)
		}
	}
}
