// Package bridge lends package idem's core to package idemsql, the
// database/sql form of idem's API, so that both run one state machine and
// one set of checks instead of two copies.
//
// The core (judge, which decides what the row holding a key means for a
// call; decide, which turns fn's result into the outcome to store; the
// response checks, the retry policy, the observer) stays unexported in
// package idem, written against pgx's generated rows. This package
// declares it as a set of function fields (Funcs), in driver-neutral terms
// (Row, Key, Outcome); package idem fills them in its init with its own
// types and stores them in Core, and package idemsql reads them once:
//
//	var core = bridge.Core.(bridge.Funcs[*idem.Client, idem.Result, idem.Response, idem.Record])
//
// Go initializes an imported package before its importer, so Core is set
// before idemsql's variables are. The type parameters are idem's own types,
// which this package cannot name (idem imports it); the one type assertion
// above checks them all.
package bridge

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"time"
)

// Key names a key row: its scope and key.
type Key struct{ Actor, Operation, Key string }

// Row is the committed row that holds a key, as either driver reads it:
// the columns of the KeyGet and ReserveLock queries.
type Row struct {
	Fingerprint     []byte
	Status          string
	ResponseStatus  int32
	HasResponse     bool   // response_status is not NULL
	ResponseHeaders []byte // JSON; nil for NULL
	ResponseBody    []byte
	Expired         bool
	Leased          bool
	LeaseLeftMs     int64
}

// RecordRow is a whole stored row, for Lookup and ListUnknown.
type RecordRow struct {
	Row
	Key
	Token          int64
	LastError      string
	ResolveReason  string
	CreatedAt      time.Time
	CompletedAt    time.Time
	ExpiresAt      time.Time
	LeaseExpiresAt time.Time
}

// Next is what a call does after judging the row that holds its key.
type Next int

// The values of Next.
const (
	Done     Next = iota // return the result or the error
	Claim                // the row is gone: claim the key afresh
	TakeOver             // the row is over: take it over
)

// Outcome is what a claimed key ends with: fn's response, or a refusal,
// with its header encoded for the response_headers column.
type Outcome[Response any] struct {
	Status     string // "succeeded" or "rejected"
	Response   Response
	Headers    string // JSON text; NULL when HasHeaders is false
	HasHeaders bool
}

// Call is a call under observation (metrics, span, log record).
type Call[Result any] interface {
	// TimeFn runs f, the caller's function, and counts its time apart.
	TimeFn(f func())
	// Rejected marks the stored outcome as a refusal made by this call.
	Rejected()
	// End records the call's outcome.
	End(ctx context.Context, res Result, err error)
	// EndIfPanicking, deferred, records a call that did not End (fn
	// panicked) as failed.
	EndIfPanicking(ctx context.Context)
}

// Funcs is package idem's core. Client is *idem.Client, Result
// idem.Result, Response idem.Response and Record idem.Record.
type Funcs[Client, Result, Response, Record any] struct {
	// Judge tells what the committed row that holds k means for a call with
	// fingerprint fp (found false: no row holds it).
	Judge func(c Client, row Row, found bool, fp [32]byte, k Key) (Result, Next, error)
	// Resolvable decides whether Resolve may reconcile the locked record of
	// a key, in status with token (leased and leaseLeftMs as ReserveLock
	// reads them), for a Resolution naming want: nil, idem.ErrFenced or
	// idem.ErrNotResolvable.
	Resolvable func(status string, token, want int64, leased bool, leaseLeftMs int64) error
	// Forgettable decides whether Forget may delete the locked record of a
	// key, in status (leaseRanOut as KeyLockForForget reads it): nil,
	// idem.ErrInProgress or idem.ErrOutcomeUnknown.
	Forgettable func(c Client, status string, leaseRanOut bool) error
	// Inbox is the key under which Inbox records message messageID of
	// consumer, and the fingerprint of payload; nilFn is whether the
	// caller's fn is nil. The error is the refusal of invalid input.
	Inbox func(c Client, consumer, messageID string, payload []byte, nilFn bool) (Key, [32]byte, error)
	// Decide checks fn's result and turns it into the outcome to store; a
	// refusal (idem.Reject) is an outcome, any other error comes back.
	Decide func(c Client, resp Response, fnErr error) (Outcome[Response], error)
	// Encode checks that resp can be stored and encodes its header.
	Encode func(c Client, resp Response) (headers string, valid bool, err error)
	// Result is what a call that stored out returns.
	Result func(out Outcome[Response]) Result
	// Record turns a stored row into an idem.Record.
	Record func(row RecordRow) (Record, error)
	// InProgress is the in-progress error of a claim of k that waited in
	// vain (k zero: of a key in flight).
	InProgress func(c Client, k Key) error
	// JSONResponse is the Response that stores v, fn's value under the
	// typed-replay calls (DoJSON), or fn's error err; back points to a zero
	// value of v's type, which v's JSON must decode into.
	JSONResponse func(v any, err error, back any) (Response, error)
	// DecodeInto decodes the result of a typed-replay call into v (a
	// pointer); a refusal comes back as an *idem.RejectedError.
	DecodeInto func(res Result, err error, v any) (replayed bool, _ error)
	// CheckCursor validates the record after which ListUnknown continues.
	CheckCursor func(after *Record) error
	// CheckReason validates a reason to store.
	CheckReason func(reason string) error
	// Retryable reports a serialization failure or a deadlock.
	Retryable func(err error) bool
	// Backoff is the jittered delay before retry number attempt.
	Backoff func(attempt int) time.Duration
	// Observe starts observing a call named name (do, do_in_tx, reserve)
	// with a span named spanName.
	Observe func(c Client, ctx context.Context, name, spanName string, k Key) (context.Context, Call[Result])
	// CountEnd counts the end of a reservation or operator call (event when
	// it succeeded and event is not "", a fenced reservation, a store
	// failure).
	CountEnd func(c Client, ctx context.Context, call, operation string, err error, event string)
	// PreparedStatementsLost wraps err with idem.ErrPreparedStatements
	// when it is pgx's cached prepared statement lost behind a transaction
	// pooler (pgx's stdlib driver in its default exec mode).
	PreparedStatementsLost func(err error) error
	// Migrate brings idem's tables up to date on db, serialized with
	// idem.Migrate (the same goose provider, version table and lock).
	Migrate func(ctx context.Context, db *sql.DB) error
	// Count adds n to the counter of event.
	Count func(c Client, ctx context.Context, event, call, operation string, n int64)
}

// Core is package idem's Funcs, set in its init.
var Core any

// JSON is a jsonb column as package idemsql's generated code reads it:
// its bytes, nil for NULL (a json.RawMessage would refuse NULL).
type JSON []byte

// Scan implements sql.Scanner.
func (j *JSON) Scan(src any) error {
	switch v := src.(type) {
	case nil:
		*j = nil
	case []byte:
		*j = append(JSON(nil), v...)
	case string:
		*j = JSON(v)
	default:
		return errors.New("bridge: jsonb column holds neither text nor bytes")
	}
	return nil
}

// Value implements driver.Valuer: the JSON as text, NULL for nil.
func (j JSON) Value() (driver.Value, error) {
	if j == nil {
		return nil, nil
	}
	return string(j), nil
}
