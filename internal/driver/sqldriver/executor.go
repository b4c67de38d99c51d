package sqldriver

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/pgidem/idem/internal/dbsql"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// Begin begins a transaction on db at the configured isolation level.
func (d *Driver) Begin(ctx context.Context, db *sql.DB) (*sql.Tx, error) {
	return db.BeginTx(ctx, d.txOptions)
}

// Commit commits tx. database/sql ends the Tx whatever COMMIT answers.
func (d *Driver) Commit(_ context.Context, tx *sql.Tx) error { return tx.Commit() }

// Rollback rolls tx back and reports whether the connection is gone.
func (d *Driver) Rollback(_ context.Context, _ *sql.DB, tx *sql.Tx) bool {
	err := rollback(tx)
	return err != nil && dberr.Unavailable(err)
}

// executor runs the reservation and operator statements in one
// transaction, one per round trip. database/sql cannot ask a driver to plan
// a statement anew on every execution (pgx's stdlib driver caches a generic
// plan for the life of a connection), so the transactions that find rows by
// a WHERE clause set the planner for themselves first (UseIndexes).
type executor struct {
	d  *Driver
	tx *sql.Tx
	// reserving: Reserve's settings are sent (once per transaction).
	reserving bool
}

// sqlIndexWalk makes the statements after it in its transaction walk an
// index in the index's order (see idem.Prune).
const sqlIndexWalk = "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off"

// UseIndexes sets enable_seqscan off for the rest of the transaction: every
// plan of the statements that follow, also the generic plan a connection
// caches, finds rows through an index, even when idem_keys was analyzed
// while empty.
func (e *executor) UseIndexes(ctx context.Context) error {
	_, err := e.tx.ExecContext(ctx, sqlIndexLookup)
	return err
}

// WalkIndexes sets sqlIndexWalk for the rest of the transaction.
func (e *executor) WalkIndexes(ctx context.Context) error {
	_, err := e.tx.ExecContext(ctx, sqlIndexWalk)
	return err
}

// noRows turns database/sql's ErrNoRows into the driver's.
func noRows(err error) error {
	if errors.Is(err, sql.ErrNoRows) {
		return driver.ErrNoRows
	}
	return err
}

// ReserveInsertOrLock sends, on its first call in the transaction, SET
// LOCAL lock_timeout (which bounds the waits of the rest of Reserve's
// transaction, and reaches Citus's workers) and SET LOCAL enable_seqscan =
// off; then the insert of a fresh reservation and, when it inserts nothing,
// the locking read of the row that holds the key.
func (e *executor) ReserveInsertOrLock(ctx context.Context, r driver.Reserve) (driver.Reserved, error) {
	if !e.reserving {
		if _, err := e.tx.ExecContext(ctx, e.d.sqlSetWait); err != nil {
			return driver.Reserved{}, err
		}
		if err := e.UseIndexes(ctx); err != nil {
			return driver.Reserved{}, err
		}
		e.reserving = true
	}
	k := r.Key
	ins, err := queries.ReserveInsert(ctx, e.tx, dbsql.ReserveInsertParams{
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Fingerprint: r.Fingerprint[:],
		LeaseMicros: r.Lease.Microseconds(), TtlMicros: e.d.ttl.TTL(k.Operation), ResumeMicros: r.ResumeWithin.Microseconds(),
	})
	if err == nil {
		return driver.Reserved{Inserted: true, Token: ins.Token, LeaseExpiresAt: ins.LeaseExpiresAt.Time}, nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return driver.Reserved{}, err
	}
	row, err := e.ReserveLock(ctx, k)
	if errors.Is(err, driver.ErrNoRows) {
		return driver.Reserved{}, nil // gone since the insert
	}
	return driver.Reserved{Found: err == nil, Row: row}, err
}

func (e *executor) ReserveAcquire(ctx context.Context, r driver.Reserve, token int64, a driver.Attempt) (int64, time.Time, error) {
	acq, err := queries.ReserveAcquire(ctx, e.tx, dbsql.ReserveAcquireParams{
		Fingerprint: r.Fingerprint[:], TtlMicros: e.d.ttl.TTL(r.Key.Operation), LeaseMicros: r.Lease.Microseconds(),
		Resume: a == driver.Resume, NewWindow: a == driver.NewRequest, ResumeMicros: r.ResumeWithin.Microseconds(),
		Actor: r.Key.Actor, Operation: r.Key.Operation, IdemKey: r.Key.Key, Token: token,
	})
	return acq.Token, acq.LeaseExpiresAt.Time, err
}

