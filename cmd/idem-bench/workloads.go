package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/draw"
)

// ttlMicros is the key lifetime the floor and two-tx workloads write,
// idem's default TTL.
var ttlMicros = idem.DefaultTTL.Microseconds()

// worker is the state of one benchmark goroutine.
type worker struct {
	b    *bench
	pool *pgxpool.Pool
	rng  *rand.Rand
	buf  []byte
}

func newWorker(b *bench, id int, pool *pgxpool.Pool) *worker {
	seed := uint64(time.Now().UnixNano())
	return &worker{b: b, pool: pool, rng: rand.New(rand.NewPCG(seed, uint64(id)))}
}

// request is one draw request: a random user draws once from a random box.
type request struct {
	user string
	req  draw.Request
	body []byte
	fp   idem.Fingerprint
}

// newRequest builds the request every workload sends, fingerprint
// included, so the client-side work is the same in all of them.
func (w *worker) newRequest() request {
	user := "u" + strconv.Itoa(1+w.rng.IntN(w.b.o.users))
	box := int64(1001 + w.rng.IntN(w.b.o.boxes))
	body := strconv.AppendInt([]byte(`{"box_id":`), box, 10)
	body = append(body, `,"quantity":1}`...)
	fp, err := idem.FingerprintJSON(body)
	if err != nil {
		panic(err) // the body is fixed-shape valid JSON
	}
	return request{user: user, req: draw.Request{BoxID: box, Quantity: 1}, body: body, fp: fp}
}

func (r request) scope() idem.Scope { return idem.Scope{Actor: r.user, Operation: draw.Operation} }

// execute is the draw, as the fn of idem.Do.
func (r request) execute(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
	return draw.Execute(ctx, tx, r.user, r.req)
}

// executeJSON is execute, with the response's header encoded as JSON for
// the statements that store it by hand.
func (r request) executeJSON(ctx context.Context, tx pgx.Tx) (idem.Response, []byte, error) {
	resp, err := r.execute(ctx, tx)
	if err != nil {
		return resp, nil, err
	}
	hdr, err := json.Marshal(resp.Header)
	return resp, hdr, err
}

// closeBatch closes br and returns err, or the error of closing when err is
// nil.
func closeBatch(br pgx.BatchResults, err error) error {
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	return err
}

// newKey returns a fresh random key shaped like a UUID, as clients send.
func (w *worker) newKey() string {
	var raw [16]byte
	for i := 0; i < 16; i += 8 {
		v := w.rng.Uint64()
		for j := range 8 {
			raw[i+j] = byte(v >> (8 * j))
		}
	}
	raw[6] = raw[6]&0x0f | 0x40
	raw[8] = raw[8]&0x3f | 0x80
	w.buf = w.buf[:0]
	w.buf = hex.AppendEncode(w.buf, raw[0:4])
	w.buf = append(w.buf, '-')
	w.buf = hex.AppendEncode(w.buf, raw[4:6])
	w.buf = append(w.buf, '-')
	w.buf = hex.AppendEncode(w.buf, raw[6:8])
	w.buf = append(w.buf, '-')
	w.buf = hex.AppendEncode(w.buf, raw[8:10])
	w.buf = append(w.buf, '-')
	w.buf = hex.AppendEncode(w.buf, raw[10:16])
	return string(w.buf)
}

// An op runs one transaction of a workload.
type op func(ctx context.Context, w *worker) error

// errUnexpected marks an outcome that breaks a workload's premise (a fresh
// key replayed, a replay that ran fn); it fails the run.
var errUnexpected = errors.New("unexpected outcome")

