package idemconnect_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconnect"
	"github.com/pgidem/idem/internal/pgtest"
	"github.com/pgidem/idem/internal/relay"
	"github.com/pgidem/idem/internal/rpcidem"
	"github.com/pgidem/idem/internal/testlog"
)

// errorInfo returns the reason of err's ErrorInfo detail, or "".
func errorInfo(err error) string {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return ""
	}
	for _, d := range ce.Details() {
		if v, err := d.Value(); err == nil {
			if info, ok := v.(*errdetails.ErrorInfo); ok {
				if info.Domain != idemconnect.ErrorDomain {
					return "wrong domain " + info.Domain
				}
				return info.Reason
			}
		}
	}
	return ""
}

// retryDelay returns the delay of err's RetryInfo detail, or -1.
func retryDelay(err error) time.Duration {
	var ce *connect.Error
	if errors.As(err, &ce) {
		for _, d := range ce.Details() {
			if v, err := d.Value(); err == nil {
				if info, ok := v.(*errdetails.RetryInfo); ok {
					return info.RetryDelay.AsDuration()
				}
			}
		}
	}
	return -1
}

// A retry gets the first reply's bytes, the stored headers and trailers
// and Idempotent-Replayed: true, over the Connect and the gRPC protocols;
// a retry in JSON gets the same message. The handler ran once.
func TestReplaySameBytes(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	url, hc := serve(t, pool, idemconnect.Options{StoredHeaders: []string{"X-Order"}, StoredTrailers: []string{"x-trace-bin"}},
		func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
			resp, err := insert(ctx, req)
			if err == nil {
				resp.Header().Set("X-Order", "42")
				resp.Header().Set("X-Other", "not stored")
				resp.Trailer().Set("X-Trace-Bin", connect.EncodeBinaryHeader([]byte{0, 0xff, '\n'}))
			}
			return resp, err
		})

	first := call(ctx, url, hc, "alice", key("order-0001"), request("coffee", 3))
	if first.err != nil {
		t.Fatal(first.err)
	}
	if first.replayed() || first.decode(t).ResourceName != "transfers/1" || first.header.Get("X-Other") == "" {
		t.Fatalf("first call: replayed %v, reply %v, header %v", first.replayed(), first.decode(t), first.header)
	}
	for _, protocol := range []struct {
		name string
		opts []connect.ClientOption
	}{{"connect", nil}, {"grpc", []connect.ClientOption{connect.WithGRPC()}}, {"grpc-web", []connect.ClientOption{connect.WithGRPCWeb()}}} {
		again := call(ctx, url, hc, "alice", key("order-0001"), request("coffee", 3), protocol.opts...)
		if again.err != nil {
			t.Fatalf("%s: %v", protocol.name, again.err)
		}
		if !again.replayed() || !bytes.Equal(again.body, first.body) {
			t.Errorf("%s retry: replayed %v, body %x; first body %x", protocol.name, again.replayed(), again.body, first.body)
		}
		if again.header.Get("X-Order") != "42" || again.header.Get("X-Other") != "" {
			t.Errorf("%s retry: header %v", protocol.name, again.header)
		}
		if b, err := connect.DecodeBinaryHeader(again.trailer.Get("X-Trace-Bin")); err != nil || !bytes.Equal(b, []byte{0, 0xff, '\n'}) {
			t.Errorf("%s retry: trailer %v", protocol.name, again.trailer)
		}
	}

	// A retry in JSON: the same message.
	jsonClient := connect.NewClient[dynamicpb.Message, errdetails.ResourceInfo](hc, url+transferProcedure, connect.WithProtoJSON())
	req := connect.NewRequest(request("coffee", 3))
	req.Header().Set("User", "alice")
	req.Header().Set(idemconnect.HeaderKey, "order-0001")
	resp, err := jsonClient.CallUnary(ctx, req)
	if err != nil || resp.Header().Get(idemconnect.HeaderReplayed) != "true" || !proto.Equal(resp.Msg, first.decode(t)) {
		t.Errorf("JSON retry: %v, %v", err, resp)
	}
	if runs.Load() != 1 || countRows(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), countRows(t, pool))
	}
}

