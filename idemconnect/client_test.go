package idemconnect_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
	"github.com/pgidem/idem/internal/rpcproto/rpctest"
	"github.com/pgidem/idem/internal/testkit/httprelay"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// quickPolicy retries quickly, so that the tests do not wait.
var quickPolicy = idem.RetryPolicy{MaxAttempts: 4, BaseDelay: time.Millisecond, MaxDelay: 20 * time.Millisecond}

// plainServer mounts h behind interceptors on an HTTP/1.1 server on
// 127.0.0.1, which httprelay can stand in front of, and returns its URL.
func plainServer(t *testing.T, h rpctest.Handler, interceptors ...connect.Interceptor) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(rpctest.Transfer, connect.NewUnaryHandler(rpctest.Transfer, handler(h),
		connect.WithSchema(rpctest.Method), connect.WithRequestInitializer(initRequest),
		connect.WithInterceptors(interceptors...)))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// call calls Transfer at url (a server's root) with hc, as server.call.
func call(ctx context.Context, url string, hc *http.Client, user string, keys []string, req *dynamicpb.Message,
	options ...connect.ClientOption) rpctest.Answer {
	return (&server{url: url + rpctest.Transfer, hc: hc}).call(ctx, user, keys, req, options...)
}

// withRetries is the client option of the interceptor under test.
func withRetries(p idem.RetryPolicy) connect.ClientOption {
	return connect.WithInterceptors(idemconnect.NewClientInterceptor(p))
}

// The first reply is lost after the server committed: the client's retry,
// with the same key, replays it. One execution, one key, whether the key
// was minted, from the context or the request's own.
func TestClientInterceptorHealsDroppedReply(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, rpctest.Migrate)
	var runs atomic.Int64
	url := plainServer(t, rpctest.Insert(&runs), idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scopeFromHeader}))
	relay := httprelay.New(t, url, func(_ *http.Request, attempt int) httprelay.Action {
		if attempt == 1 {
			return httprelay.Action{Fault: httprelay.DropReply}
		}
		return httprelay.Action{}
	})
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	ctx := t.Context()
	own := "own-" + idem.NewCallKey()
	for i, c := range []struct {
		name string
		ctx  context.Context
		keys []string
	}{
		{"minted", ctx, nil},
		{"context", idem.WithCallKey(ctx, "ctx-"+idem.NewCallKey()), nil},
		{"own", ctx, []string{own}},
	} {
		before := len(relay.Keys())
		a := call(c.ctx, relay.URL, hc, "alice", c.keys, rpctest.Request(c.name, int64(i)), withRetries(quickPolicy))
		keys := relay.Keys()[before:]
		if a.Err != nil || !a.Replayed() || a.Decode(t).Description != c.name {
			t.Fatalf("%s: %v, replayed %t", c.name, a.Err, a.Replayed())
		}
		if len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" || (c.keys != nil && keys[0] != own) {
			t.Errorf("%s: keys %q", c.name, keys)
		}
		if ck, ok := idem.CallKeyFrom(c.ctx); ok && keys[0] != ck {
			t.Errorf("%s: sent %q, not the context's %q", c.name, keys[0], ck)
		}
	}
	if runs.Load() != 3 || transfers(t, pool) != 3 {
		t.Fatalf("%d runs, %d rows for 3 calls", runs.Load(), transfers(t, pool))
	}
}

