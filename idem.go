package idem

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/driver/pgxdriver"
)

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

// Client is a configured form of the package-level API. It holds no
// connections: every call takes the transaction or database handle to use.
// A Client is safe for concurrent use.
type Client struct {
	c *core.Client[pgx.Tx, pgxdriver.Beginner]
}

// New returns a Client for cfg, with zero fields replaced by their defaults.
// A field out of range gives an error wrapping ErrInvalidConfig.
func New(cfg Config) (*Client, error) {
	c, err := core.New(coreConfig(cfg), "idem", pgxdriver.New)
	if err != nil {
		return nil, publicErr(err)
	}
	return &Client{c}, nil
}

// Config returns the client's configuration with defaults filled in.
func (c *Client) Config() Config { return config(c.c.Config()) }

var defaultClient = func() *Client {
	c, err := New(Config{})
	if err != nil {
		panic(err)
	}
	return c
}()

// Do runs fn at most once per key: it claims (scope, key) in tx, runs fn in
// tx, and stores fn's Response in tx. Everything commits or rolls back with
// tx; Do itself never commits or rolls back the caller's transaction. The
// claim and fn run in a savepoint of tx that Do ends before it returns.
//
//   - First call: fn runs once, its Response is stored and returned with
//     Replayed false.
//   - A later call with the same scope, key and fingerprint, after the first
//     committed: fn does not run; the stored Response comes back exactly
//     (status, headers, body bytes) with Replayed true.
//   - The same scope and key with a different fingerprint: ErrKeyReused; fn
//     does not run.
//   - Concurrent calls with the same key: the primary key lets one claim win.
//     The others wait up to Config.Wait for the winner's transaction: if it
//     commits they replay its outcome, if it rolls back one of them runs fn,
//     and if the wait runs out they get ErrInProgress (an *InProgressError).
//   - fn returns Reject(resp): fn's writes are undone, resp is stored as the
//     final outcome of the key and returned with a nil error, so the caller
//     commits. Retries replay the refusal. (Undoing fn's writes gives the
//     key up for a moment: should a concurrent twin claim it then and run,
//     its outcome is the key's and Do returns it as a replay.)
//   - fn returns any other error, or panics: fn's writes and the claim are
//     undone, nothing is stored, and the error (or panic) is passed on. The
//     key is free again. This undo runs even when ctx is done (bounded by 5
//     seconds), so a transaction the caller commits anyway holds nothing of
//     fn's. Should the connection break during that undo, the error is
//     ErrUnavailable, and names fn's error in words only (errors.Is finds
//     no refusal fn passed on: tx is gone).
//   - A key past its TTL counts as a new request.
//   - A key held by a reservation (Reserve): ErrInProgress while its lease
//     lasts, ErrOutcomeUnknown once the lease ran out or its outcome is
//     unknown; a reservation that failed retryably runs as a new attempt.
//
// Invalid input (key, scope, nil tx or fn) is refused before any statement
// runs. A Response that cannot be stored (too large, bad status, header that
// is not valid text) undoes fn's writes and the claim, and returns
// ErrResponseTooLarge or ErrInvalidResponse.
//
// When Do returns ErrInProgress, ErrKeyReused, ErrOutcomeUnknown,
// ErrInvalidArgument (except when fn ended tx itself, below) or a replay,
// tx is as it was before the call: also on a
// connection that has not run Do before, in every exec mode of pgx. The
// claim, its lock wait and the question whether the database is Citus run
// inside Do's savepoint, which Do undoes on the way out. On a connection
// where pgx has not cached the claim's statements (its first Do, the first
// after a claim failed there), Do sends SAVEPOINT alone first, in the simple
// protocol, and everything else inside it; otherwise SAVEPOINT and the
// claim go in one batch. Before a batch pgx may still prepare or describe,
// in tx itself, the statement SAVEPOINT (which takes no lock) and
// statements it evicted from a full cache: a cancellation or a failure
// there leaves tx aborted, and Do returns an error that is no refusal. So
// does a connection that breaks while Do undoes its savepoint
// (ErrUnavailable). docs/guarantees.md says exactly what runs where.
//
// When fn changes or deletes the key's own row in idem_keys, the outcome
// cannot be stored: Do undoes fn's writes and the claim, tx stays usable,
// and the error is ErrKeyRowChanged. After a serialization failure
// (SQLSTATE 40001, under REPEATABLE READ or SERIALIZABLE) or a deadlock the
// whole transaction must be run again (InTx and DoInTx do so); after a lost
// connection it is gone. Either way the retry replays or runs.
//
// fn must not commit or roll back tx: Do then returns an error wrapping
// ErrInvalidArgument, which says which when Do can tell. After a COMMIT
// there, fn's writes and the claim are durable without an outcome; Do
// cannot tell that row from its own caller's claim and answers
// ErrInProgress to the key, while a DoInTx or Reserve of the key with the
// same fingerprint, in a transaction of its own, turns it unknown and
// answers ErrOutcomeUnknown (see DoInTx); another fingerprint gets
// ErrKeyReused and leaves the row as it is. When tx is a savepoint of a
// transaction (begun on a pgx.Tx), fn's Commit is RELEASE SAVEPOINT: fn's
// writes and the claim stay pending in the enclosing transaction, and Do
// aborts that transaction, so that they cannot commit without an outcome:
// roll it back. After fn's Rollback of such a tx, the enclosing
// transaction is usable and the key free.
//
// Each Do uses a subtransaction; keep the number of Do calls in one
// transaction well under 64, PostgreSQL's per-backend subtransaction cache.
//
// Do uses the package defaults; see Config and New for the configurable form.
func Do(ctx context.Context, tx pgx.Tx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	return defaultClient.Do(ctx, tx, scope, key, fp, fn)
}

