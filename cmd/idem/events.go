package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
	"github.com/pgidem/idem/internal/outbox"
)

// eventsCommand is idem events: the outbox's events (issue 32).
var eventsCommand = command{
	usage: "events list [--status failed|pending|delivered|overdue] [--destination D] [--limit N] | events show <destination> <id> | events retry <destination> <id> --reason R [--operator NAME]",
	help: "list prints the events of the outbox, newest first: their status, attempts and last error;\n" +
		"--status overdue lists the pending events due for over a minute that no relay has sent.\n" +
		"show prints an event of the outbox: its status (pending, delivered, failed), its attempts and\n" +
		"their errors. retry sends a failed event again (due at once, its schedule restarting), with the\n" +
		"reason recorded in the event; a pending or delivered event is refused with exit code 4, a\n" +
		"missing one is exit code 3. It writes a row of the audit trail (idem audit list) in the same\n" +
		"transaction, naming --operator.",
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		var reason, operator string
		var f outbox.Filter
		fs.StringVar(&reason, "reason", "", "with retry: why the event is sent again `R` (required)")
		operatorFlag(fs, &operator)
		fs.StringVar(&f.Status, "status", "", "with list: only the events `S`: pending, delivered, failed or overdue")
		fs.StringVar(&f.Destination, "destination", "", "with list: only the events for the destination `D`")
		fs.IntVar(&f.Limit, "limit", 100, "with list: list at most `N` events (up to 10000)")
		return func(ctx context.Context, e *env, args []string) error {
			if len(args) > 0 && args[0] == "list" {
				return eventsList(ctx, e, args, f)
			}
			return events(ctx, e, args, reason, operator)
		}
	},
}

func events(ctx context.Context, e *env, args []string, reason, operator string) error {
	if len(args) != 3 || (args[0] != "show" && args[0] != "retry") {
		return usagef("want list, or show or retry with a destination and an event id")
	}
	destination, id := args[1], args[2]
	if args[0] == "retry" {
		if reason == "" {
			return usagef("--reason is required: it is recorded with the event and in the audit trail")
		}
		if err := checkOperator(operator); err != nil {
			return err
		}
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if args[0] == "retry" {
		if _, err := audit.RetryEvent(ctx, pool, nil, operator, id, destination, reason); err != nil {
			return err
		}
		return e.print(map[string]any{"retried": true}, "retried: the event is pending and due now\n")
	}
	rec, err := idem.LookupEvent(ctx, pool, id, destination)
	if err != nil {
		return err
	}
	return e.print(eventJSON(rec), eventText(rec))
}

// eventJSON is rec for --json.
func eventJSON(rec idem.EventRecord) map[string]any {
	attempts := []map[string]any{}
	for _, a := range rec.Attempts {
		attempts = append(attempts, map[string]any{"attempt": a.Attempt, "started_at": a.StartedAt,
			"duration_ms": float64(a.Duration.Microseconds()) / 1000, "error": a.Error, "permanent": a.Permanent})
	}
	return map[string]any{
		"destination": rec.Event.Destination, "id": rec.Event.ID, "topic": rec.Event.Topic,
		"status": rec.Status, "attempt_count": rec.AttemptCount, "attempts": attempts,
		"created_at": rec.CreatedAt, "next_attempt_at": rec.NextAttemptAt, "delivered_at": optTime(rec.DeliveredAt),
		"failed_at": optTime(rec.FailedAt), "last_error": rec.LastError, "retried_at": optTime(rec.RetriedAt),
		"retry_reason": rec.RetryReason, "expires_at": optTime(rec.ExpiresAt), "payload_bytes": len(rec.Event.Payload),
	}
}

// optTime is t, or nil when it is zero.
func optTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

// eventText is rec for people.
func eventText(rec idem.EventRecord) string {
	var b strings.Builder
	fmt.Fprintf(&b, "event %s for %s (%s): %s, %d attempts\n", shown(rec.Event.ID), shown(rec.Event.Destination), shown(rec.Event.Topic), rec.Status, rec.AttemptCount)
	fmt.Fprintf(&b, "published %s", rec.CreatedAt.UTC().Format(time.RFC3339))
	switch rec.Status {
	case idem.EventPending:
		fmt.Fprintf(&b, ", due %s", rec.NextAttemptAt.UTC().Format(time.RFC3339))
	case idem.EventDelivered:
		fmt.Fprintf(&b, ", delivered %s", rec.DeliveredAt.UTC().Format(time.RFC3339))
	case idem.EventFailed:
		fmt.Fprintf(&b, ", failed %s", rec.FailedAt.UTC().Format(time.RFC3339))
	}
	b.WriteString("\n")
	if rec.RetryReason != "" {
		fmt.Fprintf(&b, "retried %s: %s\n", rec.RetriedAt.UTC().Format(time.RFC3339), strconv.QuoteToGraphic(rec.RetryReason))
	}
	for _, a := range rec.Attempts {
		outcome := "delivered"
		if a.Error != "" {
			outcome = strconv.QuoteToGraphic(a.Error)
			if a.Permanent {
				outcome += " (permanent)"
			}
		}
		fmt.Fprintf(&b, "  #%d %s %s: %s\n", a.Attempt, a.StartedAt.UTC().Format(time.RFC3339), a.Duration.Round(time.Microsecond), outcome)
	}
	return b.String()
}

// eventsList is idem events list: the events f selects, newest first, each
// stored string escaped as idem audit list escapes it.
func eventsList(ctx context.Context, e *env, args []string, f outbox.Filter) error {
	if err := wantArgs(args, 1, "list"); err != nil {
		return err
	}
	if !outbox.ValidStatus(f.Status) {
		return usagef("--status %q is not one of pending, delivered, failed, overdue", f.Status)
	}
	if f.Limit <= 0 || f.Limit > 10000 {
		return usagef("--limit must be 1 to 10000")
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	rows, err := outbox.List(ctx, pool, f)
	if err != nil {
		return err
	}
	out := make([]map[string]any, 0, len(rows))
	var b strings.Builder
	for _, r := range rows {
		status := r.Status
		if r.Overdue {
			status = "overdue"
		}
		var at time.Time
		switch r.Status {
		case "pending":
			at = r.NextAttemptAt.Time
		case "delivered":
			at = r.DeliveredAt.Time
		case "failed":
			at = r.FailedAt.Time
		}
		out = append(out, map[string]any{
			"destination": r.Destination, "id": r.ID, "topic": r.Topic, "status": r.Status,
			"overdue": r.Overdue, "attempt_count": r.Attempts, "created_at": r.CreatedAt.Time,
			"next_attempt_at": r.NextAttemptAt.Time, "delivered_at": optTime(r.DeliveredAt.Time),
			"failed_at": optTime(r.FailedAt.Time), "last_error": r.LastError,
		})
		fmt.Fprintf(&b, "%s  %s  %s  %s  %s %s  %d attempts", r.CreatedAt.Time.UTC().Format(time.RFC3339),
			shown(r.Destination), shown(r.ID), shown(r.Topic), status, at.UTC().Format(time.RFC3339), r.Attempts)
		if r.LastError != "" {
			fmt.Fprintf(&b, "  last error %s", strconv.QuoteToGraphic(r.LastError))
		}
		b.WriteByte('\n')
	}
	if len(rows) == 0 {
		b.WriteString("no events\n")
	}
	return e.print(out, b.String())
}
