package idemgrpc_test

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

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/internal/pgtest"
	"github.com/pgidem/idem/internal/relay"
	"github.com/pgidem/idem/internal/rpcidem"
	"github.com/pgidem/idem/internal/testlog"
)

// errorInfo returns the reason of err's ErrorInfo detail, or "".
func errorInfo(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			if info.Domain != idemgrpc.ErrorDomain {
				return "wrong domain " + info.Domain
			}
			return info.Reason
		}
	}
	return ""
}

// retryDelay returns the delay of err's RetryInfo detail, or -1.
func retryDelay(err error) time.Duration {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.RetryInfo); ok {
			return info.RetryDelay.AsDuration()
		}
	}
	return -1
}

// A retry gets the first reply's bytes, the stored headers and trailers
// (a binary one too) and idempotent-replayed: true; the handler ran once.
func TestReplaySameBytes(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	conn := serve(t, pool, idemgrpc.Options{StoredHeaders: []string{"x-order"}, StoredTrailers: []string{"x-trace-bin"}},
		func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
			r, err := insert(ctx, req)
			if err == nil {
				_ = grpc.SetHeader(ctx, metadata.Pairs("x-order", "42", "x-other", "not stored"))
				_ = grpc.SetTrailer(ctx, metadata.Pairs("x-trace-bin", "\x00\xff\n"))
			}
			return r, err
		})

	first := call(ctx, conn, "alice", "order-0001", request("coffee", 3))
	if first.err != nil {
		t.Fatal(first.err)
	}
	if first.replayed() || first.decode(t).ResourceName != "transfers/1" {
		t.Fatalf("first call: replayed %v, reply %v", first.replayed(), first.decode(t))
	}
	if got := first.header.Get("x-other"); len(got) != 1 {
		t.Errorf("first call: the handler's own header x-other = %q", got)
	}
	for range 2 {
		again := call(ctx, conn, "alice", "order-0001", request("coffee", 3))
		if again.err != nil {
			t.Fatal(again.err)
		}
		if !again.replayed() || !bytes.Equal(again.body, first.body) {
			t.Errorf("retry: replayed %v, body %x; first body %x", again.replayed(), again.body, first.body)
		}
		if got := again.header.Get("x-order"); len(got) != 1 || got[0] != "42" {
			t.Errorf("retry: x-order = %q", got)
		}
		if got := again.header.Get("x-other"); len(got) != 0 {
			t.Errorf("retry: x-other = %q, not a stored header", got)
		}
		if got := again.trailer.Get("x-trace-bin"); len(got) != 1 || got[0] != "\x00\xff\n" {
			t.Errorf("retry: x-trace-bin = %q", got)
		}
	}
	if runs.Load() != 1 || countRows(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), countRows(t, pool))
	}

	// Another actor's key is another key.
	if bob := call(ctx, conn, "bob", "order-0001", request("coffee", 3)); bob.err != nil || bob.replayed() {
		t.Errorf("bob: %v, replayed %v", bob.err, bob.replayed())
	}
}

// 16 concurrent calls with one key: the handler runs once, and every call
// that succeeds gets the same bytes.
func TestDuplicateStorm(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	// Two servers on one database, each with its own interceptor: some
	// duplicates meet in-process, the others at the primary key.
	slow := func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
		time.Sleep(20 * time.Millisecond)
		return insert(ctx, req)
	}
	conns := []*grpc.ClientConn{serve(t, pool, idemgrpc.Options{}, slow), serve(t, pool, idemgrpc.Options{}, slow)}

	const n = 16
	answers := make([]answer, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			answers[i] = call(ctx, conns[i%2], "alice", "storm-1", request("storm", 16))
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
		case status.Code(a.err) == codes.Aborted && errorInfo(a.err) == idemgrpc.ReasonInProgress && retryDelay(a.err) > 0:
			aborted++
		default:
			t.Errorf("unexpected answer: %v", a.err)
		}
	}
	t.Logf("%d calls: %d OK (%d first), %d ABORTED", n, ok, firsts, aborted)
	if runs.Load() != 1 || countRows(t, pool) != 1 || firsts != 1 {
		t.Errorf("%d runs, %d rows, %d first answers; want 1 each", runs.Load(), countRows(t, pool), firsts)
	}
}

