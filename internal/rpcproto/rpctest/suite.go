package rpctest

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/rpcidem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
	"github.com/pgidem/idem/internal/testkit/relay"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

// Transport is an interceptor under test, with its transport.
type Transport interface {
	// Name is the interceptor's package name ("idemgrpc"), the prefix of
	// its errors and log messages.
	Name() string

	// Build builds the interceptor on db with opts, as the package's
	// constructor for db's driver does, and panics as it does.
	Build(db DB, opts Options)

	// Serve starts a server with the interceptor built on db with opts,
	// serving h as opts.Procedure, and returns it; it stops with the test.
	Serve(t testing.TB, db DB, opts Options, h Handler) Server

	// BadKeys are values of the key's metadata entry or header, beyond
	// the suite's own, that the transport carries and the interceptor
	// refuses.
	BadKeys() [][]string

	// Binary is raw as a handler sets the value of a binary ("-bin")
	// header or trailer and a client reads it: raw (gRPC's metadata) or
	// base64 (HTTP headers).
	Binary(raw string) string
}

// Server is a served interceptor, as a client calls it.
type Server interface {
	// Call calls the served procedure as user (none: "") with keys, the
	// values of the key's metadata entry or header (none: nil), and req.
	Call(ctx context.Context, user string, keys []string, req proto.Message) Answer
}

// Options are the interceptor's options that the suite sets, whatever the
// transport.
type Options struct {
	StoredHeaders, StoredTrailers []string

	RequireKey   bool
	KeyField     string
	RefusalCodes []uint32 // nil: the default
	Covered      []string // the procedures covered; nil: all
	Config       idem.Config
	Logger       *slog.Logger

	// NoScope leaves Options.Scope nil. Otherwise Scope is the actor the
	// client sent (Server.Call's user) and the procedure, or when Deny the
	// transport's own PERMISSION_DENIED error "not yours".
	NoScope bool
	Deny    bool

	// Procedure is the procedure Serve serves h as: "" (Transfer), or
	// Unlisted, served without a schema.
	Procedure string

	// Citus is the interceptor's Options.Citus.
	Citus bool
}

// Scope is the Options.Scope of an interceptor that o asks for: scope (the
// client's user and the procedure), deny (the transport's PERMISSION_DENIED
// "not yours") with o.Deny, or none (nil) with o.NoScope.
func Scope[F any](o Options, scope, deny F) F {
	switch {
	case o.NoScope:
		var none F
		return none
	case o.Deny:
		return deny
	}
	return scope
}

// Codes is codes as a transport's code type; nil (the interceptor's
// default) for none.
func Codes[C ~uint32](codes []uint32) []C {
	if len(codes) == 0 {
		return nil
	}
	out := make([]C, len(codes))
	for i, c := range codes {
		out[i] = C(c)
	}
	return out
}

// Build builds the interceptor with opts on db as the package's
// constructor for db's driver does: pgx's, or sql's for a *sql.DB.
func Build[O, I any](db DB, opts O, pgx func(idem.Beginner, O) I, sql func(*sql.DB, O) I) I {
	if db.UsesSQL() {
		return sql(db.SQL, opts)
	}
	return pgx(db.Pgx, opts)
}

// Handler is the behaviour of a test handler, whatever the transport: it
// runs with the call's transaction (nil outside one) and the request.
type Handler func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome

// Outcome is what a Handler answers: Reply, or the error of Status; with
// the headers and trailers it sets (with an error, its metadata).
type Outcome struct {
	Reply           proto.Message
	Status          *spb.Status
	Header, Trailer map[string]string
}

// Fail is an Outcome that fails with code, msg and details.
func Fail(code uint32, msg string, details ...proto.Message) Outcome {
	st := &spb.Status{Code: int32(code), Message: msg}
	for _, d := range details {
		a, err := anypb.New(d)
		if err != nil {
			panic(err)
		}
		st.Details = append(st.Details, a)
	}
	return Outcome{Status: st}
}

// Answer is what a client got from one call.
type Answer struct {
	Body            []byte      // the reply's bytes as they came over the wire
	Err             error       // the error
	Status          *spb.Status // Err's status: code, message, details
	Header, Trailer func(name string) []string
}

// Code is the status code of the answer, 0 (OK) for a reply.
func (a Answer) Code() uint32 {
	if a.Status == nil {
		return 0
	}
	return uint32(a.Status.Code)
}

// Reason is the reason of the answer's ErrorInfo detail, or "".
func (a Answer) Reason() string {
	var info errdetails.ErrorInfo
	if a.detail(&info) {
		if info.Domain != rpcidem.ErrorDomain {
			return "wrong domain " + info.Domain
		}
		return info.Reason
	}
	return ""
}

// RetryDelay is the delay of the answer's RetryInfo detail, or -1.
func (a Answer) RetryDelay() time.Duration {
	var info errdetails.RetryInfo
	if a.detail(&info) {
		return info.RetryDelay.AsDuration()
	}
	return -1
}

func (a Answer) detail(m proto.Message) bool {
	for _, d := range a.Status.GetDetails() {
		if d.MessageIs(m) && d.UnmarshalTo(m) == nil {
			return true
		}
	}
	return false
}

// Replayed reports whether the answer says it is a replay.
func (a Answer) Replayed() bool {
	v := a.Header("idempotent-replayed")
	return len(v) == 1 && v[0] == "true"
}

