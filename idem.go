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
// tx, and stores fn's Response in tx, so all three commit or roll back with
// tx. Do never commits or rolls back tx itself; the claim and fn run in a
// savepoint of tx that Do ends before it returns.
//
//   - First call: fn runs, its Response is stored and returned (Replayed
//     false). After tx commits, a call with the same scope, key and
//     fingerprint does not run fn: it returns the stored Response exactly,
//     with Replayed true.
//   - The same key with another fingerprint: ErrKeyReused. A concurrent call
//     holding the key: wait up to Config.Wait, then replay, run (if the other
//     rolled back) or ErrInProgress (an *InProgressError with RetryAfter). A
//     key held by a reservation: ErrInProgress or ErrOutcomeUnknown.
//   - fn returns Reject(resp): fn's writes are undone, resp is stored as the
//     key's final outcome and returned with a nil error; commit tx.
//   - fn returns any other error or panics: fn's writes and the claim are
//     undone, nothing is stored, the error (or panic) is passed on, and the
//     key is free again.
//
// On every refusal (ErrInProgress, ErrKeyReused, ErrOutcomeUnknown, bad
// input) and on a replay, tx is as it was before the call and stays usable.
// fn must not commit or roll back tx (Do returns ErrInvalidArgument). After
// a serialization failure or a deadlock the whole transaction must run
// again (InTx and DoInTx do that); Unavailable tells a store failure. Keep
// Do calls per transaction well under 64 (each uses a subtransaction).
//
// docs/guarantees.md has the full story: what runs where on a cold
// connection, fn ending its transaction, ErrKeyRowChanged, lost
// connections. Do uses the package defaults; see New for a configured Client.
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
// response commit together. Invalid input is refused before a transaction
// begins.
//
// Serialization failures and deadlocks are retried (Config.MaxRetries; not
// on a pgx.Tx, see InTx), so fn may run more than once; only one run
// commits. On a *pgxpool.Pool or a *pgx.Conn, BEGIN goes with the claim and
// COMMIT with the stored response: the transaction costs no round trip of
// its own. Concurrent DoInTx calls with the same scope and key on one
// Client and one pool are coalesced in this process: one goes to the
// database, the others get its committed outcome as a replay.
//
// fn must not commit or roll back tx: DoInTx returns ErrInvalidArgument,
// and after fn's COMMIT the key's record turns unknown (ErrOutcomeUnknown
// for retries, settled with Resolve). docs/guarantees.md has the full
// story.
func DoInTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	return defaultClient.DoInTx(ctx, db, scope, key, fp, fn)
}

// DoInTx is the package-level DoInTx with this client's configuration.
func (c *Client) DoInTx(ctx context.Context, db Beginner, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx pgx.Tx) (Response, error)) (Result, error) {
	res, err := c.c.DoInTx(ctx, db, core.Scope(scope), key, core.Fingerprint(fp), coreFn(fn))
	if err != nil {
		return result(res), publicErr(err)
	}
	return Result{Response: Response(res.Response), Replayed: res.Replayed}, nil
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