// unavailable and aborted with RetryInfo (after its delay) are retried;
// aborted without RetryInfo, failed_precondition, invalid_argument and
// other codes are not. A call
// whose every reply is lost gives up with idem.ErrOutcomeUnknown, and a
// request sent again after the call is a new call with a new key.
func TestClientInterceptorRetriesByCode(t *testing.T) {
	t.Parallel()
	cases := rpctest.RetryCases(quickPolicy.MaxAttempts)
	var mu sync.Mutex
	attempts := map[string][]string{} // keys, by note
	url := plainServer(t, rpctest.Scripted(cases, func(ctx context.Context, note string) {
		info, _ := connect.CallInfoForHandlerContext(ctx)
		mu.Lock()
		defer mu.Unlock()
		attempts[note] = append(attempts[note], info.RequestHeader().Get(idemconnect.HeaderKey))
	}))
	for note, want := range cases {
		ctx := t.Context()
		if want.Attempts == rpctest.InProgressForever {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
		}
		a := call(ctx, url, http.DefaultClient, "alice", nil, rpctest.Request(note, 1), withRetries(quickPolicy))
		mu.Lock()
		keys := attempts[note]
		mu.Unlock()
		if want.Attempts == rpctest.InProgressForever && (len(keys) <= quickPolicy.MaxAttempts || a.Err == nil) {
			t.Errorf("%s: %d attempts, %v; want more than %d (in progress does not count) and an error", note, len(keys), a.Err,
				quickPolicy.MaxAttempts)
		}
		if want.Attempts == rpctest.InProgressForever {
			continue
		}
		if len(keys) != want.Attempts || a.Code() != want.Code || errors.Is(a.Err, idem.ErrOutcomeUnknown) {
			t.Errorf("%s: %d attempts, %v; want %d, %v", note, len(keys), a.Err, want.Attempts, connect.Code(want.Code))
		}
		for _, k := range keys {
			if k != keys[0] || k == "" {
				t.Errorf("%s: keys %q", note, keys)
			}
		}
	}

	// Every reply is lost: the call may have happened.
	relay := httprelay.New(t, url, func(*http.Request, int) httprelay.Action { return httprelay.Action{Fault: httprelay.DropReply} })
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	client := connect.NewClient[dynamicpb.Message, rawReply](hc, relay.URL+rpctest.Transfer, connect.WithCodec(rawCodec{}),
		withRetries(idem.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: time.Millisecond}))
	req := connect.NewRequest(rpctest.Request("ok", 1))
	req.Header().Set("User", "alice")
	_, err := client.CallUnary(t.Context(), req)
	var ce *idem.CallError
	keys := relay.Keys()
	if !errors.Is(err, idem.ErrOutcomeUnknown) || !errors.As(err, &ce) || connect.CodeOf(err) != connect.CodeUnavailable ||
		ce.Attempts != 3 || len(keys) != 3 || keys[0] != ce.Key || keys[2] != ce.Key {
		t.Fatalf("lost replies: %v, keys %q", err, keys)
	}
	if !strings.Contains(err.Error(), "may have been processed") {
		t.Errorf("message: %v", err)
	}
	if req.Header().Get(idemconnect.HeaderKey) != "" {
		t.Errorf("the minted key stayed on the request")
	}
	_, _ = client.CallUnary(t.Context(), req)
	if again := relay.Keys(); len(again) < 4 || again[3] == ce.Key {
		t.Errorf("the request sent again kept the key: %q", again)
	}
}

// Bad input fails the call before anything is sent.
func TestClientInterceptorRefusesBadInput(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	url := plainServer(t, func(context.Context, rpctest.Tx, *dynamicpb.Message) rpctest.Outcome {
		runs.Add(1)
		return rpctest.Outcome{Reply: rpctest.Reply(1, "x")}
	})
	r := idem.Reservation{Scope: idem.Scope{Actor: "alice", Operation: "transfer"}, Key: "k1"}
	ctx := t.Context()
	for _, c := range []struct {
		name   string
		ctx    context.Context
		keys   []string
		policy idem.RetryPolicy
		want   error
	}{
		{"step with a control character", idem.WithCallKey(ctx, r.CallKey("transfer\x1b")), nil, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"context key too long", idem.WithCallKey(ctx, strings.Repeat("k", 256)), nil, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"own key with a space", ctx, []string{"a b"}, idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"negative MaxElapsed", ctx, nil, idem.RetryPolicy{MaxElapsed: -1}, idem.ErrInvalidArgument},
		{"negative BaseDelay", ctx, nil, idem.RetryPolicy{BaseDelay: -1}, idem.ErrInvalidArgument},
	} {
		a := call(c.ctx, url, http.DefaultClient, "alice", c.keys, rpctest.Request("x", 1), withRetries(c.policy))
		if !errors.Is(a.Err, c.want) {
			t.Errorf("%s: %v", c.name, a.Err)
		}
	}
	if runs.Load() != 0 {
		t.Fatalf("%d calls reached the server", runs.Load())
	}
}

