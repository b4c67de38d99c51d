package idem

import (
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/core"
)

// The protocol (internal/core) has types of its own with the same fields as
// this package's; these functions carry values across. Struct conversions
// between identical underlying types cost nothing, and the copies below
// allocate nothing but the slices and maps they must rebuild (list and
// statistics calls, never Do or DoInTx).

func result(r core.Result) Result {
	return Result{Response: Response(r.Response), Replayed: r.Replayed}
}

func reservation(r core.Reservation) Reservation {
	return Reservation{Result: result(r.Result), Scope: Scope(r.Scope), Key: r.Key, Token: r.Token,
		LeaseExpiresAt: r.LeaseExpiresAt, Resumed: r.Resumed}
}

func coreReservation(r Reservation) core.Reservation {
	return core.Reservation{Result: core.Result{Response: core.Response(r.Response), Replayed: r.Replayed},
		Scope: core.Scope(r.Scope), Key: r.Key, Token: r.Token, LeaseExpiresAt: r.LeaseExpiresAt, Resumed: r.Resumed}
}

func record(r core.Record) Record {
	return Record{Scope: Scope(r.Scope), Key: r.Key, Status: Status(r.Status), Fingerprint: Fingerprint(r.Fingerprint),
		Token: r.Token, LastError: r.LastError, ResolveReason: r.ResolveReason, CreatedAt: r.CreatedAt,
		CompletedAt: r.CompletedAt, ExpiresAt: r.ExpiresAt, LeaseExpiresAt: r.LeaseExpiresAt,
		ResumeUntil: r.ResumeUntil, UnknownAt: r.UnknownAt, BodyExpiresAt: r.BodyExpiresAt, Response: (*Response)(r.Response), ResponseGone: r.ResponseGone}
}

func coreRecord(r *Record) *core.Record {
	if r == nil {
		return nil
	}
	return &core.Record{Scope: core.Scope(r.Scope), Key: r.Key, Status: core.Status(r.Status),
		Fingerprint: core.Fingerprint(r.Fingerprint), Token: r.Token, LastError: r.LastError,
		ResolveReason: r.ResolveReason, CreatedAt: r.CreatedAt, CompletedAt: r.CompletedAt,
		ExpiresAt: r.ExpiresAt, LeaseExpiresAt: r.LeaseExpiresAt, ResumeUntil: r.ResumeUntil, UnknownAt: r.UnknownAt, BodyExpiresAt: r.BodyExpiresAt,
		Response: (*core.Response)(r.Response), ResponseGone: r.ResponseGone}
}

func records(rs []core.Record, err error) ([]Record, error) {
	if rs == nil {
		return nil, publicErr(err)
	}
	out := make([]Record, len(rs))
	for i, r := range rs {
		out[i] = record(r)
	}
	return out, publicErr(err)
}

func coreResolution(r Resolution) core.Resolution {
	return core.Resolution{Token: r.Token, Succeeded: (*core.Response)(r.Succeeded), Retryable: r.Retryable, Reason: r.Reason}
}

func stats(s core.Stats) Stats {
	out := Stats{OldestProcessing: s.OldestProcessing, OldestUnknown: s.OldestUnknown,
		TableBytes: s.TableBytes, IndexBytes: s.IndexBytes}
	if s.Keys != nil {
		out.Keys = make(map[Status]int64, len(s.Keys))
		for k, n := range s.Keys {
			out.Keys[Status(k)] = n
		}
	}
	return out
}

func coreConfig(c Config) core.Config {
	return core.Config{TTL: c.TTL, TTLFor: c.TTLFor, BodyTTL: c.BodyTTL, BodyTTLFor: c.BodyTTLFor, Wait: c.Wait, MinKeyLength: c.MinKeyLength, MaxKeyLength: c.MaxKeyLength,
		MaxResponseBytes: c.MaxResponseBytes, IsolationLevel: core.IsolationLevel(c.IsolationLevel),
		MeterProvider: c.MeterProvider, TracerProvider: c.TracerProvider, Logger: c.Logger,
		LogHashKey: c.LogHashKey, MaxRetries: c.MaxRetries}
}

