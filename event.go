package idem

import (
	"context"
	"errors"
)

// Event is a message for one destination, written by Publish in the
// caller's transaction and sent by a Relay after that transaction commits.
type Event struct {
	// ID identifies the event at its destination: the relay sends it with
	// every attempt (as webhook-id and Idempotency-Key for webhooks), and the
	// receiver deduplicates by it (Inbox, idemhttp.WebhookHandler). It is
	// unique per destination; EventID derives one from a request.
	ID string
	// Topic says what happened ("payment.succeeded").
	Topic string
	// Destination names the receiver; the Sender resolves it (a webhook
	// endpoint, a queue).
	Destination string
	// Payload is the body sent, byte for byte.
	Payload []byte
	// Header is sent with the payload (optional).
	Header map[string][]string
}

// Delivery is one attempt to send an event.
type Delivery struct {
	Event Event
	// Attempt counts the attempts at this event, from 1.
	Attempt int
}

// Sender sends an event to its destination. A nil error means the
// destination accepted it; an error wrapped by Permanent means no retry can
// succeed; any other error is retried on the relay's schedule.
type Sender interface {
	Send(ctx context.Context, d Delivery) error
}

// SenderFunc is a function that is a Sender.
type SenderFunc func(ctx context.Context, d Delivery) error

// Send calls f.
func (f SenderFunc) Send(ctx context.Context, d Delivery) error { return f(ctx, d) }

// permanentError marks an error that no retry can fix.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as a failure that no retry can fix (the destination
// is gone, the payload is refused for good): a relay marks the event failed
// at once instead of retrying it. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err, or an error it wraps, was marked by
// Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}