// The context ends during the wait the server asked for (aborted, a call
// with this key in progress): the call may have happened, and the error
// still carries the last error, for connect.CodeOf.
func TestClientInterceptorKeepsLastCode(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	inProgress := rpctest.Fail(uint32(connect.CodeAborted), "a call with this key is in progress",
		&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Hour)})
	cases := map[string]rpctest.RetryCase{"wait": {Outcomes: []*rpctest.Outcome{&inProgress}}}
	url := plainServer(t, rpctest.Scripted(cases, func(context.Context, string) { time.AfterFunc(50*time.Millisecond, cancel) }))
	a := call(ctx, url, http.DefaultClient, "alice", nil, rpctest.Request("wait", 1),
		withRetries(idem.RetryPolicy{MaxDelay: time.Hour, MaxElapsed: 2 * time.Hour}))
	var ce *idem.CallError
	if !errors.As(a.Err, &ce) || ce.Attempts != 1 || !errors.Is(a.Err, context.Canceled) || connect.CodeOf(a.Err) != connect.CodeAborted {
		t.Fatalf("ended during the wait: %v (code %s)", a.Err, connect.CodeOf(a.Err))
	}
}

// An attempt that never got a connection sent nothing: a client pointed at
// a closed port, or whose context ends while the connection is still being
// dialled, gets the plain error, not idem.ErrOutcomeUnknown.
func TestClientInterceptorNothingSent(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + ln.Addr().String()
	_ = ln.Close()
	a := call(t.Context(), closed, http.DefaultClient, "alice", nil, rpctest.Request("x", 1), withRetries(quickPolicy))
	if connect.CodeOf(a.Err) != connect.CodeUnavailable || errors.Is(a.Err, idem.ErrOutcomeUnknown) || !errors.Is(a.Err, idem.ErrNotSent) {
		t.Errorf("closed port: %v", a.Err)
	}

	blocked := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		<-ctx.Done() // net/http ends the dial once the request gave up on it
		return nil, ctx.Err()
	}}}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	a = call(ctx, "http://127.0.0.1:1", blocked, "alice", nil, rpctest.Request("x", 1), withRetries(quickPolicy))
	if connect.CodeOf(a.Err) != connect.CodeDeadlineExceeded || errors.Is(a.Err, idem.ErrOutcomeUnknown) || !errors.Is(a.Err, idem.ErrNotSent) {
		t.Errorf("the context ended during the dial: %v", a.Err)
	}
}

// A stalled attempt (the server committed; the relay holds its reply far
// longer than the attempt may take) is cut at RetryPolicy.AttemptTimeout,
// well before the call's deadline, and retried with the same key: the
// retry replays. One run.
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
	committed := make(chan struct{})
	first := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if attempts.Add(1) == 1 {
				defer close(committed)
				return next(context.WithoutCancel(ctx), req)
			}
			select {
			case <-committed:
			case <-ctx.Done():
				return nil, connect.NewError(connect.CodeOf(ctx.Err()), ctx.Err())
			}
			return next(ctx, req)
		}
	})
	url := plainServer(t, rpctest.Insert(&runs), first, idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scopeFromHeader}))
	relay := httprelay.New(t, url, func(_ *http.Request, attempt int) httprelay.Action {
		if attempt == 1 {
			return httprelay.Action{Delay: time.Minute}
		}
		return httprelay.Action{}
	})
	p := quickPolicy
	p.AttemptTimeout = 2 * time.Second
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	a := call(ctx, relay.URL, hc, "alice", nil, rpctest.Request("stalled", 1), withRetries(p))
	keys := relay.Keys()
	if a.Err != nil || !a.Replayed() {
		t.Fatalf("%v, replayed %t", a.Err, a.Replayed())
	}
	if len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" || runs.Load() != 1 {
		t.Fatalf("keys %q, %d runs", keys, runs.Load())
	}
}