// Do is the package-level Do with this client's configuration.
func (c *Client) Do(ctx context.Context, tx pgx.Tx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	res, err := c.c.Do(ctx, tx, core.Scope(scope), key, core.Fingerprint(fp), coreFn(fn))
	return result(res), publicErr(err)
}

// DoInTx runs Do in a transaction of its own begun on db, and commits it
// when Do returns a nil error: the claim, fn's writes and the stored
// response commit together. Serialization failures and deadlocks are
// retried (not on a pgx.Tx, see InTx), and a retry of a duplicate replays
// the winner's response. Under SERIALIZABLE such a failure can surface
// after fn ran (when the response is stored, or at COMMIT): then fn runs
// again in the retry, and only one run's writes commit. Invalid input is
// refused before a transaction begins; so is a *pgx.Conn that is already in
// a transaction.
//
// When fn changes or deletes the key's own row in idem_keys, the
// completion fails, the COMMIT sent with it does not run, and DoInTx rolls
// back and returns ErrKeyRowChanged: nothing of fn's is committed.
//
// fn must not commit or roll back tx. If it does, DoInTx returns an error
// wrapping ErrInvalidArgument that says which (unless marking the record,
// below, failed). After a ROLLBACK nothing of fn's or of the claim remains,
// and the key is free. After a COMMIT fn's writes and the claim are
// durable without an outcome: DoInTx turns the key's record unknown, in a
// statement of its own (should the process stop first, the next DoInTx or
// Reserve of the key with the same fingerprint does it; another
// fingerprint gets ErrKeyReused and leaves the row as it is), so that
// retries get ErrOutcomeUnknown and never run fn again, ListUnknown lists
// the record, and Resolve settles it. On a pgx.Tx, fn's tx is a savepoint
// of the caller's transaction, as in Do: after fn's Commit (RELEASE
// SAVEPOINT) DoInTx aborts the caller's transaction, which holds fn's
// writes and the claim pending, so that they cannot commit without an
// outcome: roll it back.
//
// On a *pgxpool.Pool or a *pgx.Conn, DoInTx sends BEGIN with the claim and
// COMMIT with the stored response, so the transaction costs no round trip
// of its own, and fn runs directly in it (no savepoint): when fn fails the
// transaction is rolled back whole. On a pgx.Tx or another Beginner it is
// InTx around Do.
//
// Concurrent DoInTx calls with the same scope and key on one Client (the
// package-level functions share one) and one *pgxpool.Pool are coalesced in
// this process: the first goes to the database; the others wait for it, at
// most Config.Wait, and get its committed outcome as a replay (ErrKeyReused
// if their fingerprint differs). If its claim gave up waiting for a
// transaction elsewhere that holds the key, they get ErrInProgress too; if it
// fails otherwise, nothing was stored and each of them goes to the database
// itself. Duplicates in other processes, or on other pools, meet at the
// primary key as always.
func DoInTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	return defaultClient.DoInTx(ctx, db, scope, key, fp, fn)
}

// DoInTx is the package-level DoInTx with this client's configuration.
func (c *Client) DoInTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	res, err := c.c.DoInTx(ctx, db, core.Scope(scope), key, core.Fingerprint(fp), coreFn(fn))
	return result(res), publicErr(err)
}

// coreFn is fn as the protocol calls it: the same function, with the
// protocol's Response. (The closure does not escape the call: no
// allocation.)
func coreFn(fn func(ctx context.Context, tx pgx.Tx) (Response, error)) func(ctx context.Context, tx pgx.Tx) (core.Response, error) {
	if fn == nil {
		return nil
	}
	return func(ctx context.Context, tx pgx.Tx) (core.Response, error) {
		resp, err := fn(ctx, tx)
		return core.Response(resp), err
	}
}
