package core

import (
	"context"
	"errors"
	"math"

	"github.com/pgidem/idem/internal/driver"
)

// The operators' calls: finding and reconciling unknown outcomes, looking
// keys up and forgetting them, pruning, statistics. Each runs in short
// transactions of its own begun on the handle it is given.

// ExpireLeases turns at most limit 'processing' records whose lease ran out,
// without a window or past it, into 'unknown' (see idem.ExpireLeases).
func (c *Client[TTx, TDB]) ExpireLeases(ctx context.Context, db TDB, limit int) (int64, error) {
	if err := c.checkDB(db, false); err != nil {
		return 0, err
	}
	if err := checkLimit(limit); err != nil {
		return 0, err
	}
	var n int64
	err := c.batchTx(ctx, db, func(ctx context.Context, ex driver.Executor) (err error) {
		n, err = ex.ReserveExpireLeases(ctx, leaseExpiredReason, int32(min(limit, math.MaxInt32)))
		return err
	})
	if err != nil {
		err = errorf("idem: expire leases: %w", c.unsupportedIf(err))
		c.countEnd(ctx, "expire_leases", Scope{}, "", err, "")
		return 0, err
	}
	c.obs.count(ctx, "zombie_key", "expire_leases", "", n)
	return n, nil
}

// ListUnknown returns at most limit 'unknown' records that need a person,
// oldest first (see idem.ListUnknown).
func (c *Client[TTx, TDB]) ListUnknown(ctx context.Context, db TDB, limit int, after *Record) ([]Record, error) {
	return c.list(ctx, db, limit, after, "list unknown", driver.Executor.ReserveListUnknown)
}

// ListResumable returns at most limit records in doubt inside their
// window, oldest first (see idem.ListResumable).
func (c *Client[TTx, TDB]) ListResumable(ctx context.Context, db TDB, limit int, after *Record) ([]Record, error) {
	return c.list(ctx, db, limit, after, "list resumable", driver.Executor.ReserveListResumable)
}

// list is ListUnknown and ListResumable: a page of the records that query
// reads, after the record after.
func (c *Client[TTx, TDB]) list(ctx context.Context, db TDB, limit int, after *Record, call string,
	query func(ex driver.Executor, ctx context.Context, after *driver.Cursor, limit int32) ([]driver.Record, error)) ([]Record, error) {
	if err := c.checkDB(db, false); err != nil {
		return nil, err
	}
	if err := checkLimit(limit); err != nil {
		return nil, err
	}
	var cursor *driver.Cursor
	if after != nil {
		if err := checkCursor(after); err != nil {
			return nil, err
		}
		cursor = &driver.Cursor{CreatedAt: after.CreatedAt, Key: newKey(after.Scope, after.Key)}
	}
	var rows []driver.Record
	err := c.lookupTx(ctx, db, func(ctx context.Context, ex driver.Executor) (err error) {
		rows, err = query(ex, ctx, cursor, int32(min(limit, math.MaxInt32)))
		return err
	})
	if err != nil {
		return nil, errorf("idem: %s: %w", call, c.unsupportedIf(err))
	}
	records := make([]Record, 0, len(rows))
	for _, row := range rows {
		rec, err := newRecord(row)
		if err != nil {
			return nil, errorf("idem: %s: %w", call, err)
		}
		records = append(records, rec)
	}
	return records, nil
}

