package idem

import (
	"context"
	"errors"
	"slices"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/outbox"
)

// Errors of the outbox (Publish, LookupEvent, RetryEvent). idemsql returns
// the same ones.
var (
	// ErrInvalidEvent means Publish was given an event it cannot store: an
	// empty ID, Topic or Destination, one over MaxEventNameLength bytes or
	// holding a control character or invalid UTF-8, a Payload over
	// MaxEventPayload, or a Header whose name is not an RFC 9110 token,
	// whose value holds a control character other than a tab (which
	// net/http would refuse to send) or invalid UTF-8, or which is over
	// MaxEventHeader as JSON. Nothing was written.
	ErrInvalidEvent = errors.New("idem: invalid event")

	// ErrEventReused means Publish was given an event whose (Destination,
	// ID) is already in the outbox with another Topic, Payload or Header:
	// an ID used for two different events. Nothing was written; the caller's
	// transaction stays usable. (The same event again is no error: Publish
	// does nothing.)
	ErrEventReused = errors.New("idem: event id reused with a different event")

	// ErrEventNotFound means no event has this (destination, id): it was
	// never published, its transaction has not committed, or it was pruned
	// after its TTL. Nothing changed.
	ErrEventNotFound = errors.New("idem: no such event")

	// ErrEventNotFailed means RetryEvent was given an event that is pending
	// (the relay sends it) or delivered: only a failed event is sent again.
	// Nothing changed.
	ErrEventNotFailed = errors.New("idem: event is not failed")
)

// Limits of an event (ErrInvalidEvent beyond them). The checks are
// internal/outbox's; TestEventLimitsMatch keeps the two in step.
const (
	// MaxEventNameLength bounds an event's ID, Topic and Destination, in
	// bytes.
	MaxEventNameLength = 255
	// MaxEventPayload bounds an event's Payload, in bytes (1 MiB).
	MaxEventPayload = 1 << 20
	// MaxEventHeader bounds an event's Header as stored (a JSON object of
	// string arrays), in bytes (64 KiB).
	MaxEventHeader = 1 << 16
)

// EventsChannel is the PostgreSQL notification channel on which Publish
// wakes listening relays when its transaction commits.
const EventsChannel = "idem_events"

// Publish writes ev to the outbox (idem_events, migration 00007) in tx, the
// caller's transaction: inside Do's fn, or any transaction. A Relay sends it
// once tx commits; if tx rolls back, nothing was published. Publish never
// commits or rolls back tx.
//
// An event is identified by (Destination, ID). Publishing the same event
// again (same Topic, Payload byte for byte, and Header) does nothing, so a
// retried transaction or two writers of one event (EventID) publish it
// once; the same (Destination, ID) with another Topic, Payload or Header is
// ErrEventReused and writes nothing. An ID is unique until its event is
// pruned (RelayOptions.TTL); after that, the same ID is a new event.
//
// An invalid event (see ErrInvalidEvent) or a nil tx is refused before any
// statement runs. Publish costs one round trip; it also notifies
// EventsChannel, delivered when tx commits, so that listening relays send
// the event at once (PostgreSQL serializes the commits of transactions
// that notified: a few thousand per second are fine; see docs/messages.md).
// If tx commits while a second transaction publishes the same event, the
// second waits for the first and then compares.
func Publish(ctx context.Context, tx pgx.Tx, ev Event) error {
	header, err := outbox.Check(ev.ID, ev.Topic, ev.Destination, ev.Payload, ev.Header)
	if err != nil {
		return core.Errorf("idem: publish: %w: %s", ErrInvalidEvent, err.Error())
	}
	if tx == nil {
		return core.Errorf("idem: publish: %w: nil tx", ErrInvalidArgument)
	}
	payload := ev.Payload
	if payload == nil {
		payload = []byte{}
	}
	h := pgtype.Text{String: string(header), Valid: header != nil}
	q := dbQueries
	inserted, err := q.EventPublish(ctx, tx, db.EventPublishParams{
		Destination: ev.Destination, ID: ev.ID, Topic: ev.Topic, Payload: payload, Header: h})
	if err != nil {
		return storeErr("publish", err)
	}
	if inserted {
		return nil
	}
	same, err := q.EventSame(ctx, tx, db.EventSameParams{
		Destination: ev.Destination, ID: ev.ID, Topic: ev.Topic, Payload: payload, Header: h})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return core.Errorf("idem: publish: event %q for %q was pruned while it was published again: %w",
			ev.ID, ev.Destination, ErrEventReused)
	case err != nil:
		return storeErr("publish", err)
	case !same:
		return core.Errorf("idem: publish: %w: event %q for %q holds another topic, payload or header",
			ErrEventReused, ev.ID, ev.Destination)
	}
	return nil
}

