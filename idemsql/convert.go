package idemsql

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/core"
)

// The protocol (internal/core) has types of its own with the same fields as
// package idem's; these functions carry values across, as idem's own
// (convert.go at the root) do. Struct conversions
// between identical underlying types cost nothing, and the copies below
// allocate nothing but the slices and maps they must rebuild (list and
// statistics calls, never Do or DoInTx).

func result(r core.Result) idem.Result {
	return idem.Result{Response: idem.Response(r.Response), Replayed: r.Replayed}
}

func reservation(r core.Reservation) idem.Reservation {
	return idem.Reservation{Result: result(r.Result), Scope: idem.Scope(r.Scope), Key: r.Key, Token: r.Token,
		LeaseExpiresAt: r.LeaseExpiresAt, Resumed: r.Resumed}
}

func coreReservation(r idem.Reservation) core.Reservation {
	return core.Reservation{Result: core.Result{Response: core.Response(r.Response), Replayed: r.Replayed},
		Scope: core.Scope(r.Scope), Key: r.Key, Token: r.Token, LeaseExpiresAt: r.LeaseExpiresAt, Resumed: r.Resumed}
}

func record(r core.Record) idem.Record {
	return idem.Record{Scope: idem.Scope(r.Scope), Key: r.Key, Status: idem.Status(r.Status), Fingerprint: idem.Fingerprint(r.Fingerprint),
		Token: r.Token, LastError: r.LastError, ResolveReason: r.ResolveReason, CreatedAt: r.CreatedAt,
		CompletedAt: r.CompletedAt, ExpiresAt: r.ExpiresAt, LeaseExpiresAt: r.LeaseExpiresAt,
		ResumeUntil: r.ResumeUntil, UnknownAt: r.UnknownAt, BodyExpiresAt: r.BodyExpiresAt, Response: (*idem.Response)(r.Response), ResponseGone: r.ResponseGone}
}

func coreRecord(r *idem.Record) *core.Record {
	if r == nil {
		return nil
	}
	return &core.Record{Scope: core.Scope(r.Scope), Key: r.Key, Status: core.Status(r.Status),
		Fingerprint: core.Fingerprint(r.Fingerprint), Token: r.Token, LastError: r.LastError,
		ResolveReason: r.ResolveReason, CreatedAt: r.CreatedAt, CompletedAt: r.CompletedAt,
		ExpiresAt: r.ExpiresAt, LeaseExpiresAt: r.LeaseExpiresAt, ResumeUntil: r.ResumeUntil, UnknownAt: r.UnknownAt, BodyExpiresAt: r.BodyExpiresAt,
		Response: (*core.Response)(r.Response), ResponseGone: r.ResponseGone}
}

func records(rs []core.Record, err error) ([]idem.Record, error) {
	if rs == nil {
		return nil, publicErr(err)
	}
	out := make([]idem.Record, len(rs))
	for i, r := range rs {
		out[i] = record(r)
	}
	return out, publicErr(err)
}

func coreResolution(r idem.Resolution) core.Resolution {
	return core.Resolution{Token: r.Token, Succeeded: (*core.Response)(r.Succeeded), Retryable: r.Retryable, Reason: r.Reason}
}

func stats(s core.Stats) idem.Stats {
	out := idem.Stats{OldestProcessing: s.OldestProcessing, OldestUnknown: s.OldestUnknown,
		TableBytes: s.TableBytes, IndexBytes: s.IndexBytes}
	if s.Keys != nil {
		out.Keys = make(map[idem.Status]int64, len(s.Keys))
		for k, n := range s.Keys {
			out.Keys[idem.Status(k)] = n
		}
	}
	return out
}

