package idem

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// InboxOperation is the Scope.Operation under which Inbox records the
// messages it processed: a message is the key (InboxKey(messageID)) in
// Scope{Actor: consumer, Operation: InboxOperation}. Operations beginning
// with "idem." are the library's; do not use them for requests.
const InboxOperation = "idem.inbox"

// Inbox processes a message or webhook delivery at most once per consumer and
// message id: it runs fn in tx and records the message as processed in tx,
// with Do (see InboxOperation for the scope), so the record commits or rolls
// back with fn's writes. Inbox never commits or rolls back tx itself.
//
// consumer names the handler, and the stream in which message ids are
// unique: use one consumer per handler and per source of ids ("billing",
// "billing.stripe"). payload is the message's content: a redelivery is
// recognised by its id, and its payload must be byte for byte the same (its
// SHA-256 is the fingerprint). messageID is the broker's or sender's id;
// see InboxKey for ids that are not valid keys.
//
// What the handler sees:
//
//   - First delivery: fn runs in tx; Inbox returns (false, nil). Acknowledge
//     the message once tx has committed.
//   - A redelivery after the first committed: fn does not run; Inbox returns
//     (true, nil). Nothing of the first processing is returned: acknowledge
//     the message and move on.
//   - A redelivery with the same id and a different payload: ErrKeyReused;
//     fn does not run. It is never skipped silently: the sender reused an id
//     (or the payload is not byte-identical across redeliveries; then pass
//     canonical bytes, such as the part of the message that matters).
//   - Two deliveries at once (two consumers, pools or processes): one runs
//     fn; the other waits up to Config.Wait for its transaction. If that
//     commits, the other returns (true, nil); if it rolls back, the other
//     runs fn; if the wait runs out, the other gets ErrInProgress (its tx
//     is as it was before the call). Leave that delivery unacknowledged:
//     the broker delivers it again, and then it is a duplicate.
//   - fn returns an error or panics: fn's writes are undone, nothing is
//     recorded, and the error (or panic) is passed on; the next delivery
//     runs fn again. tx stays usable.
//   - fn returns Reject(Response{}): fn's writes are undone and the message
//     is recorded as processed (a poison message refused for good); Inbox
//     returns (false, nil), and redeliveries (true, nil).
//   - A message id older than Config.TTL is new again: give the Client that
//     processes messages a TTL longer than the broker's redelivery window.
//
// Several messages may share one transaction (a batch), one Inbox call
// each; each runs fn in a savepoint, so keep a batch well under 64 (see
// Do). Invalid input (empty message id, consumer that is not a valid Actor,
// nil tx or fn) is refused before any statement runs. Metrics and logs are
// those of Do. Inbox uses the package defaults; see Client.Inbox.
func Inbox(ctx context.Context, tx pgx.Tx, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx pgx.Tx) error) (duplicate bool, err error) {
	return defaultClient.Inbox(ctx, tx, consumer, messageID, payload, fn)
}

// Inbox is the package-level Inbox with this client's configuration.
func (c *Client) Inbox(ctx context.Context, tx pgx.Tx, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx pgx.Tx) error) (duplicate bool, err error) {
	dup, err := c.c.Inbox(ctx, tx, consumer, messageID, payload, fn)
	return dup, publicErr(err)
}

// InboxInTx is Inbox in a transaction of its own begun on db, committed
// when Inbox returns a nil error, with DoInTx: serialization failures and
// deadlocks are retried (so fn may run more than once; only one run
// commits), and concurrent deliveries of one message on one pool and Client
// are coalesced, the others returning (true, nil) once the first commits.
// When InboxInTx returns a nil error, the message is recorded as processed
// and may be acknowledged.
//
// InboxInTx uses the package defaults; see Client.InboxInTx.
func InboxInTx(ctx context.Context, db Beginner, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx pgx.Tx) error) (duplicate bool, err error) {
	return defaultClient.InboxInTx(ctx, db, consumer, messageID, payload, fn)
}

// InboxInTx is the package-level InboxInTx with this client's
// configuration.
func (c *Client) InboxInTx(ctx context.Context, db Beginner, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx pgx.Tx) error) (duplicate bool, err error) {
	dup, err := c.c.InboxInTx(ctx, db, consumer, messageID, payload, fn)
	return dup, publicErr(err)
}

// InboxKey returns the idempotency key under which Inbox records messageID,
// for looking a message up or forgetting it: the id itself when it is a
// valid key (ValidateKey) that does not begin with "sha256:"; otherwise
// "sha256:" and the lowercase hex SHA-256 of the id's bytes. So ids longer
// than 255 bytes, with spaces, control characters or non-ASCII, are
// accepted and told apart (up to SHA-256 collisions), and never collide
// with an id kept as it is. An empty id is refused with ErrInvalidKey.
//
// InboxKey uses the package defaults; see Client.InboxKey.
func InboxKey(messageID string) (string, error) { return defaultClient.InboxKey(messageID) }

// InboxKey is the package-level InboxKey with this client's key length
// bounds: an id outside them is hashed. With MaxKeyLength below 71 or
// MinKeyLength above it (71: the length of a hashed key) such an id is
// refused with ErrInvalidKey.
func (c *Client) InboxKey(messageID string) (string, error) {
	key, err := c.c.InboxKey(messageID)
	return key, publicErr(err)
}
