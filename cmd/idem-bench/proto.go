package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/draw"
)

// The -proto workloads are not idem: they are hand-written statement
// sequences that show what a protocol would cost if the core adopted it,
// so a design change can be priced before it is made. Each writes the same
// rows as the workload it stands in for and runs the same draw.

// protoWorkloads returns the prototype workloads.
func (b *bench) protoWorkloads() []workload {
	return []workload{
		// The floor with its INSERT sent in COMMIT's round trip: the least
		// any design that writes one row can cost.
		{name: "p-floor-piped", op: opFloorPiped, pool: b.pool},
		// DoInTx reduced to its two writes: BEGIN and the claim in one round
		// trip, the completion and COMMIT in another. No savepoints, no
		// lock_timeout handling, no read after the claim.
		{name: "p-intx-min", op: protoInTx(false), pool: b.pool},
		// p-intx-min plus a savepoint before fn, which a stored refusal
		// (Reject) needs to undo fn's writes but keep the claim.
		{name: "p-intx-sp", op: protoInTx(true), pool: b.pool},
		// p-intx-sp with the bounded wait: the claim sets lock_timeout and
		// restores it in its RETURNING list, so the fresh path needs no
		// statement after the claim (a conflict would need one more round
		// trip to read the row and restore the setting).
		{name: "p-intx-lt", op: protoInTxLockTimeout, pool: b.pool},
		// Do in the caller's transaction reduced to its two writes: the
		// claim and the completion, each its own round trip, no savepoints.
		{name: "p-do-min", op: protoDo(false), pool: b.pool},
		// p-do-min plus the savepoint around the claim that lets Do undo
		// the claim and fn's writes on failure and leave the caller's
		// transaction usable, and the savepoint before fn for Reject.
		{name: "p-do-sp", op: protoDo(true), pool: b.pool},
		// p-do-sp with the bounded wait of p-intx-lt.
		{name: "p-do-lt", op: protoDoLockTimeout, pool: b.pool},
		// One write per key, at the end: read the key with BEGIN, run fn,
		// insert the finished row with COMMIT.
		{name: "p-intx-late", op: protoInTxLate, pool: b.pool},
		// The same in the caller's transaction, with a savepoint before fn.
		{name: "p-do-late", op: protoDoLate, pool: b.pool},
	}
}

// protoClaim is the claim without lock_timeout handling.
const protoClaim = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
VALUES ($1, $2, $3, $4, 'processing', now() + ($5::bigint * interval '1 microsecond'))
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING expires_at`

// protoClaimLT is protoClaim with the bounded wait: lock_timeout is saved
// and set while the row to insert is computed (before the insert can wait),
// and restored in RETURNING, which runs only when the row was inserted.
const protoClaimLT = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
SELECT $1::text, $2::text, $3::text, $4::bytea, 'processing', now() + ($5::bigint * interval '1 microsecond')
FROM (SELECT set_config('lock_timeout', $6::text, true)
      FROM (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true)) AS saved
     ) AS bounded_wait
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING expires_at, set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true)`

// opFloorPiped is opFloor with the INSERT and COMMIT in one round trip.
func opFloorPiped(ctx context.Context, w *worker) error {
	r := w.newRequest()
	key := w.newKey()
	pc, err := w.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer pc.Release()
	tx, err := pc.Conn().Begin(ctx)
	if err != nil {
		return err
	}
	err = func() error {
		resp, hdr, err := r.executeJSON(ctx, tx)
		if err != nil {
			return err
		}
		bt := &pgx.Batch{}
		bt.Queue(floorInsert, r.user, draw.Operation, key, r.fp[:], resp.Status, hdr, resp.Body, ttlMicros)
		bt.Queue("COMMIT")
		return tx.SendBatch(ctx, bt).Close()
	}()
	if err != nil {
		// The deferred Rollback of the other workloads, here only on
		// failure: after the batch's COMMIT pgx would send a ROLLBACK.
		_ = tx.Rollback(ctx)
	}
	return err
}

// protoInTx returns a DoInTx-like op that owns its transaction.
func protoInTx(savepoint bool) op {
	return func(ctx context.Context, w *worker) error {
		return protoInTxWith(ctx, w, savepoint, protoClaim, "")
	}
}