// A refusal code is stored with its message and details and replayed; the
// handler's writes are undone. Another error stores nothing.
func TestRefusalUndoesWrites(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	conn := serve(t, pool, idemgrpc.Options{StoredHeaders: []string{"x-reason"}},
		func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
			if _, err := insert(ctx, req); err != nil {
				return nil, err
			}
			if getInt(req, "amount") > 100 {
				_ = grpc.SetHeader(ctx, metadata.Pairs("x-reason", "funds"))
				st, _ := status.New(codes.FailedPrecondition, "insufficient funds").WithDetails(
					&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
						{Type: "BALANCE", Subject: "account/1", Description: "balance 100"}}})
				return nil, st.Err()
			}
			return nil, status.Error(codes.Unavailable, "the ledger is busy")
		})

	first := call(ctx, conn, "alice", "refuse-1", request("big", 500))
	if status.Code(first.err) != codes.FailedPrecondition || first.replayed() {
		t.Fatalf("first: %v (replayed %v)", first.err, first.replayed())
	}
	for range 2 {
		again := call(ctx, conn, "alice", "refuse-1", request("big", 500))
		if !again.replayed() || !proto.Equal(status.Convert(again.err).Proto(), status.Convert(first.err).Proto()) {
			t.Errorf("retry: %v (replayed %v); first %v", again.err, again.replayed(), first.err)
		}
		if got := again.header.Get("x-reason"); len(got) != 1 || got[0] != "funds" {
			t.Errorf("retry: x-reason = %q", got)
		}
	}
	if runs.Load() != 1 || countRows(t, pool) != 0 {
		t.Errorf("refusal: %d runs, %d rows; want 1, 0", runs.Load(), countRows(t, pool))
	}

	// UNAVAILABLE from the handler is not a refusal: nothing is stored, the
	// retry runs again.
	for i := range 2 {
		a := call(ctx, conn, "alice", "busy-1", request("small", 5))
		if status.Code(a.err) != codes.Unavailable || status.Convert(a.err).Message() != "the ledger is busy" || a.replayed() {
			t.Errorf("call %d: %v (replayed %v)", i, a.err, a.replayed())
		}
	}
	if runs.Load() != 3 || countRows(t, pool) != 0 {
		t.Errorf("after busy: %d runs, %d rows; want 3, 0", runs.Load(), countRows(t, pool))
	}
}

// Configured refusal codes replace the default ones.
func TestRefusalCodesConfigured(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	conn := serve(t, pool, idemgrpc.Options{RefusalCodes: []codes.Code{codes.AlreadyExists}},
		func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
			runs.Add(1)
			if getString(req, "note") == "dup" {
				return nil, status.Error(codes.AlreadyExists, "exists")
			}
			return nil, status.Error(codes.NotFound, "no account")
		})
	for range 2 {
		if a := call(ctx, conn, "alice", "k-dup", request("dup", 1)); status.Code(a.err) != codes.AlreadyExists {
			t.Errorf("dup: %v", a.err)
		}
		if a := call(ctx, conn, "alice", "k-nf", request("nf", 1)); status.Code(a.err) != codes.NotFound || a.replayed() {
			t.Errorf("not found: %v, replayed %v", a.err, a.replayed())
		}
	}
	if runs.Load() != 3 { // dup once, not found twice
		t.Errorf("%d runs; want 3", runs.Load())
	}
}