// 16 concurrent calls with one key on two servers: the handler runs once,
// and every call that succeeds gets the same bytes.
func TestDuplicateStorm(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	slow := func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
		time.Sleep(20 * time.Millisecond)
		return insert(ctx, req)
	}
	url1, hc1 := serve(t, pool, idemconnect.Options{}, slow)
	url2, hc2 := serve(t, pool, idemconnect.Options{}, slow)

	const n = 16
	answers := make([]answer, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			url, hc := url1, hc1
			if i%2 == 1 {
				url, hc = url2, hc2
			}
			answers[i] = call(ctx, url, hc, "alice", key("storm-1"), request("storm", 16))
		})
	}
	close(start)
	wg.Wait()
	var ok, firsts, aborted int
	var body []byte
	for _, a := range answers {
		switch {
		case a.err == nil:
			ok++
			if !a.replayed() {
				firsts++
			}
			if body == nil {
				body = a.body
			} else if !bytes.Equal(a.body, body) {
				t.Errorf("bodies differ: %x, %x", a.body, body)
			}
		case connect.CodeOf(a.err) == connect.CodeAborted && errorInfo(a.err) == idemconnect.ReasonInProgress && retryDelay(a.err) > 0:
			aborted++
		default:
			t.Errorf("unexpected answer: %v", a.err)
		}
	}
	t.Logf("%d calls: %d OK (%d first), %d aborted", n, ok, firsts, aborted)
	if runs.Load() != 1 || countRows(t, pool) != 1 || firsts != 1 {
		t.Errorf("%d runs, %d rows, %d first answers; want 1 each", runs.Load(), countRows(t, pool), firsts)
	}
}

// A refusal code is stored with its message, details and metadata and
// replayed; the handler's writes are undone. Another error stores nothing.
func TestRefusalUndoesWrites(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	url, hc := serve(t, pool, idemconnect.Options{StoredHeaders: []string{"X-Reason"}},
		func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
			if _, err := insert(ctx, req); err != nil {
				return nil, err
			}
			if getInt(req.Msg, "amount") > 100 {
				ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("insufficient funds"))
				d, _ := connect.NewErrorDetail(&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
					{Type: "BALANCE", Subject: "account/1", Description: "balance 100"}}})
				ce.AddDetail(d)
				ce.Meta().Set("X-Reason", "funds")
				return nil, ce
			}
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("the ledger is busy"))
		})

	first := call(ctx, url, hc, "alice", key("refuse-1"), request("big", 500))
	if connect.CodeOf(first.err) != connect.CodeFailedPrecondition || first.replayed() {
		t.Fatalf("first: %v (replayed %v)", first.err, first.replayed())
	}
	for _, opts := range [][]connect.ClientOption{nil, {connect.WithGRPC()}} {
		again := call(ctx, url, hc, "alice", key("refuse-1"), request("big", 500), opts...)
		var ce, firstCE *connect.Error
		if !errors.As(again.err, &ce) || !errors.As(first.err, &firstCE) || !again.replayed() ||
			ce.Code() != firstCE.Code() || ce.Message() != firstCE.Message() || len(ce.Details()) != 1 ||
			!bytes.Equal(ce.Details()[0].Bytes(), firstCE.Details()[0].Bytes()) || ce.Details()[0].Type() != firstCE.Details()[0].Type() {
			t.Errorf("retry: %v (replayed %v); first %v", again.err, again.replayed(), first.err)
		}
		if again.header.Get("X-Reason") != "funds" {
			t.Errorf("retry: meta %v", again.header)
		}
	}
	if runs.Load() != 1 || countRows(t, pool) != 0 {
		t.Errorf("refusal: %d runs, %d rows; want 1, 0", runs.Load(), countRows(t, pool))
	}

	// unavailable from the handler is not a refusal: nothing is stored, the
	// retry runs again.
	for i := range 2 {
		a := call(ctx, url, hc, "alice", key("busy-1"), request("small", 5))
		var ce *connect.Error
		if !errors.As(a.err, &ce) || ce.Code() != connect.CodeUnavailable || ce.Message() != "the ledger is busy" || a.replayed() {
			t.Errorf("call %d: %v (replayed %v)", i, a.err, a.replayed())
		}
	}
	if runs.Load() != 3 || countRows(t, pool) != 0 {
		t.Errorf("after busy: %d runs, %d rows; want 3, 0", runs.Load(), countRows(t, pool))
	}
}

