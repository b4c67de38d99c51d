package main

import (
	"context"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// eventsCommand is idem events: the outbox's events (issue 32).
var eventsCommand = command{
	usage: "events show <destination> <id> | events retry <destination> <id> --reason R [--operator NAME]",
	help: "show prints an event of the outbox: its status (pending, delivered, failed), its attempts and\n" +
		"their errors. retry sends a failed event again (due at once, its schedule restarting), with the\n" +
		"reason recorded in the event; a pending or delivered event is refused with exit code 4, a\n" +
		"missing one is exit code 3. It writes a row of the audit trail (idem audit list) in the same\n" +
		"transaction, naming --operator.",
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		var reason, operator string
		fs.StringVar(&reason, "reason", "", "with retry: why the event is sent again `R` (required)")
		operatorFlag(fs, &operator)
		return func(ctx context.Context, e *env, args []string) error { return events(ctx, e, args, reason, operator) }
	},
}

func events(ctx context.Context, e *env, args []string, reason, operator string) error {
	if len(args) != 3 || (args[0] != "show" && args[0] != "retry") {
		return usagef("want show or retry, a destination and an event id")
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
		e.print(map[string]any{"retried": true}, "retried: the event is pending and due now\n")
		return nil
	}
	rec, err := idem.LookupEvent(ctx, pool, id, destination)
	if err != nil {
		return err
	}
	e.print(eventJSON(rec), eventText(rec))
	return nil
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
	fmt.Fprintf(&b, "event %s for %s (%s): %s, %d attempts\n", rec.Event.ID, rec.Event.Destination, rec.Event.Topic, rec.Status, rec.AttemptCount)
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
		fmt.Fprintf(&b, "retried %s: %s\n", rec.RetriedAt.UTC().Format(time.RFC3339), rec.RetryReason)
	}
	for _, a := range rec.Attempts {
		outcome := "delivered"
		if a.Error != "" {
			outcome = a.Error
			if a.Permanent {
				outcome += " (permanent)"
			}
		}
		fmt.Fprintf(&b, "  #%d %s %s: %s\n", a.Attempt, a.StartedAt.UTC().Format(time.RFC3339), a.Duration.Round(time.Microsecond), outcome)
	}
	return b.String()
}