// The same key with a different request is refused with
// FAILED_PRECONDITION and nothing runs.
func TestKeyReused(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	conn := serve(t, pool, idemgrpc.Options{}, insertHandler(&runs))
	if a := call(ctx, conn, "alice", "reuse-1", request("a", 1)); a.err != nil {
		t.Fatal(a.err)
	}
	a := call(ctx, conn, "alice", "reuse-1", request("a", 2))
	if status.Code(a.err) != codes.FailedPrecondition || errorInfo(a.err) != idemgrpc.ReasonKeyReused {
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
	conn := serve(t, pool, idemgrpc.Options{}, insertHandler(&runs))
	for range 2 {
		a := call(ctx, conn, "alice", "", request("n", 1))
		if a.err != nil || a.replayed() || a.decode(t).Description != "no transaction" {
			t.Errorf("no key: %v, replayed %v", a.err, a.replayed())
		}
	}
	if runs.Load() != 2 {
		t.Errorf("%d runs; want 2", runs.Load())
	}

	required := serve(t, pool, idemgrpc.Options{RequireKey: true}, insertHandler(&runs))
	a := call(ctx, required, "alice", "", request("n", 1))
	if status.Code(a.err) != codes.InvalidArgument || errorInfo(a.err) != idemgrpc.ReasonKeyMissing {
		t.Errorf("required key missing: %v (%s)", a.err, errorInfo(a.err))
	}
	// A method the interceptor does not cover runs without a key.
	other := serve(t, pool, idemgrpc.Options{RequireKey: true, Methods: []string{"/idemtest.v1.Ledger/Other"}}, insertHandler(&runs))
	if a := call(ctx, other, "alice", "", request("n", 1)); a.err != nil {
		t.Errorf("uncovered method: %v", a.err)
	}
	if runs.Load() != 3 || countRows(t, pool) != 0 {
		t.Errorf("%d runs, %d rows; want 3, 0", runs.Load(), countRows(t, pool))
	}
}

// Malformed and invalid keys are INVALID_ARGUMENT; nothing runs and nothing
// is stored. Both forms of the HTTP header are accepted.
func TestBadKeys(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	conn := serve(t, pool, idemgrpc.Options{}, insertHandler(&runs))
	bad := [][]string{
		{"has space"},
		{strings.Repeat("k", 256)},
		{`"unterminated`},
		{`"a" junk`},
		{"a,b"},
		{"k1", "k2"},
		{" "},
	}
	for _, values := range bad {
		md := metadata.Pairs("user", "alice")
		md.Append(idemgrpc.MetadataKey, values...)
		a := callMD(ctx, conn, md, request("x", 1))
		if status.Code(a.err) != codes.InvalidArgument || errorInfo(a.err) != idemgrpc.ReasonKeyInvalid {
			t.Errorf("key %q: %v (%s)", values, a.err, errorInfo(a.err))
		}
	}
	if runs.Load() != 0 {
		t.Errorf("%d runs; want 0", runs.Load())
	}
	var stored int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys`).Scan(&stored); err != nil || stored != 0 {
		t.Errorf("%d keys stored (%v)", stored, err)
	}
	// An RFC 8941 string and a bare key name the same key.
	if a := call(ctx, conn, "alice", `"same-key";v=1`, request("x", 1)); a.err != nil || a.replayed() {
		t.Fatalf("quoted: %v", a.err)
	}
	if a := call(ctx, conn, "alice", "same-key", request("x", 1)); a.err != nil || !a.replayed() {
		t.Errorf("bare: %v, replayed %v", a.err, a.replayed())
	}
}

// AIP-155: the key can come from the request's request_id field.
func TestKeyField(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	conn := serve(t, pool, idemgrpc.Options{KeyField: "request_id", RequireKey: true}, insertHandler(&runs))
	withID := func(id string) *dynamicpb.Message {
		m := request("aip", 7)
		m.Set(requestDesc.Fields().ByName("request_id"), protoreflect.ValueOfString(id))
		return m
	}
	first := call(ctx, conn, "alice", "", withID("9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60"))
	again := call(ctx, conn, "alice", "", withID("9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60"))
	if first.err != nil || again.err != nil || !again.replayed() || !bytes.Equal(first.body, again.body) {
		t.Errorf("request_id: %v, %v, replayed %v", first.err, again.err, again.replayed())
	}
	// The same key in the metadata too is fine; a different one is not.
	if a := call(ctx, conn, "alice", "9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60", withID("9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60")); a.err != nil || !a.replayed() {
		t.Errorf("both, equal: %v", a.err)
	}
	if a := call(ctx, conn, "alice", "other", withID("9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60")); status.Code(a.err) != codes.InvalidArgument {
		t.Errorf("both, different: %v", a.err)
	}
	if a := call(ctx, conn, "alice", "", withID("not valid")); status.Code(a.err) != codes.InvalidArgument || errorInfo(a.err) != idemgrpc.ReasonKeyInvalid {
		t.Errorf("invalid request_id: %v", a.err)
	}
	if runs.Load() != 1 || countRows(t, pool) != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), countRows(t, pool))
	}
}

// A call that arrives while another holds its key, and waits longer than
// Config.Wait, gets ABORTED with RetryInfo.
func TestInProgress(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
		r, err := insert(ctx, req)
		once.Do(func() { close(entered); <-release })
		return r, err
	}
	opts := idemgrpc.Options{Config: idem.Config{Wait: 50 * time.Millisecond}}
	first, second := serve(t, pool, opts, h), serve(t, pool, opts, h)
	done := make(chan answer)
	go func() { done <- call(ctx, first, "alice", "slow-1", request("slow", 1)) }()
	<-entered
	a := call(ctx, second, "alice", "slow-1", request("slow", 1))
	close(release)
	if status.Code(a.err) != codes.Aborted || errorInfo(a.err) != idemgrpc.ReasonInProgress || retryDelay(a.err) <= 0 {
		t.Errorf("duplicate in flight: %v (%s, retry after %v)", a.err, errorInfo(a.err), retryDelay(a.err))
	}
	if f := <-done; f.err != nil {
		t.Fatal(f.err)
	}
	if a := call(ctx, second, "alice", "slow-1", request("slow", 1)); a.err != nil || !a.replayed() {
		t.Errorf("after: %v", a.err)
	}
}

// A key held by a reservation whose outcome is unknown is
// FAILED_PRECONDITION, IDEMPOTENCY_OUTCOME_UNKNOWN.
func TestOutcomeUnknown(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	conn := serve(t, pool, idemgrpc.Options{}, insertHandler(&runs))
	req := request("x", 1)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	fp := rpcidem.Fingerprint(transferMethod, b) // what the interceptor computes
	r, err := idem.Reserve(ctx, pool, idem.Scope{Actor: "alice", Operation: transferMethod}, "pay-1", fp, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "gateway timed out"); err != nil {
		t.Fatal(err)
	}
	a := call(ctx, conn, "alice", "pay-1", req)
	if status.Code(a.err) != codes.FailedPrecondition || errorInfo(a.err) != idemgrpc.ReasonOutcomeUnknown || runs.Load() != 0 {
		t.Errorf("unknown outcome: %v (%s), %d runs", a.err, errorInfo(a.err), runs.Load())
	}
}

// A COMMIT whose acknowledgement is lost: the call gets UNAVAILABLE, the
// retry with the same key replays what committed, and the handler ran once.
// A store that cannot be reached is UNAVAILABLE before the handler runs.
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
	conn := serve(t, pool, idemgrpc.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, insertHandler(&runs))

	first := call(ctx, conn, "alice", "lost-1", request("lost", 9))
	if status.Code(first.err) != codes.Unavailable || errorInfo(first.err) != idemgrpc.ReasonStoreUnavailable || retryDelay(first.err) <= 0 {
		t.Fatalf("lost acknowledgement: %v (%s); commits cut %d", first.err, errorInfo(first.err), rl.CommitsCut())
	}
	again := call(ctx, conn, "alice", "lost-1", request("lost", 9))
	if again.err != nil || !again.replayed() || again.decode(t).ResourceName != "transfers/1" {
		t.Errorf("retry: %v, replayed %v", again.err, again.replayed())
	}
	if runs.Load() != 1 || rl.CommitsCut() != 1 {
		t.Errorf("%d runs, %d commits cut; want 1, 1", runs.Load(), rl.CommitsCut())
	}

	// The store down: UNAVAILABLE, the handler does not run.
	_ = rl.Close()
	pool.Reset()
	down := call(ctx, conn, "alice", "down-1", request("down", 1))
	if status.Code(down.err) != codes.Unavailable || errorInfo(down.err) != idemgrpc.ReasonStoreUnavailable || runs.Load() != 1 {
		t.Errorf("store down: %v (%s), %d runs", down.err, errorInfo(down.err), runs.Load())
	}
	// Logged with the key's hash, never the key.
	if out := logs.String(); strings.Count(out, `msg="idemgrpc: store unavailable"`) != 2 || !strings.Contains(out, "key_hash=") ||
		strings.Contains(out, "lost-1") || strings.Contains(out, "down-1") {
		t.Errorf("logs:\n%s", out)
	}
}

// The stored form, which idemconnect shares (a key used through one
// replays through the other): a reply is status 200 and the reply's
// deterministic bytes, the chosen headers under their names and trailers
// under "trailer~", binary values base64.
func TestStoredForm(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	insert := insertHandler(&runs)
	conn := serve(t, pool, idemgrpc.Options{StoredHeaders: []string{"X-Order"}, StoredTrailers: []string{"x-trace-bin"}},
		func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
			_ = grpc.SetHeader(ctx, metadata.Pairs("x-order", "42"))
			_ = grpc.SetTrailer(ctx, metadata.Pairs("x-trace-bin", "\x00\xff\n"))
			if getInt(req, "amount") > 100 {
				return nil, status.Error(codes.OutOfRange, "too much")
			}
			return insert(ctx, req)
		})
	scope := idem.Scope{Actor: "alice", Operation: transferMethod}
	if a := call(ctx, conn, "alice", "form-1", request("f", 1)); a.err != nil {
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
	if a := call(ctx, conn, "alice", "form-2", request("f", 500)); status.Code(a.err) != codes.OutOfRange {
		t.Fatal(a.err)
	}
	if rec, err = idem.Lookup(ctx, pool, scope, "form-2"); err != nil {
		t.Fatal(err)
	}
	var st spb.Status
	if rec.Response.Status != 400 || proto.Unmarshal(rec.Response.Body, &st) != nil || st.Code != int32(codes.OutOfRange) || st.Message != "too much" {
		t.Errorf("stored refusal: %d %v", rec.Response.Status, &st)
	}
}

// A reply over Config.MaxResponseBytes cannot be stored: INTERNAL, the
// handler's writes rolled back, nothing stored.
func TestReplyTooLarge(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	conn := serve(t, pool, idemgrpc.Options{Config: idem.Config{MaxResponseBytes: 8}, Logger: slog.New(slog.DiscardHandler)},
		insertHandler(&runs))
	a := call(ctx, conn, "alice", "big-1", request("a note longer than eight bytes", 1))
	if status.Code(a.err) != codes.Internal || countRows(t, pool) != 0 {
		t.Errorf("%v, %d rows", a.err, countRows(t, pool))
	}
	if _, err := idem.Lookup(ctx, pool, idem.Scope{Actor: "alice", Operation: transferMethod}, "big-1"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("lookup: %v", err)
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
	conn := serve(t, pool, idemgrpc.Options{}, func(ctx context.Context, req *dynamicpb.Message) (proto.Message, error) {
		if runs.Load() == 0 {
			runs.Add(1)
			_, err := idemgrpc.Tx(ctx).Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END $$`)
			return nil, status.Error(codes.Internal, err.Error()) // the handler hides the cause
		}
		return insert(ctx, req)
	})
	a := call(ctx, conn, "alice", "ser-1", request("s", 1))
	if a.err != nil || runs.Load() != 2 || countRows(t, pool) != 1 {
		t.Errorf("%v, %d runs, %d rows", a.err, runs.Load(), countRows(t, pool))
	}
}