// protoInTxWith runs claimSQL (with lockTimeout as its sixth argument
// unless empty) in the BEGIN round trip, the draw, and the completion with
// COMMIT.
func protoInTxWith(ctx context.Context, w *worker, savepoint bool, claimSQL, lockTimeout string) error {
	r := w.newRequest()
	key := w.newKey()
	pc, err := w.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer pc.Release()
	conn := pc.Conn()
	open := false
	defer func() {
		if open {
			_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()

	bt := &pgx.Batch{}
	bt.BeginTx(pgx.TxOptions{})
	queueClaim(bt, claimSQL, lockTimeout, r, key)
	if savepoint {
		bt.Queue("SAVEPOINT idem_fn")
	}
	br := conn.SendBatch(ctx, bt)
	tx := br.Tx()
	open = true
	_, err = br.Exec()
	if err == nil {
		err = scanClaim(br, lockTimeout)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		err = fmt.Errorf("%w: fresh key %s already claimed", errUnexpected, key)
	}
	err = closeBatch(br, err)
	if err != nil {
		return err
	}

	resp, hdr, err := r.executeJSON(ctx, tx)
	if err != nil {
		return err
	}
	bt = &pgx.Batch{}
	bt.Queue(twoTxComplete, r.user, draw.Operation, key, resp.Status, hdr, resp.Body)
	bt.Queue("COMMIT")
	br = conn.SendBatch(ctx, bt)
	tag, err := br.Exec()
	if err == nil && tag.RowsAffected() != 1 {
		err = fmt.Errorf("%w: completion matched %d rows", errUnexpected, tag.RowsAffected())
	}
	if err == nil {
		_, err = br.Exec()
		open = err != nil
	}
	err = closeBatch(br, err)
	return err
}

// protoDo returns a Do-like op in the caller's transaction.
func protoDo(savepoints bool) op {
	return func(ctx context.Context, w *worker) error {
		return protoDoWith(ctx, w, savepoints, protoClaim, "")
	}
}

// protoDoWith is protoInTxWith in the caller's transaction.
func protoDoWith(ctx context.Context, w *worker, savepoints bool, claimSQL, lockTimeout string) error {
	r := w.newRequest()
	key := w.newKey()
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)

	bt := &pgx.Batch{}
	if savepoints {
		bt.Queue("SAVEPOINT idem_claim")
	}
	queueClaim(bt, claimSQL, lockTimeout, r, key)
	if savepoints {
		bt.Queue("SAVEPOINT idem_fn")
	}
	br := tx.SendBatch(ctx, bt)
	if savepoints {
		_, err = br.Exec()
	}
	if err == nil {
		err = scanClaim(br, lockTimeout)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		err = fmt.Errorf("%w: fresh key %s already claimed", errUnexpected, key)
	}
	err = closeBatch(br, err)
	if err != nil {
		return err
	}

	resp, hdr, err := r.executeJSON(ctx, tx)
	if err != nil {
		return err
	}
	bt = &pgx.Batch{}
	bt.Queue(twoTxComplete, r.user, draw.Operation, key, resp.Status, hdr, resp.Body)
	if savepoints {
		bt.Queue("RELEASE SAVEPOINT idem_claim")
	}
	br = tx.SendBatch(ctx, bt)
	tag, err := br.Exec()
	if err == nil && tag.RowsAffected() != 1 {
		err = fmt.Errorf("%w: completion matched %d rows", errUnexpected, tag.RowsAffected())
	}
	err = closeBatch(br, err)
	if err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// protoLockTimeout is idem's default wait, as the core passes it.
const protoLockTimeout = "2000ms"

// protoInTxLockTimeout is p-intx-sp with protoClaimLT.
func protoInTxLockTimeout(ctx context.Context, w *worker) error {
	return protoInTxWith(ctx, w, true, protoClaimLT, protoLockTimeout)
}

// protoDoLockTimeout is p-do-sp with protoClaimLT.
func protoDoLockTimeout(ctx context.Context, w *worker) error {
	return protoDoWith(ctx, w, true, protoClaimLT, protoLockTimeout)
}

func queueClaim(bt *pgx.Batch, claimSQL, lockTimeout string, r request, key string) {
	if lockTimeout == "" {
		bt.Queue(claimSQL, r.user, draw.Operation, key, r.fp[:], ttlMicros)
		return
	}
	bt.Queue(claimSQL, r.user, draw.Operation, key, r.fp[:], ttlMicros, lockTimeout)
}

func scanClaim(br pgx.BatchResults, lockTimeout string) error {
	var expires time.Time
	if lockTimeout == "" {
		return br.QueryRow().Scan(&expires)
	}
	var restored string
	return br.QueryRow().Scan(&expires, &restored)
}

// The "late" prototypes write the key row once, finished, at the end, like
// the floor: they read the key first (a retry of a finished key replays
// without running fn) and let the primary key pick the winner when the
// finished row is inserted. A twin that raced past the read runs fn too,
// waits at the INSERT for the winner (bounded by lock_timeout) and then
// undoes fn's writes and replays. Only the fresh path is exercised here.
const (
	protoReadKey = `SELECT status, response_status, response_headers, response_body, expires_at <= now()
FROM idem_keys WHERE actor = $1 AND operation = $2 AND idem_key = $3`

	// protoInsertFinished bounds its wait; the COMMIT that follows in the
	// same round trip ends the setting with the transaction.
	protoInsertFinished = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status,
	response_status, response_headers, response_body, completed_at, expires_at)
SELECT $1::text, $2::text, $3::text, $4::bytea, 'succeeded', $5::integer, $6::jsonb, $7::bytea, now(),
	now() + ($8::bigint * interval '1 microsecond')
FROM (SELECT set_config('lock_timeout', $9::text, true)) AS bounded_wait`

	// protoInsertFinishedDo is the same in the caller's transaction: it
	// does nothing on a conflict (Do then rolls back to its savepoint and
	// replays) and restores lock_timeout when it inserted.
	protoInsertFinishedDo = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status,
	response_status, response_headers, response_body, completed_at, expires_at)
SELECT $1::text, $2::text, $3::text, $4::bytea, 'succeeded', $5::integer, $6::jsonb, $7::bytea, now(),
	now() + ($8::bigint * interval '1 microsecond')
FROM (SELECT set_config('lock_timeout', $9::text, true)
      FROM (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true)) AS saved
     ) AS bounded_wait
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true)`
)

// protoInTxLate: [BEGIN, read key] draw [INSERT finished row, COMMIT].
func protoInTxLate(ctx context.Context, w *worker) error {
	r := w.newRequest()
	key := w.newKey()
	pc, err := w.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer pc.Release()
	conn := pc.Conn()
	open := false
	defer func() {
		if open {
			_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()

	bt := &pgx.Batch{}
	bt.BeginTx(pgx.TxOptions{})
	bt.Queue(protoReadKey, r.user, draw.Operation, key)
	br := conn.SendBatch(ctx, bt)
	tx := br.Tx()
	open = true
	_, err = br.Exec()
	if err == nil {
		err = scanAbsent(br.QueryRow(), key)
	}
	err = closeBatch(br, err)
	if err != nil {
		return err
	}

	resp, hdr, err := r.executeJSON(ctx, tx)
	if err != nil {
		return err
	}
	bt = &pgx.Batch{}
	bt.Queue(protoInsertFinished, r.user, draw.Operation, key, r.fp[:], resp.Status, hdr, resp.Body, ttlMicros, protoLockTimeout)
	bt.Queue("COMMIT")
	br = conn.SendBatch(ctx, bt)
	_, err = br.Exec()
	if err == nil {
		_, err = br.Exec()
		open = err != nil
	}
	err = closeBatch(br, err)
	return err
}

// protoDoLate: caller's BEGIN, [read key, SAVEPOINT] draw [INSERT finished
// row, RELEASE], caller's COMMIT.
func protoDoLate(ctx context.Context, w *worker) error {
	r := w.newRequest()
	key := w.newKey()
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	bt := &pgx.Batch{}
	bt.Queue(protoReadKey, r.user, draw.Operation, key)
	bt.Queue("SAVEPOINT idem_fn")
	br := tx.SendBatch(ctx, bt)
	err = scanAbsent(br.QueryRow(), key)
	err = closeBatch(br, err)
	if err != nil {
		return err
	}
	resp, hdr, err := r.executeJSON(ctx, tx)
	if err != nil {
		return err
	}
	bt = &pgx.Batch{}
	bt.Queue(protoInsertFinishedDo, r.user, draw.Operation, key, r.fp[:], resp.Status, hdr, resp.Body, ttlMicros, protoLockTimeout)
	bt.Queue("RELEASE SAVEPOINT idem_fn")
	br = tx.SendBatch(ctx, bt)
	var restored string
	err = br.QueryRow().Scan(&restored)
	if errors.Is(err, pgx.ErrNoRows) {
		err = fmt.Errorf("%w: fresh key %s inserted by another", errUnexpected, key)
	}
	err = closeBatch(br, err)
	if err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// scanAbsent reads the key row and requires that there is none.
func scanAbsent(row pgx.Row, key string) error {
	var status string
	var respStatus *int32
	var hdr, body []byte
	var expired bool
	err := row.Scan(&status, &respStatus, &hdr, &body, &expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err == nil {
		err = fmt.Errorf("%w: fresh key %s exists", errUnexpected, key)
	}
	return err
}
