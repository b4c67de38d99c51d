package core

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
)

// InboxOperation is the Scope.Operation under which Inbox records the
// messages it processed (see idem.InboxOperation).
const InboxOperation = "idem.inbox"

// hashedIDPrefix begins the key of a message id that is hashed. Ids kept as
// they are never begin with it (those that do are hashed too), so the two
// kinds of key cannot meet.
const hashedIDPrefix = "sha256:"

// Inbox processes a message at most once per consumer and message id, with
// Do in tx (see idem.Inbox).
func (c *Client[TTx, TDB]) Inbox(ctx context.Context, tx TTx, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx TTx) error) (duplicate bool, err error) {
	scope, key, fp, err := c.inboxTarget(consumer, messageID, payload, fn == nil)
	if err != nil {
		return false, err
	}
	return inboxResult(c.Do(ctx, tx, scope, key, fp, inboxFn(fn)))
}

// InboxInTx is Inbox in a transaction of its own begun on db, with DoInTx
// (see idem.InboxInTx).
func (c *Client[TTx, TDB]) InboxInTx(ctx context.Context, db TDB, consumer, messageID string, payload []byte,
	fn func(ctx context.Context, tx TTx) error) (duplicate bool, err error) {
	scope, key, fp, err := c.inboxTarget(consumer, messageID, payload, fn == nil)
	if err != nil {
		return false, err
	}
	return inboxResult(c.DoInTx(ctx, db, scope, key, fp, inboxFn(fn)))
}

// inboxResult is what Inbox answers for the call's result: a message
// processed before is a duplicate, also when its stored (empty) response
// has outlived Config.BodyTTL (a replay with ErrResponseGone: nothing ran
// again). fn's own error that wraps ErrResponseGone (from a call of its
// own) is no replay: it is passed on.
func inboxResult(res Result, err error) (duplicate bool, _ error) {
	if res.Replayed && errors.Is(err, ErrResponseGone) {
		return true, nil
	}
	return res.Replayed, err
}

// inboxTarget is the key under which Inbox records a message, and its
// fingerprint; nilFn is whether the caller's fn is nil (refused).
func (c *Client[TTx, TDB]) inboxTarget(consumer, messageID string, payload []byte, nilFn bool) (Scope, string, Fingerprint, error) {
	key, err := c.InboxKey(messageID)
	if err != nil {
		return Scope{}, "", Fingerprint{}, err
	}
	if nilFn {
		return Scope{}, "", Fingerprint{}, errNilFn
	}
	return Scope{Actor: consumer, Operation: InboxOperation}, key, sha256.Sum256(payload), nil
}

// InboxKey returns the idempotency key under which Inbox records messageID
// (see idem.InboxKey), with this client's key length bounds.
func (c *Client[TTx, TDB]) InboxKey(messageID string) (string, error) {
	if messageID == "" {
		return "", errorf("idem: %w: empty message id", ErrInvalidKey)
	}
	if !strings.HasPrefix(messageID, hashedIDPrefix) && c.ValidateKey(messageID) == nil {
		return messageID, nil
	}
	sum := sha256.Sum256([]byte(messageID))
	key := hashedIDPrefix + hex.EncodeToString(sum[:])
	if err := c.ValidateKey(key); err != nil {
		return "", errorf("idem: %w: message id of %d bytes is not a valid key, and neither is its hash", ErrInvalidKey, len(messageID))
	}
	return key, nil
}

// inboxFn is fn as Do runs it: no response to store.
func inboxFn[TTx any](fn func(ctx context.Context, tx TTx) error) func(ctx context.Context, tx TTx) (Response, error) {
	return func(ctx context.Context, tx TTx) (Response, error) {
		return Response{}, fn(ctx, tx)
	}
}