func (e *executor) ReserveMarkUnknown(ctx context.Context, k driver.Key, token int64, reason string) (int64, error) {
	return queries.ReserveMarkUnknown(ctx, e.tx, dbsql.ReserveMarkUnknownParams{
		Reason: reason, Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	})
}

func (e *executor) ReserveComplete(ctx context.Context, k driver.Key, token int64, r driver.Reply) (int64, error) {
	return queries.ReserveComplete(ctx, e.tx, dbsql.ReserveCompleteParams{
		ResponseStatus: r.Status, ResponseHeaders: sql.NullString{String: r.Headers, Valid: r.HasHeaders},
		ResponseBody: r.Body, TtlMicros: e.d.ttl.TTL(k.Operation),
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	})
}

func (e *executor) ReserveFailRetryable(ctx context.Context, k driver.Key, token int64, reason string) (int64, error) {
	return queries.ReserveFailRetryable(ctx, e.tx, dbsql.ReserveFailRetryableParams{
		Reason: reason, TtlMicros: e.d.ttl.TTL(k.Operation), Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	})
}

func (e *executor) ReserveHeartbeat(ctx context.Context, k driver.Key, token int64, extend time.Duration, resumed bool) (time.Time, error) {
	lease, err := queries.ReserveHeartbeat(ctx, e.tx, dbsql.ReserveHeartbeatParams{
		ExtendMicros: extend.Microseconds(), Resumed: resumed, Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	})
	return lease.Time, noRows(err)
}

