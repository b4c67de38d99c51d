package idemconnect_test

import (
	"context"
	"errors"
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
	"github.com/pgidem/idem/internal/httprelay"
	"github.com/pgidem/idem/internal/pgtest"
)

// quickPolicy retries quickly, so that the tests do not wait.
var quickPolicy = idem.RetryPolicy{MaxAttempts: 4, BaseDelay: time.Millisecond, MaxDelay: 20 * time.Millisecond}

// plainServer mounts h behind interceptors on an HTTP/1.1 server on
// 127.0.0.1, which httprelay can stand in front of, and returns its URL.
func plainServer(t *testing.T, h ledgerHandler, interceptors ...connect.Interceptor) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(transferProcedure, connect.NewUnaryHandler(transferProcedure, h,
		connect.WithSchema(transferMethod), connect.WithRequestInitializer(initRequest),
		connect.WithInterceptors(interceptors...)))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
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
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	url := plainServer(t, insertHandler(&runs), idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scopeFromHeader}))
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
		{"own", ctx, key(own)},
	} {
		before := len(relay.Keys())
		a := call(c.ctx, relay.URL, hc, "alice", c.keys, request(c.name, int64(i)), withRetries(quickPolicy))
		keys := relay.Keys()[before:]
		if a.err != nil || !a.replayed() || a.decode(t).Description != c.name {
			t.Fatalf("%s: %v, replayed %t", c.name, a.err, a.replayed())
		}
		if len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" || (c.keys != nil && keys[0] != own) {
			t.Errorf("%s: keys %q", c.name, keys)
		}
		if ck, ok := idem.CallKeyFrom(c.ctx); ok && keys[0] != ck {
			t.Errorf("%s: sent %q, not the context's %q", c.name, keys[0], ck)
		}
	}
	if runs.Load() != 3 || countRows(t, pool) != 3 {
		t.Fatalf("%d runs, %d rows for 3 calls", runs.Load(), countRows(t, pool))
	}
}

// unavailable and aborted (after RetryInfo's delay) are retried;
// failed_precondition, invalid_argument and other codes are not. A call
// whose every reply is lost gives up with idem.ErrOutcomeUnknown, and a
// request sent again after the call is a new call with a new key.
func TestClientInterceptorRetriesByCode(t *testing.T) {
	t.Parallel()
	aborted := connect.NewError(connect.CodeAborted, errors.New("a call with this key is in progress"))
	if d, err := connect.NewErrorDetail(&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Millisecond)}); err == nil {
		aborted.AddDetail(d)
	}
	scripts := map[string][]error{
		"unavailable":         {connect.NewError(connect.CodeUnavailable, errors.New("store down")), nil},
		"aborted":             {aborted, aborted, nil},
		"failed-precondition": {connect.NewError(connect.CodeFailedPrecondition, errors.New("key reused")), nil},
		"invalid-argument":    {connect.NewError(connect.CodeInvalidArgument, errors.New("bad key")), nil},
		"not-found":           {connect.NewError(connect.CodeNotFound, errors.New("no")), nil},
		"aborted-forever":     {aborted},
		"ok":                  {nil},
	}
	var mu sync.Mutex
	attempts := map[string][]string{} // keys, by note
	url := plainServer(t, func(_ context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
		note := getString(req.Msg, "note")
		mu.Lock()
		n := len(attempts[note])
		attempts[note] = append(attempts[note], req.Header().Get(idemconnect.HeaderKey))
		mu.Unlock()
		script := scripts[note]
		if err := script[min(n, len(script)-1)]; err != nil {
			return nil, err
		}
		return connect.NewResponse(reply(1, note)), nil
	})
	for note, want := range map[string]struct {
		attempts int
		code     connect.Code
	}{
		"unavailable": {2, 0}, "aborted": {3, 0}, "failed-precondition": {1, connect.CodeFailedPrecondition},
		"invalid-argument": {1, connect.CodeInvalidArgument}, "not-found": {1, connect.CodeNotFound},
		"aborted-forever": {quickPolicy.MaxAttempts, connect.CodeAborted}, "ok": {1, 0},
	} {
		a := call(t.Context(), url, http.DefaultClient, "alice", nil, request(note, 1), withRetries(quickPolicy))
		mu.Lock()
		keys := attempts[note]
		mu.Unlock()
		code := connect.Code(0)
		if a.err != nil {
			code = connect.CodeOf(a.err)
		}
		if len(keys) != want.attempts || code != want.code || errors.Is(a.err, idem.ErrOutcomeUnknown) {
			t.Errorf("%s: %d attempts, %v; want %d, %v", note, len(keys), a.err, want.attempts, want.code)
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
	client := connect.NewClient[dynamicpb.Message, rawReply](hc, relay.URL+transferProcedure, connect.WithCodec(rawCodec{}),
		withRetries(idem.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: time.Millisecond}))
	req := connect.NewRequest(request("ok", 1))
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
	url := plainServer(t, func(context.Context, *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
		runs.Add(1)
		return connect.NewResponse(reply(1, "x")), nil
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
		{"own key with a space", ctx, key("a b"), idem.RetryPolicy{}, idem.ErrInvalidKey},
		{"negative MaxElapsed", ctx, nil, idem.RetryPolicy{MaxElapsed: -1}, idem.ErrInvalidArgument},
		{"negative BaseDelay", ctx, nil, idem.RetryPolicy{BaseDelay: -1}, idem.ErrInvalidArgument},
	} {
		a := call(c.ctx, url, http.DefaultClient, "alice", c.keys, request("x", 1), withRetries(c.policy))
		if !errors.Is(a.err, c.want) {
			t.Errorf("%s: %v", c.name, a.err)
		}
	}
	if runs.Load() != 0 {
		t.Fatalf("%d calls reached the server", runs.Load())
	}
}