// The same key with a different request is refused with
// failed_precondition and nothing runs.
func TestKeyReused(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	url, hc := serve(t, pool, idemconnect.Options{}, insertHandler(&runs))
	if a := call(ctx, url, hc, "alice", key("reuse-1"), request("a", 1)); a.err != nil {
		t.Fatal(a.err)
	}
	a := call(ctx, url, hc, "alice", key("reuse-1"), request("a", 2))
	if connect.CodeOf(a.err) != connect.CodeFailedPrecondition || errorInfo(a.err) != idemconnect.ReasonKeyReused {
		t.Errorf("reused key: %v (%s)", a.err, errorInfo(a.err))
	}
	if runs.Load() != 1 || countRows(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), countRows(t, pool))
	}
}

// A call without a key runs as usual, outside a transaction, every time;
// with RequireKey it is refused.
func TestNoKey(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	url, hc := serve(t, pool, idemconnect.Options{}, insertHandler(&runs))
	for range 2 {
		a := call(ctx, url, hc, "alice", nil, request("n", 1))
		if a.err != nil || a.replayed() || a.decode(t).Description != "no transaction" {
			t.Errorf("no key: %v, replayed %v", a.err, a.replayed())
		}
	}
	required, rhc := serve(t, pool, idemconnect.Options{RequireKey: true}, insertHandler(&runs))
	a := call(ctx, required, rhc, "alice", nil, request("n", 1))
	if connect.CodeOf(a.err) != connect.CodeInvalidArgument || errorInfo(a.err) != idemconnect.ReasonKeyMissing {
		t.Errorf("required key missing: %v (%s)", a.err, errorInfo(a.err))
	}
	other, ohc := serve(t, pool, idemconnect.Options{RequireKey: true, Procedures: []string{"/idemtest.v1.Ledger/Other"}}, insertHandler(&runs))
	if a := call(ctx, other, ohc, "alice", nil, request("n", 1)); a.err != nil {
		t.Errorf("uncovered procedure: %v", a.err)
	}
	if runs.Load() != 3 || countRows(t, pool) != 0 {
		t.Errorf("%d runs, %d rows; want 3, 0", runs.Load(), countRows(t, pool))
	}
}

