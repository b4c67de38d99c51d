package driver_test

import (
	"testing"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// TestRowJudge: what KeyGet's statement computed until 2026-12-06, now in
// Go from its times: expires_at <= now(), lease_expires_at IS NOT NULL,
// coalesce((extract(epoch FROM lease_expires_at - now()) * 1000)::bigint, 0)
// (numeric to bigint rounds half away from zero), and whether the body is
// gone as KeyLookup and ReserveLock say it (response_body IS NULL OR
// body_expires_at <= now()), for finished rows that kept their
// response_status.
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
		r.Judge(driver.KeyTimes{Now: now, ExpiresAt: c.expires, LeaseExpiresAt: c.lease})
		if r.Expired != c.expired || r.Leased != c.leased || r.LeaseLeftMs != c.leftMs {
			t.Errorf("%s: expired %v leased %v left %d ms, want %v %v %d", c.name,
				r.Expired, r.Leased, r.LeaseLeftMs, c.expired, c.leased, c.leftMs)
		}
	}

	stored := driver.Stored{Valid: true, Status: 201, Headers: []byte(`{}`), Body: []byte("ok")}
	empty := driver.Stored{Valid: true, Status: 204, Body: []byte{}}
	dropped := driver.Stored{Valid: true, Status: 201}
	for _, c := range []struct {
		name   string
		status string
		stored driver.Stored
		body   time.Time // body_expires_at
		gone   bool
	}{
		{"body's time passed", "succeeded", stored, at(-1), true},
		{"body's time now", "rejected", stored, now, true},
		{"body's time to come", "succeeded", stored, at(1), false},
		{"no body's time", "succeeded", stored, time.Time{}, false},
		{"empty body", "succeeded", empty, time.Time{}, false},
		{"dropped body", "succeeded", dropped, time.Time{}, true},
		{"dropped body, rejected", "rejected", dropped, time.Time{}, true},
		{"NULL body before its time", "succeeded", dropped, at(1), true},
		{"not finished", "failed_retryable", stored, at(-1), false},
		{"no outcome", "processing", driver.Stored{}, at(-1), false},
		{"no response", "succeeded", driver.Stored{}, time.Time{}, false},
	} {
		r := driver.Row{Status: c.status, Stored: c.stored}
		r.Judge(driver.KeyTimes{Now: now, ExpiresAt: at(1), BodyExpiresAt: c.body})
		want := c.stored
		if c.gone {
			want = driver.Stored{Valid: true, Status: c.stored.Status, Gone: true}
		}
		if r.Stored.Gone != want.Gone || r.Stored.Status != want.Status || (r.Stored.Body == nil) != (want.Body == nil) ||
			(r.Stored.Headers == nil) != (want.Headers == nil) {
			t.Errorf("%s: %+v, want %+v", c.name, r.Stored, want)
		}
	}
}
