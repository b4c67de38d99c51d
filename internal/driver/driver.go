// Package driver is the interface between idem's protocol (internal/core)
// and a database package: pgx (pgxdriver) or database/sql (sqldriver).
//
// The core decides; a driver only sends statements and reads their
// results. Each method names the statements it runs and the round trip it
// joins, so that pgx's driver sends a call's steps pipelined (BEGIN or
// SAVEPOINT with the claim, the completion with COMMIT or RELEASE) while
// database/sql's sends the same steps one statement at a time. Which form a
// statement takes on a Citus coordinator is the driver's business too: the
// core never asks.
//
//	core   ──calls──▶  Driver[TTx, TDB]: transactions, spans, executors
//	                     ├─ Span[TTx]:  one round of Do or DoInTx
//	                     └─ Executor:   one method per statement
//	drivers ──call──▶  generated queries (internal/db, internal/dbsql)
//
// Errors come back as the database package gave them (ErrNoRows for a row
// that is not there), labelled with the step that failed ("claim: ...",
// "commit: ...") and never with "idem: ", which the core adds once. What
// the core tells apart in them it asks the driver (Interpret), in this
// package's terms (errors.go): the core imports no database package and
// reads no SQLSTATE and no message text.
package driver

import (
	"context"
	"errors"
	"time"
)

// ErrNoRows means a statement that reads or locks one row found none.
var ErrNoRows = errors.New("no rows")

// Settings are the parts of a Client's configuration that shape its
// statements.
type Settings struct {
	// TTLMicros is Config.TTL in microseconds.
	TTLMicros int64
	// TTLFor is Config.TTLFor: nil, or the TTL of an operation's keys (0:
	// TTLMicros).
	TTLFor func(operation string) time.Duration
	// BodyTTLMicros is Config.BodyTTL in microseconds: 0, or how long the
	// stored response's body and headers live after the claim of Do or
	// DoInTx (body_expires_at).
	BodyTTLMicros int64
	// BodyTTLFor is Config.BodyTTLFor: nil, or the body life of an
	// operation's keys (0: BodyTTLMicros).
	BodyTTLFor func(operation string) time.Duration
	// LockTimeout is Config.Wait as a lock_timeout value ("2000ms"), at
	// least a millisecond.
	LockTimeout string
	// IsolationLevel is Config.IsolationLevel ("" for the server's
	// default), the level of the transactions the driver begins.
	IsolationLevel string
}

// TTL is the TTL in microseconds of the keys of operation: TTLFor's when it
// gives one, TTLMicros otherwise. The calls refused a TTLFor value under a
// microsecond before any statement ran (ErrInvalidConfig).
func (s *Settings) TTL(operation string) int64 {
	if s.TTLFor != nil {
		if t := s.TTLFor(operation).Microseconds(); t > 0 {
			return t
		}
	}
	return s.TTLMicros
}

// BodyTTL is the life in microseconds of the stored body of a key of
// operation claimed by Do or DoInTx: BodyTTLFor's when it gives one,
// BodyTTLMicros otherwise, when that is shorter than the key's TTL (ttl,
// Settings.TTL); otherwise 0: the body lives as long as the key. The calls
// refused a BodyTTLFor value under a microsecond before any statement ran
// (ErrInvalidConfig).
func (s *Settings) BodyTTL(operation string, ttl int64) int64 {
	body := s.BodyTTLMicros
	if s.BodyTTLFor != nil {
		if t := s.BodyTTLFor(operation).Microseconds(); t > 0 {
			body = t
		}
	}
	if body > 0 && body < ttl {
		return body
	}
	return 0
}

