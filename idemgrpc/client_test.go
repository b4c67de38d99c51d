package idemgrpc_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/pgtest"
	"github.com/pgidem/idem/internal/rpcproto/rpctest"
)

// quickPolicy retries quickly, so that the tests do not wait.
var quickPolicy = idem.RetryPolicy{MaxAttempts: 4, BaseDelay: time.Millisecond, MaxDelay: 20 * time.Millisecond}

// cutter is a listener that can cut every connection it accepted.
type cutter struct {
	net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func (l *cutter) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.mu.Lock()
		l.conns = append(l.conns, c)
		l.mu.Unlock()
	}
	return c, err
}

// cut closes every connection accepted so far.
func (l *cutter) cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		_ = c.Close()
	}
	l.conns = nil
}

// seenKeys records the idempotency keys of the attempts a server received.
type seenKeys struct {
	mu   sync.Mutex
	keys []string
}

func (s *seenKeys) all() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.keys...)
}

// record is a server interceptor that records each call's key, runs the
// rest of the chain, and then, while drop says so, cuts the connection
// instead of replying: the call ran (and committed), its reply is lost.
func (s *seenKeys) record(l *cutter, drop func(attempt int) bool) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		s.mu.Lock()
		s.keys = append(s.keys, strings.Join(md.Get(idemgrpc.MetadataKey), ","))
		n := len(s.keys)
		s.mu.Unlock()
		resp, err := handler(ctx, req)
		if drop(n) {
			l.cut()
		}
		return resp, err
	}
}

// clientServer serves h behind the server interceptors on 127.0.0.1 and
// returns a client connection through UnaryClientInterceptor(p).
func clientServer(t *testing.T, p idem.RetryPolicy, h rpctest.Handler, chain func(l *cutter) []grpc.UnaryServerInterceptor) client {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &cutter{Listener: ln}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(chain(l)...))
	srv.RegisterService(serviceDesc(rpctest.Transfer, h), nil)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor(p)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return client{conn: conn, procedure: rpctest.Transfer}
}