// opBare is the draw transaction without idempotency.
func opBare(ctx context.Context, w *worker) error {
	r := w.newRequest()
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if _, err := r.execute(ctx, tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// floorInsert writes a finished key row: the least any durable record of
// the outcome, committed atomically with the draw, can cost.
const floorInsert = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status,
	response_status, response_headers, response_body, completed_at, expires_at)
VALUES ($1, $2, $3, $4, 'succeeded', $5, $6, $7, now(), now() + ($8::bigint * interval '1 microsecond'))`

// opFloor is bare plus one INSERT of a finished row into idem_keys.
func opFloor(ctx context.Context, w *worker) error {
	r := w.newRequest()
	key := w.newKey()
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	resp, hdr, err := r.executeJSON(ctx, tx)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, floorInsert, r.user, draw.Operation, key, r.fp[:],
		resp.Status, hdr, resp.Body, ttlMicros); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// opDo is idem.Do with a fresh key in the caller's transaction.
func opDo(ctx context.Context, w *worker) error {
	r := w.newRequest()
	key := w.newKey()
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	res, err := idem.Do(ctx, tx, r.scope(), key, r.fp, r.execute)
	if err != nil {
		return err
	}
	if res.Replayed {
		return fmt.Errorf("%w: fresh key %s replayed", errUnexpected, key)
	}
	return tx.Commit(ctx)
}

// opDoInTx is idem.DoInTx with a fresh key.
func opDoInTx(ctx context.Context, w *worker) error {
	r := w.newRequest()
	key := w.newKey()
	res, err := idem.DoInTx(ctx, w.pool, r.scope(), key, r.fp, r.execute)
	if err != nil {
		return err
	}
	if res.Replayed {
		return fmt.Errorf("%w: fresh key %s replayed", errUnexpected, key)
	}
	return nil
}

// opReplay is idem.DoInTx with a key that completed before; fn must not run.
func opReplay(ctx context.Context, w *worker) error {
	// Build a request like every other workload does, then send the
	// completed key's own request instead.
	_ = w.newRequest()
	rk := w.b.replayKeys[w.rng.IntN(len(w.b.replayKeys))]
	res, err := idem.DoInTx(ctx, w.pool, rk.req.scope(), rk.key, rk.req.fp, mustNotRun)
	if err != nil {
		return err
	}
	if !res.Replayed || res.Status != 201 {
		return fmt.Errorf("%w: key %s not replayed (status %d)", errUnexpected, rk.key, res.Status)
	}
	return nil
}

func mustNotRun(context.Context, pgx.Tx) (idem.Response, error) {
	return idem.Response{}, fmt.Errorf("%w: fn ran on replay", errUnexpected)
}

// The two statements of the two-transaction pattern: the claim is committed
// on its own (an autocommitted INSERT, one round trip, as libraries that
// keep the key apart from the business transaction do); the completion
// runs in the business transaction.
const (
	twoTxClaim = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
VALUES ($1, $2, $3, $4, 'processing', now() + ($5::bigint * interval '1 microsecond'))
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING expires_at`
	twoTxComplete = `UPDATE idem_keys
SET status = 'succeeded', response_status = $4, response_headers = $5, response_body = $6, completed_at = now()
WHERE actor = $1 AND operation = $2 AND idem_key = $3 AND status = 'processing'`
	twoTxRelease = `DELETE FROM idem_keys
WHERE actor = $1 AND operation = $2 AND idem_key = $3 AND status = 'processing'`
)

// opTwoTx claims the key in a transaction of its own, then runs the draw
// and the completion in a second one.
func opTwoTx(ctx context.Context, w *worker) error {
	r := w.newRequest()
	key := w.newKey()
	var expires time.Time
	err := w.pool.QueryRow(ctx, twoTxClaim, r.user, draw.Operation, key, r.fp[:], ttlMicros).Scan(&expires)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: fresh key %s already claimed", errUnexpected, key)
	}
	if err != nil {
		return err
	}
	if err := twoTxBusiness(ctx, w, r, key); err != nil {
		// What such a library does when the business transaction fails:
		// free the key again.
		_, _ = w.pool.Exec(context.WithoutCancel(ctx), twoTxRelease, r.user, draw.Operation, key)
		return err
	}
	return nil
}

func twoTxBusiness(ctx context.Context, w *worker, r request, key string) error {
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	resp, hdr, err := r.executeJSON(ctx, tx)
	if err != nil {
		return err
	}
	tag, err := tx.Exec(ctx, twoTxComplete, r.user, draw.Operation, key, resp.Status, hdr, resp.Body)
	if err != nil {
		return err
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("%w: completion of %s matched %d rows", errUnexpected, key, tag.RowsAffected())
	}
	return tx.Commit(ctx)
}
