package callertest

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/idem"
)

// UnknownAt is the life of Record.UnknownAt, when a record became unknown:
// written by the worker's MarkUnknown and by ExpireLeases, the first time
// kept when the attempt is marked unknown again and after a verdict,
// cleared by the next attempt (after a retryable verdict, and a resume
// inside a window). Times are compared with the record's own, never with a
// clock of the test.
func UnknownAt(t *testing.T, newFront NewFront) {
	ctx := context.Background()
	f := newFront(t, idem.Config{})
	scope, fp := idem.Scope{Actor: "ursula", Operation: "charge"}, idem.FingerprintParts([]byte("u"))
	lookup := func(key string) idem.Record {
		t.Helper()
		rec, err := f.Lookup(ctx, scope, key)
		if err != nil {
			t.Fatalf("Lookup %s: %v", key, err)
		}
		return rec
	}

	// The worker marks its attempt unknown: the time is recorded, within the
	// attempt's lease.
	r1, err := f.ReserveWith(ctx, scope, "marked", fp, idem.ReserveOptions{Lease: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if rec := lookup("marked"); !rec.UnknownAt.IsZero() {
		t.Fatalf("an attempt in flight has an UnknownAt: %+v", rec)
	}
	if err := f.MarkUnknown(ctx, r1, "gateway timeout"); err != nil {
		t.Fatal(err)
	}
	first := lookup("marked")
	if first.Status != idem.StatusUnknown || first.UnknownAt.IsZero() || first.UnknownAt.Before(first.CreatedAt) ||
		!first.UnknownAt.Before(first.LeaseExpiresAt) {
		t.Fatalf("marked unknown: %+v", first)
	}
	// Marked again (a repeated call): the first time stays.
	time.Sleep(2 * time.Millisecond)
	if err := f.MarkUnknown(ctx, r1, "again"); err != nil {
		t.Fatal(err)
	}
	if rec := lookup("marked"); !rec.UnknownAt.Equal(first.UnknownAt) || rec.LastError != "again" {
		t.Fatalf("marked unknown again: UnknownAt %s, first %s (%+v)", rec.UnknownAt, first.UnknownAt, rec)
	}
	// A verdict keeps it; the next attempt clears it.
	if err := f.Resolve(ctx, scope, "marked", idem.Resolution{Token: r1.Token, Retryable: true, Reason: "no charge at the provider"}); err != nil {
		t.Fatal(err)
	}
	if rec := lookup("marked"); rec.Status != idem.StatusFailedRetryable || !rec.UnknownAt.Equal(first.UnknownAt) {
		t.Fatalf("after the verdict: %+v, want UnknownAt %s kept", rec, first.UnknownAt)
	}
	r2, err := f.ReserveWith(ctx, scope, "marked", fp, idem.ReserveOptions{Lease: time.Hour})
	if err != nil || r2.Token <= r1.Token {
		t.Fatalf("the next attempt: %+v, %v", r2, err)
	}
	if rec := lookup("marked"); rec.Status != idem.StatusProcessing || !rec.UnknownAt.IsZero() {
		t.Fatalf("the next attempt kept UnknownAt: %+v", rec)
	}
	if err := f.Complete(ctx, r2, idem.Response{Status: 201}); err != nil {
		t.Fatal(err)
	}
	if rec := lookup("marked"); rec.Status != idem.StatusSucceeded || !rec.UnknownAt.IsZero() {
		t.Fatalf("completed: %+v", rec)
	}

	// ExpireLeases: the time it turned the lapsed attempt unknown, after
	// the lease ran out.
	if _, err := f.ReserveWith(ctx, scope, "lapsed", fp, idem.ReserveOptions{Lease: time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	if n, err := f.ExpireLeases(ctx, 100); err != nil || n != 1 {
		t.Fatalf("ExpireLeases: %d, %v", n, err)
	}
	if rec := lookup("lapsed"); rec.Status != idem.StatusUnknown || rec.UnknownAt.IsZero() || rec.UnknownAt.Before(rec.LeaseExpiresAt) {
		t.Fatalf("expired: %+v", rec)
	}

	// Inside a window, the resume is a new attempt: cleared.
	w1, err := f.ReserveWith(ctx, scope, "window", fp, idem.ReserveOptions{Lease: time.Minute, ResumeWithin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.MarkUnknown(ctx, w1, "no answer"); err != nil {
		t.Fatal(err)
	}
	if rec := lookup("window"); rec.UnknownAt.IsZero() {
		t.Fatalf("marked unknown inside its window: %+v", rec)
	}
	if w2, err := f.ReserveWith(ctx, scope, "window", fp, idem.ReserveOptions{Lease: time.Minute}); err != nil || !w2.Resumed {
		t.Fatalf("the resume: %+v, %v", w2, err)
	}
	if rec := lookup("window"); rec.Status != idem.StatusProcessing || !rec.UnknownAt.IsZero() {
		t.Fatalf("the resumed attempt kept UnknownAt: %+v", rec)
	}
}
