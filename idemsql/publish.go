package idemsql

import (
	"context"
	"database/sql"
	"errors"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/dbsql"
	"github.com/pgidem/idem/internal/outbox"
)

// Publish is idem.Publish on a *sql.Tx: it writes ev to the outbox in tx,
// the caller's transaction, for an idem.Relay to send once tx commits.
// The same event again does nothing; the same (Destination, ID) with
// another Topic, Payload or Header is idem.ErrEventReused; an invalid
// event idem.ErrInvalidEvent and a nil tx idem.ErrInvalidArgument, refused
// before any statement runs. Publish never commits or rolls back tx. It
// works with pgx's stdlib driver and with lib/pq.
func Publish(ctx context.Context, tx *sql.Tx, ev idem.Event) error {
	header, err := outbox.Check(ev.ID, ev.Topic, ev.Destination, ev.Payload, ev.Header)
	if err != nil {
		return core.Errorf("idem: publish: %w: %s", idem.ErrInvalidEvent, err.Error())
	}
	if tx == nil {
		return core.Errorf("idem: publish: %w: nil tx", idem.ErrInvalidArgument)
	}
	payload := ev.Payload
	if payload == nil {
		payload = []byte{}
	}
	h := sql.NullString{String: string(header), Valid: header != nil}
	q := dbsql.New()
	inserted, err := q.EventPublish(ctx, tx, dbsql.EventPublishParams{
		Destination: ev.Destination, ID: ev.ID, Topic: ev.Topic, Payload: payload, Header: h})
	if err != nil {
		return eventStoreErr("publish", err)
	}
	if inserted {
		return nil
	}
	same, err := q.EventSame(ctx, tx, dbsql.EventSameParams{
		Destination: ev.Destination, ID: ev.ID, Topic: ev.Topic, Payload: payload, Header: h})
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return core.Errorf("idem: publish: event %q for %q was pruned while it was published again: %w",
			ev.ID, ev.Destination, idem.ErrEventReused)
	case err != nil:
		return eventStoreErr("publish", err)
	case !same:
		return core.Errorf("idem: publish: %w: event %q for %q holds another topic, payload or header",
			idem.ErrEventReused, ev.ID, ev.Destination)
	}
	return nil
}
