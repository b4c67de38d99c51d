package idem

import (
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Config configures a Client. The zero value of every field means its
// default; the package-level functions (Do, DoInTx, InTx) use Config{}.
type Config struct {
	// TTL is how long a key is remembered after it is claimed (for a
	// reservation, also at least a TTL after its outcome is recorded). Past
	// it a finished key counts as a new request. Default 24 hours. It is
	// counted, as BodyTTL is, from the start of the transaction the claim
	// runs in (PostgreSQL's now()): DoInTx's own on a pool or connection,
	// which the claim begins; for Do, and DoInTx on a caller's
	// transaction, the caller's, so the time it spent before the call
	// counts too.
	TTL time.Duration

	// TTLFor, when set, gives the TTL of the keys of an operation
	// (Scope.Operation), in place of TTL: a short one for a payment
	// attempt, a long one for an order. 0 means TTL. It is called on every
	// call, so it must be fast and safe for concurrent use; a value under a
	// microsecond (negative, or 1-999ns) fails the call with ErrInvalidConfig before
	// anything is written. A key keeps the TTL it was claimed with.
	TTLFor func(operation string) time.Duration

	// BodyTTL, when set, is how long the stored response's body and
	// headers are kept after the key is claimed by Do or DoInTx, when that
	// is shorter than the key's TTL (TTL, TTLFor). Past it the key still
	// refuses a different request (ErrKeyReused), and a replay returns
	// ErrResponseGone with the stored status: nothing runs again. Prune
	// drops the bodies. 0 means the body lives as long as the key;
	// reservations (Reserve) always keep theirs. A value under a
	// microsecond (negative, or 1-999ns) is refused (ErrInvalidConfig).
	BodyTTL time.Duration

	// BodyTTLFor, when set, gives the body life of an operation's keys
	// (Scope.Operation) in place of BodyTTL, as TTLFor does for the key's
	// TTL: drop a large receipt's body after an hour, keep a small one as
	// long as the key. 0 means BodyTTL. It is called on every call, so it
	// must be fast and safe for concurrent use; a value under a microsecond
	// (negative, or 1-999ns) fails the call with ErrInvalidConfig before anything is
	// written. A body keeps the life it was claimed with.
	BodyTTLFor func(operation string) time.Duration

	// Wait bounds how long a call waits for a concurrent transaction that
	// holds the same key before it gives up with ErrInProgress. (On Citus
	// the wait happens on a worker, which the bound reaches only when
	// citus.propagate_set_commands is 'local': see Distribute.) Default 2
	// seconds; a negative value means wait at most a millisecond
	// (PostgreSQL's lock_timeout cannot be zero: that means forever). A
	// statement_timeout shorter than Wait ends the wait first: the
	// duplicate then fails with ErrUnavailable (SQLSTATE 57014), not
	// ErrInProgress; keep statement_timeout above Wait.
	Wait time.Duration

	// MinKeyLength and MaxKeyLength bound the key length in bytes. Defaults
	// 1 and 255 (Stripe's limit); MaxKeyLength may be at most 1024.
	MinKeyLength int
	MaxKeyLength int

	// MaxResponseBytes bounds the stored response: body plus header names
	// and values. Default 1 MiB. Keep responses small and free of secrets.
	MaxResponseBytes int

	// IsolationLevel is the isolation level of the transactions InTx and
	// DoInTx begin. Default: the server's default (READ COMMITTED unless
	// configured otherwise). On a pgx.Tx they run in a savepoint, which has
	// the isolation level of the caller's transaction.
	IsolationLevel pgx.TxIsoLevel

	// MeterProvider receives idem's metrics: a counter per outcome
	// (idem.reserve.created, .replay, .in_progress, .key_misuse, ...,
	// idem.store.error, idem.ttl_pruned) and the histograms
	// idem.duplicate.wait and idem.overhead, with the attributes "call" and
	// "operation" (the scope's Operation), never a key or an actor. nil means
	// OpenTelemetry's global provider, a no-op until the application
	// installs one.
	MeterProvider metric.MeterProvider

	// TracerProvider, when set, gets one span per Do, DoInTx and Reserve
	// call (idem.Do, idem.DoInTx, idem.Reserve) with its outcome. nil means
	// no spans. A tracer set on pgx's connection config keeps tracing idem's
	// statements either way.
	TracerProvider trace.TracerProvider

	// Logger receives a record per replay, refusal (in progress, key
	// misuse, unknown outcome) and store error of Do, DoInTx and the
	// reservation calls, and per store error of Prune, ExpireLeases and
	// Resolve (not of the operator's reads: Lookup, Forget, ListUnknown,
	// ListResumable, ReadStats, which return theirs), carrying keyed hashes
	// of the key and the actor (key_hash, actor_hash), never their values.
	// Those other than Do, DoInTx and Reserve log nothing when their own
	// context cut them (a pruner given a deadline). nil means silent.
	Logger *slog.Logger

	// LogHashKey is the HMAC-SHA256 key of those hashes. Give every
	// instance the same secret to follow one key across their logs; empty
	// means a random key per Client (idemhttp's handlers and the RPC
	// interceptors, given an empty one, share one random key per process).
	LogHashKey []byte

	// MaxRetries is how many times InTx and DoInTx run a transaction again
	// after a serialization failure (40001) or a deadlock (40P01), with
	// jittered exponential backoff. Default 5; a negative value disables
	// retries. On a pgx.Tx there are none: the caller's transaction is lost.
	MaxRetries int
}

// Defaults of Config.
const (
	DefaultTTL              = 24 * time.Hour
	DefaultWait             = 2 * time.Second
	DefaultMinKeyLength     = 1
	DefaultMaxKeyLength     = 255
	DefaultMaxResponseBytes = 1 << 20
	DefaultMaxRetries       = 5
)
