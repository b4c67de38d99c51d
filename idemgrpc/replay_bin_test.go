package idemgrpc_test

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/rpcidem"
	"github.com/pgidem/idem/internal/rpcproto/rpctest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

// A stored binary ("-bin") metadata value that does not decode is answered
// INTERNAL on a replay, and logged with the key's hash like every INTERNAL
// the interceptor answers itself; the handler does not run.
func TestReplayUndecodableBinaryMetadataLogged(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, rpctest.Migrate)
	var runs atomic.Int64
	var logs testlog.Buffer
	conn := clientServer(t, idem.RetryPolicy{MaxAttempts: 1}, rpctest.Insert(&runs), func(*cutter) []grpc.UnaryServerInterceptor {
		return []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scopeFromMetadata,
			Logger: slog.New(slog.NewTextHandler(&logs, nil))})}
	})
	req := rpctest.Request("bin", 1)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	reply, err := proto.Marshal(rpctest.Reply(1, "bin"))
	if err != nil {
		t.Fatal(err)
	}
	const key = "bad-bin-1"
	if _, err := idem.DoInTx(t.Context(), pool, idem.Scope{Actor: "alice", Operation: rpctest.Transfer}, key,
		rpcidem.Fingerprint(rpctest.Transfer, b), func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: rpcidem.StatusReply, Body: reply,
				Header: map[string][]string{rpcidem.ReplyType: {string(proto.MessageName(rpctest.Reply(1, "bin")))}, "x-data-bin": {"!!!!"}}}, nil
		}); err != nil {
		t.Fatal(err)
	}
	a := conn.Call(t.Context(), "alice", []string{key}, req)
	if a.Code() != uint32(codes.Internal) || !strings.Contains(a.Status.GetMessage(), "x-data-bin") || runs.Load() != 0 {
		t.Fatalf("replay of an undecodable binary value: %s; runs %d", a, runs.Load())
	}
	if out := logs.String(); strings.Count(out, "level=ERROR") != 1 || !strings.Contains(out, "key_hash=") || strings.Contains(out, key) {
		t.Errorf("logs: %q; want one record with the key's hash", out)
	}
}
