package pgxdriver

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/driver"
)

// Begin starts a transaction on db, at the configured isolation level
// unless db is a pgx.Tx (a savepoint runs at its transaction's level).
func (d *Driver) Begin(ctx context.Context, db Beginner) (pgx.Tx, error) {
	if _, nested := db.(pgx.Tx); d.txOptions.IsoLevel == "" || nested {
		return db.Begin(ctx)
	}
	if tb, ok := db.(txBeginner); ok {
		return tb.BeginTx(ctx, d.txOptions)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL "+string(d.txOptions.IsoLevel)); err != nil {
		rollback(ctx, tx)
		return nil, err
	}
	return tx, nil
}

// Commit commits tx.
func (d *Driver) Commit(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) }

// Rollback rolls tx back, even when ctx is done, and reports whether its
// connection was lost. The connection is looked at before the rollback,
// and only when the transaction holds it until it ends: once rolled back,
// a pool's transaction has given its connection back to the pool, where
// another call may be using it, and a transaction of another Beginner may
// have given it back already.
func (d *Driver) Rollback(ctx context.Context, db Beginner, tx pgx.Tx) bool {
	lost := false
	switch db.(type) {
	case *pgxpool.Pool, *pgx.Conn, pgx.Tx:
		conn := tx.Conn()
		lost = conn != nil && conn.IsClosed()
	}
	rollback(ctx, tx)
	return lost
}

// executor runs the reservation and operator statements in one
// transaction: each through planned (planned anew for its arguments and the
// table as it is), except Reserve's first round trip, which is a batch.
type executor struct {
	d  *Driver
	tx pgx.Tx
}

// Executor runs statements in tx.
func (d *Driver) Executor(tx pgx.Tx) driver.Executor { return &executor{d: d, tx: tx} }

// sqlIndexWalk makes the statements after it in its transaction walk an
// index in the index's order instead of reading every matching row and
// sorting them. With statistics gathered while idem_keys was empty (and
// autovacuum off or behind) the planner takes a batch's LIMIT over the
// expired rows for a small part of a small table, and would pick a bitmap
// scan of all of them and a sort, for every batch.
const sqlIndexWalk = "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off"

// UseIndexes does nothing: every statement is planned for its arguments.
func (e *executor) UseIndexes(context.Context) error { return nil }

// WalkIndexes sets sqlIndexWalk for the rest of the transaction.
func (e *executor) WalkIndexes(ctx context.Context) error {
	_, err := e.tx.Exec(ctx, sqlIndexWalk)
	return err
}

// noRows turns pgx's ErrNoRows into the driver's.
func noRows(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return driver.ErrNoRows
	}
	return err
}

