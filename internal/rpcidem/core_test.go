package rpcidem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/front"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// noDB is a handle for tests that never reach the database.
type noDB struct{}

func (noDB) Begin(context.Context) (pgx.Tx, error) { return nil, errors.New("no database") }

func testOptions() Options {
	return Options{Transport: Transport{Name: "idemtest", ProcedureAttr: "method", KeySource: "idempotency-key metadata",
		KeyMissing: "this method requires an idempotency key", Reserved: []string{"grpc-"}, NameKind: "metadata key"},
		ScopeSet: true, KeyField: "request_id", RefusalCodes: []uint32{CodeFailedPrecondition}}
}

// txs holds the test handlers' transaction.
var txs front.Txs

func newCore(t *testing.T, db idem.Beginner, opts Options) *Core {
	t.Helper()
	c, err := New(opts, txs.Pgx(db))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Invalid options are refused, in the interceptor's name.
func TestNewRefuses(t *testing.T) {
	noScope := testOptions()
	noScope.ScopeSet = false
	badConfig := testOptions()
	badConfig.Config.TTL = -time.Second
	badName := testOptions()
	badName.StoredTrailers = []string{"x~y"}
	for _, tc := range []struct {
		name string
		db   idem.Beginner
		opts Options
		want string
	}{
		{"nil db", nil, testOptions(), "idemtest: nil database handle"},
		{"typed nil pool", (*pgxpool.Pool)(nil), testOptions(), "idemtest: nil database handle"},
		{"no scope", noDB{}, noScope, "idemtest: Options.Scope is required"},
		{"bad config", noDB{}, badConfig, "idemtest: Options.Config: "},
		{"bad name", noDB{}, badName, `idemtest: Options.StoredHeaders, StoredTrailers: invalid metadata key "x~y"`},
	} {
		if _, err := New(tc.opts, txs.Pgx(tc.db)); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%s: New = %v, want %q", tc.name, err, tc.want)
		}
	}
}

// The key comes from the metadata or the request field, which must agree;
// a missing key is none unless required; a bad key is INVALID_ARGUMENT.
func TestKeyRules(t *testing.T) {
	c := newCore(t, noDB{}, testOptions())
	required := testOptions()
	required.RequireKey = true
	cr := newCore(t, noDB{}, required)
	for _, tc := range []struct {
		name   string
		core   *Core
		values []string
		field  string
		key    string
		reason string // "" for no failure
		msg    string // a part of the message
	}{
		{"none", c, nil, "", "", "", ""},
		{"none, required", cr, nil, "", "", ReasonKeyMissing, "requires an idempotency key"},
		{"metadata", c, []string{"k-1"}, "", "k-1", "", ""},
		{"quoted", c, []string{`"k-1"`}, "", "k-1", "", ""},
		{"field", cr, nil, "k-2", "k-2", "", ""},
		{"both alike", c, []string{"k-3"}, "k-3", "k-3", "", ""},
		{"both differ", c, []string{"k-3"}, "k-4", "", ReasonKeyInvalid, "idempotency-key metadata and the request field request_id hold different keys"},
		{"empty value", c, []string{""}, "", "", ReasonKeyInvalid, "invalid "},
		{"two keys", c, []string{"a", "b"}, "", "", ReasonKeyInvalid, "invalid idempotency-key metadata: "},
		{"too long", c, []string{strings.Repeat("k", 256)}, "", "", ReasonKeyInvalid, "invalid "},
		{"field too long", c, nil, strings.Repeat("k", 256), "", ReasonKeyInvalid, "invalid idempotency key: "},
	} {
		key, f := tc.core.Key(tc.values, tc.field)
		switch {
		case tc.reason == "" && (f != nil || key != tc.key):
			t.Errorf("%s: Key = %q, %+v; want %q", tc.name, key, f, tc.key)
		case tc.reason != "" && (f == nil || key != "" || f.Code != CodeInvalidArgument || f.Reason != tc.reason ||
			!strings.Contains(f.Message, tc.msg) || strings.Contains(f.Message, "idem: ")):
			t.Errorf("%s: Key = %q, %+v; want INVALID_ARGUMENT %s %q", tc.name, key, f, tc.reason, tc.msg)
		}
	}
}

