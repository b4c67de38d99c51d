package idemsql

import (
	"context"
	"database/sql"
)

// Inbox is idem.Inbox on a *sql.Tx: it processes a message or webhook
// delivery at most once per consumer and message id, running fn in tx and
// recording the message as processed in tx with Do (under
// idem.InboxOperation, keyed by InboxKey(messageID), the payload's SHA-256
// as fingerprint: the same record idem.Inbox writes), so the record commits
// or rolls back with fn's writes. duplicate is true for a redelivery of a
// message whose processing committed; fn then does not run. Every case
// (a reused id with another payload, deliveries at once, fn's errors,
// Reject, a closed or aborted tx) is as idem.Inbox documents. Inbox never
// commits or rolls back tx itself.
//
// Inbox uses the package defaults; see Client.Inbox.
func Inbox(ctx context.Context, tx *sql.Tx, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx *sql.Tx) error) (duplicate bool, err error) {
	return defaultClient.Inbox(ctx, tx, consumer, messageID, payload, fn)
}

// Inbox is the package-level Inbox with this client's configuration.
func (c *Client) Inbox(ctx context.Context, tx *sql.Tx, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx *sql.Tx) error) (duplicate bool, err error) {
	dup, err := c.c.Inbox(ctx, tx, consumer, messageID, payload, fn)
	return dup, publicErr(err)
}

// InboxInTx is idem.InboxInTx on a *sql.DB: Inbox in a transaction of its
// own begun on db, committed when Inbox returns a nil error, with DoInTx
// (serialization failures and deadlocks are retried, so fn may run more
// than once; only one run commits). When it returns a nil error the
// message is recorded as processed and may be acknowledged.
//
// InboxInTx uses the package defaults; see Client.InboxInTx.
func InboxInTx(ctx context.Context, db *sql.DB, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx *sql.Tx) error) (duplicate bool, err error) {
	return defaultClient.InboxInTx(ctx, db, consumer, messageID, payload, fn)
}

// InboxInTx is the package-level InboxInTx with this client's
// configuration.
func (c *Client) InboxInTx(ctx context.Context, db *sql.DB, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx *sql.Tx) error) (duplicate bool, err error) {
	dup, err := c.c.InboxInTx(ctx, db, consumer, messageID, payload, fn)
	return dup, publicErr(err)
}

// InboxKey is idem.InboxKey: the idempotency key under which Inbox records
// messageID (the id itself, or "sha256:" and its hash), for Lookup and
// Forget.
func InboxKey(messageID string) (string, error) { return defaultClient.InboxKey(messageID) }

// InboxKey is the package-level InboxKey with this client's key length
// bounds (see idem.Client.InboxKey).
func (c *Client) InboxKey(messageID string) (string, error) {
	key, err := c.c.InboxKey(messageID)
	return key, publicErr(err)
}