// Decode returns the reply.
func (a Answer) Decode(t testing.TB) *errdetails.ResourceInfo {
	t.Helper()
	m := &errdetails.ResourceInfo{}
	if err := proto.Unmarshal(a.Body, m); err != nil {
		t.Fatal(err)
	}
	return m
}

func (a Answer) String() string {
	if a.Err != nil {
		return fmt.Sprintf("code %d %q (%s)", a.Code(), a.Status.GetMessage(), a.Reason())
	}
	return fmt.Sprintf("reply %x, replayed %v", a.Body, a.Replayed())
}

// Insert is the handler that writes a transfer in the call's transaction
// and answers its id, or "no transaction" outside one; it counts its runs.
func Insert(runs *atomic.Int64) Handler {
	return func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
		runs.Add(1)
		if tx == nil {
			return Outcome{Reply: Reply(0, "no transaction")}
		}
		id, err := tx.Insert(ctx, Note(req), Amount(req))
		if err != nil {
			return Fail(rpcidem.CodeInternal, err.Error())
		}
		return Outcome{Reply: Reply(id, Note(req))}
	}
}

// The status codes the suite names.
const (
	codeInvalidArgument    = rpcidem.CodeInvalidArgument
	codeNotFound           = 5
	codeAlreadyExists      = 6
	codeFailedPrecondition = rpcidem.CodeFailedPrecondition
	codeAborted            = rpcidem.CodeAborted
	codeOutOfRange         = 11
	codeUnimplemented      = rpcidem.CodeUnimplemented
	codeInternal           = rpcidem.CodeInternal
	codeUnavailable        = rpcidem.CodeUnavailable
	codeUnauthenticated    = rpcidem.CodeUnauthenticated
	codePermissionDenied   = 7
)

// env is one test of the suite: a transport, a driver, a fresh database.
type env struct {
	t     *testing.T
	tr    Transport
	db    DB
	url   string
	check *pgxpool.Pool // the test's own queries
}

func newEnv(t *testing.T, tr Transport, d Driver) *env {
	e := &env{t: t, tr: tr, url: pgtest.URL(t, Migrate)}
	e.db = d.Open(t, e.url)
	if pool, ok := e.db.Pgx.(*pgxpool.Pool); ok {
		e.check = pool
	} else {
		e.check = d.pool(t, e.url)
	}
	return e
}

func (d Driver) pool(t testing.TB, url string) *pgxpool.Pool {
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func (e *env) serve(opts Options, h Handler) Server { return e.tr.Serve(e.t, e.db, opts, h) }

// count returns the number of rows of query's count.
func (e *env) count(query string) int {
	e.t.Helper()
	var n int
	if err := e.check.QueryRow(context.Background(), query).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) transfers() int { return e.count(`SELECT count(*) FROM transfers`) }

// Run runs the suite on tr with every driver.
func Run(t *testing.T, tr Transport) {
	t.Run("InvalidOptionsPanic", func(t *testing.T) { testInvalidOptions(t, tr) })
	for _, d := range Drivers {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			for _, tc := range []struct {
				name string
				run  func(e *env)
			}{
				{"ReplaySameBytes", testReplaySameBytes},
				{"DuplicateStorm", testDuplicateStorm},
				{"RefusalUndoesWrites", testRefusalUndoesWrites},
				{"RefusalCodesConfigured", testRefusalCodesConfigured},
				{"KeyReused", testKeyReused},
				{"NoKey", testNoKey},
				{"BadKeys", testBadKeys},
				{"KeyField", testKeyField},
				{"InProgress", testInProgress},
				{"OutcomeUnknown", testOutcomeUnknown},
				{"ResponseExpired", testResponseExpired},
				{"LostCommitAcknowledgement", testLostCommitAcknowledgement},
				{"StoredForm", testStoredForm},
				{"ReplyTooLarge", testReplyTooLarge},
				{"HandlerSerializationFailure", testHandlerSerializationFailure},
				{"HandlerHidingAFailedStatement", testHandlerHidingAFailedStatement},
				{"HandlerCommittingThenPanicking", testHandlerCommittingThenPanicking},
				{"ScopeErrors", testScopeErrors},
				{"NoSchema", testNoSchema},
				{"UnresolvableReplyType", testUnresolvableReplyType},
				{"StoredWithoutType", testStoredWithoutType},
				{"UndecodableStoredOutcome", testUndecodableStoredOutcome},
			} {
				t.Run(tc.name, func(t *testing.T) {
					t.Parallel()
					tc.run(newEnv(t, tr, d))
				})
			}
		})
	}
}

