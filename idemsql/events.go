package idemsql

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"time"
	"unicode/utf8"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/dbsql"
	"github.com/pgidem/idem/internal/outbox"
)

// LookupEvent is idem.LookupEvent on a *sql.DB: the event (destination, id)
// with its state and attempt log, or idem.ErrEventNotFound. It reads in a
// transaction of its own and changes nothing.
func LookupEvent(ctx context.Context, db *sql.DB, id, destination string) (idem.EventRecord, error) {
	if db == nil {
		return idem.EventRecord{}, core.Errorf("idem: lookup event: %w: nil db", idem.ErrInvalidArgument)
	}
	var rec idem.EventRecord
	err := eventTx(ctx, db, "lookup event", func(tx *sql.Tx) error {
		var err error
		rec, err = lookupEvent(ctx, tx, id, destination)
		return err
	})
	return rec, err
}

// RetryEvent is idem.RetryEvent on a *sql.DB: a failed event becomes
// pending and due now, reason recorded; a pending or delivered one is
// idem.ErrEventNotFailed, a missing one idem.ErrEventNotFound, an empty or
// invalid reason idem.ErrInvalidArgument, and none of them changes
// anything. It wakes listening relays when it commits.
func RetryEvent(ctx context.Context, db *sql.DB, id, destination, reason string) error {
	switch {
	case db == nil:
		return core.Errorf("idem: retry event: %w: nil db", idem.ErrInvalidArgument)
	case reason == "" || len(reason) > idem.MaxRetryReason || !utf8.ValidString(reason):
		return core.Errorf("idem: retry event: %w: reason must be 1 to %d bytes of UTF-8", idem.ErrInvalidArgument, idem.MaxRetryReason)
	}
	return eventTx(ctx, db, "retry event", func(tx *sql.Tx) error {
		q := dbsql.New()
		n, err := q.EventRetry(ctx, tx, dbsql.EventRetryParams{Destination: destination, ID: id, Reason: reason})
		if err != nil {
			return eventStoreErr("retry event", err)
		}
		if n == 0 {
			rec, err := lookupEvent(ctx, tx, id, destination)
			if err != nil {
				return err
			}
			return core.Errorf("idem: retry event: %w: %q for %q is %s", idem.ErrEventNotFailed, id, destination, rec.Status)
		}
		if _, err := tx.ExecContext(ctx, "SELECT pg_notify('"+idem.EventsChannel+"', '')"); err != nil {
			return eventStoreErr("retry event", err)
		}
		return nil
	})
}

// eventTx runs fn in a transaction on db, committed when fn returns nil.
func eventTx(ctx context.Context, db *sql.DB, op string, fn func(tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return eventStoreErr(op, err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return eventStoreErr(op, err)
	}
	return nil
}

// lookupEvent reads the event and its attempt log in tx.
func lookupEvent(ctx context.Context, tx *sql.Tx, id, destination string) (idem.EventRecord, error) {
	q := dbsql.New()
	r, err := q.EventLookup(ctx, tx, dbsql.EventLookupParams{Destination: destination, ID: id})
	if errors.Is(err, sql.ErrNoRows) {
		return idem.EventRecord{}, core.Errorf("idem: lookup event: %w: %q for %q", idem.ErrEventNotFound, id, destination)
	}
	if err != nil {
		return idem.EventRecord{}, eventStoreErr("lookup event", err)
	}
	header, err := outbox.DecodeHeader(r.Header)
	if err != nil {
		return idem.EventRecord{}, core.Errorf("idem: lookup event: %w: header: %w", idem.ErrStoredValue, err)
	}
	rec := idem.EventRecord{
		Event:  idem.Event{ID: r.ID, Topic: r.Topic, Destination: r.Destination, Payload: r.Payload, Header: header},
		Status: idem.EventStatus(r.Status), AttemptCount: int(r.Attempts),
		CreatedAt: r.CreatedAt, NextAttemptAt: r.NextAttemptAt,
		DeliveredAt: r.DeliveredAt.Time, FailedAt: r.FailedAt.Time, LastError: r.LastError.String,
		RetriedAt: r.RetriedAt.Time, RetryReason: r.RetryReason.String, ExpiresAt: r.ExpiresAt.Time,
	}
	attempts, err := q.EventAttempts(ctx, tx, dbsql.EventAttemptsParams{Destination: destination, ID: id})
	if err != nil {
		return idem.EventRecord{}, eventStoreErr("lookup event", err)
	}
	for _, a := range attempts {
		rec.Attempts = append(rec.Attempts, idem.EventAttempt{
			Attempt: int(a.Attempt), StartedAt: a.StartedAt,
			Duration: time.Duration(a.DurationMicros) * time.Microsecond,
			Error:    a.Error.String, Permanent: a.Permanent,
		})
	}
	logged := slices.ContainsFunc(rec.Attempts, func(a idem.EventAttempt) bool { return a.Attempt == int(r.DeliveredAttempt.Int32) })
	if r.DeliveredAttempt.Valid && !logged {
		// The delivery is kept in the event's row (as idem.LookupEvent).
		rec.Attempts = append(rec.Attempts, idem.EventAttempt{
			Attempt: int(r.DeliveredAttempt.Int32), StartedAt: r.DeliveryStartedAt.Time,
			Duration: time.Duration(r.DeliveryMicros.Int64) * time.Microsecond,
		})
		slices.SortFunc(rec.Attempts, func(a, b idem.EventAttempt) int { return a.Attempt - b.Attempt })
	}
	return rec, nil
}

// eventStoreErr is a failed statement of op: wrapped with
// idem.ErrUnavailable when the database could not serve it.
func eventStoreErr(op string, err error) error {
	if err = publicErr(defaultClient.c.PreparedStatementsLost(err)); errors.Is(err, idem.ErrPreparedStatements) {
		return core.Errorf("idem: %s: %w", op, err)
	}
	if idem.Unavailable(err) {
		return core.Errorf("idem: %s: %w: %w", op, idem.ErrUnavailable, err)
	}
	return core.Errorf("idem: %s: %w", op, err)
}