func coreConfig(c idem.Config) core.Config {
	return core.Config{TTL: c.TTL, TTLFor: c.TTLFor, BodyTTL: c.BodyTTL, BodyTTLFor: c.BodyTTLFor, Wait: c.Wait, MinKeyLength: c.MinKeyLength, MaxKeyLength: c.MaxKeyLength,
		MaxResponseBytes: c.MaxResponseBytes, IsolationLevel: core.IsolationLevel(c.IsolationLevel),
		MeterProvider: c.MeterProvider, TracerProvider: c.TracerProvider, Logger: c.Logger,
		LogHashKey: c.LogHashKey, MaxRetries: c.MaxRetries}
}

func config(c core.Config) idem.Config {
	return idem.Config{TTL: c.TTL, TTLFor: c.TTLFor, BodyTTL: c.BodyTTL, BodyTTLFor: c.BodyTTLFor, Wait: c.Wait, MinKeyLength: c.MinKeyLength, MaxKeyLength: c.MaxKeyLength,
		MaxResponseBytes: c.MaxResponseBytes, IsolationLevel: pgx.TxIsoLevel(c.IsolationLevel),
		MeterProvider: c.MeterProvider, TracerProvider: c.TracerProvider, Logger: c.Logger,
		LogHashKey: c.LogHashKey, MaxRetries: c.MaxRetries}
}

// sentinels pairs each of this package's sentinel errors with the
// protocol's, which the protocol's errors wrap.
var sentinels = [...]struct{ public, core error }{
	{idem.ErrKeyReused, core.ErrKeyReused},
	{idem.ErrInProgress, core.ErrInProgress},
	{idem.ErrInvalidKey, core.ErrInvalidKey},
	{idem.ErrInvalidScope, core.ErrInvalidScope},
	{idem.ErrInvalidResponse, core.ErrInvalidResponse},
	{idem.ErrResponseTooLarge, core.ErrResponseTooLarge},
	{idem.ErrInvalidJSON, core.ErrInvalidJSON},
	{idem.ErrInvalidConfig, core.ErrInvalidConfig},
	{idem.ErrUnavailable, core.ErrUnavailable},
	{idem.ErrInvalidArgument, core.ErrInvalidArgument},
	{idem.ErrOutcomeUnknown, core.ErrOutcomeUnknown},
	{idem.ErrResponseGone, core.ErrResponseGone},
	{idem.ErrNotFound, core.ErrNotFound},
	{idem.ErrFenced, core.ErrFenced},
	{idem.ErrKeyRowChanged, core.ErrKeyRowChanged},
	{idem.ErrTxAborted, core.ErrTxAborted},
	{idem.ErrPreparedStatements, core.ErrPreparedStatements},
	{idem.ErrNotResolvable, core.ErrNotResolvable},
	{idem.ErrUnsupported, core.ErrUnsupported},
	{idem.ErrStoredValue, core.ErrStoredValue},
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
		return &idem.InProgressError{RetryAfter: e.RetryAfter}
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
	case **idem.InProgressError:
		var c *core.InProgressError
		if errors.As(e.err, &c) {
			*t = &idem.InProgressError{RetryAfter: c.RetryAfter}
			return true
		}
	case **idem.RejectedError:
		var c *core.RejectedError
		if errors.As(e.err, &c) {
			*t = &idem.RejectedError{Status: c.Status, Body: c.Body}
			return true
		}
	}
	return false
}

// coreFn is fn as the protocol calls it: the same function, with the
// protocol's Response. (The closure does not escape the call: no
// allocation.)
func coreFn(fn func(ctx context.Context, tx *sql.Tx) (idem.Response, error)) func(ctx context.Context, tx *sql.Tx) (core.Response, error) {
	if fn == nil {
		return nil
	}
	return func(ctx context.Context, tx *sql.Tx) (core.Response, error) {
		resp, err := fn(ctx, tx)
		return core.Response(resp), err
	}
}

// typed is the outcome of the protocol's DoJSON as this package returns it.
func typed[T any](v T, replayed bool, err error) (T, bool, error) {
	if rej, ok := err.(*core.RejectedError); ok {
		return v, replayed, &idem.RejectedError{Status: rej.Status, Body: rej.Body}
	}
	return v, replayed, publicErr(err)
}