// The first reply is lost with its connection after the server committed:
// the client's retry, with the same key, replays it. One execution, one
// key, whether the key was minted, from the context or the call's own.
func TestClientInterceptorHealsDroppedReply(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, rpctest.Migrate)
	var runs atomic.Int64
	seen := &seenKeys{}
	dropped := map[string]bool{}
	var mu sync.Mutex
	conn := clientServer(t, quickPolicy, rpctest.Insert(&runs), func(l *cutter) []grpc.UnaryServerInterceptor {
		return []grpc.UnaryServerInterceptor{
			seen.record(l, func(n int) bool { // the first attempt of each key
				mu.Lock()
				defer mu.Unlock()
				k := seen.all()[n-1]
				first := !dropped[k]
				dropped[k] = true
				return first
			}),
			idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scopeFromMetadata}),
		}
	})
	ctx := t.Context()
	own := "own-" + idem.NewCallKey()
	for i, c := range []struct {
		name string
		ctx  context.Context
		keys []string
		key  string
	}{
		{"minted", ctx, nil, ""},
		{"context", idem.WithCallKey(ctx, "ctx-"+idem.NewCallKey()), nil, ""},
		{"own", ctx, []string{own}, own},
	} {
		before := len(seen.all())
		a := conn.Call(c.ctx, "alice", c.keys, rpctest.Request(c.name, int64(i)))
		keys := seen.all()[before:]
		if a.Err != nil || !a.Replayed() || a.Decode(t).Description != c.name {
			t.Fatalf("%s: %v, replayed %t", c.name, a.Err, a.Replayed())
		}
		if len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" || (c.key != "" && keys[0] != c.key) {
			t.Errorf("%s: keys %q", c.name, keys)
		}
		if ck, ok := idem.CallKeyFrom(c.ctx); ok && keys[0] != ck {
			t.Errorf("%s: sent %q, not the context's %q", c.name, keys[0], ck)
		}
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM transfers`).Scan(&rows); err != nil || runs.Load() != 3 || rows != 3 {
		t.Fatalf("%d runs, %d rows for 3 calls (%v)", runs.Load(), rows, err)
	}
}

// UNAVAILABLE and ABORTED (after RetryInfo's delay) are retried;
// FAILED_PRECONDITION, INVALID_ARGUMENT and other codes are not. A call
// that never got an answer gives up with idem.ErrOutcomeUnknown.
func TestClientInterceptorRetriesByCode(t *testing.T) {
	t.Parallel()
	fail := func(code codes.Code, msg string, details ...proto.Message) *rpctest.Outcome {
		out := rpctest.Fail(uint32(code), msg, details...)
		return &out
	}
	aborted := fail(codes.Aborted, "a call with this key is in progress", &errdetails.RetryInfo{RetryDelay: durationpb.New(time.Millisecond)})
	scripts := map[string][]*rpctest.Outcome{
		"unavailable":         {fail(codes.Unavailable, "store down"), nil},
		"aborted":             {aborted, aborted, nil},
		"failed-precondition": {fail(codes.FailedPrecondition, "key reused"), nil},
		"invalid-argument":    {fail(codes.InvalidArgument, "bad key"), nil},
		"not-found":           {fail(codes.NotFound, "no"), nil},
		"aborted-forever":     {aborted},
		"ok":                  {nil},
	}
	var mu sync.Mutex
	attempts := map[string]int{}
	seen := &seenKeys{}
	conn := clientServer(t, quickPolicy, func(ctx context.Context, _ rpctest.Tx, req *dynamicpb.Message) rpctest.Outcome {
		note := rpctest.Note(req)
		mu.Lock()
		n := attempts[note]
		attempts[note]++
		mu.Unlock()
		script := scripts[note]
		if out := script[min(n, len(script)-1)]; out != nil {
			return *out
		}
		return rpctest.Outcome{Reply: rpctest.Reply(1, note)}
	}, func(l *cutter) []grpc.UnaryServerInterceptor {
		return []grpc.UnaryServerInterceptor{seen.record(l, func(int) bool { return false })}
	})
	for note, want := range map[string]struct {
		attempts int
		code     codes.Code
	}{
		"unavailable": {2, codes.OK}, "aborted": {3, codes.OK}, "failed-precondition": {1, codes.FailedPrecondition},
		"invalid-argument": {1, codes.InvalidArgument}, "not-found": {1, codes.NotFound},
		"aborted-forever": {quickPolicy.MaxAttempts, codes.Aborted}, "ok": {1, codes.OK},
	} {
		a := conn.Call(t.Context(), "alice", nil, rpctest.Request(note, 1))
		mu.Lock()
		n := attempts[note]
		mu.Unlock()
		if n != want.attempts || status.Code(a.Err) != want.code || errors.Is(a.Err, idem.ErrOutcomeUnknown) {
			t.Errorf("%s: %d attempts, %v; want %d, %s", note, n, a.Err, want.attempts, want.code)
		}
	}

	// Every attempt's reply is lost: the call may have happened.
	var runs atomic.Int64
	lost := &seenKeys{}
	conn = clientServer(t, idem.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: time.Millisecond},
		func(context.Context, rpctest.Tx, *dynamicpb.Message) rpctest.Outcome {
			runs.Add(1)
			return rpctest.Outcome{Reply: rpctest.Reply(1, "x")}
		},
		func(l *cutter) []grpc.UnaryServerInterceptor {
			return []grpc.UnaryServerInterceptor{lost.record(l, func(int) bool { return true })}
		})
	a := conn.Call(t.Context(), "alice", nil, rpctest.Request("lost", 1))
	var ce *idem.CallError
	keys := lost.all()
	if !errors.Is(a.Err, idem.ErrOutcomeUnknown) || !errors.As(a.Err, &ce) || status.Code(a.Err) != codes.Unavailable ||
		ce.Attempts != 3 || len(keys) != 3 || keys[0] != ce.Key || keys[2] != ce.Key || runs.Load() != 3 {
		t.Fatalf("lost replies: %v, keys %q, %d runs", a.Err, keys, runs.Load())
	}
	if !strings.Contains(a.Err.Error(), "may have been processed") {
		t.Errorf("message: %v", a.Err)
	}
}

// Bad input fails the call before anything is sent.
func TestClientInterceptorRefusesBadInput(t *testing.T) {
	t.Parallel()
	r := idem.Reservation{Scope: idem.Scope{Actor: "alice", Operation: "transfer"}, Key: "k1"}
	ctx := t.Context()
	cases := []struct {
		name   string
		ctx    context.Context
		policy idem.RetryPolicy
		want   error
	}{
		{"step with a control character", idem.WithCallKey(ctx, r.CallKey("transfer\x01")), idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"context key with a space", idem.WithCallKey(ctx, "a b"), idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"own key with a space", ctx, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"negative MaxAttempts", ctx, idem.RetryPolicy{MaxAttempts: -1}, idem.ErrInvalidArgument},
		{"negative MaxDelay", ctx, idem.RetryPolicy{MaxDelay: -time.Second}, idem.ErrInvalidArgument},
	}
	for _, c := range cases {
		var runs atomic.Int64
		conn := clientServer(t, c.policy, func(context.Context, rpctest.Tx, *dynamicpb.Message) rpctest.Outcome {
			runs.Add(1)
			return rpctest.Outcome{Reply: rpctest.Reply(1, "x")}
		}, func(*cutter) []grpc.UnaryServerInterceptor { return nil })
		var keys []string
		if strings.HasPrefix(c.name, "own") {
			keys = []string{"a b"}
		}
		a := conn.Call(c.ctx, "alice", keys, rpctest.Request("x", 1))
		if !errors.Is(a.Err, c.want) || runs.Load() != 0 {
			t.Errorf("%s: %v, %d runs", c.name, a.Err, runs.Load())
		}
	}
}