// Driver wraps one database package: TTx is its transaction (pgx.Tx,
// *sql.Tx), TDB the handle transactions are begun on (a pgx Beginner,
// *sql.DB).
type Driver[TTx, TDB any] interface {
	// CheckDB refuses a handle the call cannot use (nil; for a call that
	// commits before it returns, such as Reserve, one that would only give
	// a savepoint) with an error that wraps the core's ErrInvalidArgument
	// once the core has wrapped it. It sends nothing.
	CheckDB(db TDB, commits bool) error
	// Nested reports whether transactions begun on db are savepoints of a
	// caller's transaction (which the call cannot run again).
	Nested(db TDB) bool
	// NilTx reports whether tx is nil.
	NilTx(tx TTx) bool
	// TxClosed reports whether err says the caller's transaction was
	// already committed or rolled back.
	TxClosed(err error) bool
	// CtxEndsTx reports whether the database package rolls a transaction
	// back when the context it was begun with ends (database/sql does;
	// pgx never does): only then may a transaction found closed once the
	// call's context has ended not be fn's doing.
	CtxEndsTx() bool
	// Interpret translates an error of the database package (of one of
	// the driver's statements, or of fn's) into the driver package's terms:
	// an *Error that matches the faults it shows (ErrUnavailable,
	// ErrLockNotAvailable, ...) with errors.Is and wraps err; err itself
	// when it shows none (nil for nil). It sends nothing.
	Interpret(err error) error
	// PreparedStatementsFix names, in this driver's terms, the setting that
	// stops a transaction pooler from losing prepared statements ("" for
	// none beyond the core's).
	PreparedStatementsFix() string

	// Begin begins a transaction on db (a savepoint when db is a
	// transaction), at the settings' isolation level: its own round trip.
	Begin(ctx context.Context, db TDB) (TTx, error)
	// Commit commits tx: its own round trip.
	Commit(ctx context.Context, tx TTx) error
	// Rollback rolls tx back, even when ctx is done, and reports whether
	// the connection is lost.
	Rollback(ctx context.Context, db TDB, tx TTx) (lost bool)

	// SavepointSpan is where Do runs in the caller's transaction tx: a
	// savepoint of it per round. It sends nothing.
	SavepointSpan(tx TTx) Span[TTx]
	// OwnSpan is where DoInTx runs on db: a transaction of its own per
	// round, begun with the claim where the driver can. It refuses what
	// CheckDB(db, false) refuses, and sends nothing: the span takes a
	// connection when it claims (Claim). s is nil when db cannot give one (a
	// caller's transaction): the core then runs Do in a transaction begun
	// with Begin. flight identifies db for coalescing concurrent DoInTx
	// calls of one process (nil: not coalesced).
	OwnSpan(db TDB) (s Span[TTx], flight any, err error)

	// Executor runs statements in tx, one method per statement.
	Executor(tx TTx) Executor
}

// Span is where one round of Do or DoInTx claims its key, runs fn and
// stores the outcome: a savepoint of the caller's transaction, or a
// transaction of the call's own.
type Span[TTx any] interface {
	// Claim begins the span and claims c.Key in it, waiting at most the
	// Client's Wait for a transaction that holds it: on pgx, the savepoint
	// (or BEGIN) and the claim in one round trip, unless pgx would first
	// prepare or describe the claim's statements in the caller's
	// transaction (on a connection where it has not cached them): then the
	// savepoint goes first, in a round trip of its own, and the claim
	// inside it, so that no lock wait or cancelled statement of the claim's
	// fails in the caller's transaction outside the savepoint (pgxdriver's
	// Claim says what pgx still prepares before a savepoint: SAVEPOINT
	// itself, and statements it evicted from a full cache). A span of the
	// call's own that holds no connection takes one first (a pool's). tx is
	// the transaction the span runs in, which fn runs in once claimed.
	// claimed is false when a committed row holds the key (Read reads it).
	// begun is false when the span did not begin: there is nothing to
	// undo, and the core calls no Undo (nor anything else of the span but
	// Lost and Close); for a savepoint the error happened in the caller's
	// transaction itself.
	Claim(ctx context.Context, c Claim) (tx TTx, claimed, begun bool, err error)
	// Complete stores the outcome of the claimed key and ends the span
	// (RELEASE, or COMMIT): on pgx one round trip, in which the end does
	// not run when the completion fails. Its errors, once interpreted:
	// ErrKeyRowChanged when fn changed or deleted the claimed row (the span
	// is still there to undo), ErrTxAborted when a statement of fn's had
	// aborted the transaction; TxClosed is true when fn ended it. When it
	// returns nil on a span of the call's own, the COMMIT has given back
	// the connection the span took (see Close).
	Complete(ctx context.Context, out Outcome) error
	// Read reads the committed row that holds k as an index lookup and
	// ends the span without keeping anything of it (its planner setting,
	// the claim's lock_timeout): on pgx one round trip. found is false when
	// no row holds the key any more. When it returns nil on a span of the
	// call's own, the COMMIT has given back the connection the span took,
	// as Complete's.
	Read(ctx context.Context, k Key) (row Row, found bool, err error)
	// Undo undoes the span: the claim and fn's writes are gone, and so are
	// the settings made in it. It runs even when ctx is done. For a
	// transaction of the call's own it returns nil (see Lost), or an error
	// for which the driver's TxClosed is true when the transaction had
	// already ended: fn committed or rolled it back (on database/sql, or
	// its context ended).
	Undo(ctx context.Context) error
	// Orphaned runs after fn ended the call's own transaction itself, or
	// when a claim's row was found committed without an outcome. In a
	// statement of its own, outside any transaction, it turns the key's
	// row that a claim with fingerprint fp left committed ('processing', no
	// token, no lease) 'unknown' with reason (KeyMarkUnknown), and returns
	// the rows it changed; when it changed none, the key's row as it is
	// now (ErrNoRows: none), for the core to judge whether another call
	// marked it first. For a savepoint, which has no connection of its own
	// to run it on, it is an error.
	Orphaned(ctx context.Context, k Key, fp [32]byte, reason string) (marked int64, now Record, err error)
	// Enclosing runs after fn ended the savepoint Do runs it in (never for
	// a transaction of the call's own). When that savepoint was nested in a
	// transaction still open on its connection (pgx: a pgx.Tx begun on a
	// pgx.Tx, whose Commit is RELEASE SAVEPOINT: it releases Do's savepoint
	// too, and keeps the claim and fn's writes in the enclosing
	// transaction), it makes sure that transaction cannot commit the claim
	// without an outcome: in it, a statement that fails when the claim is
	// there (KeyAbortIfClaimed), which aborts it. It runs even when ctx is
	// done. err is a failure of that statement other than the one it is
	// meant to have (Enclosing then says EnclosingUnknown).
	Enclosing(ctx context.Context, k Key, fp [32]byte) (Enclosing, error)
	// Lost reports whether the connection of the call's own transaction is
	// gone (false for a savepoint).
	Lost() bool
	// Close gives back what the span holds (a pooled connection taken by
	// Claim and not given back by Complete or Read): the core calls it when
	// the call failed, or fn panicked. It does nothing on a span that holds
	// nothing.
	Close()
}