// A retry gets the first reply's bytes, the stored headers and trailers
// and idempotent-replayed: true; the handler ran once. Another actor's key
// is another key.
func testReplaySameBytes(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	insert := Insert(&runs)
	srv := e.serve(Options{StoredHeaders: []string{"X-Order"}, StoredTrailers: []string{"x-trace", "X-Trace-Bin"}},
		func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
			out := insert(ctx, tx, req)
			out.Header = map[string]string{"x-order": "42", "x-other": "not stored"}
			out.Trailer = map[string]string{"x-trace": "t-1", "x-trace-bin": e.tr.Binary("\x00\xff\n")}
			return out
		})
	first := srv.Call(ctx, "alice", []string{"order-0001"}, Request("coffee", 3))
	if first.Err != nil {
		t.Fatal(first)
	}
	if first.Replayed() || first.Decode(t).ResourceName != "transfers/1" || len(first.Header("x-other")) != 1 {
		t.Fatalf("first call: %s, %v", first, first.Decode(t))
	}
	for range 2 {
		again := srv.Call(ctx, "alice", []string{"order-0001"}, Request("coffee", 3))
		if again.Err != nil || !again.Replayed() || !bytes.Equal(again.Body, first.Body) {
			t.Errorf("retry: %s; first %x", again, first.Body)
		}
		if got := again.Header("x-order"); !reflect.DeepEqual(got, []string{"42"}) || len(again.Header("x-other")) != 0 {
			t.Errorf("retry: x-order %q, x-other %q", got, again.Header("x-other"))
		}
		if got := again.Trailer("x-trace"); !reflect.DeepEqual(got, []string{"t-1"}) {
			t.Errorf("retry: x-trace %q", got)
		}
		if got := again.Trailer("x-trace-bin"); !reflect.DeepEqual(got, []string{e.tr.Binary("\x00\xff\n")}) {
			t.Errorf("retry: x-trace-bin %q", got)
		}
	}
	if runs.Load() != 1 || e.transfers() != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), e.transfers())
	}
	if bob := srv.Call(ctx, "bob", []string{"order-0001"}, Request("coffee", 3)); bob.Err != nil || bob.Replayed() {
		t.Errorf("bob: %s", bob)
	}
}

// 16 concurrent calls with one key on two servers: the handler runs once,
// and every call that succeeds gets the same bytes; the others are ABORTED
// with REQUEST_IN_PROGRESS and a RetryInfo.
func testDuplicateStorm(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	insert := Insert(&runs)
	slow := func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
		time.Sleep(20 * time.Millisecond)
		return insert(ctx, tx, req)
	}
	servers := []Server{e.serve(Options{}, slow), e.serve(Options{}, slow)}
	const n = 16
	answers := make([]Answer, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			answers[i] = servers[i%2].Call(ctx, "alice", []string{"storm-1"}, Request("storm", 16))
		})
	}
	close(start)
	wg.Wait()
	var ok, firsts, aborted int
	var body []byte
	for _, a := range answers {
		switch {
		case a.Err == nil:
			ok++
			if !a.Replayed() {
				firsts++
			}
			if body == nil {
				body = a.Body
			} else if !bytes.Equal(a.Body, body) {
				t.Errorf("bodies differ: %x, %x", a.Body, body)
			}
		case a.Code() == codeAborted && a.Reason() == rpcidem.ReasonInProgress && a.RetryDelay() > 0:
			aborted++
		default:
			t.Errorf("unexpected answer: %s", a)
		}
	}
	t.Logf("%d calls: %d OK (%d first), %d ABORTED", n, ok, firsts, aborted)
	if runs.Load() != 1 || e.transfers() != 1 || firsts != 1 {
		t.Errorf("%d runs, %d rows, %d first answers; want 1 each", runs.Load(), e.transfers(), firsts)
	}
}

// A refusal code is stored with its message, details and metadata and
// replayed; the handler's writes are undone. Another error stores nothing.
func testRefusalUndoesWrites(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	insert := Insert(&runs)
	srv := e.serve(Options{StoredHeaders: []string{"X-Reason"}}, func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
		if out := insert(ctx, tx, req); out.Status != nil {
			return out
		}
		if Amount(req) > 100 {
			out := Fail(codeFailedPrecondition, "insufficient funds", &errdetails.PreconditionFailure{
				Violations: []*errdetails.PreconditionFailure_Violation{{Type: "BALANCE", Subject: "account/1", Description: "balance 100"}}})
			out.Header = map[string]string{"x-reason": "funds"}
			return out
		}
		return Fail(codeUnavailable, "the ledger is busy")
	})
	first := srv.Call(ctx, "alice", []string{"refuse-1"}, Request("big", 500))
	if first.Code() != codeFailedPrecondition || first.Replayed() {
		t.Fatalf("first: %s", first)
	}
	for range 2 {
		again := srv.Call(ctx, "alice", []string{"refuse-1"}, Request("big", 500))
		if !again.Replayed() || !proto.Equal(again.Status, first.Status) {
			t.Errorf("retry: %s, %v; first %v", again, again.Status, first.Status)
		}
		if got := again.Header("x-reason"); !reflect.DeepEqual(got, []string{"funds"}) {
			t.Errorf("retry: x-reason %q", got)
		}
	}
	if runs.Load() != 1 || e.transfers() != 0 {
		t.Errorf("refusal: %d runs, %d rows; want 1, 0", runs.Load(), e.transfers())
	}
	// UNAVAILABLE from the handler is not a refusal: nothing is stored, the
	// retry runs again.
	for i := range 2 {
		a := srv.Call(ctx, "alice", []string{"busy-1"}, Request("small", 5))
		if a.Code() != codeUnavailable || a.Status.GetMessage() != "the ledger is busy" || a.Replayed() {
			t.Errorf("call %d: %s", i, a)
		}
	}
	if runs.Load() != 3 || e.transfers() != 0 {
		t.Errorf("after busy: %d runs, %d rows; want 3, 0", runs.Load(), e.transfers())
	}
}