// Malformed and invalid keys are invalid_argument; nothing runs and nothing
// is stored. Both forms of the header are accepted.
func TestBadKeys(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	url, hc := serve(t, pool, idemconnect.Options{}, insertHandler(&runs))
	for _, keys := range [][]string{
		{"has space"},
		{strings.Repeat("k", 256)},
		{`"unterminated`},
		{`"a" junk`},
		{"a,b"},
		{"k1", "k2"},
		{""},
		{"caf\u00e9"},
	} {
		a := call(ctx, url, hc, "alice", keys, request("x", 1))
		if connect.CodeOf(a.err) != connect.CodeInvalidArgument || errorInfo(a.err) != idemconnect.ReasonKeyInvalid {
			t.Errorf("key %q: %v (%s)", keys, a.err, errorInfo(a.err))
		}
	}
	if runs.Load() != 0 {
		t.Errorf("%d runs; want 0", runs.Load())
	}
	var stored int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys`).Scan(&stored); err != nil || stored != 0 {
		t.Errorf("%d keys stored (%v)", stored, err)
	}
	if a := call(ctx, url, hc, "alice", key(`"same-key";v=1`), request("x", 1)); a.err != nil || a.replayed() {
		t.Fatalf("quoted: %v", a.err)
	}
	if a := call(ctx, url, hc, "alice", key("same-key"), request("x", 1)); a.err != nil || !a.replayed() {
		t.Errorf("bare: %v, replayed %v", a.err, a.replayed())
	}
}

// AIP-155: the key can come from the request's request_id field.
func TestKeyField(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	url, hc := serve(t, pool, idemconnect.Options{KeyField: "request_id", RequireKey: true}, insertHandler(&runs))
	withID := func(id string) *dynamicpb.Message {
		m := request("aip", 7)
		m.Set(requestDesc.Fields().ByName("request_id"), protoreflect.ValueOfString(id))
		return m
	}
	const id = "9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60"
	first := call(ctx, url, hc, "alice", nil, withID(id))
	again := call(ctx, url, hc, "alice", nil, withID(id))
	if first.err != nil || again.err != nil || !again.replayed() || !bytes.Equal(first.body, again.body) {
		t.Errorf("request_id: %v, %v, replayed %v", first.err, again.err, again.replayed())
	}
	if a := call(ctx, url, hc, "alice", key(id), withID(id)); a.err != nil || !a.replayed() {
		t.Errorf("both, equal: %v", a.err)
	}
	if a := call(ctx, url, hc, "alice", key("other"), withID(id)); connect.CodeOf(a.err) != connect.CodeInvalidArgument {
		t.Errorf("both, different: %v", a.err)
	}
	if runs.Load() != 1 || countRows(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), countRows(t, pool))
	}
}

// A call that arrives while another holds its key, and waits longer than
// Config.Wait, gets aborted with RetryInfo.
func TestInProgress(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
		r, err := insert(ctx, req)
		once.Do(func() { close(entered); <-release })
		return r, err
	}
	opts := idemconnect.Options{Config: idem.Config{Wait: 50 * time.Millisecond}}
	url1, hc1 := serve(t, pool, opts, h)
	url2, hc2 := serve(t, pool, opts, h)
	done := make(chan answer)
	go func() { done <- call(ctx, url1, hc1, "alice", key("slow-1"), request("slow", 1)) }()
	<-entered
	a := call(ctx, url2, hc2, "alice", key("slow-1"), request("slow", 1))
	close(release)
	if connect.CodeOf(a.err) != connect.CodeAborted || errorInfo(a.err) != idemconnect.ReasonInProgress || retryDelay(a.err) <= 0 {
		t.Errorf("duplicate in flight: %v (%s, retry after %v)", a.err, errorInfo(a.err), retryDelay(a.err))
	}
	if f := <-done; f.err != nil {
		t.Fatal(f.err)
	}
	if a := call(ctx, url2, hc2, "alice", key("slow-1"), request("slow", 1)); a.err != nil || !a.replayed() {
		t.Errorf("after: %v", a.err)
	}
}

// A key held by a reservation whose outcome is unknown is
// failed_precondition, IDEMPOTENCY_OUTCOME_UNKNOWN.
func TestOutcomeUnknown(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	url, hc := serve(t, pool, idemconnect.Options{}, insertHandler(&runs))
	req := request("x", 1)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	fp := rpcidem.Fingerprint(transferProcedure, b) // what the interceptor computes
	r, err := idem.Reserve(ctx, pool, idem.Scope{Actor: "alice", Operation: transferProcedure}, "pay-1", fp, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "gateway timed out"); err != nil {
		t.Fatal(err)
	}
	a := call(ctx, url, hc, "alice", key("pay-1"), req)
	if connect.CodeOf(a.err) != connect.CodeFailedPrecondition || errorInfo(a.err) != idemconnect.ReasonOutcomeUnknown || runs.Load() != 0 {
		t.Errorf("unknown outcome: %v (%s), %d runs", a.err, errorInfo(a.err), runs.Load())
	}
}

// A COMMIT whose acknowledgement is lost: the call gets unavailable, the
// retry with the same key replays what committed, and the handler ran once.
// A store that cannot be reached is unavailable before the handler runs.
func TestLostCommitAcknowledgement(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := pgtest.URL(t, migrate)
	target, err := relay.Target(url)
	if err != nil {
		t.Fatal(err)
	}
	var cut atomic.Bool
	cut.Store(true)
	rl, err := relay.Start(target, relay.Options{DropAfterCommit: func() bool { return cut.CompareAndSwap(true, false) }})
	if err != nil {
		t.Fatal(err)
	}
	defer rl.Close()
	relayed, err := rl.ConnString(url)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, relayed)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var runs atomic.Int64
	var logs testlog.Buffer
	srv, hc := serve(t, pool, idemconnect.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, insertHandler(&runs))

	first := call(ctx, srv, hc, "alice", key("lost-1"), request("lost", 9))
	if connect.CodeOf(first.err) != connect.CodeUnavailable || errorInfo(first.err) != idemconnect.ReasonStoreUnavailable || retryDelay(first.err) <= 0 {
		t.Fatalf("lost acknowledgement: %v (%s); commits cut %d", first.err, errorInfo(first.err), rl.CommitsCut())
	}
	again := call(ctx, srv, hc, "alice", key("lost-1"), request("lost", 9))
	if again.err != nil || !again.replayed() || again.decode(t).ResourceName != "transfers/1" {
		t.Errorf("retry: %v, replayed %v", again.err, again.replayed())
	}
	if runs.Load() != 1 || rl.CommitsCut() != 1 {
		t.Errorf("%d runs, %d commits cut; want 1, 1", runs.Load(), rl.CommitsCut())
	}

	_ = rl.Close()
	pool.Reset()
	down := call(ctx, srv, hc, "alice", key("down-1"), request("down", 1))
	if connect.CodeOf(down.err) != connect.CodeUnavailable || errorInfo(down.err) != idemconnect.ReasonStoreUnavailable || runs.Load() != 1 {
		t.Errorf("store down: %v (%s), %d runs", down.err, errorInfo(down.err), runs.Load())
	}
	if out := logs.String(); strings.Count(out, `msg="idemconnect: store unavailable"`) != 2 || !strings.Contains(out, "key_hash=") ||
		strings.Contains(out, "lost-1") || strings.Contains(out, "down-1") {
		t.Errorf("logs:\n%s", out)
	}
}

// The stored form, which idemgrpc shares (a key used through one replays
// through the other): a reply is status 200 and the reply's deterministic
// bytes, the chosen headers under their lower-case names and trailers under
// "trailer~", binary values base64; a refusal is the HTTP status of its code
// and a google.rpc.Status.
func TestStoredForm(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	url, hc := serve(t, pool, idemconnect.Options{StoredHeaders: []string{"X-Order"}, StoredTrailers: []string{"x-trace-bin"}},
		func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
			if getInt(req.Msg, "amount") > 100 {
				return nil, connect.NewError(connect.CodeOutOfRange, errors.New("too much"))
			}
			resp, err := insert(ctx, req)
			if err == nil {
				resp.Header().Set("X-Order", "42")
				resp.Trailer().Set("X-Trace-Bin", "AP8K")
			}
			return resp, err
		})
	scope := idem.Scope{Actor: "alice", Operation: transferProcedure}
	if a := call(ctx, url, hc, "alice", key("form-1"), request("f", 1)); a.err != nil {
		t.Fatal(a.err)
	}
	rec, err := idem.Lookup(ctx, pool, scope, "form-1")
	if err != nil {
		t.Fatal(err)
	}
	want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(reply(1, "f"))
	if rec.Response.Status != 200 || !bytes.Equal(rec.Response.Body, want) ||
		!reflect.DeepEqual(rec.Response.Header, map[string][]string{"x-order": {"42"}, "trailer~x-trace-bin": {"AP8K"}}) {
		t.Errorf("stored reply: %d %x %v", rec.Response.Status, rec.Response.Body, rec.Response.Header)
	}
	if a := call(ctx, url, hc, "alice", key("form-2"), request("f", 500)); connect.CodeOf(a.err) != connect.CodeOutOfRange {
		t.Fatal(a.err)
	}
	if rec, err = idem.Lookup(ctx, pool, scope, "form-2"); err != nil {
		t.Fatal(err)
	}
	var st spb.Status
	if rec.Response.Status != 400 || proto.Unmarshal(rec.Response.Body, &st) != nil || st.Code != int32(connect.CodeOutOfRange) || st.Message != "too much" {
		t.Errorf("stored refusal: %d %v", rec.Response.Status, &st)
	}
}

// A serialization failure in the handler's own statement runs it again in a
// new transaction; the client gets the second run's reply.
func TestHandlerSerializationFailureRunsAgain(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	url, hc := serve(t, pool, idemconnect.Options{}, func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
		if runs.Load() == 0 {
			runs.Add(1)
			_, err := idemconnect.Tx(ctx).Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END $$`)
			return nil, connect.NewError(connect.CodeInternal, errors.New(err.Error())) // the handler hides the cause
		}
		return insert(ctx, req)
	})
	a := call(ctx, url, hc, "alice", key("ser-1"), request("s", 1))
	if a.err != nil || runs.Load() != 2 || countRows(t, pool) != 1 {
		t.Errorf("%v, %d runs, %d rows", a.err, runs.Load(), countRows(t, pool))
	}
}