func config(c core.Config) Config {
	return Config{TTL: c.TTL, TTLFor: c.TTLFor, BodyTTL: c.BodyTTL, BodyTTLFor: c.BodyTTLFor, Wait: c.Wait, MinKeyLength: c.MinKeyLength, MaxKeyLength: c.MaxKeyLength,
		MaxResponseBytes: c.MaxResponseBytes, IsolationLevel: pgx.TxIsoLevel(c.IsolationLevel),
		MeterProvider: c.MeterProvider, TracerProvider: c.TracerProvider, Logger: c.Logger,
		LogHashKey: c.LogHashKey, MaxRetries: c.MaxRetries}
}

// sentinels pairs each of this package's sentinel errors with the
// protocol's, which the protocol's errors wrap.
var sentinels = [...]struct{ public, core error }{
	{ErrKeyReused, core.ErrKeyReused},
	{ErrInProgress, core.ErrInProgress},
	{ErrInvalidKey, core.ErrInvalidKey},
	{ErrInvalidScope, core.ErrInvalidScope},
	{ErrInvalidResponse, core.ErrInvalidResponse},
	{ErrResponseTooLarge, core.ErrResponseTooLarge},
	{ErrInvalidJSON, core.ErrInvalidJSON},
	{ErrInvalidConfig, core.ErrInvalidConfig},
	{ErrUnavailable, core.ErrUnavailable},
	{ErrInvalidArgument, core.ErrInvalidArgument},
	{ErrOutcomeUnknown, core.ErrOutcomeUnknown},
	{ErrResponseGone, core.ErrResponseGone},
	{ErrNotFound, core.ErrNotFound},
	{ErrFenced, core.ErrFenced},
	{ErrKeyRowChanged, core.ErrKeyRowChanged},
	{ErrTxAborted, core.ErrTxAborted},
	{ErrPreparedStatements, core.ErrPreparedStatements},
	{ErrNotResolvable, core.ErrNotResolvable},
	{ErrUnsupported, core.ErrUnsupported},
	{ErrStoredValue, core.ErrStoredValue},
}

// publicErr is err as this package returns it: errors.Is finds this
// package's sentinels in it and errors.As its error types. The message is
// err's. A nil err (every call that succeeds) costs one comparison; err
// itself comes back when it holds nothing of the protocol's (fn's own
// errors, passed on), so that it stays comparable with ==.
func publicErr(err error) error {
	if err == nil {
		return nil
	}
	if e, ok := err.(*core.InProgressError); ok {
		return &InProgressError{RetryAfter: e.RetryAfter}
	}
	if _, ok := err.(*publicError); ok || !fromCore(err) {
		return err
	}
	return &publicError{err}
}

// fromCore reports whether err's chain holds one of the protocol's
// sentinels or error types.
func fromCore(err error) bool {
	var ipe *core.InProgressError
	var rej *core.RejectedError
	if errors.As(err, &ipe) || errors.As(err, &rej) {
		return true
	}
	for _, s := range sentinels {
		if errors.Is(err, s.core) {
			return true
		}
	}
	return false
}

// publicError is an error of the protocol as this package returns it.
type publicError struct{ err error }

func (e *publicError) Error() string { return e.err.Error() }
func (e *publicError) Unwrap() error { return e.err }

// Is makes errors.Is(err, ErrKeyReused) true when err wraps the protocol's
// ErrKeyReused, and so for every sentinel.
func (e *publicError) Is(target error) bool {
	for _, s := range sentinels {
		if s.public == target {
			return errors.Is(e.err, s.core)
		}
	}
	return false
}

// As finds an *InProgressError or a *RejectedError where the chain holds
// the protocol's.
func (e *publicError) As(target any) bool {
	switch t := target.(type) {
	case **InProgressError:
		var c *core.InProgressError
		if errors.As(e.err, &c) {
			*t = &InProgressError{RetryAfter: c.RetryAfter}
			return true
		}
	case **RejectedError:
		var c *core.RejectedError
		if errors.As(e.err, &c) {
			*t = &RejectedError{Status: c.Status, Body: c.Body}
			return true
		}
	}
	return false
}