// A scope error or a bad actor is UNAUTHENTICATED, a bad operation
// INTERNAL (a programming error), wrapping idem.ErrInvalidScope.
func TestScopeRules(t *testing.T) {
	c := newCore(t, noDB{}, testOptions())
	if f := c.Scope(idem.Scope{Actor: "u", Operation: "/p.S/M"}, nil); f != nil {
		t.Errorf("valid scope: %+v", f)
	}
	for _, tc := range []struct {
		scope idem.Scope
		err   error
	}{
		{idem.Scope{Actor: "u", Operation: "/p.S/M"}, errors.New("no token")},
		{idem.Scope{Operation: "/p.S/M"}, nil},
		{idem.Scope{Actor: strings.Repeat("u", idem.MaxScopeLength+1), Operation: "/p.S/M"}, nil},
	} {
		if f := c.Scope(tc.scope, tc.err); f == nil || f.Code != CodeUnauthenticated || f.Message != "the call is not authenticated" {
			t.Errorf("Scope(%+v, %v) = %+v, want UNAUTHENTICATED", tc.scope, tc.err, f)
		}
	}
	f := c.Scope(idem.Scope{Actor: "u"}, nil)
	if f == nil || f.Code != CodeInternal || !errors.Is(f.Cause, idem.ErrInvalidScope) ||
		!strings.HasPrefix(f.Message, "idemtest: Options.Scope: ") {
		t.Errorf("empty operation: %+v, want INTERNAL wrapping idem.ErrInvalidScope", f)
	}
}

// idem's errors map to the documented codes and reasons; those answered
// UNAVAILABLE or INTERNAL are logged with the key's hash, never the key.
func TestStoreErrorMapping(t *testing.T) {
	var logs bytes.Buffer
	opts := testOptions()
	opts.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
	c := newCore(t, noDB{}, opts)
	const key = "secret-key-1"
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel2 := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel2()
	for _, tc := range []struct {
		name   string
		ctx    context.Context
		err    error
		code   uint32
		reason string
		retry  bool
		logged string
	}{
		{"reused", context.Background(), idem.ErrKeyReused, CodeFailedPrecondition, ReasonKeyReused, false, ""},
		{"in progress", context.Background(), &idem.InProgressError{RetryAfter: 3 * time.Second}, CodeAborted, ReasonInProgress, true, ""},
		{"outcome unknown", context.Background(), idem.ErrOutcomeUnknown, CodeFailedPrecondition, ReasonOutcomeUnknown, false, ""},
		{"invalid key", context.Background(), fmt.Errorf("%w: too long", idem.ErrInvalidKey), CodeInvalidArgument, ReasonKeyInvalid, false, ""},
		{"canceled", canceled, errors.New("query failed"), CodeCanceled, "", false, ""},
		{"deadline", expired, errors.New("query failed"), CodeDeadlineExceeded, "", false, ""},
		{"unavailable", context.Background(), fmt.Errorf("commit: %w", io.ErrUnexpectedEOF), CodeUnavailable, ReasonStoreUnavailable, true, "idemtest: store unavailable"},
		{"other", context.Background(), errors.New("reply too large"), CodeInternal, "", false, "idemtest: call failed"},
	} {
		logs.Reset()
		f := c.storeError(tc.ctx, "/p.S/M", key, tc.err)
		if f.Code != tc.code || f.Reason != tc.reason || f.Retry != tc.retry {
			t.Errorf("%s: %+v, want code %d reason %q retry %v", tc.name, f, tc.code, tc.reason, tc.retry)
		}
		if tc.name == "in progress" && f.RetryDelay != 3*time.Second || tc.name == "unavailable" && f.RetryDelay != time.Second {
			t.Errorf("%s: retry delay %v", tc.name, f.RetryDelay)
		}
		if tc.ctx.Err() != nil && (f.Cause != tc.ctx.Err() || f.Message != tc.ctx.Err().Error()) {
			t.Errorf("%s: %+v, want the context's error", tc.name, f)
		}
		got := logs.String()
		if tc.logged == "" && got != "" || tc.logged != "" && (!strings.Contains(got, `"msg":"`+tc.logged+`"`) ||
			!strings.Contains(got, `"method":"/p.S/M"`) || !strings.Contains(got, `"key_hash":"`) || strings.Contains(got, key)) {
			t.Errorf("%s: logged %q", tc.name, got)
		}
	}
}

// fakeCall is a handler that writes a row in the call's transaction and
// answers reply, or err with code.
type fakeCall struct {
	runs  int
	note  string
	err   error
	code  uint32
	reply []byte
}

func (c *fakeCall) Handle(ctx context.Context) error {
	c.runs++
	if _, err := txs.PgxTx(ctx).Exec(ctx, `INSERT INTO notes (note) VALUES ($1)`, c.note); err != nil {
		return err
	}
	return c.err
}

func (c *fakeCall) Code(error) uint32 { return c.code }

func (c *fakeCall) Reply() (map[string][]string, []byte, error) {
	return map[string][]string{"x-id": {"1"}}, c.reply, nil
}

func (c *fakeCall) Refusal(err error) (map[string][]string, []byte, error) {
	return nil, []byte("status: " + err.Error()), nil
}