// Scope failures: no actor is unauthenticated, a *connect.Error passes
// through, and nothing runs.
func TestScopeErrors(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	url, hc := serve(t, pool, idemconnect.Options{}, insertHandler(&runs))
	if a := call(ctx, url, hc, "", key("k"), request("x", 1)); connect.CodeOf(a.err) != connect.CodeUnauthenticated {
		t.Errorf("no user: %v", a.err)
	}
	denied, dhc := serve(t, pool, idemconnect.Options{Scope: func(context.Context, string) (idem.Scope, error) {
		return idem.Scope{}, connect.NewError(connect.CodePermissionDenied, errors.New("not yours"))
	}}, insertHandler(&runs))
	if a := call(ctx, denied, dhc, "alice", key("k"), request("x", 1)); connect.CodeOf(a.err) != connect.CodePermissionDenied {
		t.Errorf("denied: %v", a.err)
	}
	if runs.Load() != 0 {
		t.Errorf("%d runs", runs.Load())
	}
}

// NewInterceptor refuses invalid options at start-up.
func TestInvalidOptionsPanic(t *testing.T) {
	for name, opts := range map[string]idemconnect.Options{
		"no scope":          {},
		"bad field":         {Scope: scopeFromHeader, KeyField: "request-id"},
		"non-token header":  {Scope: scopeFromHeader, StoredHeaders: []string{"x@id"}},
		"non-token trailer": {Scope: scopeFromHeader, StoredTrailers: []string{"x id"}},
		"bad header":        {Scope: scopeFromHeader, StoredHeaders: []string{""}},
		"bad config":        {Scope: scopeFromHeader, Config: idem.Config{TTL: -time.Hour}},
		"connect header":    {Scope: scopeFromHeader, StoredTrailers: []string{"Connect-Timeout-Ms"}},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			idemconnect.NewInterceptor(&pgxpool.Pool{}, opts)
		}()
	}
	defer func() {
		if recover() == nil {
			t.Error("nil db: no panic")
		}
	}()
	idemconnect.NewInterceptor(nil, idemconnect.Options{Scope: scopeFromHeader})
}

