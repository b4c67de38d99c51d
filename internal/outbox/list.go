package outbox

import (
	"context"
	"time"

	store "github.com/pgidem/idem/internal/db"
)

// OverdueAfter is how long a pending event may be due before it is
// overdue: no relay sent it within a minute of its time (none runs, or
// they are behind).
const OverdueAfter = time.Minute

// Filter selects the events List returns. Status is "", "pending",
// "delivered", "failed" or "overdue" (pending and overdue); Destination ""
// matches every destination; Limit is at least 1.
type Filter struct {
	Status      string
	Destination string
	Limit       int
}

// Statuses are the values of Filter.Status other than "".
var Statuses = []string{"pending", "delivered", "failed", "overdue"}

// ValidStatus reports whether s is a Filter.Status.
func ValidStatus(s string) bool {
	if s == "" {
		return true
	}
	for _, v := range Statuses {
		if s == v {
			return true
		}
	}
	return false
}

// List returns the events f selects, newest first; the overdue ones the
// longest overdue first, through the relay's index of due events, and the
// failed ones through their own (queries/outbox_ops.sql).
// The caller validates f (ValidStatus, a positive Limit).
func List(ctx context.Context, db store.DBTX, f Filter) ([]store.EventListRow, error) {
	p := store.EventListParams{
		OverdueMicros: OverdueAfter.Microseconds(),
		Status:        f.Status,
		Destination:   f.Destination,
		MaxRows:       int32(min(f.Limit, 10000)),
	}
	switch f.Status {
	case "overdue":
		rows, err := store.New().EventListOverdue(ctx, db, store.EventListOverdueParams{
			OverdueMicros: p.OverdueMicros, Destination: p.Destination, MaxRows: p.MaxRows})
		out := make([]store.EventListRow, len(rows))
		for i, r := range rows {
			out[i] = store.EventListRow(r)
		}
		return out, err
	case "failed":
		rows, err := store.New().EventListFailed(ctx, db, store.EventListFailedParams{Destination: p.Destination, MaxRows: p.MaxRows})
		out := make([]store.EventListRow, len(rows))
		for i, r := range rows {
			out[i] = store.EventListRow(r)
		}
		return out, err
	}
	return store.New().EventList(ctx, db, p)
}
