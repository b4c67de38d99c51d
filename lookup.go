package idem

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	store "github.com/pgidem/idem/internal/db"
)

// Lookup returns the committed record of (scope, key): its status,
// fingerprint, timestamps, lease and token, and the stored response. It
// returns ErrNotFound when no record holds the key; a claim whose
// transaction has not committed is not visible. Lookup does not check who
// asks: an HTTP endpoint that shows records must check that the caller is
// scope.Actor first (idemhttp.StatusHandler does).
func Lookup(ctx context.Context, db Beginner, scope Scope, key string) (Record, error) {
	return defaultClient.Lookup(ctx, db, scope, key)
}

// Lookup is the package-level Lookup with this client's key limits.
func (c *Client) Lookup(ctx context.Context, db Beginner, scope Scope, key string) (Record, error) {
	if err := c.checkTarget(scope, key); err != nil {
		return Record{}, err
	}
	if isNil(db) {
		return Record{}, fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	var rec Record
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		row, err := queries.KeyLookup(ctx, planned{tx}, store.KeyLookupParams{
			Actor: scope.Actor, Operation: scope.Operation, IdemKey: key})
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		rec, err = newRecord(row.IdemKey)
		return err
	})
	switch {
	case errors.Is(err, ErrNotFound):
		return Record{}, err
	case err != nil:
		return Record{}, fmt.Errorf("idem: lookup: %w", unsupportedIf(err))
	}
	return rec, nil
}

// Forget deletes the record of a finished key (succeeded, rejected or
// failed_retryable), so that the next request with it runs as a new one:
// for a client stuck on ErrKeyReused with a key it reused by mistake, or a
// refusal that should not be replayed any more. It refuses a key in flight
// with ErrInProgress (a reservation's 'processing' record whose lease is
// live, or a record a transaction holds right now) and a key whose outcome
// is unknown with ErrOutcomeUnknown, as Reserve and Do do (an 'unknown'
// record, or a reservation whose lease ran out before it recorded an
// outcome: Resolve it instead, since forgetting it could run its work
// twice). ErrNotFound when no committed record holds the key. Nothing
// changes on an error.
func Forget(ctx context.Context, db Beginner, scope Scope, key string) error {
	return defaultClient.Forget(ctx, db, scope, key)
}

// Forget is the package-level Forget with this client's key limits.
func (c *Client) Forget(ctx context.Context, db Beginner, scope Scope, key string) error {
	if err := c.checkTarget(scope, key); err != nil {
		return err
	}
	if isNil(db) {
		return fmt.Errorf("%w: nil database handle", ErrInvalidArgument)
	}
	k := store.KeyLockForForgetParams{Actor: scope.Actor, Operation: scope.Operation, IdemKey: key}
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		row, err := queries.KeyLockForForget(ctx, planned{tx}, k)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return ErrNotFound
		case pgCode(err) == pgerrcode.LockNotAvailable:
			return c.inProgress()
		case err != nil:
			return err
		}
		if err := c.forgettable(Status(row.Status), row.LeaseRanOut); err != nil {
			return err
		}
		_, err = queries.KeyForget(ctx, planned{tx}, store.KeyForgetParams(k))
		return err
	})
	switch {
	case errors.Is(err, ErrNotFound), errors.Is(err, ErrInProgress), errors.Is(err, ErrOutcomeUnknown):
		return err
	case err != nil:
		return fmt.Errorf("idem: forget: %w", unsupportedIf(err))
	}
	return nil
}

// forgettable decides whether Forget may delete the locked record of a key,
// which is in status (leaseRanOut as KeyLockForForget reads it): nil,
// ErrInProgress or ErrOutcomeUnknown. Package idemsql decides through it
// too (internal/bridge).
func (c *Client) forgettable(status Status, leaseRanOut bool) error {
	switch status {
	case StatusProcessing:
		if leaseRanOut {
			// As Reserve and Do answer: the owner's lease ran out before
			// it recorded an outcome.
			return fmt.Errorf("%w: the reservation's lease ran out", ErrOutcomeUnknown)
		}
		return c.inProgress()
	case StatusUnknown:
		return ErrOutcomeUnknown
	}
	return nil
}