// A typed nil *pgxpool.Pool is refused at start-up too, not call by call.
func TestTypedNilPoolPanics(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "nil database handle") {
			t.Errorf("recovered %v, want a nil database handle panic", r)
		}
	}()
	var pool *pgxpool.Pool
	idemconnect.NewInterceptor(pool, idemconnect.Options{Scope: scopeFromHeader})
}

// A run of the handler that is rolled back (a serialization failure) leaves
// nothing it set through connect.CallInfoForHandlerContext: the first call
// and its replay get the headers and trailers of the run that committed
// only, and those an interceptor before this one set.
func TestRolledBackRunHeadersDropped(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	outer := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
				info.ResponseHeader().Set("X-Outer", "kept")
			}
			return next(ctx, req)
		}
	})
	url, hc := serveWith(t, pool, idemconnect.Options{StoredHeaders: []string{"X-Run"}, StoredTrailers: []string{"X-Run-Trailer"}},
		[]connect.Interceptor{outer},
		func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
			info, _ := connect.CallInfoForHandlerContext(ctx)
			if runs.Load() == 0 {
				runs.Add(1)
				info.ResponseHeader().Add("X-Run", "first-rolled-back")
				info.ResponseTrailer().Add("X-Run-Trailer", "first-rolled-back")
				_, err := idemconnect.Tx(ctx).Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END $$`)
				return nil, err
			}
			info.ResponseHeader().Add("X-Run", "second")
			info.ResponseTrailer().Add("X-Run-Trailer", "second")
			return insert(ctx, req)
		})
	for _, name := range []string{"first call", "replay"} {
		a := call(ctx, url, hc, "alice", key("rerun-1"), request("r", 1))
		if a.err != nil {
			t.Fatalf("%s: %v", name, a.err)
		}
		if got := a.header.Values("X-Run"); !reflect.DeepEqual(got, []string{"second"}) {
			t.Errorf("%s: X-Run %q, want [second]", name, got)
		}
		if got := a.trailer.Values("X-Run-Trailer"); !reflect.DeepEqual(got, []string{"second"}) {
			t.Errorf("%s: X-Run-Trailer %q, want [second]", name, got)
		}
		if got := a.header.Values("X-Outer"); !reflect.DeepEqual(got, []string{"kept"}) {
			t.Errorf("%s: X-Outer %q, want [kept]", name, got)
		}
		if a.replayed() != (name == "replay") {
			t.Errorf("%s: replayed %v", name, a.replayed())
		}
	}
	if runs.Load() != 2 || countRows(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 2, 1", runs.Load(), countRows(t, pool))
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
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	inFirst := make(chan struct{})
	// Two servers, as two processes: a duplicate on the same one would
	// wait for the first call in the process, not for the key's row lock.
	h := func(ctx context.Context, req *connect.Request[dynamicpb.Message]) (*connect.Response[errdetails.ResourceInfo], error) {
		info, _ := connect.CallInfoForHandlerContext(ctx)
		n := runs.Add(1)
		if n == 1 {
			info.ResponseHeader().Add("X-Run", "first-rolled-back")
			close(inFirst)
			// Until the duplicate waits for the key's row lock (at most 20 s).
			for waiting, start := 0, time.Now(); waiting == 0 && time.Since(start) < 20*time.Second; time.Sleep(10 * time.Millisecond) {
				if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
						WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
					return nil, err
				}
			}
			_, err := idemconnect.Tx(ctx).Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END $$`)
			return nil, err
		}
		info.ResponseHeader().Add("X-Run", fmt.Sprint("run-", n))
		var id int64
		if err := idemconnect.Tx(ctx).QueryRow(ctx, `INSERT INTO transfers (note, amount) VALUES ('d', 1) RETURNING id`).Scan(&id); err != nil {
			return nil, err
		}
		return connect.NewResponse(reply(id, "d")), nil
	}
	opts := idemconnect.Options{StoredHeaders: []string{"X-Run"}, Config: idem.Config{Wait: 30 * time.Second}}
	url, hc := serve(t, pool, opts, h)
	url2, hc2 := serve(t, pool, opts, h)
	var first answer
	done := make(chan struct{})
	go func() {
		defer close(done)
		first = call(ctx, url, hc, "alice", key("dup-1"), request("d", 1))
	}()
	select {
	case <-inFirst:
	case <-done:
		t.Fatalf("first call: %v", first.err)
	}
	dup := call(ctx, url2, hc2, "alice", key("dup-1"), request("d", 1))
	<-done
	for name, a := range map[string]answer{"first call": first, "duplicate": dup} {
		if a.err != nil {
			t.Fatalf("%s: %v", name, a.err)
		}
		if got := a.header.Values("X-Run"); !reflect.DeepEqual(got, []string{"run-2"}) {
			t.Errorf("%s: X-Run %q, want [run-2]", name, got)
		}
	}
	if first.replayed() == dup.replayed() {
		t.Errorf("replayed: first call %v, duplicate %v; want exactly one", first.replayed(), dup.replayed())
	}
	if runs.Load() != 2 || countRows(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 2, 1", runs.Load(), countRows(t, pool))
	}
}
