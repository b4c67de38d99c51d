package idemui

// The deliveries page: the outbox's failed and overdue events (issue 32),
// one event's attempt log, and the form that sends a failed event again.

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
	store "github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/outbox"
)

// deliveriesLimit is how many events each list of the page shows.
const deliveriesLimit = 100

// deliveriesView is the body of the deliveries page.
type deliveriesView struct {
	Destination string
	Lists       []eventList // failed, then overdue
	Limit       int
}

// eventList is one list of the deliveries page.
type eventList struct {
	Title, Empty string
	Rows         []store.EventListRow
}

// deliveriesPage lists the failed events and the overdue ones (pending,
// due for over outbox.OverdueAfter), newest first, optionally for one
// destination.
func (q *request) deliveriesPage() {
	destination, err := one(q.r.URL.Query(), "destination")
	if err != nil {
		q.fail(err)
		return
	}
	v := deliveriesView{Destination: strings.TrimSpace(destination), Limit: deliveriesLimit}
	err = readEvents(q.r.Context(), q.c.opts.DB, func(ctx context.Context, tx pgx.Tx) error {
		for _, l := range []eventList{{Title: "Failed", Empty: "No failed event."}, {Title: "Overdue", Empty: "No overdue event."}} {
			var err error
			l.Rows, err = outbox.List(ctx, tx, outbox.Filter{Status: strings.ToLower(l.Title), Destination: v.Destination, Limit: deliveriesLimit})
			if err != nil {
				return err
			}
			v.Lists = append(v.Lists, l)
		}
		return nil
	})
	if err != nil {
		q.fail(err)
		return
	}
	q.page(http.StatusOK, "deliveries", "Deliveries", "deliveries", v, q.done())
}

// readEvents runs fn in a read-only transaction on db.
func readEvents(ctx context.Context, db idem.Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, "SET TRANSACTION READ ONLY"); err != nil {
		return err
	}
	return fn(ctx, tx)
}

// eventView is the body of an event's page.
type eventView struct {
	Record idem.EventRecord
	// BackURL is the deliveries page for the event's destination.
	BackURL string
}

// eventQuery reads the event's address: ?destination=D&id=X (a form's
// fields for the POST).
func eventQuery(vs url.Values) (destination, id string, err error) {
	if destination, err = one(vs, "destination"); err != nil {
		return "", "", err
	}
	if id, err = one(vs, "id"); err != nil {
		return "", "", err
	}
	if destination == "" || id == "" {
		return "", "", badRequest("invalid_event", "An event's address needs its destination and its id.")
	}
	return destination, id, nil
}

// eventPage shows one event: its status and its attempt log, and for a
// failed event the form that sends it again.
func (q *request) eventPage() {
	destination, id, err := eventQuery(q.r.URL.Query())
	if err != nil {
		q.fail(err)
		return
	}
	rec, err := idem.LookupEvent(q.r.Context(), q.c.opts.DB, id, destination)
	if err != nil {
		q.fail(err)
		return
	}
	v := eventView{Record: rec, BackURL: q.url("/deliveries", url.Values{"destination": {destination}})}
	q.page(http.StatusOK, "event", "Event "+id, "deliveries", v, q.done())
}

// retryEventPage sends a failed event again, after the confirmation box
// was ticked and with a reason, writing the audit row retry_event in the
// same transaction (audit.RetryEvent). A refusal changes nothing.
func (q *request) retryEventPage() {
	if err := q.r.ParseForm(); err != nil {
		q.fail(badRequest("invalid_form", "The form could not be read."))
		return
	}
	destination, id, err := eventQuery(q.r.PostForm)
	if err != nil {
		q.fail(err)
		return
	}
	if q.r.PostForm.Get("confirm") != "yes" {
		q.fail(badRequest("not_confirmed", "Tick the box to confirm that the event is to be sent again. Nothing changed."))
		return
	}
	reason := strings.TrimSpace(q.r.PostForm.Get("reason"))
	if reason == "" {
		q.fail(badRequest("no_reason", "Say why the event is sent again: the reason is kept with the event and in the audit trail. Nothing changed."))
		return
	}
	if _, err := audit.RetryEvent(q.r.Context(), q.c.opts.DB, q.client(), q.operator, id, destination, reason); err != nil {
		q.fail(err)
		return
	}
	q.redirectDone("/event", url.Values{"destination": {destination}, "id": {id}},
		"Event sent again: it is pending and due now; a relay sends it next. The audit trail records it.")
}

// eventLink is the event an audit row of retry_event names.
type eventLink struct{ Destination, ID, URL string }

// eventRef reads the event of a retry_event row from its detail; nil when
// the detail names none.
func eventRef(prefix string, e audit.Entry) *eventLink {
	var d struct{ Destination, ID string }
	if json.Unmarshal(e.Detail, &d) != nil || d.Destination == "" || d.ID == "" {
		return nil
	}
	return &eventLink{Destination: d.Destination, ID: d.ID,
		URL: prefix + "/event?" + url.Values{"destination": {d.Destination}, "id": {d.ID}}.Encode()}
}
