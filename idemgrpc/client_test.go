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
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/rpcproto/rpctest"
	"github.com/pgidem/idem/internal/testkit/pgtest"
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

// UNAVAILABLE and ABORTED with RetryInfo (after its delay) are retried;
// ABORTED without RetryInfo, FAILED_PRECONDITION, INVALID_ARGUMENT and
// other codes are not. A call
// that never got an answer gives up with idem.ErrOutcomeUnknown.
func TestClientInterceptorRetriesByCode(t *testing.T) {
	t.Parallel()
	cases := rpctest.RetryCases(quickPolicy.MaxAttempts)
	var mu sync.Mutex
	attempts := map[string]int{}
	seen := &seenKeys{}
	conn := clientServer(t, quickPolicy, rpctest.Scripted(cases, func(_ context.Context, note string) {
		mu.Lock()
		defer mu.Unlock()
		attempts[note]++
	}), func(l *cutter) []grpc.UnaryServerInterceptor {
		return []grpc.UnaryServerInterceptor{seen.record(l, func(int) bool { return false })}
	})
	for note, want := range cases {
		ctx := t.Context()
		if want.Attempts == rpctest.InProgressForever {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
		}
		a := conn.Call(ctx, "alice", nil, rpctest.Request(note, 1))
		mu.Lock()
		n := attempts[note]
		mu.Unlock()
		if want.Attempts == rpctest.InProgressForever {
			if n <= quickPolicy.MaxAttempts || a.Err == nil {
				t.Errorf("%s: %d attempts, %v; want more than %d (in progress does not count) and an error", note, n, a.Err,
					quickPolicy.MaxAttempts)
			}
			continue
		}
		if n != want.Attempts || a.Code() != want.Code || errors.Is(a.Err, idem.ErrOutcomeUnknown) {
			t.Errorf("%s: %d attempts, %v; want %d, %s", note, n, a.Err, want.Attempts, codes.Code(want.Code))
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

// The context ends during the wait the server asked for (ABORTED, a call
// with this key in progress): the call may have happened, and the error
// still carries the last status, for status.Code.
func TestClientInterceptorKeepsLastStatus(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	inProgress := rpctest.Fail(uint32(codes.Aborted), "a call with this key is in progress",
		&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Hour)})
	cases := map[string]rpctest.RetryCase{"wait": {Outcomes: []*rpctest.Outcome{&inProgress}}}
	conn := clientServer(t, idem.RetryPolicy{MaxDelay: time.Hour, MaxElapsed: 2 * time.Hour},
		rpctest.Scripted(cases, func(context.Context, string) { time.AfterFunc(50*time.Millisecond, cancel) }),
		func(*cutter) []grpc.UnaryServerInterceptor { return nil })
	a := conn.Call(ctx, "alice", nil, rpctest.Request("wait", 1))
	var ce *idem.CallError
	if !errors.As(a.Err, &ce) || ce.Attempts != 1 || !errors.Is(a.Err, context.Canceled) || status.Code(a.Err) != codes.Aborted {
		t.Fatalf("ended during the wait: %v (code %s)", a.Err, status.Code(a.Err))
	}
}

// An attempt that never got a connection to a server sent nothing: a
// client pointed at a closed port, or one whose context ends while the
// connection is still being made, gets the plain status, not
// idem.ErrOutcomeUnknown.
func TestClientInterceptorNothingSent(t *testing.T) {
	t.Parallel()
	dial := func(addr string) *grpc.ClientConn {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor(quickPolicy)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}

	// Nothing listens.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	_ = ln.Close()
	a := client{conn: dial(closed), procedure: rpctest.Transfer}.Call(t.Context(), "alice", nil, rpctest.Request("x", 1))
	if status.Code(a.Err) != codes.Unavailable || errors.Is(a.Err, idem.ErrOutcomeUnknown) || !errors.Is(a.Err, idem.ErrNotSent) {
		t.Errorf("closed port: %v", a.Err)
	}

	// A listener that accepts and never speaks HTTP/2: the connection is
	// never ready, and the context's deadline passes while it is made.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = silent.Close() })
	go func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() })
		}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	a = client{conn: dial(silent.Addr().String()), procedure: rpctest.Transfer}.Call(ctx, "alice", nil, rpctest.Request("x", 1))
	if status.Code(a.Err) != codes.DeadlineExceeded || errors.Is(a.Err, idem.ErrOutcomeUnknown) || !errors.Is(a.Err, idem.ErrNotSent) {
		t.Errorf("never connected: %v", a.Err)
	}
}

