package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// idemsql.LookupEvent reads what idem.LookupEvent reads; RetryEvent sends
// a failed event again, and refuses a pending one, a missing one and a bad
// reason, changing nothing.
func TestLookupAndRetryEvent(t *testing.T) {
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, pool := migrated(t, driver)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		ev := idem.Event{ID: "ev-1", Topic: "payment.succeeded", Destination: "billing", Payload: []byte(`{}`),
			Header: map[string][]string{"X-Trace": {"t1"}}}
		if err := idemsql.Publish(ctx, tx, ev); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		got, err := idemsql.LookupEvent(ctx, db, "ev-1", "billing")
		if err != nil {
			t.Fatal(err)
		}
		want, err := idem.LookupEvent(ctx, pool, "ev-1", "billing")
		if err != nil {
			t.Fatal(err)
		}
		// Printed: the drivers give the same instants in different *time.Location values.
		if fmt.Sprintf("%+v", got) != fmt.Sprintf("%+v", want) || got.Status != idem.EventPending {
			t.Fatalf("idemsql.LookupEvent:\n%+v\nidem.LookupEvent:\n%+v", got, want)
		}
		if _, err := idemsql.LookupEvent(ctx, db, "nope", "billing"); !errors.Is(err, idem.ErrEventNotFound) {
			t.Fatalf("a missing event: %v", err)
		}
		if err := idemsql.RetryEvent(ctx, db, "ev-1", "billing", "r"); !errors.Is(err, idem.ErrEventNotFailed) {
			t.Fatalf("retry of a pending event: %v", err)
		}
		if err := idemsql.RetryEvent(ctx, db, "nope", "billing", "r"); !errors.Is(err, idem.ErrEventNotFound) {
			t.Fatalf("retry of a missing event: %v", err)
		}
		if _, err := pool.Exec(ctx, `UPDATE idem_events SET status = 'failed', failed_at = now(), last_error = 'down'`); err != nil {
			t.Fatal(err)
		}
		for _, reason := range []string{"", "\xff"} {
			if err := idemsql.RetryEvent(ctx, db, "ev-1", "billing", reason); !errors.Is(err, idem.ErrInvalidArgument) {
				t.Fatalf("retry with reason %q: %v", reason, err)
			}
		}
		if err := idemsql.RetryEvent(ctx, (*sql.DB)(nil), "ev-1", "billing", "r"); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Fatalf("retry on a nil db: %v", err)
		}
		if rec, _ := idemsql.LookupEvent(ctx, db, "ev-1", "billing"); rec.Status != idem.EventFailed {
			t.Fatalf("refused retries changed the event: %s", rec.Status)
		}
		if err := idemsql.RetryEvent(ctx, db, "ev-1", "billing", "receiver back"); err != nil {
			t.Fatal(err)
		}
		rec, err := idemsql.LookupEvent(ctx, db, "ev-1", "billing")
		if err != nil || rec.Status != idem.EventPending || rec.RetryReason != "receiver back" {
			t.Fatalf("after the retry: %+v, %v", rec, err)
		}
	})
}