// storeErr is a failed statement of the outbox: wrapped with ErrUnavailable
// when the database could not serve it.
func storeErr(op string, err error) error {
	if err = publicErr(defaultClient.c.PreparedStatementsLost(err)); errors.Is(err, ErrPreparedStatements) {
		return core.Errorf("idem: %s: %w", op, err)
	}
	if Unavailable(err) {
		return core.Errorf("idem: %s: %w: %w", op, ErrUnavailable, err)
	}
	return core.Errorf("idem: %s: %w", op, err)
}

// EventStatus is the state of an event in the outbox.
type EventStatus string

// The states of an event.
const (
	// EventPending: to send, or being sent (a relay holds a claim on it
	// until NextAttemptAt).
	EventPending EventStatus = "pending"
	// EventDelivered: the destination accepted it.
	EventDelivered EventStatus = "delivered"
	// EventFailed: its schedule ran out, or an attempt failed with a
	// Permanent error. RetryEvent sends it again.
	EventFailed EventStatus = "failed"
)

// EventRecord is an event as the outbox holds it (LookupEvent).
type EventRecord struct {
	Event  Event
	Status EventStatus
	// AttemptCount is the number of attempts made, every claim by a relay
	// counting one (an attempt cut by a relay's crash is counted here and
	// has no entry in Attempts, unless the relay held the event by a row
	// lock only, a fast batch: then it is neither counted nor logged).
	AttemptCount int
	// Attempts is the attempt log, in order.
	Attempts []EventAttempt
	// CreatedAt is when the event was published (its transaction's time).
	CreatedAt time.Time
	// NextAttemptAt is, for a pending event, when it is due, or when the
	// claim of the relay that is sending it runs out.
	NextAttemptAt time.Time
	// DeliveredAt and FailedAt are when the event was delivered or marked
	// failed (zero otherwise).
	DeliveredAt, FailedAt time.Time
	// LastError is the last attempt's error ("" after a delivery).
	LastError string
	// RetriedAt and RetryReason are the last RetryEvent's (zero and "" if
	// none).
	RetriedAt   time.Time
	RetryReason string
	// ExpiresAt is when a delivered or failed event may be pruned (zero
	// while pending).
	ExpiresAt time.Time
}

// EventAttempt is one attempt in an event's log.
type EventAttempt struct {
	// Attempt numbers the attempts at the event, from 1.
	Attempt int
	// StartedAt is when the relay called the Sender, and Duration how long
	// the Sender took.
	StartedAt time.Time
	Duration  time.Duration
	// Error is the Sender's error ("" for the delivery); Permanent says it
	// was marked Permanent.
	Error     string
	Permanent bool
}

// LookupEvent returns the event (destination, id) with its state and
// attempt log, or ErrEventNotFound. It reads in a transaction of its own
// begun on db and changes nothing.
func LookupEvent(ctx context.Context, db Beginner, id, destination string) (EventRecord, error) {
	if db == nil {
		return EventRecord{}, core.Errorf("idem: lookup event: %w: nil db", ErrInvalidArgument)
	}
	var rec EventRecord
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		rec, err = lookupEvent(ctx, tx, id, destination)
		return err
	})
	return rec, err
}

