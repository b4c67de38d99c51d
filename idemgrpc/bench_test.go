package idemgrpc_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem/internal/rpcproto/rpctest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// BenchmarkCall measures a call over a real connection on 127.0.0.1 whose
// handler INSERTs one row: "bare" commits its own transaction (no key, the
// interceptor passes the call through), "keyed" is a first call with a new
// key (claim, INSERT, stored reply, one transaction), "replay" a retry of
// one key. Compare them as ratios within one run:
//
//	go test -run '^$' -bench Call -benchtime 2000x ./idemgrpc/
func BenchmarkCall(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b, rpctest.Migrate)
	var runs atomic.Int64
	insert := rpctest.Insert(&runs)
	srv := transport{}.Serve(b, rpctest.DB{Driver: rpctest.Drivers[0], Pgx: pool}, rpctest.Options{},
		func(ctx context.Context, tx rpctest.Tx, req *dynamicpb.Message) rpctest.Outcome {
			if tx != nil {
				return insert(ctx, tx, req)
			}
			var id int64
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return tx.QueryRow(ctx, `INSERT INTO transfers (note, amount) VALUES ($1, $2) RETURNING id`,
					rpctest.Note(req), rpctest.Amount(req)).Scan(&id)
			})
			if err != nil {
				return rpctest.Fail(13, err.Error())
			}
			return rpctest.Outcome{Reply: rpctest.Reply(id, "bare")}
		})
	req := rpctest.Request("bench", 1)
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			if a := srv.Call(ctx, "alice", nil, req); a.Err != nil {
				b.Fatal(a.Err)
			}
		}
	})
	b.Run("keyed", func(b *testing.B) {
		i := 0
		for b.Loop() {
			i++
			if a := srv.Call(ctx, "alice", []string{fmt.Sprintf("bench-%d", i)}, req); a.Err != nil {
				b.Fatal(a.Err)
			}
		}
	})
	b.Run("replay", func(b *testing.B) {
		for b.Loop() {
			if a := srv.Call(ctx, "alice", []string{"bench-1"}, req); a.Err != nil || !a.Replayed() {
				b.Fatal(a.Err)
			}
		}
	})
}