// A stalled attempt (the server ran the call, committed, and its reply
// hangs) is cut at RetryPolicy.AttemptTimeout, well before the call's
// deadline, and retried with the same key: the retry replays. One run.
//
// Nothing here races the scheduler: the first attempt commits whatever
// its deadline (which the server gets with the call), so that a loaded
// machine cannot turn it into a rolled-back call that the retry runs
// afresh; the retry waits for that commit, so that it never finds the
// call in progress; and AttemptTimeout is far above what one attempt
// takes, so that only the stalled attempt is cut.
func TestClientInterceptorAttemptTimeout(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, rpctest.Migrate)
	var runs, attempts atomic.Int64
	seen := &seenKeys{}
	committed := make(chan struct{})
	cut := make(chan error, 1)
	p := quickPolicy
	p.AttemptTimeout = 2 * time.Second
	conn := clientServer(t, p, rpctest.Insert(&runs), func(l *cutter) []grpc.UnaryServerInterceptor {
		return []grpc.UnaryServerInterceptor{
			seen.record(l, func(int) bool { return false }),
			func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
				if attempts.Add(1) == 1 {
					// The call runs to its commit; then its reply hangs
					// until the client gives up on it.
					_, err := handler(context.WithoutCancel(ctx), req)
					close(committed)
					if err != nil {
						return nil, err
					}
					<-ctx.Done()
					cut <- ctx.Err()
					return nil, status.FromContextError(ctx.Err()).Err()
				}
				select {
				case <-committed:
				case <-ctx.Done():
					return nil, status.FromContextError(ctx.Err()).Err()
				}
				return handler(ctx, req)
			},
			idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scopeFromMetadata}),
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	a := conn.Call(ctx, "alice", nil, rpctest.Request("stalled", 1))
	keys := seen.all()
	if a.Err != nil || !a.Replayed() {
		t.Fatalf("%v, replayed %t", a.Err, a.Replayed())
	}
	if len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" || runs.Load() != 1 {
		t.Fatalf("keys %q, %d runs", keys, runs.Load())
	}
	select {
	case err := <-cut: // the client's cut (CANCELLED) or its deadline, sent with the call
		if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("the stalled attempt ended with %v", err)
		}
	case <-ctx.Done():
		t.Fatal("the stalled attempt was never cut")
	}
}

// An answer that arrives as the attempt's AttemptTimeout passes is an
// answer, not a cut: the interceptor returns it, once, rather than retry
// it and end with an outcome it calls unknown. The client interceptor
// inside the one under test holds the answer until the attempt's deadline
// has passed, as a loaded machine may before the interceptor reads it.
func TestClientInterceptorAnswerAtAttemptTimeout(t *testing.T) {
	t.Parallel()
	var attempts atomic.Int64
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(context.Context, any, *grpc.UnaryServerInfo, grpc.UnaryHandler) (any, error) {
		attempts.Add(1)
		return nil, status.Error(codes.FailedPrecondition, "the key was used for another request")
	}))
	var runs atomic.Int64
	srv.RegisterService(serviceDesc(rpctest.Transfer, rpctest.Insert(&runs)), nil)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	late := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		<-ctx.Done() // the attempt's deadline passes before the answer is read
		return err
	}
	p := quickPolicy
	p.AttemptTimeout = 100 * time.Millisecond
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(idemgrpc.UnaryClientInterceptor(p), late))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	a := client{conn: conn, procedure: rpctest.Transfer}.Call(t.Context(), "alice", nil, rpctest.Request("x", 1))
	if status.Code(a.Err) != codes.FailedPrecondition || errors.Is(a.Err, idem.ErrOutcomeUnknown) || attempts.Load() != 1 {
		t.Fatalf("%v after %d attempts", a.Err, attempts.Load())
	}
}