// Configured refusal codes replace the default ones.
func testRefusalCodesConfigured(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{RefusalCodes: []uint32{codeAlreadyExists}}, func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
		runs.Add(1)
		if Note(req) == "dup" {
			return Fail(codeAlreadyExists, "exists")
		}
		return Fail(codeNotFound, "no account")
	})
	for range 2 {
		if a := srv.Call(ctx, "alice", []string{"k-dup"}, Request("dup", 1)); a.Code() != codeAlreadyExists {
			t.Errorf("dup: %s", a)
		}
		if a := srv.Call(ctx, "alice", []string{"k-nf"}, Request("nf", 1)); a.Code() != codeNotFound || a.Replayed() {
			t.Errorf("not found: %s", a)
		}
	}
	if runs.Load() != 3 { // dup once, not found twice
		t.Errorf("%d runs; want 3", runs.Load())
	}
}

// The same key with a different request is refused with
// FAILED_PRECONDITION and nothing runs.
func testKeyReused(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{}, Insert(&runs))
	if a := srv.Call(ctx, "alice", []string{"reuse-1"}, Request("a", 1)); a.Err != nil {
		t.Fatal(a)
	}
	if a := srv.Call(ctx, "alice", []string{"reuse-1"}, Request("a", 2)); a.Code() != codeFailedPrecondition || a.Reason() != rpcidem.ReasonKeyReused {
		t.Errorf("reused key: %s", a)
	}
	if runs.Load() != 1 || e.transfers() != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), e.transfers())
	}
}

// A call without a key runs as usual, outside a transaction, every time;
// with RequireKey it is refused; a procedure not covered runs without one.
func testNoKey(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{}, Insert(&runs))
	for range 2 {
		if a := srv.Call(ctx, "alice", nil, Request("n", 1)); a.Err != nil || a.Replayed() || a.Decode(t).Description != "no transaction" {
			t.Errorf("no key: %s", a)
		}
	}
	required := e.serve(Options{RequireKey: true}, Insert(&runs))
	if a := required.Call(ctx, "alice", nil, Request("n", 1)); a.Code() != codeInvalidArgument || a.Reason() != rpcidem.ReasonKeyMissing {
		t.Errorf("required key missing: %s", a)
	}
	other := e.serve(Options{RequireKey: true, Covered: []string{"/idemtest.v1.Ledger/Other"}}, Insert(&runs))
	if a := other.Call(ctx, "alice", nil, Request("n", 1)); a.Err != nil {
		t.Errorf("uncovered procedure: %s", a)
	}
	if runs.Load() != 3 || e.transfers() != 0 {
		t.Errorf("%d runs, %d rows; want 3, 0", runs.Load(), e.transfers())
	}
}

// Malformed and invalid keys are INVALID_ARGUMENT; nothing runs and nothing
// is stored. Both forms of the HTTP header are accepted.
func testBadKeys(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{}, Insert(&runs))
	bad := [][]string{{"has space"}, {strings.Repeat("k", 256)}, {`"unterminated`}, {`"a" junk`}, {"a,b"}, {"k1", "k2"}, {" "}}
	for _, keys := range append(bad, e.tr.BadKeys()...) {
		if a := srv.Call(ctx, "alice", keys, Request("x", 1)); a.Code() != codeInvalidArgument || a.Reason() != rpcidem.ReasonKeyInvalid {
			t.Errorf("key %q: %s", keys, a)
		}
	}
	if runs.Load() != 0 || e.count(`SELECT count(*) FROM idem_keys`) != 0 {
		t.Errorf("%d runs, %d keys stored; want 0, 0", runs.Load(), e.count(`SELECT count(*) FROM idem_keys`))
	}
	if a := srv.Call(ctx, "alice", []string{`"same-key";v=1`}, Request("x", 1)); a.Err != nil || a.Replayed() {
		t.Fatalf("quoted: %s", a)
	}
	if a := srv.Call(ctx, "alice", []string{"same-key"}, Request("x", 1)); a.Err != nil || !a.Replayed() {
		t.Errorf("bare: %s", a)
	}
}

// AIP-155: the key can come from the request's request_id field; the
// metadata or header may hold the same key, not another.
func testKeyField(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{KeyField: "request_id", RequireKey: true}, Insert(&runs))
	const id = "9b1d2c6e-0d0f-4e5a-8f0e-1b2c3d4e5f60"
	first := srv.Call(ctx, "alice", nil, WithID(Request("aip", 7), id))
	again := srv.Call(ctx, "alice", nil, WithID(Request("aip", 7), id))
	if first.Err != nil || again.Err != nil || !again.Replayed() || !bytes.Equal(first.Body, again.Body) {
		t.Errorf("request_id: %s, %s", first, again)
	}
	if a := srv.Call(ctx, "alice", []string{id}, WithID(Request("aip", 7), id)); a.Err != nil || !a.Replayed() {
		t.Errorf("both, equal: %s", a)
	}
	if a := srv.Call(ctx, "alice", []string{"other"}, WithID(Request("aip", 7), id)); a.Code() != codeInvalidArgument {
		t.Errorf("both, different: %s", a)
	}
	if a := srv.Call(ctx, "alice", nil, WithID(Request("aip", 7), "not valid")); a.Code() != codeInvalidArgument || a.Reason() != rpcidem.ReasonKeyInvalid {
		t.Errorf("invalid request_id: %s", a)
	}
	if runs.Load() != 1 || e.transfers() != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), e.transfers())
	}
}