// Scope failures: no actor is UNAUTHENTICATED, a status error passes
// through, and nothing runs.
func TestScopeErrors(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := pgtest.Pool(t, migrate)
	var runs atomic.Int64
	conn := serve(t, pool, idemgrpc.Options{}, insertHandler(&runs))
	if a := callMD(ctx, conn, metadata.Pairs(idemgrpc.MetadataKey, "k"), request("x", 1)); status.Code(a.err) != codes.Unauthenticated {
		t.Errorf("no user: %v", a.err)
	}
	denied := serve(t, pool, idemgrpc.Options{Scope: func(context.Context, string) (idem.Scope, error) {
		return idem.Scope{}, status.Error(codes.PermissionDenied, "not yours")
	}}, insertHandler(&runs))
	if a := call(ctx, denied, "alice", "k", request("x", 1)); status.Code(a.err) != codes.PermissionDenied {
		t.Errorf("denied: %v", a.err)
	}
	if runs.Load() != 0 {
		t.Errorf("%d runs", runs.Load())
	}
}

// UnaryServerInterceptor refuses invalid options at start-up.
func TestInvalidOptionsPanic(t *testing.T) {
	for name, opts := range map[string]idemgrpc.Options{
		"no scope":          {},
		"OK refusal":        {Scope: scopeFromMetadata, RefusalCodes: []codes.Code{codes.OK}},
		"bad field":         {Scope: scopeFromMetadata, KeyField: "request-id"},
		"non-token header":  {Scope: scopeFromMetadata, StoredHeaders: []string{"x@id"}},
		"non-token trailer": {Scope: scopeFromMetadata, StoredTrailers: []string{"x id"}},
		"bad header":        {Scope: scopeFromMetadata, StoredHeaders: []string{""}},
		"bad config":        {Scope: scopeFromMetadata, Config: idem.Config{TTL: -time.Hour}},
		"grpc header":       {Scope: scopeFromMetadata, StoredTrailers: []string{"grpc-status"}},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			idemgrpc.UnaryServerInterceptor(&pgxpool.Pool{}, opts)
		}()
	}
	defer func() {
		if recover() == nil {
			t.Error("nil db: no panic")
		}
	}()
	idemgrpc.UnaryServerInterceptor(nil, idemgrpc.Options{Scope: scopeFromMetadata})
}

// A typed nil *pgxpool.Pool is refused at start-up too, not call by call.
func TestTypedNilPoolPanics(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "nil database handle") {
			t.Errorf("recovered %v, want a nil database handle panic", r)
		}
	}()
	var pool *pgxpool.Pool
	idemgrpc.UnaryServerInterceptor(pool, idemgrpc.Options{Scope: scopeFromMetadata})
}