// Enclosing is what Span.Enclosing found of a transaction enclosing the
// savepoint that fn ended.
type Enclosing int

const (
	// NoEnclosing: the connection is not in a transaction, or the driver
	// cannot tell (it does not read a connection it may have given back).
	NoEnclosing Enclosing = iota
	// EnclosingUsable: the claim is not in the enclosing transaction (fn
	// rolled back to its savepoint, and the claim with it), which is
	// usable.
	EnclosingUsable
	// EnclosingAborted: the claim was in the enclosing transaction (fn's
	// COMMIT released it there), which is now aborted.
	EnclosingAborted
	// EnclosingUnknown: the enclosing transaction was aborted already, or
	// the statement failed otherwise; whether fn committed or rolled back
	// is not known.
	EnclosingUnknown
	// EnclosingNotRead: the transaction is of a type the driver does not
	// look into (a wrapper of another making, which may have given its
	// connection back when it ended): it may have been a savepoint of
	// another transaction, which then holds what fn's COMMIT released.
	EnclosingNotRead
)

// Key names a key row.
type Key struct{ Actor, Operation, Key string }

// Claim asks for a key.
type Claim struct {
	Key         Key
	Fingerprint [32]byte
	// TakeOver claims a row that is over (a finished row past its TTL, or a
	// failed_retryable one with the same fingerprint) rather than a free
	// key.
	TakeOver bool
}

// Reply is a response as it is written: its status, its header encoded as
// JSON text (HasHeaders false: NULL), its body.
type Reply struct {
	Status     int32
	Headers    string
	HasHeaders bool
	Body       []byte
}

// Outcome is what a claimed key ends with.
type Outcome struct {
	Key         Key
	Fingerprint [32]byte
	Status      string // "succeeded" or "rejected"
	Reply       Reply
}

// Stored is a response as it is read: Valid is false when none is stored
// (response_status is NULL); Headers is JSON, nil for NULL.
type Stored struct {
	Valid   bool
	Status  int32
	Headers []byte
	Body    []byte
	// Gone: the body and headers were dropped (Config.BodyTTL), or their
	// time has passed; Status is the one stored. Set by the reads that
	// compute body_gone (KeyLookup, ReserveLock) and by Row.Judge for
	// KeyGet's.
	Gone bool
}

// KeyTimes is what KeyGet reads of a row's clock: its expiry, its lease's
// and its body's (zero: NULL), and Now, the database's now() of the same
// statement, against which Row.Judge judges them.
type KeyTimes struct {
	Now, ExpiresAt, LeaseExpiresAt, BodyExpiresAt time.Time
}

