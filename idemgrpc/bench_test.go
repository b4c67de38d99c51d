package idemgrpc_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/pgtest"
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
	pool := pgtest.Pool(b, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	conn := serve(b, pool, idemgrpc.Options{}, func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
		if idemgrpc.Tx(ctx) != nil {
			return insert(ctx, req)
		}
		var id int64
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, `INSERT INTO transfers (note, amount) VALUES ($1, $2) RETURNING id`,
				getString(req, "note"), getInt(req, "amount")).Scan(&id)
		})
		return reply(id, "bare"), err
	})
	req := request("bench", 1)
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			if a := call(ctx, conn, "alice", "", req); a.err != nil {
				b.Fatal(a.err)
			}
		}
	})
	b.Run("keyed", func(b *testing.B) {
		i := 0
		for b.Loop() {
			i++
			if a := call(ctx, conn, "alice", fmt.Sprintf("bench-%d", i), req); a.err != nil {
				b.Fatal(a.err)
			}
		}
	})
	b.Run("replay", func(b *testing.B) {
		for b.Loop() {
			if a := call(ctx, conn, "alice", "bench-1", req); a.err != nil || !a.replayed() {
				b.Fatal(a.err)
			}
		}
	})
}
