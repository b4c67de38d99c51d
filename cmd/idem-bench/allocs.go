package main

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// allocResult is the heap allocation of one kind of call, sequential, with
// a trivial fn, the way go test -bench -benchmem counts it.
type allocResult struct {
	name   string
	n      int
	allocs float64 // per call
	bytes  float64 // per call
	wall   time.Duration
}

// trivialResponse is what trivialFn returns: shaped like a draw response,
// allocated once.
var trivialResponse = idem.Response{
	Status: 201,
	Header: map[string][]string{"Content-Type": {"application/json"}},
	Body:   []byte(`{"batch_id":1,"prizes":["Goose Sticker"],"points_spent":1,"points_left":99}`),
}

// trivialFn stands in for the business logic, so only the library's own
// allocations are counted.
func trivialFn(context.Context, pgx.Tx) (idem.Response, error) { return trivialResponse, nil }

// allocMeter sums heap allocations over the stretches it is running.
type allocMeter struct {
	m0             runtime.MemStats
	mallocs, bytes uint64
	wall           time.Duration
	t0             time.Time
}

func (m *allocMeter) start() {
	runtime.ReadMemStats(&m.m0)
	m.t0 = time.Now()
}

func (m *allocMeter) stop() {
	m.wall += time.Since(m.t0)
	var m1 runtime.MemStats
	runtime.ReadMemStats(&m1)
	m.mallocs += m1.Mallocs - m.m0.Mallocs
	m.bytes += m1.TotalAlloc - m.m0.TotalAlloc
}

func (m *allocMeter) result(name string, n int) allocResult {
	return allocResult{name: name, n: n, allocs: float64(m.mallocs) / float64(n),
		bytes: float64(m.bytes) / float64(n), wall: m.wall / time.Duration(n)}
}

// measureAllocs counts the allocations of Do alone (inside a transaction
// begun and committed outside the count), of DoInTx as a whole, fresh and
// replayed, and of a plain pgx transaction writing one row for reference.
func (b *bench) measureAllocs(ctx context.Context) ([]allocResult, error) {
	n := b.o.allocOps
	// Do calls per transaction. Each call takes up to two subtransaction
	// ids; staying under PostgreSQL's 64 cached per backend keeps every
	// other session's snapshots from overflowing into pg_subtrans.
	const chunk = 25
	w := newWorker(b, 1<<23, b.pool)
	scope := idem.Scope{Actor: "alloc", Operation: "bench"}
	fp := idem.FingerprintParts([]byte("alloc"))
	keysDo := make([]string, n)
	keysInTx := make([]string, n)
	for i := range n {
		keysDo[i], keysInTx[i] = w.newKey(), w.newKey()
	}

	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	// inTxs runs call for every key in transactions of chunk calls, and
	// counts only the calls.
	inTxs := func(name string, keys []string, call func(tx pgx.Tx, key string) error) (allocResult, error) {
		var m allocMeter
		for lo := 0; lo < len(keys); lo += chunk {
			tx, err := conn.Begin(ctx)
			if err != nil {
				return allocResult{}, err
			}
			m.start()
			for _, key := range keys[lo:min(lo+chunk, len(keys))] {
				if err := call(tx, key); err != nil {
					_ = tx.Rollback(ctx)
					return allocResult{}, fmt.Errorf("%s: %w", name, err)
				}
			}
			m.stop()
			if err := tx.Commit(ctx); err != nil {
				return allocResult{}, err
			}
		}
		return m.result(name, len(keys)), nil
	}
	doAlone := func(name string, replayed bool) (allocResult, error) {
		return inTxs(name, keysDo, func(tx pgx.Tx, key string) error {
			res, err := idem.Do(ctx, tx, scope, key, fp, trivialFn)
			if err == nil && res.Replayed != replayed {
				err = fmt.Errorf("%w: key %s: replayed %t", errUnexpected, key, res.Replayed)
			}
			return err
		})
	}
	doInTx := func(name string, replayed bool) (allocResult, error) {
		var m allocMeter
		m.start()
		for _, key := range keysInTx {
			res, err := idem.DoInTx(ctx, b.pool, scope, key, fp, trivialFn)
			if err == nil && res.Replayed != replayed {
				err = fmt.Errorf("%w: key %s: replayed %t", errUnexpected, key, res.Replayed)
			}
			if err != nil {
				return allocResult{}, fmt.Errorf("%s: %w", name, err)
			}
		}
		m.stop()
		return m.result(name, n), nil
	}

	fs := []func() (allocResult, error){
		func() (allocResult, error) { return doAlone("Do fresh (in a tx, fn trivial)", false) },
		func() (allocResult, error) { return doAlone("Do replay (in a tx)", true) },
		func() (allocResult, error) { return doInTx("DoInTx fresh (fn trivial)", false) },
		func() (allocResult, error) { return doInTx("DoInTx replay", true) },
		func() (allocResult, error) {
			var m allocMeter
			m.start()
			for _, key := range keysInTx {
				err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, floorInsert, scope.Actor, "reference", key, fp[:],
						trivialResponse.Status, []byte(`{"Content-Type":["application/json"]}`),
						trivialResponse.Body, ttlMicros)
					return err
				})
				if err != nil {
					return allocResult{}, fmt.Errorf("reference: %w", err)
				}
			}
			m.stop()
			return m.result("reference: pgx Begin, 1 INSERT, Commit", n), nil
		},
	}
	if b.o.proto {
		fs = append(fs,
			func() (allocResult, error) {
				keys := make([]string, n)
				for i := range keys {
					keys[i] = w.newKey()
				}
				return inTxs("p: SAVEPOINT, claim, SAVEPOINT | RELEASE, complete via pgx.Batch", keys,
					func(tx pgx.Tx, key string) error { return pgxBatchDo(ctx, tx, scope, key, fp, trivialFn) })
			},
			func() (allocResult, error) {
				p, err := preparePgconnDo(ctx, conn.Conn())
				if err != nil {
					return allocResult{}, err
				}
				keys := make([]string, n)
				for i := range keys {
					keys[i] = w.newKey()
				}
				return inTxs("p: the same via pgconn.Batch, prepared", keys,
					func(tx pgx.Tx, key string) error { return p.do(ctx, tx, scope, key, fp, trivialFn) })
			})
	}
	var out []allocResult
	for _, f := range fs {
		r, err := f()
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}
