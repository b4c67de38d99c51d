package idemconnect_test

import (
	"bytes"
	"context"
	"fmt"
	"reflect"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
	"github.com/pgidem/idem/internal/rpcproto/rpctest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// The behaviour idemconnect shares with idemgrpc, on a pgx pool and on
// database/sql with pgx's stdlib driver and lib/pq.
func TestSuite(t *testing.T) { rpctest.Run(t, transport{}) }

// NewInterceptorSQL on a Citus coordinator, with and without Options.Citus
// (skipped without IDEM_CITUS_URL; .ci/citus starts a cluster).
func TestCitusSQL(t *testing.T) { rpctest.RunCitus(t, transport{}) }

// pgxDB is a pool on a fresh database, as rpctest's suite reaches it.
func pgxDB(t *testing.T) (rpctest.DB, *pgxpool.Pool) {
	pool := pgtest.Pool(t, rpctest.Migrate)
	return rpctest.DB{Driver: rpctest.Drivers[0], Pgx: pool}, pool
}

func transfers(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM transfers`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A retry over the gRPC and the gRPC-Web protocols gets the first reply's
// bytes, its stored headers and trailers and Idempotent-Replayed: true; a
// retry in JSON gets the same message. With a schema and without one.
func TestReplayOverEveryProtocol(t *testing.T) {
	t.Parallel()
	for _, procedure := range []string{rpctest.Transfer, rpctest.Unlisted} {
		t.Run(procedure, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			db, pool := pgxDB(t)
			var runs atomic.Int64
			insert := rpctest.Insert(&runs)
			srv := serve(t, db, rpctest.Options{StoredHeaders: []string{"X-Order"}, StoredTrailers: []string{"x-trace-bin"}, Procedure: procedure}, nil,
				func(ctx context.Context, tx rpctest.Tx, req *dynamicpb.Message) rpctest.Outcome {
					out := insert(ctx, tx, req)
					out.Header = map[string]string{"X-Order": "42"}
					out.Trailer = map[string]string{"X-Trace-Bin": connect.EncodeBinaryHeader([]byte{0, 0xff, '\n'})}
					return out
				})
			first := srv.Call(ctx, "alice", []string{"order-0001"}, rpctest.Request("coffee", 3))
			if first.Err != nil || first.Replayed() {
				t.Fatalf("first call: %s", first)
			}
			for name, opts := range map[string][]connect.ClientOption{"grpc": {connect.WithGRPC()}, "grpc-web": {connect.WithGRPCWeb()}} {
				again := srv.call(ctx, "alice", []string{"order-0001"}, rpctest.Request("coffee", 3), opts...)
				if again.Err != nil || !again.Replayed() || !bytes.Equal(again.Body, first.Body) {
					t.Errorf("%s retry: %s; first body %x", name, again, first.Body)
				}
				if got := again.Header("X-Order"); !reflect.DeepEqual(got, []string{"42"}) {
					t.Errorf("%s retry: X-Order %q", name, got)
				}
				if b, err := connect.DecodeBinaryHeader(again.Trailer("X-Trace-Bin")[0]); err != nil || !bytes.Equal(b, []byte{0, 0xff, '\n'}) {
					t.Errorf("%s retry: trailer %q", name, again.Trailer("X-Trace-Bin"))
				}
			}

			jsonClient := connect.NewClient[dynamicpb.Message, errdetails.ResourceInfo](srv.hc, srv.url, connect.WithProtoJSON())
			req := connect.NewRequest(rpctest.Request("coffee", 3))
			req.Header().Set("User", "alice")
			req.Header().Set(idemconnect.HeaderKey, "order-0001")
			resp, err := jsonClient.CallUnary(ctx, req)
			if err != nil || resp.Header().Get(idemconnect.HeaderReplayed) != "true" || !proto.Equal(resp.Msg, first.Decode(t)) {
				t.Errorf("JSON retry: %v, %v", err, resp)
			}
			if runs.Load() != 1 || transfers(t, pool) != 1 {
				t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), transfers(t, pool))
			}
		})
	}
}

// Stored names that start with "connect-" are refused at start-up.
func TestConnectHeaderPanics(t *testing.T) {
	defer func() {
		if r := recover(); r == nil {
			t.Error("no panic")
		}
	}()
	idemconnect.NewInterceptor(&pgxpool.Pool{}, idemconnect.Options{Scope: scopeFromHeader, StoredTrailers: []string{"Connect-Timeout-Ms"}})
}

// A run of the handler that is rolled back (a serialization failure) leaves
// nothing it set through connect.CallInfoForHandlerContext: the first call
// and its replay get the headers and trailers of the run that committed
// only, and those an interceptor before this one set.
func TestRolledBackRunHeadersDropped(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, pool := pgxDB(t)
	var runs atomic.Int64
	insert := rpctest.Insert(&runs)
	outer := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
				info.ResponseHeader().Set("X-Outer", "kept")
			}
			return next(ctx, req)
		}
	})
	srv := serve(t, db, rpctest.Options{StoredHeaders: []string{"X-Run"}, StoredTrailers: []string{"X-Run-Trailer"}},
		[]connect.Interceptor{outer},
		func(ctx context.Context, tx rpctest.Tx, req *dynamicpb.Message) rpctest.Outcome {
			info, _ := connect.CallInfoForHandlerContext(ctx)
			if runs.Load() == 0 {
				runs.Add(1)
				info.ResponseHeader().Add("X-Run", "first-rolled-back")
				info.ResponseTrailer().Add("X-Run-Trailer", "first-rolled-back")
				err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END $$`)
				return rpctest.Fail(uint32(connect.CodeUnknown), fmt.Sprint(err))
			}
			info.ResponseHeader().Add("X-Run", "second")
			info.ResponseTrailer().Add("X-Run-Trailer", "second")
			return insert(ctx, tx, req)
		})
	for _, name := range []string{"first call", "replay"} {
		a := srv.Call(ctx, "alice", []string{"rerun-1"}, rpctest.Request("r", 1))
		if a.Err != nil {
			t.Fatalf("%s: %s", name, a)
		}
		if got := a.Header("X-Run"); !reflect.DeepEqual(got, []string{"second"}) {
			t.Errorf("%s: X-Run %q, want [second]", name, got)
		}
		if got := a.Trailer("X-Run-Trailer"); !reflect.DeepEqual(got, []string{"second"}) {
			t.Errorf("%s: X-Run-Trailer %q, want [second]", name, got)
		}
		if got := a.Header("X-Outer"); !reflect.DeepEqual(got, []string{"kept"}) {
			t.Errorf("%s: X-Outer %q, want [kept]", name, got)
		}
		if a.Replayed() != (name == "replay") {
			t.Errorf("%s: replayed %v", name, a.Replayed())
		}
	}
	if runs.Load() != 2 || transfers(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 2, 1", runs.Load(), transfers(t, pool))
	}
}

