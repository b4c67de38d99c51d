package main

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// allocRow is the heap allocations per call of one kind of call,
// sequential, with a trivial fn, as testing.AllocsPerRun counts them.
type allocRow struct {
	name   string
	allocs float64
}

var trivialResponse = idem.Response{Status: 201, Header: jsonHeader, Body: []byte(`{"order_id":1}`)}

// trivialFn stands in for the business transaction, so only idem's own
// allocations (and pgx's under it) are counted.
func trivialFn(context.Context, pgx.Tx) (idem.Response, error) { return trivialResponse, nil }

// allocs counts the allocations of Do alone (in transactions begun and
// committed outside the count), of DoInTx as a whole, fresh and replayed,
// and of a plain pgx transaction writing one row, for reference.
func (b *bench) allocs(ctx context.Context) ([]allocRow, error) {
	// Do calls per transaction: each fresh Do takes a subtransaction id;
	// PostgreSQL caches 64 per backend before every snapshot has to look
	// further.
	const chunk = 25
	n := max(chunk, b.o.allocs/chunk*chunk)
	w := newWorker(&workload{biz: b.light, pool: b.pool}, -4)
	scope, fp := idem.Scope{Actor: "alloc", Operation: "bench"}, idem.FingerprintParts([]byte("alloc"))
	keys, txKeys := make([]string, n), make([]string, n)
	for i := range keys {
		keys[i], txKeys[i] = w.newKey(), w.newKey()
	}
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Release()

	var failed error
	check := func(res idem.Result, err error, replayed bool) {
		if err == nil && res.Replayed != replayed {
			err = fmt.Errorf("%w: replayed %t", errUnexpected, res.Replayed)
		}
		failed = cmp(failed, err)
	}
	// AllocsPerRun calls f once more than it counts.
	doAlone := func(replayed bool) float64 {
		var sum float64
		for lo := 0; lo < n; lo += chunk {
			tx, err := conn.Begin(ctx)
			if err != nil {
				failed = cmp(failed, err)
				return 0
			}
			i := lo
			sum += testing.AllocsPerRun(chunk-1, func() {
				res, err := idem.Do(ctx, tx, scope, keys[i], fp, trivialFn)
				check(res, err, replayed)
				i++
			})
			failed = cmp(failed, tx.Commit(ctx))
		}
		return sum / float64(n/chunk)
	}
	inTx := func(replayed bool) float64 {
		i := 0
		return testing.AllocsPerRun(n-1, func() {
			res, err := idem.DoInTx(ctx, b.pool, scope, txKeys[i], fp, trivialFn)
			check(res, err, replayed)
			i++
		})
	}
	rows := []allocRow{
		{"Do fresh (in a transaction)", doAlone(false)},
		{"Do replay (in a transaction)", doAlone(true)},
		{"DoInTx fresh", inTx(false)},
		{"DoInTx replay", inTx(true)},
	}
	i := 0
	rows = append(rows, allocRow{"reference: pgx Begin, one INSERT, Commit", testing.AllocsPerRun(n-1, func() {
		failed = cmp(failed, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, floorInsert, scope.Actor, "reference", keys[i], fp[:], 201,
				[]byte(`{"Content-Type":["application/json"]}`), trivialResponse.Body, ttlMicros)
			return err
		}))
		i++
	})})
	return rows, failed
}
