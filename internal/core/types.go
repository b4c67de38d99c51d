package core

import (
	"encoding/hex"
	"time"
)

// The protocol's types. Package idem defines the public types with the same
// fields (idemsql uses idem's) and converts at the boundary; its tests keep
// the two in step (docs/development.md, Layers).

// Fingerprint identifies the content of a request: the SHA-256 of its
// canonical form. The same key with the same fingerprint is a retry; the same
// key with a different fingerprint is refused with ErrKeyReused.
type Fingerprint [32]byte

// String returns the fingerprint in lowercase hex.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// Scope is the namespace of a key: (Actor, Operation, key) is unique. The same
// key under another actor or operation is an independent request, and a
// stored response is never replayed across scopes.
type Scope struct {
	// Actor is the authenticated tenant or user. Take it from authentication,
	// never from the request body.
	Actor string
	// Operation separates kinds of request, such as "draw" or
	// "payment.create".
	Operation string
}

// Response is the outcome of a request as it is stored and replayed.
type Response struct {
	Status int                 // replayed as stored (200, 201, 402, ...; 0 or 100..999)
	Header map[string][]string // optional, replayed as stored
	Body   []byte              // replayed byte for byte
}

// Result is what Do returns: the response, and whether it was replayed.
type Result struct {
	Response
	// Replayed is true when fn did not run and Response is the stored outcome
	// of an earlier call with the same key.
	Replayed bool
}

// Status is the state of a key's record.
type Status string

// The states of a record. Do writes succeeded and rejected records (its
// processing claim never commits); the reservation mode adds the others.
const (
	// StatusProcessing: a reservation holds the key with a lease.
	StatusProcessing Status = "processing"
	// StatusSucceeded: the outcome is stored and replayed.
	StatusSucceeded Status = "succeeded"
	// StatusRejected: Do stored a deterministic refusal, replayed.
	StatusRejected Status = "rejected"
	// StatusFailedRetryable: the work certainly did not happen; the next
	// Reserve with the same fingerprint executes again.
	StatusFailedRetryable Status = "failed_retryable"
	// StatusUnknown: the work may have happened; nothing runs again until
	// Resolve reconciles it, or, inside the window of a key reserved with
	// ReserveOptions.ResumeWithin, until the next Reserve resumes it.
	StatusUnknown Status = "unknown"
)

// finished reports whether s is the final outcome of an attempt, which a
// new request may take over once the TTL has passed.
func (s Status) finished() bool {
	return s == StatusSucceeded || s == StatusRejected || s == StatusFailedRetryable
}

// Record is a key's record as stored.
type Record struct {
	Scope       Scope
	Key         string
	Status      Status
	Fingerprint Fingerprint
	// Token is the fencing token of the reservation that last held the key
	// (0 for records Do wrote).
	Token int64
	// LastError says why the record failed or became unknown; empty when
	// there is nothing to say. Resolve keeps it.
	LastError string
	// ResolveReason is the operator's reason (Resolution.Reason) when
	// Resolve reconciled the record; empty otherwise.
	ResolveReason string
	// CreatedAt is when the key was claimed or reserved (for a reservation,
	// its latest attempt).
	CreatedAt time.Time
	// CompletedAt is when an outcome was recorded; zero when none was.
	CompletedAt time.Time
	// ExpiresAt is the end of the TTL: past it a finished record is a new
	// request.
	ExpiresAt time.Time
	// LeaseExpiresAt is the end of the last reservation's lease; zero for
	// records Do wrote.
	LeaseExpiresAt time.Time
	// ResumeUntil is the end of the key's window
	// (ReserveOptions.ResumeWithin from the first reservation of its TTL
	// generation): before it, an attempt in doubt is resumed rather than
	// left for a person. Zero when the key was reserved without one, and for
	// records Do wrote.
	ResumeUntil time.Time
	// UnknownAt is when the record's latest attempt became unknown (by the
	// database clock), whoever made it so: its worker (MarkUnknown),
	// ExpireLeases, an operator's expiry in the console, or a call that
	// found a claim of Do or DoInTx left without an outcome. Marked unknown
	// again, it keeps the first time; a verdict (Resolve) keeps it; a new
	// attempt clears it. Zero when the attempt never became unknown, or
	// became unknown before migration 10, which records it.
	UnknownAt time.Time
	// BodyExpiresAt is when the stored response's body and headers are
	// dropped (Config.BodyTTL, BodyTTLFor: a replay past it gets
	// ErrResponseGone, and Prune drops them); zero when the body lives as
	// long as the key (the default, every reservation and every response
	// Resolve stored), and once Prune has dropped it (ResponseGone).
	BodyExpiresAt time.Time
	// Response is the stored outcome; nil when none is stored.
	Response *Response
	// ResponseGone: the response's body and headers were dropped, or their
	// time has passed (Config.BodyTTL); Response holds the stored status
	// only. A replay of the key returns ErrResponseGone.
	ResponseGone bool
}