// A call that arrives while another holds its key, and waits longer than
// Config.Wait, gets ABORTED with RetryInfo; then it replays.
func testInProgress(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	insert := Insert(&runs)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
		out := insert(ctx, tx, req)
		once.Do(func() { close(entered); <-release })
		return out
	}
	opts := Options{Config: idem.Config{Wait: 50 * time.Millisecond}}
	first, second := e.serve(opts, h), e.serve(opts, h)
	done := make(chan Answer)
	go func() { done <- first.Call(ctx, "alice", []string{"slow-1"}, Request("slow", 1)) }()
	<-entered
	a := second.Call(ctx, "alice", []string{"slow-1"}, Request("slow", 1))
	close(release)
	if a.Code() != codeAborted || a.Reason() != rpcidem.ReasonInProgress || a.RetryDelay() <= 0 {
		t.Errorf("duplicate in flight: %s, retry after %v", a, a.RetryDelay())
	}
	if f := <-done; f.Err != nil {
		t.Fatal(f)
	}
	if a := second.Call(ctx, "alice", []string{"slow-1"}, Request("slow", 1)); a.Err != nil || !a.Replayed() {
		t.Errorf("after: %s", a)
	}
}

// A key held by a reservation whose outcome is unknown is
// FAILED_PRECONDITION, IDEMPOTENCY_OUTCOME_UNKNOWN, and nothing runs.
func testOutcomeUnknown(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{}, Insert(&runs))
	req := Request("x", 1)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	fp := rpcidem.Fingerprint(Transfer, b) // what the interceptor computes
	r, err := idem.Reserve(ctx, e.check, idem.Scope{Actor: "alice", Operation: Transfer}, "pay-1", fp, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, e.check, r, "gateway timed out"); err != nil {
		t.Fatal(err)
	}
	if a := srv.Call(ctx, "alice", []string{"pay-1"}, req); a.Code() != codeFailedPrecondition || a.Reason() != rpcidem.ReasonOutcomeUnknown || runs.Load() != 0 {
		t.Errorf("unknown outcome: %s, %d runs", a, runs.Load())
	}
}

// A retry past idem.Config.BodyTTL is refused with FAILED_PRECONDITION,
// IDEMPOTENCY_RESPONSE_EXPIRED, and nothing runs again; a different
// request with the key is still IDEMPOTENCY_KEY_REUSED.
func testResponseExpired(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	const life = 200 * time.Millisecond
	srv := e.serve(Options{Config: idem.Config{BodyTTL: life}}, Insert(&runs))
	if a := srv.Call(ctx, "alice", []string{"gone-1"}, Request("a", 1)); a.Err != nil {
		t.Fatal(a)
	}
	time.Sleep(life + 100*time.Millisecond)
	if a := srv.Call(ctx, "alice", []string{"gone-1"}, Request("a", 1)); a.Code() != codeFailedPrecondition || a.Reason() != rpcidem.ReasonResponseExpired {
		t.Errorf("retry past BodyTTL: %s", a)
	}
	if a := srv.Call(ctx, "alice", []string{"gone-1"}, Request("a", 2)); a.Code() != codeFailedPrecondition || a.Reason() != rpcidem.ReasonKeyReused {
		t.Errorf("another request past BodyTTL: %s", a)
	}
	if runs.Load() != 1 || e.transfers() != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), e.transfers())
	}
}

// A COMMIT whose acknowledgement is lost: the call gets UNAVAILABLE, the
// retry with the same key replays what committed, and the handler ran once.
// A store that cannot be reached is UNAVAILABLE before the handler runs.
// Both are logged with the key's hash, never the key.
func testLostCommitAcknowledgement(e *env) {
	t, ctx := e.t, e.t.Context()
	target, err := relay.Target(e.url)
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
	relayed, err := rl.ConnString(e.url)
	if err != nil {
		t.Fatal(err)
	}
	db := e.db.Driver.Open(t, relayed)
	var runs atomic.Int64
	var logs testlog.Buffer
	srv := e.tr.Serve(t, db, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, Insert(&runs))

	first := srv.Call(ctx, "alice", []string{"lost-1"}, Request("lost", 9))
	if first.Code() != codeUnavailable || first.Reason() != rpcidem.ReasonStoreUnavailable || first.RetryDelay() <= 0 {
		t.Fatalf("lost acknowledgement: %s; commits cut %d", first, rl.CommitsCut())
	}
	again := srv.Call(ctx, "alice", []string{"lost-1"}, Request("lost", 9))
	if again.Err != nil || !again.Replayed() || again.Decode(t).ResourceName != "transfers/1" {
		t.Errorf("retry: %s", again)
	}
	if runs.Load() != 1 || rl.CommitsCut() != 1 {
		t.Errorf("%d runs, %d commits cut; want 1, 1", runs.Load(), rl.CommitsCut())
	}

	_ = rl.Close()
	db.reset()
	down := srv.Call(ctx, "alice", []string{"down-1"}, Request("down", 1))
	if down.Code() != codeUnavailable || down.Reason() != rpcidem.ReasonStoreUnavailable || runs.Load() != 1 {
		t.Errorf("store down: %s, %d runs", down, runs.Load())
	}
	if out := logs.String(); strings.Count(out, `msg="`+e.tr.Name()+`: store unavailable"`) != 2 || !strings.Contains(out, "key_hash=") ||
		strings.Contains(out, "lost-1") || strings.Contains(out, "down-1") {
		t.Errorf("logs:\n%s", out)
	}
}