// Resolve reconciles the record of (scope, key) whose outcome was in doubt
// (see idem.Resolve).
func (c *Client[TTx, TDB]) Resolve(ctx context.Context, db TDB, scope Scope, key string, res Resolution) error {
	if err := c.checkTarget(scope, key); err != nil {
		return err
	}
	if err := c.checkDB(db, false); err != nil {
		return err
	}
	if res.Token <= 0 {
		return errorf("idem: %w: a Resolution names the Token of the attempt it resolves (Record.Token)", ErrInvalidArgument)
	}
	if (res.Succeeded != nil) == res.Retryable {
		return errorf("idem: %w: a Resolution sets exactly one of Succeeded and Retryable", ErrInvalidArgument)
	}
	if err := checkReason(res.Reason); err != nil {
		return err
	}
	verdict := driver.Resolve{Status: string(StatusFailedRetryable), Reason: res.Reason}
	if resp := res.Succeeded; resp != nil {
		reply, err := c.reply(*resp)
		if err != nil {
			return err
		}
		verdict.Status, verdict.Reply = string(StatusSucceeded), &reply
	}
	k := newKey(scope, key)
	err := c.lookupTx(ctx, db, func(ctx context.Context, ex driver.Executor) error {
		row, err := ex.ReserveLock(ctx, k)
		if errors.Is(err, driver.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		if err := resolvable(row, res.Token); err != nil {
			return err
		}
		n, err := ex.ReserveResolve(ctx, k, row.Token, verdict)
		if err == nil && n != 1 {
			err = errorf("idem: locked row not updated (%d rows)", n)
		}
		return err
	})
	if err != nil && !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrNotResolvable) && !errors.Is(err, ErrFenced) {
		err = errorf("idem: resolve: %w", c.unsupportedIf(err))
	}
	if err != nil {
		c.obs.count(ctx, "reconcile_failed", "resolve", scope.Operation, 1)
	}
	c.countEnd(ctx, "resolve", scope, key, err, "reconcile_resolved")
	return err
}

// resolvable decides whether Resolve may reconcile the locked row of a key
// with a Resolution that names the token want: nil, ErrFenced or
// ErrNotResolvable.
func resolvable(row driver.Row, want int64) error {
	status := Status(row.Status)
	// (Token 0: a record Do wrote, which has no attempt to name and is
	// never awaiting reconciliation: ErrNotResolvable below.)
	if row.Token != want && row.Token != 0 {
		return errorf("idem: %w: token %d was resolved or replaced; the record holds token %d now (status %s)",
			ErrFenced, want, row.Token, status)
	}
	switch {
	case status == StatusUnknown:
	case status == StatusProcessing && row.Leased && row.LeaseLeftMs > 0:
		return errorf("idem: %w: a live lease holds it", ErrNotResolvable)
	case status == StatusProcessing && row.Leased:
		// The lease ran out before an outcome was recorded.
	default:
		return errorf("idem: %w: it is %s", ErrNotResolvable, status)
	}
	return nil
}

