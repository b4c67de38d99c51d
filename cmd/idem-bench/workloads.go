package main

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/demo/draw"
)

// ttlMicros is the key lifetime floor and two-tx write: idem's default.
var ttlMicros = idem.DefaultTTL.Microseconds()

// request is one business request: who sends it, its fingerprint, and the
// business transaction, as the fn of idem.Do.
type request struct {
	scope idem.Scope
	fp    idem.Fingerprint
	run   func(ctx context.Context, tx pgx.Tx) (idem.Response, error)
}

// business is a business transaction the workloads protect.
type business struct {
	name string
	// request builds a request of a random actor on a random row, so no
	// row is hot.
	request func(w *worker) request
	// fresh builds a request of an actor created for it, and a count of
	// the business transactions that committed for that actor.
	fresh func(ctx context.Context, pool *pgxpool.Pool, n int) (request, func(context.Context) (int, error), error)
}

// lightSchema is the light business's own small domain.
const lightSchema = `
CREATE TABLE light_accounts (id int PRIMARY KEY, balance bigint NOT NULL);
CREATE TABLE light_items (id int PRIMARY KEY, stock bigint NOT NULL);
CREATE TABLE light_orders (id bigserial PRIMARY KEY, account_id int NOT NULL, item_id int NOT NULL,
	created_at timestamptz NOT NULL DEFAULT now());`

var jsonHeader = map[string][]string{"Content-Type": {"application/json"}}

// lightRequest is an order: debit an account, take an item's stock, insert
// the order (two UPDATEs and an INSERT, three round trips).
func lightRequest(account, item int) request {
	body := fmt.Appendf(nil, `{"account":%d,"item":%d}`, account, item)
	return request{
		scope: idem.Scope{Actor: "a" + strconv.Itoa(account), Operation: "order"},
		fp:    mustFingerprint(body),
		run: func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			if _, err := tx.Exec(ctx, `UPDATE light_accounts SET balance = balance - 1 WHERE id = $1`, account); err != nil {
				return idem.Response{}, err
			}
			if _, err := tx.Exec(ctx, `UPDATE light_items SET stock = stock - 1 WHERE id = $1`, item); err != nil {
				return idem.Response{}, err
			}
			var id int64
			if err := tx.QueryRow(ctx, `INSERT INTO light_orders (account_id, item_id) VALUES ($1, $2) RETURNING id`,
				account, item).Scan(&id); err != nil {
				return idem.Response{}, err
			}
			out := strconv.AppendInt([]byte(`{"order_id":`), id, 10)
			return idem.Response{Status: 201, Header: jsonHeader, Body: append(out, '}')}, nil
		},
	}
}

// drawRequest is one draw of internal/demo/draw by user from box.
func drawRequest(user string, box int64) request {
	body := fmt.Appendf(nil, `{"box_id":%d,"quantity":1}`, box)
	req := draw.Request{BoxID: box, Quantity: 1}
	return request{
		scope: idem.Scope{Actor: user, Operation: draw.Operation},
		fp:    mustFingerprint(body),
		run: func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			return draw.Execute(ctx, tx, user, req)
		},
	}
}

func mustFingerprint(body []byte) idem.Fingerprint {
	fp, err := idem.FingerprintJSON(body)
	if err != nil {
		panic(err) // the bodies are fixed-shape valid JSON
	}
	return fp
}

// businesses returns light and draw for o's table sizes. Fresh actors come
// after the loaded ones: accounts above o.users, wallets named fresh-N.
func businesses(o options) (light, drawB *business) {
	light = &business{
		name: "light",
		request: func(w *worker) request {
			return lightRequest(1+w.rng.IntN(o.users), 1+w.rng.IntN(o.boxes))
		},
		fresh: func(ctx context.Context, pool *pgxpool.Pool, n int) (request, func(context.Context) (int, error), error) {
			account := o.users + n
			_, err := pool.Exec(ctx, `INSERT INTO light_accounts VALUES ($1, 1000000000000)`, account)
			return lightRequest(account, 1), func(ctx context.Context) (int, error) {
				return count(ctx, pool, `SELECT count(*) FROM light_orders WHERE account_id = $1`, account)
			}, err
		},
	}
	drawB = &business{
		name: "draw",
		request: func(w *worker) request {
			return drawRequest("u"+strconv.Itoa(1+w.rng.IntN(o.users)), int64(1000+1+w.rng.IntN(o.boxes)))
		},
		fresh: func(ctx context.Context, pool *pgxpool.Pool, n int) (request, func(context.Context) (int, error), error) {
			user := "fresh-" + strconv.Itoa(n)
			err := draw.AddWallet(ctx, pool, user, 1_000_000_000_000)
			return drawRequest(user, 1001), func(ctx context.Context) (int, error) {
				return count(ctx, pool, `SELECT count(*) FROM draw_batches WHERE user_id = $1`, user)
			}, err
		},
	}
	return light, drawB
}