// A context that ended before the call: nothing is sent, and the error says
// why as grpc-go's own does, CANCELLED or DEADLINE_EXCEEDED for
// status.Code, while errors.Is finds the context's error and
// idem.ErrNotSent.
func TestClientInterceptorEndedContext(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	conn := clientServer(t, quickPolicy, func(context.Context, rpctest.Tx, *dynamicpb.Message) rpctest.Outcome {
		runs.Add(1)
		return rpctest.Outcome{Reply: rpctest.Reply(1, "x")}
	}, func(*cutter) []grpc.UnaryServerInterceptor { return nil })
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	expired, cancel2 := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel2()
	for _, c := range []struct {
		ctx  context.Context
		code codes.Code
		err  error
	}{{canceled, codes.Canceled, context.Canceled}, {expired, codes.DeadlineExceeded, context.DeadlineExceeded}} {
		a := conn.Call(c.ctx, "alice", nil, rpctest.Request("x", 1))
		if status.Code(a.Err) != c.code || !errors.Is(a.Err, c.err) || !errors.Is(a.Err, idem.ErrNotSent) ||
			errors.Is(a.Err, idem.ErrOutcomeUnknown) {
			t.Errorf("%v: %v (code %s)", c.err, a.Err, status.Code(a.Err))
		}
	}
	if runs.Load() != 0 {
		t.Errorf("%d runs", runs.Load())
	}
}

// AIP-155: a request whose request_id field holds a key, sent without a key
// of its own or from the context, carries that key, so that a server that
// takes it from the field (Options.KeyField) accepts the call, and the same
// request sent again as a new call replays. One run.
func TestClientInterceptorRequestID(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, rpctest.Migrate)
	var runs atomic.Int64
	seen := &seenKeys{}
	conn := clientServer(t, quickPolicy, rpctest.Insert(&runs), func(l *cutter) []grpc.UnaryServerInterceptor {
		return []grpc.UnaryServerInterceptor{seen.record(l, func(int) bool { return false }),
			idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scopeFromMetadata, KeyField: "request_id", RequireKey: true})}
	})
	const id = "9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60"
	for i := range 2 {
		a := conn.Call(t.Context(), "alice", nil, rpctest.WithID(rpctest.Request("aip", 7), id))
		if a.Err != nil || a.Replayed() != (i == 1) {
			t.Errorf("call %d: %s", i, a)
		}
	}
	if keys := seen.all(); len(keys) != 2 || keys[0] != id || keys[1] != id {
		t.Errorf("keys sent: %q, want the request_id", keys)
	}
	if runs.Load() != 1 {
		t.Errorf("%d runs; want 1", runs.Load())
	}
}

// A context key that idem accepts but that is not a bare key in the
// metadata (a comma, a leading double quote) is sent so that the server
// reads the same key back (an RFC 8941 string): the call runs once, and a
// second call with the key replays.
func TestClientInterceptorKeyNeedsQuoting(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, rpctest.Migrate)
	var runs atomic.Int64
	conn := clientServer(t, quickPolicy, rpctest.Insert(&runs), func(*cutter) []grpc.UnaryServerInterceptor {
		return []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scopeFromMetadata})}
	})
	for i, key := range []string{"order,1", `"order-2`, `order\3"`} {
		if err := idem.ValidateKey(key); err != nil {
			t.Fatal(err)
		}
		for n := range 2 {
			a := conn.Call(idem.WithCallKey(t.Context(), key), "alice", nil, rpctest.Request(key, int64(i)))
			if a.Err != nil || a.Replayed() != (n == 1) {
				t.Errorf("%s, call %d: %s", key, n, a)
			}
		}
		if _, err := idem.Lookup(t.Context(), pool, idem.Scope{Actor: "alice", Operation: rpctest.Transfer}, key); err != nil {
			t.Errorf("%s: %v", key, err)
		}
	}
	if runs.Load() != 3 {
		t.Errorf("%d runs; want 3", runs.Load())
	}
}