// ReserveInsertOrLock sends, in one round trip, SET LOCAL lock_timeout (a
// statement, not set_config: on Citus the wait happens on the worker, which
// only it reaches), the insert of a fresh reservation, SET LOCAL
// enable_seqscan = off (the read is an index lookup whatever the planner's
// statistics say) and the locking read of the row that holds the key. The
// transaction is Reserve's own: both settings end with it.
func (e *executor) ReserveInsertOrLock(ctx context.Context, r driver.Reserve) (driver.Reserved, error) {
	k := r.Key
	insert := db.ReserveInsertParams{
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Fingerprint: r.Fingerprint[:],
		LeaseMicros: r.Lease.Microseconds(), TtlMicros: e.d.ttl.TTL(k.Operation), ResumeMicros: r.ResumeWithin.Microseconds(),
	}
	lock := db.ReserveLockParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key}
	b := &pgx.Batch{}
	b.Queue(e.d.sqlSetWait)
	_, _ = queries.ReserveInsert(ctx, queuer{b}, insert)
	b.Queue(sqlIndexLookup)
	_, _ = queries.ReserveLock(ctx, queuer{b}, lock)
	br := e.tx.SendBatch(ctx, b)
	read := batchRead{br}
	var got driver.Reserved
	_, err := br.Exec()
	if err == nil {
		var ins db.ReserveInsertRow
		ins, err = queries.ReserveInsert(ctx, read, insert)
		got.Inserted, got.Token, got.LeaseExpiresAt = err == nil, ins.Token, ins.LeaseExpiresAt.Time
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if err == nil {
		_, err = br.Exec()
	}
	if err == nil {
		var row db.ReserveLockRow
		row, err = queries.ReserveLock(ctx, read, lock)
		got.Found, got.Row = err == nil, lockedRow(row)
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	return got, closeBatch(br, err)
}

// lockedRow is a row ReserveLock read.
func lockedRow(row db.ReserveLockRow) driver.Row {
	k := row.IdemKey
	return driver.Row{
		Fingerprint: k.Fingerprint, Status: k.Status, Token: k.Token,
		Stored:  storedOrGone(k.ResponseStatus, k.ResponseHeaders, k.ResponseBody, row.BodyGone),
		Expired: row.Expired, Leased: row.Leased, LeaseLeftMs: row.LeaseLeftMs, InWindow: row.InWindow,
	}
}

func (e *executor) ReserveAcquire(ctx context.Context, r driver.Reserve, token int64, a driver.Attempt) (int64, time.Time, error) {
	acq, err := queries.ReserveAcquire(ctx, planned{e.tx}, db.ReserveAcquireParams{
		Fingerprint: r.Fingerprint[:], TtlMicros: e.d.ttl.TTL(r.Key.Operation), LeaseMicros: r.Lease.Microseconds(),
		Resume: a == driver.Resume, NewWindow: a == driver.NewRequest, ResumeMicros: r.ResumeWithin.Microseconds(),
		Actor: r.Key.Actor, Operation: r.Key.Operation, IdemKey: r.Key.Key, Token: token,
	})
	return acq.Token, acq.LeaseExpiresAt.Time, err
}

func (e *executor) ReserveMarkUnknown(ctx context.Context, k driver.Key, token int64, reason string) (int64, error) {
	return queries.ReserveMarkUnknown(ctx, planned{e.tx}, db.ReserveMarkUnknownParams{
		Reason: reason, Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	})
}

func (e *executor) ReserveComplete(ctx context.Context, k driver.Key, token int64, r driver.Reply) (int64, error) {
	return queries.ReserveComplete(ctx, planned{e.tx}, db.ReserveCompleteParams{
		ResponseStatus: r.Status, ResponseHeaders: pgtype.Text{String: r.Headers, Valid: r.HasHeaders},
		ResponseBody: r.Body, TtlMicros: e.d.ttl.TTL(k.Operation),
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	})
}

func (e *executor) ReserveFailRetryable(ctx context.Context, k driver.Key, token int64, reason string) (int64, error) {
	return queries.ReserveFailRetryable(ctx, planned{e.tx}, db.ReserveFailRetryableParams{
		Reason: reason, TtlMicros: e.d.ttl.TTL(k.Operation), Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	})
}

func (e *executor) ReserveHeartbeat(ctx context.Context, k driver.Key, token int64, extend time.Duration, resumed bool) (time.Time, error) {
	lease, err := queries.ReserveHeartbeat(ctx, planned{e.tx}, db.ReserveHeartbeatParams{
		ExtendMicros: extend.Microseconds(), Resumed: resumed, Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	})
	return lease.Time, noRows(err)
}

func (e *executor) ReserveLock(ctx context.Context, k driver.Key) (driver.Row, error) {
	row, err := queries.ReserveLock(ctx, planned{e.tx}, db.ReserveLockParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	return lockedRow(row), noRows(err)
}

func (e *executor) ReserveResolve(ctx context.Context, k driver.Key, token int64, r driver.Resolve) (int64, error) {
	arg := db.ReserveResolveParams{
		Status: r.Status, Reason: r.Reason, TtlMicros: e.d.ttl.TTL(k.Operation),
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	}
	if r.Reply != nil {
		arg.ResponseStatus = pgtype.Int4{Int32: r.Reply.Status, Valid: true}
		arg.ResponseHeaders = pgtype.Text{String: r.Reply.Headers, Valid: r.Reply.HasHeaders}
		arg.ResponseBody = r.Reply.Body
	}
	return queries.ReserveResolve(ctx, planned{e.tx}, arg)
}

// ReserveExpireLeases skips rows another worker holds (SKIP LOCKED), except
// on Citus, which refuses it over a distributed table.
func (e *executor) ReserveExpireLeases(ctx context.Context, reason string, limit int32) (int64, error) {
	citus, err := e.d.txCitus(ctx, e.tx)
	if err != nil {
		return 0, err
	}
	arg := db.ReserveExpireLeasesParams{Reason: reason, MaxRows: limit}
	if citus {
		return queries.ReserveExpireLeasesCitus(ctx, planned{e.tx}, db.ReserveExpireLeasesCitusParams(arg))
	}
	return queries.ReserveExpireLeases(ctx, planned{e.tx}, arg)
}

func (e *executor) ReserveListUnknown(ctx context.Context, after *driver.Cursor, limit int32) ([]driver.Record, error) {
	return list(ctx, after, limit, func(arg db.ReserveListUnknownParams) ([]db.IdemKey, error) {
		return queries.ReserveListUnknown(ctx, planned{e.tx}, arg)
	})
}

func (e *executor) ReserveListResumable(ctx context.Context, after *driver.Cursor, limit int32) ([]driver.Record, error) {
	return list(ctx, after, limit, func(arg db.ReserveListUnknownParams) ([]db.IdemKey, error) {
		return queries.ReserveListResumable(ctx, planned{e.tx}, db.ReserveListResumableParams(arg))
	})
}

// list reads a page of records with query, which takes the position after
// the cursor (nil: the first page) and the page's size.
func list(ctx context.Context, after *driver.Cursor, limit int32,
	query func(arg db.ReserveListUnknownParams) ([]db.IdemKey, error)) ([]driver.Record, error) {
	arg := db.ReserveListUnknownParams{
		AfterCreatedAt: pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true},
		MaxRows:        limit,
	}
	if after != nil {
		arg.AfterCreatedAt = pgtype.Timestamptz{Time: after.CreatedAt, Valid: true}
		arg.AfterActor, arg.AfterOperation, arg.AfterKey = after.Key.Actor, after.Key.Operation, after.Key.Key
	}
	rows, err := query(arg)
	if err != nil {
		return nil, err
	}
	records := make([]driver.Record, len(rows))
	for i, row := range rows {
		records[i] = record(row)
	}
	return records, nil
}

// record is a whole stored row.
func record(k db.IdemKey) driver.Record {
	return driver.Record{
		Key:         driver.Key{Actor: k.Actor, Operation: k.Operation, Key: k.IdemKey},
		Fingerprint: k.Fingerprint, Status: k.Status, Token: k.Token,
		Stored:    stored(k.ResponseStatus, k.ResponseHeaders, k.ResponseBody),
		LastError: k.LastError.String, ResolveReason: k.ResolveReason.String,
		CreatedAt: k.CreatedAt.Time, CompletedAt: k.CompletedAt.Time, ExpiresAt: k.ExpiresAt.Time,
		LeaseExpiresAt: k.LeaseExpiresAt.Time, ResumeUntil: k.ResumeUntil.Time, UnknownAt: k.UnknownAt.Time,
		BodyExpiresAt: k.BodyExpiresAt.Time,
	}
}

func (e *executor) KeyMarkUnknown(ctx context.Context, k driver.Key, fp [32]byte, reason string) (int64, error) {
	return markUnknown(ctx, e.tx, k, fp, reason)
}

func (e *executor) KeyLookup(ctx context.Context, k driver.Key) (driver.Record, error) {
	row, err := queries.KeyLookup(ctx, planned{e.tx}, db.KeyLookupParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	rec := record(row.IdemKey)
	if row.BodyGone {
		rec.Stored = storedOrGone(row.IdemKey.ResponseStatus, nil, nil, true)
	}
	return rec, noRows(err)
}

func (e *executor) KeyLockForForget(ctx context.Context, k driver.Key) (string, bool, error) {
	row, err := queries.KeyLockForForget(ctx, planned{e.tx}, db.KeyLockForForgetParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	return row.Status, row.LeaseRanOut, noRows(err)
}

func (e *executor) KeyForget(ctx context.Context, k driver.Key) error {
	_, err := queries.KeyForget(ctx, planned{e.tx}, db.KeyForgetParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	return err
}

// KeyPrune skips rows another pruner holds (SKIP LOCKED), except on Citus,
// which refuses it over a distributed table.
func (e *executor) KeyPrune(ctx context.Context, batch int32) (int64, error) {
	citus, err := e.d.txCitus(ctx, e.tx)
	if err != nil {
		return 0, err
	}
	if citus {
		return queries.KeyPruneCitus(ctx, planned{e.tx}, batch)
	}
	return queries.KeyPrune(ctx, planned{e.tx}, batch)
}

// KeyDropBodies skips rows another pruner holds, as KeyPrune.
func (e *executor) KeyDropBodies(ctx context.Context, batch int32) (int64, error) {
	citus, err := e.d.txCitus(ctx, e.tx)
	if err != nil {
		return 0, err
	}
	if citus {
		return queries.KeyDropBodiesCitus(ctx, planned{e.tx}, batch)
	}
	return queries.KeyDropBodies(ctx, planned{e.tx}, batch)
}

func (e *executor) KeyCountPrunable(ctx context.Context) (int64, error) {
	return queries.KeyCountPrunable(ctx, planned{e.tx})
}

func (e *executor) KeyStats(ctx context.Context) ([]driver.StatusCount, error) {
	rows, err := queries.KeyStats(ctx, planned{e.tx})
	counts := make([]driver.StatusCount, len(rows))
	for i, r := range rows {
		counts[i] = driver.StatusCount{Status: r.Status, Keys: r.Keys, Oldest: r.Oldest.Time}
	}
	return counts, err
}

// KeyTableSize asks whether idem_keys is a Citus table on every call
// (ReadStats is off the request path): the coordinator's idem_keys is an
// empty shell, and citus_table_size adds up its shards.
func (e *executor) KeyTableSize(ctx context.Context) (int64, int64, error) {
	citus, err := isCitusTable(ctx, e.tx)
	if err != nil {
		return 0, 0, err
	}
	var size db.KeyTableSizeRow
	if citus {
		err = e.tx.QueryRow(ctx, sqlCitusTableSize).Scan(&size.TableBytes, &size.IndexBytes)
	} else {
		size, err = queries.KeyTableSize(ctx, planned{e.tx})
	}
	return size.TableBytes, size.IndexBytes, err
}