func (e *executor) ReserveLock(ctx context.Context, k driver.Key) (driver.Row, error) {
	row, err := queries.ReserveLock(ctx, e.tx, dbsql.ReserveLockParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	r := row.IdemKey
	return driver.Row{
		Fingerprint: r.Fingerprint, Status: r.Status, Token: r.Token,
		Stored:  storedOrGone(r.ResponseStatus, r.ResponseHeaders, r.ResponseBody, row.BodyGone),
		Expired: row.Expired, Leased: row.Leased, LeaseLeftMs: row.LeaseLeftMs, InWindow: row.InWindow,
	}, noRows(err)
}

func (e *executor) ReserveResolve(ctx context.Context, k driver.Key, token int64, r driver.Resolve) (int64, error) {
	arg := dbsql.ReserveResolveParams{
		Status: r.Status, Reason: r.Reason, TtlMicros: e.d.ttl.TTL(k.Operation),
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Token: token,
	}
	if r.Reply != nil {
		arg.ResponseStatus = sql.NullInt32{Int32: r.Reply.Status, Valid: true}
		arg.ResponseHeaders = sql.NullString{String: r.Reply.Headers, Valid: r.Reply.HasHeaders}
		arg.ResponseBody = r.Reply.Body
	}
	return queries.ReserveResolve(ctx, e.tx, arg)
}

// ReserveExpireLeases skips rows another worker holds (SKIP LOCKED), except
// on Citus, which refuses it over a distributed table.
func (e *executor) ReserveExpireLeases(ctx context.Context, reason string, limit int32) (int64, error) {
	arg := dbsql.ReserveExpireLeasesParams{Reason: reason, MaxRows: limit}
	if e.d.citus {
		return queries.ReserveExpireLeasesCitus(ctx, e.tx, dbsql.ReserveExpireLeasesCitusParams(arg))
	}
	return queries.ReserveExpireLeases(ctx, e.tx, arg)
}

func (e *executor) ReserveListUnknown(ctx context.Context, after *driver.Cursor, limit int32) ([]driver.Record, error) {
	return list(after, limit, func(arg dbsql.ReserveListUnknownParams) ([]dbsql.IdemKey, error) {
		return queries.ReserveListUnknown(ctx, e.tx, arg)
	})
}

func (e *executor) ReserveListResumable(ctx context.Context, after *driver.Cursor, limit int32) ([]driver.Record, error) {
	return list(after, limit, func(arg dbsql.ReserveListUnknownParams) ([]dbsql.IdemKey, error) {
		return queries.ReserveListResumable(ctx, e.tx, dbsql.ReserveListResumableParams(arg))
	})
}

// list reads a page of records with query, which takes the position after
// the cursor (nil: the first page) and the page's size.
func list(after *driver.Cursor, limit int32,
	query func(arg dbsql.ReserveListUnknownParams) ([]dbsql.IdemKey, error)) ([]driver.Record, error) {
	arg := dbsql.ReserveListUnknownParams{AfterCreatedAt: firstPage, MaxRows: limit}
	if after != nil {
		arg.AfterCreatedAt = after.CreatedAt
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
func record(k dbsql.IdemKey) driver.Record {
	return driver.Record{
		Key:         driver.Key{Actor: k.Actor, Operation: k.Operation, Key: k.IdemKey},
		Fingerprint: k.Fingerprint, Status: k.Status, Token: k.Token,
		Stored:    stored(k.ResponseStatus, k.ResponseHeaders, k.ResponseBody),
		LastError: k.LastError.String, ResolveReason: k.ResolveReason.String,
		CreatedAt: k.CreatedAt, CompletedAt: k.CompletedAt.Time, ExpiresAt: k.ExpiresAt,
		LeaseExpiresAt: k.LeaseExpiresAt.Time, ResumeUntil: k.ResumeUntil.Time, UnknownAt: k.UnknownAt.Time,
		BodyExpiresAt: k.BodyExpiresAt.Time,
	}
}

func (e *executor) KeyMarkUnknown(ctx context.Context, k driver.Key, fp [32]byte, reason string) (int64, error) {
	return markUnknown(ctx, e.tx, k, fp, reason)
}

func (e *executor) KeyLookup(ctx context.Context, k driver.Key) (driver.Record, error) {
	row, err := queries.KeyLookup(ctx, e.tx, dbsql.KeyLookupParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	rec := record(row.IdemKey)
	if row.BodyGone {
		rec.Stored = storedOrGone(row.IdemKey.ResponseStatus, nil, nil, true)
	}
	return rec, noRows(err)
}

func (e *executor) KeyLockForForget(ctx context.Context, k driver.Key) (string, bool, error) {
	row, err := queries.KeyLockForForget(ctx, e.tx, dbsql.KeyLockForForgetParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	return row.Status, row.LeaseRanOut, noRows(err)
}

func (e *executor) KeyForget(ctx context.Context, k driver.Key) error {
	_, err := queries.KeyForget(ctx, e.tx, dbsql.KeyForgetParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	return err
}

// KeyPrune skips rows another pruner holds (SKIP LOCKED), except on Citus,
// which refuses it over a distributed table.
func (e *executor) KeyPrune(ctx context.Context, batch int32) (int64, error) {
	if e.d.citus {
		return queries.KeyPruneCitus(ctx, e.tx, batch)
	}
	return queries.KeyPrune(ctx, e.tx, batch)
}

// KeyDropBodies skips rows another pruner holds, as KeyPrune.
func (e *executor) KeyDropBodies(ctx context.Context, batch int32) (int64, error) {
	if e.d.citus {
		return queries.KeyDropBodiesCitus(ctx, e.tx, batch)
	}
	return queries.KeyDropBodies(ctx, e.tx, batch)
}

func (e *executor) KeyCountPrunable(ctx context.Context) (int64, error) {
	return queries.KeyCountPrunable(ctx, e.tx)
}

func (e *executor) KeyStats(ctx context.Context) ([]driver.StatusCount, error) {
	rows, err := queries.KeyStats(ctx, e.tx)
	counts := make([]driver.StatusCount, len(rows))
	for i, r := range rows {
		counts[i] = driver.StatusCount{Status: r.Status, Keys: r.Keys, Oldest: r.Oldest}
	}
	return counts, err
}

// sqlCitusTableSize is the size of a distributed idem_keys: the sums over
// its shards on the workers (the coordinator's own idem_keys is an empty
// shell).
const sqlCitusTableSize = "SELECT citus_table_size('idem_keys')::bigint, " +
	"(citus_total_relation_size('idem_keys') - citus_table_size('idem_keys'))::bigint"

func (e *executor) KeyTableSize(ctx context.Context) (int64, int64, error) {
	if e.d.citus {
		var table, index int64
		err := e.tx.QueryRowContext(ctx, sqlCitusTableSize).Scan(&table, &index)
		return table, index, err
	}
	size, err := queries.KeyTableSize(ctx, e.tx)
	return size.TableBytes, size.IndexBytes, err
}