// Reservation is the right to execute a request's outside work, or the
// stored outcome of an earlier execution (Replayed true, Token 0).
type Reservation struct {
	// Result holds the stored Response when Replayed is true.
	Result
	Scope Scope
	Key   string
	// Token is the fencing token of this execution, greater than zero: no
	// other reservation of any key ever had it. Complete, FailRetryable,
	// MarkUnknown and Heartbeat succeed only while the record still holds it.
	Token int64
	// LeaseExpiresAt is when the lease runs out, by the database clock.
	// After it, Reserve and ExpireLeases turn the record unknown, or,
	// inside the key's window (ReserveOptions.ResumeWithin), the next
	// Reserve resumes it. A resumed reservation's lease ends no later than
	// the window.
	LeaseExpiresAt time.Time
	// Resumed is true when this reservation took over an attempt in doubt
	// (its lease ran out, or its worker marked it unknown) inside the key's
	// window: that attempt may have made its outside calls. Make them again
	// with the same call keys (CallKey), which the receiver deduplicates,
	// never with new ones.
	Resumed bool
}

// ReserveOptions configures ReserveWith. The zero value means the
// defaults: a lease of DefaultLease and no window.
type ReserveOptions struct {
	// Lease is how long the reservation holds the key before it counts as
	// stuck (extend it with Heartbeat). Default DefaultLease; otherwise at
	// least 1µs.
	Lease time.Duration

	// ResumeWithin is the window in which an attempt in doubt resumes by
	// itself. Setting it promises that every outside call made under the
	// reservation carries its call key (Reservation.CallKey) and that the
	// receiver deduplicates by that key for at least ResumeWithin from the
	// key's first reservation. Then, until the window ends, an attempt
	// whose lease ran out, or that its worker marked unknown, is not a case
	// for a person: the next Reserve (a retry of the client, or a recovery
	// worker that ListResumable feeds) takes it over with a new token and
	// Resumed true, and makes the calls again with the same keys. Past the
	// window such an attempt is unknown, for a person, as without one.
	//
	// The window is measured from the first reservation of the key's TTL
	// generation and stored with the record; resumes and new attempts after
	// FailRetryable keep it and never extend it, and a Reserve of the same
	// generation, with or without ResumeWithin, honours the stored window.
	// 0, the default, means no window; otherwise it must be at least the
	// lease, since a lease that outlives the window could never resume.
	ResumeWithin time.Duration
}

// DefaultLease is ReserveOptions.Lease's default.
const DefaultLease = 30 * time.Second

// Resolution is an operator's verdict on a record whose outcome was unknown,
// after looking at the outside system. Set exactly one of Succeeded and
// Retryable, and the Token of the attempt the verdict is about.
type Resolution struct {
	// Token is the fencing token of the attempt being resolved, as
	// ListUnknown and Lookup show it (Record.Token). Required: a verdict
	// about one attempt must never land on a later one, so Resolve refuses
	// a token that is not the record's current one with ErrFenced.
	Token int64
	// Succeeded is the response to store and replay: the work did happen.
	Succeeded *Response
	// Retryable says the work certainly did not happen: the next Reserve with
	// the same fingerprint executes again.
	Retryable bool
	// Reason is stored as the record's ResolveReason (at most
	// MaxReasonLength bytes), for the audit trail, beside the LastError
	// that says why the record became unknown.
	Reason string
}

// Stats describes the idem_keys table for operators.
type Stats struct {
	// Keys counts the keys in each status ("processing", "succeeded",
	// "rejected", "failed_retryable", "unknown"); statuses without keys are
	// left out. Claims of transactions still open are not counted.
	Keys map[Status]int64
	// OldestProcessing is when the oldest committed 'processing' key (a
	// reservation in flight) was claimed; zero when there is none.
	OldestProcessing time.Time
	// OldestUnknown is when the oldest 'unknown' key was claimed; zero when
	// there is none.
	OldestUnknown time.Time
	// TableBytes and IndexBytes are the table's size on disk (with its
	// TOAST data) and its indexes'. For a Citus distributed idem_keys they
	// are the sums over its shards on the workers.
	TableBytes, IndexBytes int64
}

// PruneOptions configures Prune. The zero value means the defaults.
type PruneOptions struct {
	// BatchSize is the most rows one DELETE (one transaction) removes.
	// Default 1000. Small batches keep locks and WAL bursts short.
	BatchSize int

	// MaxBatches bounds the batches of one call; 0 means until no expired
	// finished row is left.
	MaxBatches int

	// DryRun counts the rows Prune would delete now, and deletes nothing.
	DryRun bool
}

// DefaultPruneBatchSize is PruneOptions.BatchSize's default.
const DefaultPruneBatchSize = 1000

// MaxReasonLength is the longest reason, in bytes, that FailRetryable,
// MarkUnknown and Resolve store.
const MaxReasonLength = 1024

// MaxScopeLength is the longest Actor or Operation, in bytes.
const MaxScopeLength = 255