func count(ctx context.Context, pool *pgxpool.Pool, sql string, arg any) (int, error) {
	var n int
	err := pool.QueryRow(ctx, sql, arg).Scan(&n)
	return n, err
}

// worker is the state of one benchmark goroutine.
type worker struct {
	biz    *business
	db     db // a pool, or one connection of it
	rng    *rand.Rand
	replay []replayKey // the completed keys of a replay workload
}

// db is what the ops use of a *pgxpool.Pool or a *pgx.Conn.
type db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func newWorker(wl *workload, id int) *worker {
	return &worker{biz: wl.biz, db: wl.pool, replay: wl.replay,
		rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(id)))}
}

// replayKey is a completed key and the request that completed it.
type replayKey struct {
	req request
	key string
}

// newKey returns a fresh random key shaped like a UUID, as clients send.
func (w *worker) newKey() string {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], w.rng.Uint64())
	binary.LittleEndian.PutUint64(b[8:], w.rng.Uint64())
	b[6], b[8] = b[6]&0x0f|0x40, b[8]&0x3f|0x80
	h := hex.EncodeToString(b[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// An op runs one transaction of a workload.
type op func(ctx context.Context, w *worker) error

// errUnexpected marks an outcome that breaks a workload's premise (a fresh
// key replayed, fn running on replay); it fails the run.
var errUnexpected = errors.New("unexpected outcome")

// ops are the workloads, by name, in the order they are reported.
var ops = []struct {
	name string
	op   op
}{
	{"bare", opBare}, {"floor", opFloor}, {"do", opDo}, {"doInTx", opDoInTx}, {"replay", opReplay}, {"two-tx", opTwoTx},
	{"doInTx+obs", opDoInTxObserved},
}

// observed is a Client with metrics and logs on, as a service runs them: an
// OpenTelemetry SDK MeterProvider that aggregates every counter and
// histogram in memory, and a JSON slog logger at Info level (to io.Discard),
// which writes a record for every replay, refusal and store error; a fresh
// call is a Debug record and is not written. doInTx+obs / doInTx is what
// observability costs.
var observed = func() *idem.Client {
	c, err := idem.New(idem.Config{
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader())),
		Logger:        slog.New(slog.NewJSONHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	if err != nil {
		panic(err)
	}
	return c
}()

// opDoInTxObserved is opDoInTx through the observed Client.
func opDoInTxObserved(ctx context.Context, w *worker) error {
	r, key := w.biz.request(w), w.newKey()
	res, err := observed.DoInTx(ctx, w.db, r.scope, key, r.fp, r.run)
	if err == nil && res.Replayed {
		err = fmt.Errorf("%w: fresh key %s replayed", errUnexpected, key)
	}
	return err
}

// opBare is the business transaction alone.
func opBare(ctx context.Context, w *worker) error {
	r := w.biz.request(w)
	return pgx.BeginFunc(ctx, w.db, func(tx pgx.Tx) error {
		_, err := r.run(ctx, tx)
		return err
	})
}

// floorInsert writes a finished key row: the least any durable record of
// the outcome, committed with the business transaction, must do.
const floorInsert = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status,
	response_status, response_headers, response_body, completed_at, expires_at)
VALUES ($1, $2, $3, $4, 'succeeded', $5, $6, $7, now(), now() + ($8::bigint * interval '1 microsecond'))`

// opFloor is bare plus one INSERT of a finished key row.
func opFloor(ctx context.Context, w *worker) error {
	return floorTx(ctx, w.db, w.biz.request(w), w.newKey(), ttlMicros)
}

// floorTx runs r's business transaction on d with the floor's INSERT of
// key, kept ttl µs.
func floorTx(ctx context.Context, d db, r request, key string, ttl int64) error {
	return pgx.BeginFunc(ctx, d, func(tx pgx.Tx) error {
		resp, err := r.run(ctx, tx)
		if err != nil {
			return err
		}
		hdr, err := json.Marshal(resp.Header)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, floorInsert, r.scope.Actor, r.scope.Operation, key, r.fp[:],
			resp.Status, hdr, resp.Body, ttl)
		return err
	})
}

// opDo is idem.Do with a fresh key in the caller's transaction.
func opDo(ctx context.Context, w *worker) error {
	r, key := w.biz.request(w), w.newKey()
	return pgx.BeginFunc(ctx, w.db, func(tx pgx.Tx) error {
		res, err := idem.Do(ctx, tx, r.scope, key, r.fp, r.run)
		if err == nil && res.Replayed {
			err = fmt.Errorf("%w: fresh key %s replayed", errUnexpected, key)
		}
		return err
	})
}

// opDoInTx is idem.DoInTx with a fresh key.
func opDoInTx(ctx context.Context, w *worker) error {
	r, key := w.biz.request(w), w.newKey()
	res, err := idem.DoInTx(ctx, w.db, r.scope, key, r.fp, r.run)
	if err == nil && res.Replayed {
		err = fmt.Errorf("%w: fresh key %s replayed", errUnexpected, key)
	}
	return err
}

// opReplay is idem.DoInTx on a key that completed before; fn must not run.
func opReplay(ctx context.Context, w *worker) error {
	_ = w.biz.request(w) // the client-side work every workload does
	rk := w.replay[w.rng.IntN(len(w.replay))]
	res, err := idem.DoInTx(ctx, w.db, rk.req.scope, rk.key, rk.req.fp, mustNotRun)
	if err == nil && (!res.Replayed || res.Status != 201) {
		err = fmt.Errorf("%w: key %s not replayed (status %d)", errUnexpected, rk.key, res.Status)
	}
	return err
}

func mustNotRun(context.Context, pgx.Tx) (idem.Response, error) {
	return idem.Response{}, fmt.Errorf("%w: fn ran on replay", errUnexpected)
}

// The two-transaction pattern of libraries that keep the key apart from the
// business transaction: the claim commits on its own (one autocommitted
// INSERT), then the business transaction completes the key.
const (
	twoTxClaim = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
VALUES ($1, $2, $3, $4, 'processing', now() + ($5::bigint * interval '1 microsecond'))
ON CONFLICT (actor, operation, idem_key) DO NOTHING`
	twoTxComplete = `UPDATE idem_keys
SET status = 'succeeded', response_status = $4, response_headers = $5, response_body = $6, completed_at = now()
WHERE actor = $1 AND operation = $2 AND idem_key = $3 AND status = 'processing'`
	twoTxRelease = `DELETE FROM idem_keys WHERE actor = $1 AND operation = $2 AND idem_key = $3 AND status = 'processing'`
)

// opTwoTx claims in one transaction, then runs the business transaction and
// the completion in a second one.
func opTwoTx(ctx context.Context, w *worker) error {
	r, key := w.biz.request(w), w.newKey()
	tag, err := w.db.Exec(ctx, twoTxClaim, r.scope.Actor, r.scope.Operation, key, r.fp[:], ttlMicros)
	if err != nil {
		return err
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("%w: fresh key %s already claimed", errUnexpected, key)
	}
	err = pgx.BeginFunc(ctx, w.db, func(tx pgx.Tx) error {
		resp, err := r.run(ctx, tx)
		if err != nil {
			return err
		}
		hdr, err := json.Marshal(resp.Header)
		if err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, twoTxComplete, r.scope.Actor, r.scope.Operation, key, resp.Status, hdr, resp.Body)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("%w: completion of %s matched %d rows", errUnexpected, key, tag.RowsAffected())
		}
		return err
	})
	if err != nil {
		// What such a library does when the business transaction fails.
		_, _ = w.db.Exec(context.WithoutCancel(ctx), twoTxRelease, r.scope.Actor, r.scope.Operation, key)
	}
	return err
}