// Judge sets what the database clock says of the row KeyGet read, as the
// statement itself computed it until 2026-12-06 (queries/keys.sql): Expired
// (expires_at has come), Leased and LeaseLeftMs (the lease's time left,
// rounded to the nearest millisecond, half away from zero, as PostgreSQL
// rounds numeric to bigint), and, for a finished row that kept its
// response_status (the only rows a replay reads a body of), whether its
// body is gone: NULL (r.Stored.Body nil: the drivers read only NULL as nil;
// Prune drops a body so), or past body_expires_at, as KeyLookup and
// ReserveLock say it (until 2026-12-06 a NULL body before its
// body_expires_at, which idem never writes, was replayed as empty here). A
// gone body keeps only its status.
func (r *Row) Judge(t KeyTimes) {
	r.Expired = !t.ExpiresAt.After(t.Now)
	r.Leased = !t.LeaseExpiresAt.IsZero()
	if r.Leased {
		us := t.LeaseExpiresAt.Sub(t.Now).Microseconds()
		if us >= 0 {
			r.LeaseLeftMs = (us + 500) / 1000
		} else {
			r.LeaseLeftMs = (us - 500) / 1000
		}
	}
	gone := r.Stored.Body == nil || (!t.BodyExpiresAt.IsZero() && !t.BodyExpiresAt.After(t.Now))
	if gone && r.Stored.Valid && (r.Status == "succeeded" || r.Status == "rejected") {
		r.Stored = Stored{Valid: true, Status: r.Stored.Status, Gone: true}
	}
}

// Row is the committed row that holds a key, with what the database clock
// says of its TTL and lease.
type Row struct {
	Fingerprint []byte
	Status      string
	Stored      Stored
	Token       int64 // read by the reservation statements only
	Expired     bool
	Leased      bool
	LeaseLeftMs int64
	// InWindow: the key's window (resume_until) has not ended; read by the
	// reservation statements only.
	InWindow bool
}

// Record is a whole stored row.
type Record struct {
	Key            Key
	Fingerprint    []byte
	Status         string
	Stored         Stored
	Token          int64
	LastError      string
	ResolveReason  string
	CreatedAt      time.Time
	CompletedAt    time.Time // zero: NULL
	ExpiresAt      time.Time
	LeaseExpiresAt time.Time // zero: NULL
	ResumeUntil    time.Time // zero: NULL
	UnknownAt      time.Time // zero: NULL
	BodyExpiresAt  time.Time // zero: NULL
}

// Reserve asks for a reservation of a key.
type Reserve struct {
	Key         Key
	Fingerprint [32]byte
	Lease       time.Duration
	// ResumeWithin is the window of a new generation of the key (0: none),
	// from now.
	ResumeWithin time.Duration
}

// Attempt is what ReserveAcquire hands a locked row over for.
type Attempt int

const (
	// NewRequest: a new request after the TTL. The window is set afresh
	// (Reserve.ResumeWithin).
	NewRequest Attempt = iota
	// NewAttempt: a new attempt after a retryable failure. The window is
	// kept.
	NewAttempt
	// Resume: a resume of an attempt in doubt inside its window. The window
	// is kept, and the lease ends no later than the window.
	Resume
)

// Reserved is what ReserveInsertOrLock found: a fresh reservation
// (Inserted), or the row that holds the key, locked (Found), or neither
// (the row went away in between).
type Reserved struct {
	Inserted       bool
	Token          int64
	LeaseExpiresAt time.Time
	Found          bool
	Row            Row
}

// Resolve is an operator's verdict on a record: to Status ("succeeded",
// with Reply, or "failed_retryable"), with Reason.
type Resolve struct {
	Status string
	Reply  *Reply
	Reason string
}

// Cursor is where a page of ListUnknown or ListResumable begins: after
// this record.
type Cursor struct {
	CreatedAt time.Time
	Key       Key
}

// StatusCount is the number of keys in one status, and the oldest claim.
type StatusCount struct {
	Status string
	Keys   int64
	Oldest time.Time
}