// reset drops db's idle connections.
func (db DB) reset() {
	if pool, ok := db.Pgx.(*pgxpool.Pool); ok {
		pool.Reset()
	}
	if db.SQL != nil {
		db.SQL.SetMaxIdleConns(-1)
		db.SQL.SetMaxIdleConns(2)
	}
}

// The stored form, which both interceptors share (a key used through one
// replays through the other): a reply is status 200, the reply's
// deterministic bytes and its type's full name, the chosen headers under
// their lower-case names and trailers under "trailer~", binary values
// base64; a refusal is the
// HTTP status of its code and a google.rpc.Status.
func testStoredForm(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	insert := Insert(&runs)
	srv := e.serve(Options{StoredHeaders: []string{"X-Order"}, StoredTrailers: []string{"x-trace-bin"}},
		func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
			if Amount(req) > 100 {
				return Fail(codeOutOfRange, "too much")
			}
			out := insert(ctx, tx, req)
			out.Header, out.Trailer = map[string]string{"x-order": "42"}, map[string]string{"x-trace-bin": e.tr.Binary("\x00\xff\n")}
			return out
		})
	scope := idem.Scope{Actor: "alice", Operation: Transfer}
	if a := srv.Call(ctx, "alice", []string{"form-1"}, Request("f", 1)); a.Err != nil {
		t.Fatal(a)
	}
	rec, err := idem.Lookup(ctx, e.check, scope, "form-1")
	if err != nil {
		t.Fatal(err)
	}
	want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(Reply(1, "f"))
	if rec.Response.Status != 200 || !bytes.Equal(rec.Response.Body, want) || !reflect.DeepEqual(rec.Response.Header,
		map[string][]string{"x-order": {"42"}, "trailer~x-trace-bin": {"AP8K"}, "reply~type": {"google.rpc.ResourceInfo"}}) {
		t.Errorf("stored reply: %d %x %v", rec.Response.Status, rec.Response.Body, rec.Response.Header)
	}
	if a := srv.Call(ctx, "alice", []string{"form-2"}, Request("f", 500)); a.Code() != codeOutOfRange {
		t.Fatal(a)
	}
	if rec, err = idem.Lookup(ctx, e.check, scope, "form-2"); err != nil {
		t.Fatal(err)
	}
	var st spb.Status
	if rec.Response.Status != 400 || proto.Unmarshal(rec.Response.Body, &st) != nil || st.Code != codeOutOfRange || st.Message != "too much" {
		t.Errorf("stored refusal: %d %v", rec.Response.Status, &st)
	}
}

// A reply over Config.MaxResponseBytes cannot be stored: INTERNAL, the
// handler's writes rolled back, nothing stored.
func testReplyTooLarge(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{Config: idem.Config{MaxResponseBytes: 8}, Logger: slog.New(slog.DiscardHandler)}, Insert(&runs))
	if a := srv.Call(ctx, "alice", []string{"big-1"}, Request("a note longer than eight bytes", 1)); a.Code() != codeInternal || e.transfers() != 0 {
		t.Errorf("%s, %d rows", a, e.transfers())
	}
	if _, err := idem.Lookup(ctx, e.check, idem.Scope{Actor: "alice", Operation: Transfer}, "big-1"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("lookup: %v", err)
	}
}