// A run that is rolled back while a duplicate waits for its key: the
// duplicate runs and commits, and the first call's next try replays that
// outcome (or, if it claims the key first, runs again and the duplicate
// replays it). Either way both calls get the headers of the run that
// committed only, not those the rolled-back run set.
func TestRolledBackRunHeadersDroppedOnReplay(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, pool := pgxDB(t)
	var runs atomic.Int64
	inFirst := make(chan struct{})
	// Two servers, as two processes: a duplicate on the same one would
	// wait for the first call in the process, not for the key's row lock.
	h := func(ctx context.Context, tx rpctest.Tx, req *dynamicpb.Message) rpctest.Outcome {
		info, _ := connect.CallInfoForHandlerContext(ctx)
		n := runs.Add(1)
		if n == 1 {
			info.ResponseHeader().Add("X-Run", "first-rolled-back")
			close(inFirst)
			// Until the duplicate waits for the key's row lock (at most 20 s).
			for waiting, start := 0, time.Now(); waiting == 0 && time.Since(start) < 20*time.Second; time.Sleep(10 * time.Millisecond) {
				if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
						WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
					return rpctest.Fail(uint32(connect.CodeInternal), err.Error())
				}
			}
			err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END $$`)
			return rpctest.Fail(uint32(connect.CodeUnknown), fmt.Sprint(err))
		}
		info.ResponseHeader().Add("X-Run", fmt.Sprint("run-", n))
		id, err := tx.Insert(ctx, "d", 1)
		if err != nil {
			return rpctest.Fail(uint32(connect.CodeInternal), err.Error())
		}
		return rpctest.Outcome{Reply: rpctest.Reply(id, "d")}
	}
	opts := rpctest.Options{StoredHeaders: []string{"X-Run"}, Config: idem.Config{Wait: 30 * time.Second}}
	srv1, srv2 := serve(t, db, opts, nil, h), serve(t, db, opts, nil, h)
	var first rpctest.Answer
	done := make(chan struct{})
	go func() {
		defer close(done)
		first = srv1.Call(ctx, "alice", []string{"dup-1"}, rpctest.Request("d", 1))
	}()
	select {
	case <-inFirst:
	case <-done:
		t.Fatalf("first call: %s", first)
	}
	dup := srv2.Call(ctx, "alice", []string{"dup-1"}, rpctest.Request("d", 1))
	<-done
	for name, a := range map[string]rpctest.Answer{"first call": first, "duplicate": dup} {
		if a.Err != nil {
			t.Fatalf("%s: %s", name, a)
		}
		if got := a.Header("X-Run"); !reflect.DeepEqual(got, []string{"run-2"}) {
			t.Errorf("%s: X-Run %q, want [run-2]", name, got)
		}
	}
	if first.Replayed() == dup.Replayed() {
		t.Errorf("replayed: first call %v, duplicate %v; want exactly one", first.Replayed(), dup.Replayed())
	}
	if runs.Load() != 2 || transfers(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 2, 1", runs.Load(), transfers(t, pool))
	}
}

// Headers and trailers that an interceptor before this one sets are not
// the handler's: a replay gets them once, from that interceptor, even when
// StoredHeaders or StoredTrailers name them; the handler's own are stored.
// For a reply and for a refusal.
func TestOuterInterceptorHeadersNotStored(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, pool := pgxDB(t)
	var runs atomic.Int64
	insert := rpctest.Insert(&runs)
	outer := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
				info.ResponseHeader().Set("X-Version", "v1")
				info.ResponseTrailer().Set("X-Served-By", "outer")
			}
			return next(ctx, req)
		}
	})
	srv := serve(t, db, rpctest.Options{StoredHeaders: []string{"X-Version", "X-Order"}, StoredTrailers: []string{"X-Served-By"}},
		[]connect.Interceptor{outer},
		func(ctx context.Context, tx rpctest.Tx, req *dynamicpb.Message) rpctest.Outcome {
			if rpctest.Amount(req) > 100 {
				out := rpctest.Fail(uint32(connect.CodeFailedPrecondition), "insufficient funds")
				out.Header = map[string]string{"X-Order": "none"}
				return out
			}
			out := insert(ctx, tx, req)
			out.Header = map[string]string{"X-Order": "42"}
			return out
		})
	for _, name := range []string{"first call", "replay"} {
		a := srv.Call(ctx, "alice", []string{"outer-1"}, rpctest.Request("r", 1))
		if a.Err != nil {
			t.Fatalf("%s: %s", name, a)
		}
		if got := a.Header("X-Version"); !reflect.DeepEqual(got, []string{"v1"}) {
			t.Errorf("%s: X-Version %q, want [v1]", name, got)
		}
		if got := a.Trailer("X-Served-By"); !reflect.DeepEqual(got, []string{"outer"}) {
			t.Errorf("%s: X-Served-By %q, want [outer]", name, got)
		}
		if got := a.Header("X-Order"); !reflect.DeepEqual(got, []string{"42"}) {
			t.Errorf("%s: X-Order %q, want [42]", name, got)
		}
	}
	for _, name := range []string{"first refusal", "replayed refusal"} {
		a := srv.Call(ctx, "alice", []string{"outer-2"}, rpctest.Request("r", 500))
		if a.Code() != uint32(connect.CodeFailedPrecondition) {
			t.Fatalf("%s: %s", name, a)
		}
		if got := a.Header("X-Version"); !reflect.DeepEqual(got, []string{"v1"}) {
			t.Errorf("%s: X-Version %q, want [v1]", name, got)
		}
		if got := a.Header("X-Order"); !reflect.DeepEqual(got, []string{"none"}) {
			t.Errorf("%s: X-Order %q, want [none]", name, got)
		}
	}
	if runs.Load() != 1 || transfers(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), transfers(t, pool))
	}
}