// Executor runs statements in one transaction, each in a round trip of its
// own unless it says otherwise. Statements that find rows by a WHERE
// clause find them through an index whatever the planner's statistics say
// (pgx plans each anew; database/sql sets the planner for the transaction,
// see UseIndexes).
type Executor interface {
	// UseIndexes makes the statements that follow in the transaction find
	// rows through an index (database/sql: SET LOCAL enable_seqscan = off,
	// a round trip; pgx: nothing).
	UseIndexes(ctx context.Context) error
	// WalkIndexes makes the statements that follow walk an index in its
	// order, without a sort or a bitmap scan (Prune, ExpireLeases).
	WalkIndexes(ctx context.Context) error

	// ReserveInsertOrLock inserts a fresh reservation of r.Key with a new
	// token, or else locks and reads the committed row that holds it,
	// waiting at most the Client's Wait for a transaction that holds the
	// key (55P03 when the wait runs out): on pgx one round trip with its
	// settings (SET LOCAL lock_timeout, which reaches Citus's workers).
	ReserveInsertOrLock(ctx context.Context, r Reserve) (Reserved, error)
	// ReserveAcquire hands the locked row that holds token to a new
	// reservation with a new token, for what a says.
	ReserveAcquire(ctx context.Context, r Reserve, token int64, a Attempt) (newToken int64, leaseExpiresAt time.Time, err error)
	// ReserveMarkUnknown turns the reservation holding token unknown, and
	// returns the rows changed.
	ReserveMarkUnknown(ctx context.Context, k Key, token int64, reason string) (int64, error)
	// ReserveComplete stores the outcome of the reservation holding token.
	ReserveComplete(ctx context.Context, k Key, token int64, reply Reply) (int64, error)
	// ReserveFailRetryable records that the reservation holding token
	// certainly did not execute.
	ReserveFailRetryable(ctx context.Context, k Key, token int64, reason string) (int64, error)
	// ReserveHeartbeat extends the live lease of the reservation holding
	// token (ErrNoRows: fenced); a resumed one's never past its window.
	ReserveHeartbeat(ctx context.Context, k Key, token int64, extend time.Duration, resumed bool) (time.Time, error)
	// ReserveLock locks and reads the row that holds k (ErrNoRows: none).
	ReserveLock(ctx context.Context, k Key) (Row, error)
	// ReserveResolve reconciles the locked row holding token.
	ReserveResolve(ctx context.Context, k Key, token int64, r Resolve) (int64, error)
	// ReserveExpireLeases turns at most limit reservations whose lease ran
	// out, outside a window, unknown (Citus: without SKIP LOCKED).
	ReserveExpireLeases(ctx context.Context, reason string, limit int32) (int64, error)
	// ReserveListUnknown reads at most limit unknown records outside a
	// window, oldest first, after the cursor (nil: from the first).
	ReserveListUnknown(ctx context.Context, after *Cursor, limit int32) ([]Record, error)
	// ReserveListResumable reads at most limit records in doubt (a lease
	// that ran out, or unknown) inside their window, oldest first, after
	// the cursor (nil: from the first).
	ReserveListResumable(ctx context.Context, after *Cursor, limit int32) ([]Record, error)

	// KeyMarkUnknown turns the row of k that a claim with fingerprint fp
	// left committed without an outcome 'unknown' with reason (see
	// Span.Orphaned), and returns the rows changed.
	KeyMarkUnknown(ctx context.Context, k Key, fp [32]byte, reason string) (int64, error)

	// KeyLookup reads the committed record of k (ErrNoRows: none).
	KeyLookup(ctx context.Context, k Key) (Record, error)
	// KeyLockForForget locks the record of k without waiting (55P03 when a
	// transaction holds it; ErrNoRows: none).
	KeyLockForForget(ctx context.Context, k Key) (status string, leaseRanOut bool, err error)
	// KeyForget deletes the record of k.
	KeyForget(ctx context.Context, k Key) error
	// KeyPrune deletes at most batch finished rows past their TTL (Citus:
	// without SKIP LOCKED).
	KeyPrune(ctx context.Context, batch int32) (int64, error)
	// KeyDropBodies drops the body and headers of at most batch finished
	// rows past their body_expires_at (Citus: conditions checked again
	// under the row lock instead of SKIP LOCKED).
	KeyDropBodies(ctx context.Context, batch int32) (int64, error)
	// KeyCountPrunable counts the rows KeyPrune would delete.
	KeyCountPrunable(ctx context.Context) (int64, error)
	// KeyStats counts the keys by status.
	KeyStats(ctx context.Context) ([]StatusCount, error)
	// KeyTableSize is the size of idem_keys and of its indexes (for a Citus
	// table, the sums over its shards).
	KeyTableSize(ctx context.Context) (tableBytes, indexBytes int64, err error)
}

// CleanupTimeout bounds the statements that undo a call's work, which run
// even when the caller's context is done (without its cancellation).
const CleanupTimeout = 5 * time.Second