func migrateNotes(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE notes (note text NOT NULL)`)
	return err
}

// Do stores a reply with the handler's writes and replays it; stores a
// refusal with the writes undone and replays it; stores nothing for any
// other error, so that a retry runs again.
func TestDo(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, migrateNotes)
	ctx := context.Background()
	c := newCore(t, pool, testOptions())
	scope := idem.Scope{Actor: "u", Operation: "/p.S/M"}
	notes := func(note string) int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM notes WHERE note = $1`, note).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	fp := Fingerprint("/p.S/M", []byte("request"))

	reply := &fakeCall{note: "reply", reply: []byte("reply bytes")}
	for i, want := range []bool{false, true} {
		stored, replayed, f := c.Do(ctx, "/p.S/M", scope, "k-reply", fp, reply)
		if f != nil || replayed != want || replayed && (stored.Status != StatusReply ||
			string(stored.Body) != "reply bytes" || stored.Header["x-id"][0] != "1") {
			t.Fatalf("reply, call %d: %+v, %v, %+v", i, stored, replayed, f)
		}
	}
	if reply.runs != 1 || notes("reply") != 1 {
		t.Errorf("reply: %d runs, %d rows; want 1, 1", reply.runs, notes("reply"))
	}

	refusal := &fakeCall{note: "refusal", err: errors.New("no funds"), code: CodeFailedPrecondition}
	for i, want := range []bool{false, true} {
		stored, replayed, f := c.Do(ctx, "/p.S/M", scope, "k-refusal", fp, refusal)
		if f != nil || replayed != want || replayed && (stored.Status != HTTPStatus(CodeFailedPrecondition) ||
			string(stored.Body) != "status: no funds") {
			t.Fatalf("refusal, call %d: %+v, %v, %+v", i, stored, replayed, f)
		}
	}
	if refusal.runs != 1 || notes("refusal") != 0 {
		t.Errorf("refusal: %d runs, %d rows; want 1, 0", refusal.runs, notes("refusal"))
	}

	failure := &fakeCall{note: "failure", err: errors.New("busy"), code: CodeUnavailable}
	for i := range 2 {
		if _, replayed, f := c.Do(ctx, "/p.S/M", scope, "k-failure", fp, failure); f != nil || replayed {
			t.Fatalf("failure, call %d: %v, %+v", i, replayed, f)
		}
	}
	if failure.runs != 2 || notes("failure") != 0 {
		t.Errorf("failure: %d runs, %d rows; want 2, 0", failure.runs, notes("failure"))
	}

	other := Fingerprint("/p.S/M", []byte("another request"))
	if _, _, f := c.Do(ctx, "/p.S/M", scope, "k-reply", other, reply); f == nil || f.Reason != ReasonKeyReused {
		t.Errorf("same key, other request: %+v, want %s", f, ReasonKeyReused)
	}
}

// Stored header names are HTTP tokens outside the reserved prefixes.
func TestHeaderName(t *testing.T) {
	for name, want := range map[string]bool{
		"x-order": true, "X-Order": true, "x-trace-bin": true, "x_a.b|c!": true,
		"x~y": false, "trailer~x": false, "reply~type": false, "": false, "x@id": false, "x id": false, ":authority": false, "x:y": false,
		"x\r\n": false, "x\"y": false, "grpc-status": false, "Grpc-Status": false, "é": false,
	} {
		if got := HeaderName(name, "grpc-"); got != want {
			t.Errorf("HeaderName(%q) = %v, want %v", name, got, want)
		}
	}
}

// Stored keeps the chosen names only, in lower case, trailers under
// TrailerPrefix, raw binary values in base64 when the transport hands them
// over raw; Entries splits the stored form back, the reply's type apart.
func TestStoredAndEntries(t *testing.T) {
	opts := testOptions()
	opts.StoredHeaders = []string{"X-Order", "x-order", "x-id-bin"}
	opts.StoredTrailers = []string{"X-Trace-Bin", "x-missing"}
	set := map[string][]string{"x-order": {"42", "43"}, "x-other": {"no"}, "x-id-bin": {"\x00\xff"}, "x-trace-bin": {"\x01"}}
	get := func(name string) []string { return set[name] }
	for _, raw := range []bool{false, true} {
		opts.RawBinary = raw
		c := newCore(t, noDB{}, opts)
		got := c.Stored(get, get)
		want := map[string][]string{"x-order": {"42", "43"}, "x-id-bin": {"\x00\xff"}, "trailer~x-trace-bin": {"\x01"}}
		if raw {
			want["x-id-bin"], want["trailer~x-trace-bin"] = []string{"AP8="}, []string{"AQ=="}
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("raw %v: Stored = %v, want %v", raw, got, want)
		}
		got[ReplyType] = []string{"pkg.Reply"}
		header, trailer, typ := Entries(got)
		if typ != "pkg.Reply" || len(header) != 2 || header["x-order"][1] != "43" || len(trailer) != 1 || trailer["x-trace-bin"] == nil {
			t.Errorf("raw %v: Entries = %v, %v, %q", raw, header, trailer, typ)
		}
	}
	if c := newCore(t, noDB{}, testOptions()); c.Stored(get, get) != nil {
		t.Error("Stored without chosen names is not nil")
	}
}