// Lookup returns the committed record of (scope, key) (see idem.Lookup).
func (c *Client[TTx, TDB]) Lookup(ctx context.Context, db TDB, scope Scope, key string) (Record, error) {
	if err := c.checkTarget(scope, key); err != nil {
		return Record{}, err
	}
	if err := c.checkDB(db, false); err != nil {
		return Record{}, err
	}
	var rec Record
	err := c.lookupTx(ctx, db, func(ctx context.Context, ex driver.Executor) error {
		row, err := ex.KeyLookup(ctx, newKey(scope, key))
		if errors.Is(err, driver.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		rec, err = newRecord(row)
		return err
	})
	switch {
	case errors.Is(err, ErrNotFound):
		return Record{}, err
	case err != nil:
		return Record{}, errorf("idem: lookup: %w", c.unsupportedIf(err))
	}
	return rec, nil
}

// Forget deletes the record of a finished key (see idem.Forget).
func (c *Client[TTx, TDB]) Forget(ctx context.Context, db TDB, scope Scope, key string) error {
	if err := c.checkTarget(scope, key); err != nil {
		return err
	}
	if err := c.checkDB(db, false); err != nil {
		return err
	}
	k := newKey(scope, key)
	err := c.lookupTx(ctx, db, func(ctx context.Context, ex driver.Executor) error {
		status, leaseRanOut, err := ex.KeyLockForForget(ctx, k)
		switch {
		case errors.Is(err, driver.ErrNoRows):
			return ErrNotFound
		case c.lockNotAvailable(err):
			return c.inProgress()
		case err != nil:
			return err
		}
		if err := c.forgettable(Status(status), leaseRanOut); err != nil {
			return err
		}
		return ex.KeyForget(ctx, k)
	})
	switch {
	case errors.Is(err, ErrNotFound), errors.Is(err, ErrInProgress), errors.Is(err, ErrOutcomeUnknown):
		return err
	case err != nil:
		return errorf("idem: forget: %w", c.unsupportedIf(err))
	}
	return nil
}

// forgettable decides whether Forget may delete the locked record of a key,
// which is in status: nil, ErrInProgress or ErrOutcomeUnknown.
func (c *Client[TTx, TDB]) forgettable(status Status, leaseRanOut bool) error {
	switch status {
	case StatusProcessing:
		if leaseRanOut {
			// As Reserve and Do answer: the owner's lease ran out before
			// it recorded an outcome.
			return errorf("idem: %w: the reservation's lease ran out", ErrOutcomeUnknown)
		}
		return c.inProgress()
	case StatusUnknown:
		return ErrOutcomeUnknown
	}
	return nil
}

// Prune deletes finished keys past their TTL, in batches of one short
// transaction each (see idem.Prune).
func (c *Client[TTx, TDB]) Prune(ctx context.Context, db TDB, opts PruneOptions) (int64, error) {
	keys, _, err := c.PruneReport(ctx, db, opts)
	return keys, err
}

// PruneReport is Prune, and also returns the stored bodies it dropped (see
// idem.PruneReport). A database that cannot serve it is counted in
// idem.store.error, as for ExpireLeases.
func (c *Client[TTx, TDB]) PruneReport(ctx context.Context, db TDB, opts PruneOptions) (keys, bodies int64, err error) {
	keys, bodies, err = c.pruneReport(ctx, db, opts)
	if err != nil {
		c.countEnd(ctx, "prune", Scope{}, "", err, "")
	}
	return keys, bodies, err
}

// pruneReport is PruneReport, uncounted.
func (c *Client[TTx, TDB]) pruneReport(ctx context.Context, db TDB, opts PruneOptions) (keys, bodies int64, _ error) {
	if err := c.checkDB(db, false); err != nil {
		return 0, 0, err
	}
	switch {
	case opts.BatchSize < 0:
		return 0, 0, errorf("idem: %w: PruneOptions.BatchSize %d must not be negative", ErrInvalidArgument, opts.BatchSize)
	case opts.MaxBatches < 0:
		return 0, 0, errorf("idem: %w: PruneOptions.MaxBatches %d must not be negative", ErrInvalidArgument, opts.MaxBatches)
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = DefaultPruneBatchSize
	}
	if opts.DryRun {
		var n int64
		err := c.batchTx(ctx, db, func(ctx context.Context, ex driver.Executor) (err error) {
			n, err = ex.KeyCountPrunable(ctx)
			return err
		})
		if err != nil {
			return 0, 0, errorf("idem: prune: %w", c.unsupportedIf(err))
		}
		// As many as the batches Prune may run would delete.
		if b, m := int64(min(opts.BatchSize, 1<<30)), int64(opts.MaxBatches); m > 0 && (n+b-1)/b > m {
			n = b * m
		}
		return n, 0, nil
	}
	var total int64
	for batch := 0; opts.MaxBatches == 0 || batch < opts.MaxBatches; batch++ {
		if err := ctx.Err(); err != nil {
			return total, 0, err
		}
		var n int64
		err := c.batchTx(ctx, db, func(ctx context.Context, ex driver.Executor) (err error) {
			n, err = ex.KeyPrune(ctx, int32(min(opts.BatchSize, 1<<30)))
			return err
		})
		if err != nil {
			return total, 0, errorf("idem: prune: %w", c.unsupportedIf(err))
		}
		total += n
		c.obs.count(ctx, "ttl_pruned", "prune", "", n)
		if n < int64(opts.BatchSize) {
			break // none left that no other pruner holds
		}
	}
	bodies, err := c.dropBodies(ctx, db, opts)
	return total, bodies, err
}

// dropBodies drops the bodies of finished keys past their body's life
// (Config.BodyTTL), in batches as Prune deletes keys, and returns how many:
// the rows stay, with their status and response status.
func (c *Client[TTx, TDB]) dropBodies(ctx context.Context, db TDB, opts PruneOptions) (int64, error) {
	var total int64
	for batch := 0; opts.MaxBatches == 0 || batch < opts.MaxBatches; batch++ {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		var n int64
		err := c.batchTx(ctx, db, func(ctx context.Context, ex driver.Executor) (err error) {
			n, err = ex.KeyDropBodies(ctx, int32(min(opts.BatchSize, 1<<30)))
			return err
		})
		if err != nil {
			return total, errorf("idem: prune: drop bodies: %w", c.unsupportedIf(err))
		}
		total += n
		c.obs.count(ctx, "bodies_dropped", "prune", "", n)
		if n < int64(opts.BatchSize) {
			return total, nil
		}
	}
	return total, nil
}

// batchTx runs fn in a short transaction of its own begun on db, whose
// statements walk an index in its order (Executor.WalkIndexes): the
// maintenance calls that write batches of rows (Prune, ExpireLeases). The
// settings end with the transaction. On a caller's transaction, fn runs in
// a savepoint without them (they would outlive the call in the caller's
// transaction), planned for the table as it is.
func (c *Client[TTx, TDB]) batchTx(ctx context.Context, db TDB, fn func(ctx context.Context, ex driver.Executor) error) error {
	nested := c.drv.Nested(db)
	return c.InTx(ctx, db, func(ctx context.Context, tx TTx) error {
		ex := c.drv.Executor(tx)
		if !nested {
			if err := ex.WalkIndexes(ctx); err != nil {
				return err
			}
		}
		return fn(ctx, ex)
	})
}

// ReadStats reads Stats in one transaction on db (see idem.ReadStats).
func (c *Client[TTx, TDB]) ReadStats(ctx context.Context, db TDB) (Stats, error) {
	if err := c.checkDB(db, false); err != nil {
		return Stats{}, err
	}
	st := Stats{Keys: make(map[Status]int64)}
	err := c.InTx(ctx, db, func(ctx context.Context, tx TTx) error {
		ex := c.drv.Executor(tx)
		counts, err := ex.KeyStats(ctx)
		if err != nil {
			return err
		}
		for _, r := range counts {
			st.Keys[Status(r.Status)] = r.Keys
			switch Status(r.Status) {
			case StatusProcessing:
				st.OldestProcessing = r.Oldest
			case StatusUnknown:
				st.OldestUnknown = r.Oldest
			}
		}
		st.TableBytes, st.IndexBytes, err = ex.KeyTableSize(ctx)
		return err
	})
	if err != nil {
		return Stats{}, errorf("idem: stats: %w", c.unsupportedIf(err))
	}
	return st, nil
}

// newRecord turns a stored row into a Record.
func newRecord(k driver.Record) (Record, error) {
	if len(k.Fingerprint) != len(Fingerprint{}) {
		return Record{}, errorf("idem: stored fingerprint has %d bytes", len(k.Fingerprint))
	}
	rec := Record{
		Scope:          Scope{Actor: k.Key.Actor, Operation: k.Key.Operation},
		Key:            k.Key.Key,
		Status:         Status(k.Status),
		Fingerprint:    Fingerprint(k.Fingerprint),
		Token:          k.Token,
		LastError:      k.LastError,
		ResolveReason:  k.ResolveReason,
		CreatedAt:      k.CreatedAt,
		CompletedAt:    k.CompletedAt,
		ExpiresAt:      k.ExpiresAt,
		LeaseExpiresAt: k.LeaseExpiresAt,
		ResumeUntil:    k.ResumeUntil,
		UnknownAt:      k.UnknownAt,
		BodyExpiresAt:  k.BodyExpiresAt,
	}
	switch {
	case k.Stored.Valid && k.Stored.Gone:
		rec.Response, rec.ResponseGone = &Response{Status: int(k.Stored.Status)}, true
	case k.Stored.Valid:
		res, err := replay(k.Stored)
		if err != nil {
			return Record{}, err
		}
		rec.Response = &res.Response
	}
	return rec, nil
}