// lookupEvent reads the event and its attempt log in tx.
func lookupEvent(ctx context.Context, tx pgx.Tx, id, destination string) (EventRecord, error) {
	q := dbQueries
	r, err := q.EventLookup(ctx, tx, db.EventLookupParams{Destination: destination, ID: id})
	if errors.Is(err, pgx.ErrNoRows) {
		return EventRecord{}, core.Errorf("idem: lookup event: %w: %q for %q", ErrEventNotFound, id, destination)
	}
	if err != nil {
		return EventRecord{}, storeErr("lookup event", err)
	}
	header, err := outbox.DecodeHeader(r.Header)
	if err != nil {
		return EventRecord{}, core.Errorf("idem: lookup event: %w: header: %w", ErrStoredValue, err)
	}
	rec := EventRecord{
		Event:  Event{ID: r.ID, Topic: r.Topic, Destination: r.Destination, Payload: r.Payload, Header: header},
		Status: EventStatus(r.Status), AttemptCount: int(r.Attempts),
		CreatedAt: r.CreatedAt.Time, NextAttemptAt: r.NextAttemptAt.Time,
		DeliveredAt: r.DeliveredAt.Time, FailedAt: r.FailedAt.Time, LastError: r.LastError.String,
		RetriedAt: r.RetriedAt.Time, RetryReason: r.RetryReason.String, ExpiresAt: r.ExpiresAt.Time,
	}
	attempts, err := q.EventAttempts(ctx, tx, db.EventAttemptsParams{Destination: destination, ID: id})
	if err != nil {
		return EventRecord{}, storeErr("lookup event", err)
	}
	for _, a := range attempts {
		rec.Attempts = append(rec.Attempts, EventAttempt{
			Attempt: int(a.Attempt), StartedAt: a.StartedAt.Time,
			Duration: time.Duration(a.DurationMicros) * time.Microsecond,
			Error:    a.Error.String, Permanent: a.Permanent,
		})
	}
	logged := slices.ContainsFunc(rec.Attempts, func(a EventAttempt) bool { return a.Attempt == int(r.DeliveredAttempt.Int32) })
	if r.DeliveredAttempt.Valid && !logged {
		// The delivery is kept in the event's row (migration 00007); a
		// record sent twice (its first reply lost) also logged it.
		rec.Attempts = append(rec.Attempts, EventAttempt{
			Attempt: int(r.DeliveredAttempt.Int32), StartedAt: r.DeliveryStartedAt.Time,
			Duration: time.Duration(r.DeliveryMicros.Int64) * time.Microsecond,
		})
		slices.SortFunc(rec.Attempts, func(a, b EventAttempt) int { return a.Attempt - b.Attempt })
	}
	return rec, nil
}

// MaxRetryReason bounds RetryEvent's reason, in bytes.
const MaxRetryReason = 1024

// RetryEvent sends a failed event again: it becomes pending and due now,
// its schedule restarting from the first retry delay, and reason (who
// decided and why, required) is recorded in EventRecord.RetryReason. Its
// attempt log is kept; new attempts are numbered after it. An event that is
// pending or delivered is ErrEventNotFailed, a missing one
// ErrEventNotFound, an empty or invalid reason ErrInvalidArgument; none of
// them changes anything. It runs in a transaction of its own begun on db,
// and wakes listening relays when it commits. The console and the idem
// command retry through their own paths, which also write the audit trail.
func RetryEvent(ctx context.Context, db Beginner, id, destination, reason string) error {
	switch {
	case db == nil:
		return core.Errorf("idem: retry event: %w: nil db", ErrInvalidArgument)
	case reason == "" || len(reason) > MaxRetryReason || !utf8.ValidString(reason):
		return core.Errorf("idem: retry event: %w: reason must be 1 to %d bytes of UTF-8", ErrInvalidArgument, MaxRetryReason)
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return retryEvent(ctx, tx, id, destination, reason) })
}

// retryEvent is RetryEvent in tx.
func retryEvent(ctx context.Context, tx pgx.Tx, id, destination, reason string) error {
	q := dbQueries
	n, err := q.EventRetry(ctx, tx, db.EventRetryParams{Destination: destination, ID: id, Reason: reason})
	if err != nil {
		return storeErr("retry event", err)
	}
	if n == 0 {
		rec, err := lookupEvent(ctx, tx, id, destination)
		if err != nil {
			return core.Errorf("idem: retry event: %w", err)
		}
		return core.Errorf("idem: retry event: %w: %q for %q is %s", ErrEventNotFailed, id, destination, rec.Status)
	}
	_, err = tx.Exec(ctx, "SELECT pg_notify('"+EventsChannel+"', '')")
	if err != nil {
		return storeErr("retry event", err)
	}
	return nil
}

// dbQueries are the outbox's statements (sqlc's Queries hold no state).
var dbQueries = db.New()