// An answer that arrives as the attempt's AttemptTimeout passes is an
// answer, not a cut: the interceptor returns it, once, rather than retry
// it and end with an outcome it calls unknown. The client interceptor
// inside the one under test holds the answer until the attempt's deadline
// has passed, as a loaded machine may before the interceptor reads it.
func TestClientInterceptorAnswerAtAttemptTimeout(t *testing.T) {
	t.Parallel()
	var runs, attempts atomic.Int64
	refuse := connect.UnaryInterceptorFunc(func(connect.UnaryFunc) connect.UnaryFunc {
		return func(context.Context, connect.AnyRequest) (connect.AnyResponse, error) {
			attempts.Add(1)
			return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("the key was used for another request"))
		}
	})
	url := plainServer(t, rpctest.Insert(&runs), refuse)
	late := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			<-ctx.Done() // the attempt's deadline passes before the answer is read
			return resp, err
		}
	})
	p := quickPolicy
	p.AttemptTimeout = 100 * time.Millisecond
	a := call(t.Context(), url, http.DefaultClient, "alice", nil, rpctest.Request("x", 1),
		connect.WithInterceptors(idemconnect.NewClientInterceptor(p), late))
	if connect.CodeOf(a.Err) != connect.CodeFailedPrecondition || errors.Is(a.Err, idem.ErrOutcomeUnknown) || attempts.Load() != 1 {
		t.Fatalf("%v after %d attempts", a.Err, attempts.Load())
	}
}

// A context that ended before the call: nothing is sent, and the error says
// why as connect-go's own does, canceled or deadline_exceeded for
// connect.CodeOf, while errors.Is finds the context's error and
// idem.ErrNotSent.
func TestClientInterceptorEndedContext(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	url := plainServer(t, func(context.Context, rpctest.Tx, *dynamicpb.Message) rpctest.Outcome {
		runs.Add(1)
		return rpctest.Outcome{Reply: rpctest.Reply(1, "x")}
	})
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	expired, cancel2 := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel2()
	for _, c := range []struct {
		ctx  context.Context
		code connect.Code
		err  error
	}{{canceled, connect.CodeCanceled, context.Canceled}, {expired, connect.CodeDeadlineExceeded, context.DeadlineExceeded}} {
		a := call(c.ctx, url, http.DefaultClient, "alice", nil, rpctest.Request("x", 1), withRetries(quickPolicy))
		if connect.CodeOf(a.Err) != c.code || !errors.Is(a.Err, c.err) || !errors.Is(a.Err, idem.ErrNotSent) ||
			errors.Is(a.Err, idem.ErrOutcomeUnknown) {
			t.Errorf("%v: %v (code %s)", c.err, a.Err, connect.CodeOf(a.Err))
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
	url := plainServer(t, rpctest.Insert(&runs),
		idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scopeFromHeader, KeyField: "request_id", RequireKey: true}))
	relay := httprelay.New(t, url, func(*http.Request, int) httprelay.Action { return httprelay.Action{} })
	const id = "9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60"
	for i := range 2 {
		a := call(t.Context(), relay.URL, http.DefaultClient, "alice", nil, rpctest.WithID(rpctest.Request("aip", 7), id), withRetries(quickPolicy))
		if a.Err != nil || a.Replayed() != (i == 1) {
			t.Errorf("call %d: %s", i, a)
		}
	}
	if keys := relay.Keys(); len(keys) != 2 || keys[0] != id || keys[1] != id {
		t.Errorf("keys sent: %q, want the request_id", keys)
	}
	if runs.Load() != 1 {
		t.Errorf("%d runs; want 1", runs.Load())
	}
}

// A context key that idem accepts but that is not a bare key in a header
// (a comma, a leading double quote) is sent so that the server reads the
// same key back (an RFC 8941 string): the call runs once, and a second
// call with the key replays.
func TestClientInterceptorKeyNeedsQuoting(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, rpctest.Migrate)
	var runs atomic.Int64
	url := plainServer(t, rpctest.Insert(&runs), idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scopeFromHeader}))
	for i, key := range []string{"order,1", `"order-2`, `order\3"`} {
		if err := idem.ValidateKey(key); err != nil {
			t.Fatal(err)
		}
		for n := range 2 {
			a := call(idem.WithCallKey(t.Context(), key), url, http.DefaultClient, "alice", nil, rpctest.Request(key, int64(i)), withRetries(quickPolicy))
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