// A serialization failure in the handler's own statement, which the
// handler answers as INTERNAL: on a pgx pool the interceptor sees it and
// runs the handler again in a new transaction, and the client gets the
// second run's reply. A *sql.Tx cannot be watched: the handler's INTERNAL
// goes to the client, nothing is stored, and the retry runs again.
func testHandlerSerializationFailure(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	insert := Insert(&runs)
	srv := e.serve(Options{Logger: slog.New(slog.DiscardHandler)}, func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
		if runs.Load() == 0 {
			runs.Add(1)
			err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END $$`)
			return Fail(codeInternal, fmt.Sprint(err)) // the handler hides the cause
		}
		return insert(ctx, tx, req)
	})
	a := srv.Call(ctx, "alice", []string{"ser-1"}, Request("s", 1))
	if e.db.UsesSQL() {
		if a.Code() != codeInternal || runs.Load() != 1 || e.transfers() != 0 {
			t.Errorf("%s, %d runs, %d rows", a, runs.Load(), e.transfers())
		}
		a = srv.Call(ctx, "alice", []string{"ser-1"}, Request("s", 1))
	}
	if a.Err != nil || a.Replayed() || runs.Load() != 2 || e.transfers() != 1 {
		t.Errorf("%s, %d runs, %d rows", a, runs.Load(), e.transfers())
	}
}

// A handler that swallows a failed statement and replies: INTERNAL (a
// server error, idem.ErrTxAborted), the reason logged, nothing stored;
// concurrent duplicates get the same, or wait.
func testHandlerHidingAFailedStatement(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	insert := Insert(&runs)
	var logs testlog.Buffer
	srv := e.serve(Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
		out := insert(ctx, tx, req)
		_ = tx.Exec(ctx, `SELECT 1/0`) // swallowed
		return out
	})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			a := srv.Call(ctx, "alice", []string{"hidden-1"}, Request("h", 1))
			if a.Code() != codeInternal && a.Code() != codeAborted {
				t.Errorf("%s, want INTERNAL", a)
			}
		})
	}
	wg.Wait()
	if out := logs.String(); !strings.Contains(out, "aborted by a statement it did not report") {
		t.Errorf("the reason is not logged:\n%s", out)
	}
	if n := e.count(`SELECT count(*) FROM idem_keys`); n != 0 || e.transfers() != 0 {
		t.Errorf("%d keys, %d rows", n, e.transfers())
	}
}

// A handler that commits the interceptor's transaction itself and then
// panics: the panic goes on (the transport's server, which recovers it
// outside every interceptor, answers INTERNAL), and the record of the key,
// whose claim the handler's COMMIT made durable, is unknown at once:
// ListUnknown lists it before any retry, and a retry is refused with
// IDEMPOTENCY_OUTCOME_UNKNOWN without running the handler again.
func testHandlerCommittingThenPanicking(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	insert := Insert(&runs)
	srv := e.serve(Options{}, func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
		insert(ctx, tx, req)
		if err := tx.Commit(ctx); err != nil {
			t.Errorf("the handler's COMMIT: %v", err)
		}
		panic("the handler's panic")
	})
	if a := srv.Call(ctx, "alice", []string{"orphan-1"}, Request("o", 1)); a.Code() != codeInternal {
		t.Errorf("%s, want INTERNAL (the recovered panic)", a)
	}
	if page, err := idem.ListUnknown(ctx, e.check, 10, nil); err != nil || len(page) != 1 || page[0].Key != "orphan-1" {
		t.Errorf("ListUnknown before any retry: %+v, %v", page, err)
	}
	if a := srv.Call(ctx, "alice", []string{"orphan-1"}, Request("o", 1)); a.Code() != codeFailedPrecondition ||
		a.Reason() != rpcidem.ReasonOutcomeUnknown {
		t.Errorf("a retry: %s, want %s", a, rpcidem.ReasonOutcomeUnknown)
	}
	if runs.Load() != 1 || e.transfers() != 1 {
		t.Errorf("%d runs, %d rows; want 1 and 1 (the handler's COMMIT)", runs.Load(), e.transfers())
	}
}

// Scope failures: no actor is UNAUTHENTICATED, an error of the transport's
// own passes through, and nothing runs.
func testScopeErrors(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{}, Insert(&runs))
	if a := srv.Call(ctx, "", []string{"k"}, Request("x", 1)); a.Code() != codeUnauthenticated {
		t.Errorf("no user: %s", a)
	}
	denied := e.serve(Options{Deny: true}, Insert(&runs))
	if a := denied.Call(ctx, "alice", []string{"k"}, Request("x", 1)); a.Code() != codePermissionDenied || a.Status.GetMessage() != "not yours" {
		t.Errorf("denied: %s", a)
	}
	if runs.Load() != 0 {
		t.Errorf("%d runs", runs.Load())
	}
}

// A handler without a schema, its procedure in no file descriptor: the
// reply's type is stored with it and found by name on replay, byte for
// byte the first reply.
func testNoSchema(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	srv := e.serve(Options{Procedure: Unlisted}, Insert(&runs))
	first := srv.Call(ctx, "alice", []string{"bare-1"}, Request("no schema", 2))
	if first.Err != nil || first.Replayed() || first.Decode(t).ResourceName != "transfers/1" {
		t.Fatalf("first call: %s", first)
	}
	again := srv.Call(ctx, "alice", []string{"bare-1"}, Request("no schema", 2))
	if again.Err != nil || !again.Replayed() || !bytes.Equal(again.Body, first.Body) {
		t.Errorf("replay: %s; first %x", again, first.Body)
	}
	if runs.Load() != 1 || e.transfers() != 1 {
		t.Errorf("%d runs, %d rows; want 1, 1", runs.Load(), e.transfers())
	}
}

// A reply whose type a replay could not find (registered nowhere, not the
// procedure's reply type) is refused at the first call with UNIMPLEMENTED,
// saying which type; the handler's writes roll back, nothing is stored,
// and the next call runs again.
func testUnresolvableReplyType(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	for _, procedure := range []string{Transfer, Unlisted} {
		srv := e.serve(Options{Procedure: procedure, Logger: slog.New(slog.DiscardHandler)},
			func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
				runs.Add(1)
				if _, err := tx.Insert(ctx, Note(req), Amount(req)); err != nil {
					return Fail(codeInternal, err.Error())
				}
				receipt := dynamicpb.NewMessage(receiptDesc)
				receipt.Set(receiptDesc.Fields().ByName("note"), req.Get(RequestDesc.Fields().ByName("note")))
				return Outcome{Reply: receipt}
			})
		for i := range 2 {
			a := srv.Call(ctx, "alice", []string{"receipt-1"}, Request("r", 1))
			if a.Code() != codeUnimplemented || !strings.Contains(a.Status.GetMessage(), "idemtest.v1.Receipt, which is neither registered in protoregistry.GlobalTypes") ||
				a.Replayed() {
				t.Errorf("%s, call %d: %s", procedure, i, a)
			}
		}
	}
	if runs.Load() != 4 || e.transfers() != 0 || e.count(`SELECT count(*) FROM idem_keys`) != 0 {
		t.Errorf("%d runs, %d rows, %d keys; want 4, 0, 0", runs.Load(), e.transfers(), e.count(`SELECT count(*) FROM idem_keys`))
	}
}

// A reply stored without its type (by an earlier version) replays as the
// procedure's reply type; without a schema for the procedure it cannot,
// and the call is refused with UNIMPLEMENTED, saying why.
func testStoredWithoutType(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	req := Request("old", 1)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := proto.MarshalOptions{Deterministic: true}.Marshal(Reply(7, "old"))
	for _, procedure := range []string{Transfer, Unlisted} {
		_, err = idem.DoInTx(ctx, e.check, idem.Scope{Actor: "alice", Operation: procedure}, "old-1", rpcidem.Fingerprint(procedure, b),
			func(context.Context, pgx.Tx) (idem.Response, error) {
				return idem.Response{Status: rpcidem.StatusReply, Body: body}, nil
			})
		if err != nil {
			t.Fatal(err)
		}
	}
	if a := e.serve(Options{}, Insert(&runs)).Call(ctx, "alice", []string{"old-1"}, req); a.Err != nil || !a.Replayed() || !bytes.Equal(a.Body, body) {
		t.Errorf("with a schema: %s", a)
	}
	a := e.serve(Options{Procedure: Unlisted}, Insert(&runs)).Call(ctx, "alice", []string{"old-1"}, req)
	if a.Code() != codeUnimplemented || !strings.Contains(a.Status.GetMessage(), "names no type") {
		t.Errorf("without a schema: %s", a)
	}
	if runs.Load() != 0 {
		t.Errorf("%d runs", runs.Load())
	}
}

// A stored outcome that cannot be decoded (a reply or a status whose bytes
// are not their message's) is INTERNAL, and logged, as every error the
// interceptor answers itself as INTERNAL, with the key's hash, never the
// key. The handler does not run.
func testUndecodableStoredOutcome(e *env) {
	t, ctx := e.t, e.t.Context()
	var runs atomic.Int64
	var logs testlog.Buffer
	srv := e.serve(Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, Insert(&runs))
	req := Request("bad", 1)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	for key, resp := range map[string]idem.Response{
		"bad-reply-1":  {Status: rpcidem.StatusReply, Body: []byte{0xff}, Header: map[string][]string{rpcidem.ReplyType: {"google.rpc.ResourceInfo"}}},
		"bad-status-1": {Status: rpcidem.HTTPStatus(codeNotFound), Body: []byte{0xff}},
	} {
		_, err = idem.DoInTx(ctx, e.check, idem.Scope{Actor: "alice", Operation: Transfer}, key, rpcidem.Fingerprint(Transfer, b),
			func(context.Context, pgx.Tx) (idem.Response, error) { return resp, nil })
		if err != nil {
			t.Fatal(err)
		}
		if a := srv.Call(ctx, "alice", []string{key}, req); a.Code() != codeInternal {
			t.Errorf("%s: %s", key, a)
		}
	}
	out := logs.String()
	if n := strings.Count(out, "level=ERROR"); n != 2 || strings.Count(out, "key_hash=") != 2 || strings.Contains(out, "bad-reply-1") || strings.Contains(out, "bad-status-1") {
		t.Errorf("%d records; logs:\n%s", n, out)
	}
	if runs.Load() != 0 {
		t.Errorf("%d runs", runs.Load())
	}
}

// The constructors refuse invalid options and nil handles (a typed nil
// too) at start-up, with a panic.
func testInvalidOptions(t *testing.T, tr Transport) {
	pool := DB{Driver: Drivers[0], Pgx: &pgxpool.Pool{}}
	for name, tc := range map[string]struct {
		db   DB
		opts Options
	}{
		"no scope":          {pool, Options{NoScope: true}},
		"bad field":         {pool, Options{KeyField: "request-id"}},
		"non-token header":  {pool, Options{StoredHeaders: []string{"x@id"}}},
		"non-token trailer": {pool, Options{StoredTrailers: []string{"x id"}}},
		"empty header":      {pool, Options{StoredHeaders: []string{""}}},
		"reserved mark":     {pool, Options{StoredHeaders: []string{"reply~type"}}},
		"grpc header":       {pool, Options{StoredTrailers: []string{"grpc-status"}}},
		"bad config":        {pool, Options{Config: idem.Config{TTL: -time.Hour}}},
		"covered, no slash": {pool, Options{Covered: []string{"idemtest.v1.Ledger/Transfer"}}},
		"covered, dotted":   {pool, Options{Covered: []string{"/idemtest.v1.Ledger.Transfer"}}},
		"covered, empty":    {pool, Options{Covered: []string{""}}},
		"nil pool":          {DB{Driver: Drivers[0]}, Options{}},
		"typed nil pool":    {DB{Driver: Drivers[0], Pgx: (*pgxpool.Pool)(nil)}, Options{}},
		"nil *sql.DB":       {DB{Driver: Drivers[1]}, Options{}},
		"SQL, bad config":   {DB{Driver: Drivers[2], SQL: sqlDB}, Options{Config: idem.Config{TTL: -time.Hour}}},
	} {
		func() {
			defer func() {
				r := recover()
				if r == nil {
					t.Errorf("%s: no panic", name)
				} else if msg := fmt.Sprint(r); !strings.HasPrefix(msg, tr.Name()+": ") ||
					strings.Contains(name, "nil") && !strings.HasSuffix(msg, "nil database handle") {
					t.Errorf("%s: panic %q", name, msg)
				}
			}()
			tr.Build(tc.db, tc.opts)
		}()
	}
	tr.Build(DB{Driver: Drivers[1], SQL: sqlDB}, Options{}) // a valid *sql.DB, never used
}
