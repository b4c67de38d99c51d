package driver

import "strings"

// What the core tells apart in a database's errors, in the driver
// package's terms. A driver translates the errors of the database package
// it wraps (Driver.Interpret) into an *Error that matches these sentinels
// with errors.Is and keeps the database's error in the chain; the core
// reads no SQLSTATE and no message text, and imports no database package.
const (
	// ErrUnavailable: the database could not serve, through no fault of
	// the statement: the server could not be reached or dropped the
	// connection, the pool is closed, a deadline ran out on the way, or the
	// server said it cannot serve now (ErrServerUnavailable).
	ErrUnavailable Fault = 1 << iota
	// ErrServerUnavailable: the server answered that it cannot serve now
	// (SQLSTATE class 08, 53, 57 or 58).
	ErrServerUnavailable
	// ErrLockNotAvailable: a wait for a lock ran out (lock_timeout, or
	// NOWAIT: 55P03).
	ErrLockNotAvailable
	// ErrRetryable: a serialization failure or a deadlock (40001, 40P01),
	// after which a whole transaction may run again.
	ErrRetryable
	// ErrTxAborted: the statement ran into a transaction that an earlier
	// statement had aborted (25P02).
	ErrTxAborted
	// ErrKeyRowChanged: the completion refused to store an outcome because
	// fn changed the claimed row (KeyComplete raises idem's SQLSTATE
	// IDMRC).
	ErrKeyRowChanged
	// ErrClaimReleased: the claim was found pending in a transaction that
	// encloses Do's savepoint (KeyAbortIfClaimed raises idem's SQLSTATE
	// IDMCR, which aborts that transaction).
	ErrClaimReleased
	// ErrPreparedStatementsLost: pgx's cached prepared statement is missing
	// (26000) or already there (42P05) on the server connection: what a
	// transaction pooler without prepared-statement support does to pgx's
	// default exec mode.
	ErrPreparedStatementsLost
	// ErrFeatureNotSupported: the server refused the statement as a
	// feature it does not support (0A000: Citus, for statements it cannot
	// distribute that way).
	ErrFeatureNotSupported
	// ErrNoTokenSequence: idem's token sequence is missing (a Citus worker,
	// or a database idem did not migrate).
	ErrNoTokenSequence
	// ErrNoLockTimeoutSetting: the setting PostgreSQL's claim saves the
	// caller's lock_timeout in is unknown (the claim ran on a Citus
	// worker).
	ErrNoLockTimeoutSetting
	// ErrNoRefusal: idem's function that raises its own SQLSTATEs is
	// missing (a database not migrated to version 8; on Citus, a worker
	// that Distribute did not reach).
	ErrNoRefusal
	// ErrNoBodyExpiry: the key table lacks the column body_expires_at (a
	// database not migrated to version 9).
	ErrNoBodyExpiry
	// ErrNoUnknownAt: the key table lacks the column unknown_at (a
	// database not migrated to version 10).
	ErrNoUnknownAt
	// ErrCommitInDoubt: the COMMIT that ends a span of the call's own
	// may have been sent, and no answer came back (its context ended, or
	// the connection broke): it may have committed. The database/sql
	// driver marks it on Span.Complete's error (dberr.CommitError); not
	// when it knows nothing was sent, which leaves one case: the context
	// ending at the very moment database/sql's Tx.Commit checks it.
	ErrCommitInDoubt
	// ErrCanceled: the server cancelled the statement at the client's
	// request (57014: lib/pq's answer to a context that ended).
	ErrCanceled
)

// The SQLSTATEs idem's statements raise on purpose (class ID is idem's;
// IDMDN is the migrations' refusal to go down).
const (
	// StateKeyRowChanged is KeyComplete's refusal (ErrKeyRowChanged).
	StateKeyRowChanged = "IDMRC"
	// StateClaimReleased is KeyAbortIfClaimed's refusal
	// (ErrClaimReleased).
	StateClaimReleased = "IDMCR"
)

// Fault is a set of what the core tells apart in a database's error; each
// of the constants above is one, and an error (it says which).
type Fault uint16

var faultNames = [...]string{
	"unavailable", "server unavailable", "lock not available", "retryable", "transaction aborted",
	"key row changed", "claim released", "prepared statements lost", "feature not supported",
	"no token sequence", "no lock_timeout setting", "no refusal function",
	"no body_expires_at column", "no unknown_at column", "commit in doubt",
}

func (f Fault) Error() string {
	var names []string
	for i, name := range faultNames {
		if f&(1<<i) != 0 {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return "no fault"
	}
	return strings.Join(names, ", ")
}

// Error is a database's error in the driver package's terms: the faults it
// shows, the SQLSTATE the server gave ("" for none), and the error itself
// (what Error and Unwrap give).
type Error struct {
	Faults   Fault
	SQLState string
	Err      error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// Is matches each Fault the error shows (all of target's bits).
func (e *Error) Is(target error) bool {
	f, ok := target.(Fault)
	return ok && f != 0 && e.Faults&f == f
}
