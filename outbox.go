package idem

import "encoding/hex"

// EventID returns a stable id for the event called name that the request
// (scope, key) emits, for an outbox row written in the same transaction as
// Do's writes: the relay that publishes the row sends the id along, and
// consumers dedupe by it (with Inbox). It is a name-based UUID (RFC 9562
// version 8) made from the SHA-256 of the actor, operation, key and name,
// each length-prefixed (FingerprintParts), in the canonical
// xxxxxxxx-xxxx-8xxx-xxxx-xxxxxxxxxxxx form, so it fits a uuid column.
//
// The same arguments always give the same id, in every process and
// release. So the id is known from the request alone (a response or a log
// line can name the event before the relay publishes it), two writers of
// the same event (a request and a reconciler finishing what it began) agree
// on it, and a unique constraint on the outbox id turns a second write into
// an error instead of a second event. The idempotency key does not appear in
// the id (it should not travel to consumers and their logs), and events of
// other scopes, keys or names do not share it (barring a collision of 122
// bits of SHA-256). name tells apart the events of one request
// ("order.placed", "stock.reserved").
//
// EventID depends on its arguments only: a key used again after its TTL (a
// new request to Do) gets the same id again. While the first event is in
// the outbox, Publish does nothing for the same event again (same
// Destination, Topic, Payload and Header) and refuses a different one
// (ErrEventReused); a hand-written outbox's insert fails on its unique
// constraint (without one, consumers that still remember the id take the
// event for a duplicate). Keys are fresh for each
// intent, so this should not arise; where it can, put into name something
// that tells the two runs apart, such as the id of a row fn created.
//
// EventID does not validate its arguments; any strings give an id.
func EventID(scope Scope, key, name string) string {
	sum := FingerprintParts([]byte("idem.event.v1"), []byte(scope.Actor), []byte(scope.Operation),
		[]byte(key), []byte(name))
	u := sum[:16]
	u[6] = u[6]&0x0f | 0x80 // version 8
	u[8] = u[8]&0x3f | 0x80 // variant 10
	var b [36]byte
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:36], u[10:16])
	return string(b[:])
}
