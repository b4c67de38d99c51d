package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

var payScope = idem.Scope{Actor: "alice", Operation: "payment.create"}

// storedRow is a key's row as the table holds it, read with plain SQL.
type storedRow struct {
	Found       bool
	Status      string
	Fingerprint []byte
	Token       int64
	Lease       *time.Time
	LastError   *string
	RespStatus  *int32
	RespHeaders *string
	RespBody    []byte
	Created     time.Time
	Completed   *time.Time
	Expires     time.Time
	ResumeUntil *time.Time
}

func readRow(t *testing.T, pool *pgxpool.Pool, scope idem.Scope, key string) storedRow {
	t.Helper()
	var r storedRow
	err := pool.QueryRow(context.Background(), `
		SELECT status, fingerprint, token, lease_expires_at, last_error, response_status,
		       response_headers::text, response_body, created_at, completed_at, expires_at, resume_until
		FROM idem_keys WHERE actor = $1 AND operation = $2 AND idem_key = $3`,
		scope.Actor, scope.Operation, key).Scan(&r.Status, &r.Fingerprint, &r.Token, &r.Lease, &r.LastError,
		&r.RespStatus, &r.RespHeaders, &r.RespBody, &r.Created, &r.Completed, &r.Expires, &r.ResumeUntil)
	if errors.Is(err, pgx.ErrNoRows) {
		return storedRow{}
	}
	if err != nil {
		t.Fatal(err)
	}
	r.Found = true
	return r
}

// waitPast waits until the database clock has passed the given column
// (lease_expires_at, expires_at or resume_until) of the key's row.
func waitPast(t *testing.T, pool *pgxpool.Pool, scope idem.Scope, key, column string) {
	t.Helper()
	for {
		var past bool
		err := pool.QueryRow(context.Background(), `SELECT `+column+` <= now() FROM idem_keys
			WHERE actor = $1 AND operation = $2 AND idem_key = $3`, scope.Actor, scope.Operation, key).Scan(&past)
		if err != nil {
			t.Fatal(err)
		}
		if past {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func mustClient(t testing.TB, cfg idem.Config) *idem.Client {
	t.Helper()
	c, err := idem.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

var (
	charged  = idem.Response{Status: 201, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: []byte(`{"charge":"ch_1"}`)}
	declined = idem.Response{Status: 402, Body: []byte(`{"error":"card_declined"}`)}
	resolved = idem.Response{Status: 201, Body: []byte(`{"charge":"ch_found"}`)}
)

// completeTx runs Complete in a transaction of its own and commits it when
// Complete succeeds.
func completeTx(ctx context.Context, c *idem.Client, pool *pgxpool.Pool, r idem.Reservation, resp idem.Response) error {
	return c.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		return c.Complete(ctx, tx, r, resp)
	})
}

// stateEvents are the columns of the state table.
var stateEvents = []string{
	"Reserve", "Reserve(other fp)", "ReserveWith(window)", "Complete", "FailRetryable", "MarkUnknown", "Heartbeat",
	"stale token", "ExpireLeases", "Resolve(succeeded)", "Resolve(retryable)", "Do", "Do(other fp)",
	"ListUnknown", "ListResumable",
}

// stateTable is the state machine of a key, one row per state and one cell
// per event of stateEvents. A cell is the expected error, or "ok", then
// optionally ">" and the state afterwards:
//
//	run>S     the event executes: nil error, state S; for Reserve a new
//	          token, and the window the key had (a new one for a new
//	          generation: none, or past the TTL)
//	resume>S  Reserve resumes an attempt in doubt: nil error, Resumed, a
//	          new token, the same window, state S
//	replay    nil error, the stored response replayed; the row unchanged
//	ok        nil error, the row unchanged
//	listed    the list holds the record; the row unchanged ("ok": it
//	          does not)
//	E         the error E (InProgress, KeyReused, OutcomeUnknown, Fenced,
//	          NotFound, NotResolvable); the row unchanged
//	X>S       X as above, then state S with the same token ("S+": a new
//	          token; "*": processing or unknown, the same token)
//
// "Complete", "FailRetryable", "MarkUnknown" and "Heartbeat" are called by
// the reservation that brought the key into the state (a token never
// issued when Do or nobody did); "stale token" calls all four with a token
// that never held the key. "Reserve" reserves without a window of its own,
// "ReserveWith(window)" with one of an hour. A state "in window" was
// reserved with a window that lasts; "past window", with one that ended.
var stateTable = []struct {
	state string
	cells [15]string
}{
	{"none", [15]string{"run>processing", "run>processing", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotFound", "NotFound", "run>succeeded", "run>succeeded", "ok", "ok"}},
	{"processing", [15]string{"InProgress", "KeyReused", "InProgress", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "ok>processing",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "InProgress", "KeyReused", "ok", "ok"}},
	{"processing, lease ran out", [15]string{"OutcomeUnknown>unknown", "KeyReused", "OutcomeUnknown>unknown", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "Fenced",
		"Fenced", "ok>unknown", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown>*", "KeyReused", "listed", "ok"}},
	{"succeeded", [15]string{"replay", "KeyReused", "replay", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "replay", "KeyReused", "ok", "ok"}},
	{"rejected (Do)", [15]string{"replay", "KeyReused", "replay", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "replay", "KeyReused", "ok", "ok"}},
	{"failed_retryable", [15]string{"run>processing", "KeyReused", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "KeyReused", "ok", "ok"}},
	{"unknown", [15]string{"OutcomeUnknown", "KeyReused", "OutcomeUnknown", "Fenced", "Fenced", "ok>unknown", "Fenced",
		"Fenced", "ok", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused", "listed", "ok"}},
	{"succeeded, past TTL", [15]string{"run>processing", "run>processing", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "run>succeeded", "ok", "ok"}},
	{"rejected (Do), past TTL", [15]string{"run>processing", "run>processing", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "run>succeeded", "ok", "ok"}},
	{"failed_retryable, past TTL", [15]string{"run>processing", "run>processing", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "run>succeeded", "ok", "ok"}},
	{"unknown, past TTL", [15]string{"OutcomeUnknown", "KeyReused", "OutcomeUnknown", "Fenced", "Fenced", "ok>unknown", "Fenced",
		"Fenced", "ok", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused", "listed", "ok"}},
	{"processing, past TTL", [15]string{"InProgress", "KeyReused", "InProgress", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "ok>processing",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "InProgress", "KeyReused", "ok", "ok"}},
	// Keys reserved with a window (ReserveOptions.ResumeWithin).
	{"processing, in window", [15]string{"InProgress", "KeyReused", "InProgress", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "ok>processing",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "InProgress", "KeyReused", "ok", "ok"}},
	{"processing, lease ran out, in window", [15]string{"resume>processing", "KeyReused", "resume>processing", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "Fenced",
		"Fenced", "ok", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused", "ok", "listed"}},
	{"unknown, in window", [15]string{"resume>processing", "KeyReused", "resume>processing", "Fenced", "Fenced", "ok>unknown", "Fenced",
		"Fenced", "ok", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused", "ok", "listed"}},
	{"failed_retryable, in window", [15]string{"run>processing", "KeyReused", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "KeyReused", "ok", "ok"}},
	{"processing, lease ran out, past window", [15]string{"OutcomeUnknown>unknown", "KeyReused", "OutcomeUnknown>unknown", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "Fenced",
		"Fenced", "ok>unknown", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused", "listed", "ok"}},
	{"unknown, past window", [15]string{"OutcomeUnknown", "KeyReused", "OutcomeUnknown", "Fenced", "Fenced", "ok>unknown", "Fenced",
		"Fenced", "ok", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused", "listed", "ok"}},
	// Keys whose fn committed the transaction of Do or DoInTx itself: the
	// claim committed without an outcome. DoInTx marks its record unknown
	// (a new token, a lease that ended); Do cannot, and leaves it
	// processing without a lease until a call in a transaction of its own
	// (Reserve, DoInTx) marks it.
	{"processing (Do, fn committed)", [15]string{"OutcomeUnknown>unknown+", "KeyReused", "OutcomeUnknown>unknown+", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "OutcomeUnknown>unknown+", "KeyReused", "ok", "ok"}},
	{"unknown (DoInTx, fn committed)", [15]string{"OutcomeUnknown", "KeyReused", "OutcomeUnknown", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused", "listed", "ok"}},
}

var stateErrors = map[string]error{
	"InProgress": idem.ErrInProgress, "KeyReused": idem.ErrKeyReused, "OutcomeUnknown": idem.ErrOutcomeUnknown,
	"Fenced": idem.ErrFenced, "NotFound": idem.ErrNotFound, "NotResolvable": idem.ErrNotResolvable,
}

// TestStateTable puts a key into every state and applies every event to it.
// The cells of the Do columns depend on the core's side of the state
// machine: they are DoInTx's, and Do in a caller's transaction (rolled
// back) must answer the same, but for a claim fn committed (ErrInProgress).
func TestStateTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	const lease = time.Minute
	c := mustClient(t, idem.Config{Wait: 200 * time.Millisecond})
	short := mustClient(t, idem.Config{TTL: time.Millisecond, Wait: 200 * time.Millisecond})
	neverIssued := int64(1) << 50

	// setup brings key into state and returns the reservation that did.
	setup := func(t *testing.T, state, key string) idem.Reservation {
		t.Helper()
		check := func(err error) {
			t.Helper()
			if err != nil {
				t.Fatalf("setup %s: %v", state, err)
			}
		}
		base, pastTTL := strings.CutSuffix(state, ", past TTL")
		base, inWindow := strings.CutSuffix(base, ", in window")
		base, pastWindow := strings.CutSuffix(base, ", past window")
		cl := c
		if pastTTL {
			cl = short
		}
		owner := idem.Reservation{Scope: payScope, Key: key, Token: neverIssued}
		var err error
		switch base {
		case "none":
			return owner
		case "rejected (Do)":
			_, err = cl.DoInTx(ctx, pool, payScope, key, fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
				return idem.Response{}, idem.Reject(declined)
			})
			check(err)
		case "processing (Do, fn committed)", "unknown (DoInTx, fn committed)":
			commit := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) { return charged, tx.Commit(ctx) }
			if strings.HasPrefix(base, "processing") {
				err = inCallerTx(ctx, pool, func(tx pgx.Tx) error { _, err := cl.Do(ctx, tx, payScope, key, fpA, commit); return err })
			} else {
				_, err = cl.DoInTx(ctx, pool, payScope, key, fpA, commit)
			}
			if !errors.Is(err, idem.ErrInvalidArgument) {
				t.Fatalf("setup %s: %v", state, err)
			}
		default:
			opts := idem.ReserveOptions{Lease: lease}
			if base == "processing, lease ran out" {
				opts.Lease = time.Millisecond
			}
			switch {
			case inWindow:
				opts.ResumeWithin = time.Hour
			case pastWindow:
				opts.Lease, opts.ResumeWithin = time.Millisecond, time.Millisecond
			}
			owner, err = cl.ReserveWith(ctx, pool, payScope, key, fpA, opts)
			check(err)
			switch base {
			case "processing, lease ran out":
				waitPast(t, pool, payScope, key, "lease_expires_at")
			case "succeeded":
				check(completeTx(ctx, cl, pool, owner, charged))
			case "failed_retryable":
				check(cl.FailRetryable(ctx, pool, owner, "not sent"))
			case "unknown":
				check(cl.MarkUnknown(ctx, pool, owner, "gateway timeout"))
			}
			if pastWindow {
				waitPast(t, pool, payScope, key, "resume_until")
			}
		}
		if pastTTL {
			waitPast(t, pool, payScope, key, "expires_at")
		}
		want, _, _ := strings.Cut(base, ",")
		want, _, _ = strings.Cut(want, " (")
		if got := readRow(t, pool, payScope, key); got.Status != want || (got.ResumeUntil != nil) != (inWindow || pastWindow) {
			t.Fatalf("setup %s: row %+v", state, got)
		}
		return owner
	}

	// outcome is what an event did: replayed, ran and resumed say what
	// Reserve or Do did, listed whether a list held the key.
	type outcome struct {
		replayed, ran, resumed, listed bool
		err                            error
		do                             *outcome // the Do events: Do's own outcome
	}
	// event applies an event.
	event := func(t *testing.T, name, key string, owner idem.Reservation) outcome {
		t.Helper()
		var runs atomic.Int64
		fn := func(context.Context, pgx.Tx) (idem.Response, error) {
			runs.Add(1)
			return idem.Response{Status: 200, Body: []byte("by Do")}, nil
		}
		switch name {
		case "Reserve", "Reserve(other fp)", "ReserveWith(window)":
			fp := fpA
			if name == "Reserve(other fp)" {
				fp = fpB
			}
			opts := idem.ReserveOptions{Lease: lease}
			if name == "ReserveWith(window)" {
				opts.ResumeWithin = time.Hour
			}
			r, err := c.ReserveWith(ctx, pool, payScope, key, fp, opts)
			if err == nil && !r.Replayed && r.Token <= 0 {
				t.Fatalf("Reserve executes without a token: %+v", r)
			}
			return outcome{replayed: r.Replayed, ran: err == nil && !r.Replayed, resumed: r.Resumed, err: err}
		case "Complete":
			return outcome{err: completeTx(ctx, c, pool, owner, charged)}
		case "FailRetryable":
			return outcome{err: c.FailRetryable(ctx, pool, owner, "connection refused")}
		case "MarkUnknown":
			return outcome{err: c.MarkUnknown(ctx, pool, owner, "read timeout")}
		case "Heartbeat":
			r, err := c.Heartbeat(ctx, pool, owner, 2*lease)
			if err == nil && !r.LeaseExpiresAt.After(owner.LeaseExpiresAt) {
				t.Fatalf("Heartbeat: lease %s, before %s", r.LeaseExpiresAt, owner.LeaseExpiresAt)
			}
			return outcome{err: err}
		case "stale token":
			stale := owner
			stale.Token = neverIssued + 1
			for _, err := range []error{
				completeTx(ctx, c, pool, stale, charged),
				c.FailRetryable(ctx, pool, stale, ""),
				c.MarkUnknown(ctx, pool, stale, ""),
				func() error { _, err := c.Heartbeat(ctx, pool, stale, lease); return err }(),
			} {
				if !errors.Is(err, idem.ErrFenced) {
					return outcome{err: err}
				}
			}
			return outcome{err: idem.ErrFenced}
		case "ExpireLeases":
			_, err := c.ExpireLeases(ctx, pool, 10)
			return outcome{err: err}
		case "Resolve(succeeded)", "Resolve(retryable)":
			// The operator names the token the record holds (none for a
			// key without a record or one Do wrote: any token).
			res := idem.Resolution{Token: max(readRow(t, pool, payScope, key).Token, 1), Retryable: true, Reason: "no charge"}
			if name == "Resolve(succeeded)" {
				res = idem.Resolution{Token: res.Token, Succeeded: &resolved, Reason: "charge found"}
			}
			return outcome{err: c.Resolve(ctx, pool, payScope, key, res)}
		case "Do", "Do(other fp)":
			fp := fpA
			if name != "Do" {
				fp = fpB
			}
			// Do first, in a transaction of the caller's that rolls back:
			// it leaves nothing, and its outcome is checked against
			// DoInTx's (the cell).
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			doRes, doErr := c.Do(ctx, tx, payScope, key, fp, fn)
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			do := &outcome{replayed: doRes.Replayed, ran: runs.Swap(0) == 1, err: doErr}
			res, err := c.DoInTx(ctx, pool, payScope, key, fp, fn)
			if n := runs.Load(); (err == nil && !res.Replayed) != (n == 1) || n > 1 {
				t.Fatalf("%s: fn ran %d times, result %+v, err %v", name, n, res, err)
			}
			if do.replayed && (doRes.Status != res.Status || string(doRes.Body) != string(res.Body)) {
				t.Fatalf("%s: Do replayed %+v, DoInTx %+v", name, doRes.Response, res.Response)
			}
			return outcome{replayed: res.Replayed, ran: runs.Load() == 1, err: err, do: do}
		case "ListUnknown", "ListResumable":
			list := c.ListUnknown
			if name == "ListResumable" {
				list = c.ListResumable
			}
			recs, err := list(ctx, pool, 10, nil)
			listed := slices.ContainsFunc(recs, func(r idem.Record) bool { return r.Key == key })
			if len(recs) > 1 || (listed && recs[0].Status != idem.Status(readRow(t, pool, payScope, key).Status)) {
				t.Fatalf("%s: %+v", name, recs)
			}
			return outcome{listed: listed, err: err}
		}
		t.Fatalf("no event %q", name)
		return outcome{}
	}

	for i, row := range stateTable {
		for j, cell := range row.cells {
			name := stateEvents[j]
			t.Run(row.state+"/"+name, func(t *testing.T) {
				if _, err := pool.Exec(ctx, `DELETE FROM idem_keys`); err != nil {
					t.Fatal(err)
				}
				key := fmt.Sprintf("cell-%02d-%02d", i, j)
				owner := setup(t, row.state, key)
				before := readRow(t, pool, payScope, key)
				got := event(t, name, key, owner)
				err := got.err
				after := readRow(t, pool, payScope, key)

				want, state, _ := strings.Cut(cell, ">")
				newToken := strings.HasSuffix(state, "+")
				state = strings.TrimSuffix(state, "+")
				switch {
				case want == "ok" || want == "run" || want == "resume" || want == "replay" || want == "listed":
					if err != nil {
						t.Fatalf("%s on %s: %v, want %s", name, row.state, err, cell)
					}
				case !errors.Is(err, stateErrors[want]):
					t.Fatalf("%s on %s: err = %v, want %s", name, row.state, err, cell)
				}
				if got.replayed != (want == "replay") || got.ran != (want == "run" || want == "resume") ||
					got.resumed != (want == "resume") || got.listed != (want == "listed") {
					t.Fatalf("%s on %s: %+v; want %s", name, row.state, got, cell)
				}
				// Do, in the caller's transaction, decides as DoInTx, but
				// for a claim that fn committed: it cannot tell that from
				// its caller's own claim (ErrInProgress).
				if do := got.do; do != nil {
					wantDo := outcome{replayed: got.replayed, ran: got.ran, err: got.err}
					if row.state == "processing (Do, fn committed)" && name == "Do" {
						wantDo = outcome{err: idem.ErrInProgress}
					}
					if do.replayed != wantDo.replayed || do.ran != wantDo.ran || (do.err == nil) != (wantDo.err == nil) ||
						slices.ContainsFunc(slices.Collect(maps.Values(stateErrors)), func(e error) bool {
							return errors.Is(do.err, e) != errors.Is(wantDo.err, e)
						}) {
						t.Fatalf("Do in the caller's transaction on %s: %+v; want %+v", row.state, *do, wantDo)
					}
				}
				var inProgress *idem.InProgressError
				if errors.As(err, &inProgress) && (inProgress.RetryAfter < time.Second || inProgress.RetryAfter > time.Minute) {
					t.Fatalf("RetryAfter %s, want 1s..1m", inProgress.RetryAfter)
				}
				isDo := strings.HasPrefix(name, "Do")
				switch {
				case state == "":
					if !reflect.DeepEqual(after, before) {
						t.Fatalf("%s on %s changed the row:\nbefore %+v\nafter  %+v", name, row.state, before, after)
					}
				case state == "*":
					if after.Token != before.Token || (after.Status != before.Status && after.Status != "unknown") {
						t.Fatalf("%s on %s: row %+v, before %+v", name, row.state, after, before)
					}
				default:
					if after.Status != state {
						t.Fatalf("%s on %s: state %q, want %q", name, row.state, after.Status, state)
					}
					switch {
					case isDo: // the token of a row Do wrote is the core's business
					case want == "run" || want == "resume" || newToken:
						if after.Token <= before.Token {
							t.Fatalf("%s on %s: token %d, before %d; want a new one", name, row.state, after.Token, before.Token)
						}
					case after.Token != before.Token:
						t.Fatalf("%s on %s: token %d, before %d; want the same", name, row.state, after.Token, before.Token)
					}
				}
				// The window: set by the reservation that starts a
				// generation, kept by every later one, cleared by Do.
				if want == "run" || want == "resume" || newToken {
					newGeneration := !before.Found || (before.Expires.Before(after.Created) && before.Status != "processing" && before.Status != "unknown")
					switch {
					case isDo && after.ResumeUntil != nil:
						t.Fatalf("%s on %s: Do's record keeps a window: %+v", name, row.state, after)
					case isDo:
					case newGeneration && (after.ResumeUntil != nil) != (name == "ReserveWith(window)"):
						t.Fatalf("%s on %s: a new generation's window %v", name, row.state, after.ResumeUntil)
					case !newGeneration && !reflect.DeepEqual(after.ResumeUntil, before.ResumeUntil):
						t.Fatalf("%s on %s: window %v, before %v; want it kept", name, row.state, after.ResumeUntil, before.ResumeUntil)
					}
				}
				if want == "resume" && (after.Lease == nil || after.Lease.After(*after.ResumeUntil)) {
					t.Fatalf("%s on %s: a resumed lease %v past the window %v", name, row.state, after.Lease, after.ResumeUntil)
				}
				if name == "Reserve" && got.replayed {
					r, _ := c.Reserve(ctx, pool, payScope, key, fpA, lease)
					if before.RespStatus == nil || r.Status != int(*before.RespStatus) || string(r.Body) != string(before.RespBody) {
						t.Fatalf("replayed %+v, stored %+v", r.Response, before)
					}
				}
				if after.Status == "unknown" && before.Status == "processing" && name != "MarkUnknown" && before.Lease != nil &&
					(after.LastError == nil || !strings.Contains(*after.LastError, "lease")) {
					t.Fatalf("an expired lease left last_error %v", after.LastError)
				}
			})
		}
	}
}

// gateway is a card gateway over real HTTP. Like providers that take an
// idempotency key, it charges once per key and answers a repeated key with
// the charge it made. It counts the requests and charges of every key.
type gateway struct {
	srv      *httptest.Server
	mu       sync.Mutex
	charges  map[string]string // idempotency key -> charge id
	requests map[string]int
}

// headerGatewayFault asks the gateway to fail a request: "abort-after-charge"
// charges, then drops the connection without answering.
const headerGatewayFault = "X-Gateway-Fault"

func newGateway(t *testing.T) *gateway {
	g := &gateway{charges: map[string]string{}, requests: map[string]int{}}
	g.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		g.mu.Lock()
		g.requests[key]++
		id, ok := g.charges[key]
		if !ok {
			id = fmt.Sprintf("ch_%d", len(g.charges)+1)
			g.charges[key] = id
		}
		g.mu.Unlock()
		if r.Header.Get(headerGatewayFault) == "abort-after-charge" {
			panic(http.ErrAbortHandler) // the charge stands; the answer is lost
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":%q}`, id)
	}))
	t.Cleanup(g.srv.Close)
	return g
}

// charge asks the gateway to charge under key and returns the charge id.
func (g *gateway) charge(ctx context.Context, key, fault string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, "POST", g.srv.URL+"/charges", strings.NewReader(`{"amount":12000}`))
	if err != nil {
		return "", err
	}
	req.Header.Set("Idempotency-Key", key)
	if fault != "" {
		req.Header.Set(headerGatewayFault, fault)
	}
	resp, err := g.srv.Client().Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var out struct{ ID string }
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return "", err
	}
	return out.ID, nil
}

// lookup returns the charge made under key, as an operator would find it.
func (g *gateway) lookup(key string) (id string, requests int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.charges[key], g.requests[key]
}

// withPayments adds the payments table the workers record charges in.
func withPayments(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(context.Background(),
		`CREATE TABLE payments (id bigserial PRIMARY KEY, idem_key text NOT NULL, charge text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
}

// record writes the payment and completes the reservation in one
// transaction: both commit, or neither.
func record(ctx context.Context, c *idem.Client, pool *pgxpool.Pool, r idem.Reservation, charge string) error {
	return c.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO payments (idem_key, charge) VALUES ($1, $2)`, r.Key, charge); err != nil {
			return err
		}
		return c.Complete(ctx, tx, r, idem.Response{Status: 201, Body: []byte(charge)})
	})
}

// A worker pauses past its lease before it reaches the gateway. The key
// turns unknown, an operator finds no charge and allows a retry, a new owner
// charges and completes; then the stale worker wakes up, reaches the gateway
// (which answers the same charge for the same key) and its Complete is
// fenced: one charge, one payment row, the new owner's outcome stored.
func TestStaleWorkerIsFenced(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	withPayments(t, pool)
	gw := newGateway(t)
	c := mustClient(t, idem.Config{})
	const key = "pay-stale"

	stale, err := c.Reserve(ctx, pool, payScope, key, fpA, 50*time.Millisecond)
	if err != nil || stale.Token <= 0 {
		t.Fatalf("Reserve: %+v, %v", stale, err)
	}
	waitPast(t, pool, payScope, key, "lease_expires_at") // the pause

	// The client retries: the lease ran out, so the key is unknown.
	if _, err := c.Reserve(ctx, pool, payScope, key, fpA, time.Minute); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("retry after the lease: %v, want ErrOutcomeUnknown", err)
	}
	// The operator finds no charge at the gateway and allows a retry.
	if id, _ := gw.lookup(key); id != "" {
		t.Fatalf("charge %s before anyone called the gateway", id)
	}
	if err := c.Resolve(ctx, pool, payScope, key, idem.Resolution{Token: stale.Token, Retryable: true, Reason: "no charge at the gateway"}); err != nil {
		t.Fatal(err)
	}

	owner, err := c.Reserve(ctx, pool, payScope, key, fpA, time.Minute)
	if err != nil || owner.Replayed || owner.Token <= stale.Token {
		t.Fatalf("new owner: %+v, %v (stale token %d)", owner, err, stale.Token)
	}
	charge, err := gw.charge(ctx, key, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := record(ctx, c, pool, owner, charge); err != nil {
		t.Fatal(err)
	}

	// The stale worker wakes up.
	staleCharge, err := gw.charge(ctx, key, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := record(ctx, c, pool, stale, staleCharge); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("stale Complete: %v, want ErrFenced", err)
	}
	for name, err := range map[string]error{
		"FailRetryable": c.FailRetryable(ctx, pool, stale, "late"),
		"MarkUnknown":   c.MarkUnknown(ctx, pool, stale, "late"),
		"Heartbeat":     func() error { _, err := c.Heartbeat(ctx, pool, stale, time.Minute); return err }(),
	} {
		if !errors.Is(err, idem.ErrFenced) {
			t.Fatalf("stale %s: %v, want ErrFenced", name, err)
		}
	}

	if id, requests := gw.lookup(key); id != charge || requests != 2 || len(gw.charges) != 1 {
		t.Fatalf("gateway: charge %s (want %s), %d requests, %d charges", id, charge, requests, len(gw.charges))
	}
	if n := count(t, pool, `SELECT count(*) FROM payments`); n != 1 {
		t.Fatalf("%d payment rows, want 1", n)
	}
	row := readRow(t, pool, payScope, key)
	if row.Status != "succeeded" || row.Token != owner.Token || string(row.RespBody) != charge {
		t.Fatalf("record %+v", row)
	}
	again, err := c.Reserve(ctx, pool, payScope, key, fpA, time.Minute)
	if err != nil || !again.Replayed || string(again.Body) != charge {
		t.Fatalf("replay: %+v, %v", again, err)
	}
}

// The gateway charges, then the worker dies before Complete. Retries get
// ErrInProgress while the lease lives and ErrOutcomeUnknown after it (the
// record turned unknown by ExpireLeases, or by the retry itself); the
// gateway is never called again. The operator finds the charge and resolves
// the record, and the retry replays it.
func TestCrashAfterChargeEndsUnknownThenResolved(t *testing.T) {
	t.Parallel()
	for _, via := range []string{"ExpireLeases", "Reserve"} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := newPool(t)
			withPayments(t, pool)
			gw := newGateway(t)
			c := mustClient(t, idem.Config{})
			const key = "pay-crash"
			retry := func() (idem.Reservation, error) {
				return c.Reserve(ctx, pool, payScope, key, fpA, time.Minute)
			}

			// The worker runs on a pool of its own, which dies with it.
			workerPool, err := pgxpool.New(ctx, pool.Config().ConnString())
			if err != nil {
				t.Fatal(err)
			}
			r, err := c.Reserve(ctx, workerPool, payScope, key, fpA, 300*time.Millisecond)
			if err != nil {
				t.Fatal(err)
			}
			charge, err := gw.charge(ctx, key, "")
			if err != nil {
				t.Fatal(err)
			}
			workerPool.Close() // the crash: no Complete

			// The lease still runs: the retry waits its turn.
			if _, err := retry(); !errors.Is(err, idem.ErrInProgress) {
				t.Fatalf("retry during the lease: %v, want ErrInProgress", err)
			}
			waitPast(t, pool, payScope, key, "lease_expires_at")
			if via == "ExpireLeases" {
				if n, err := c.ExpireLeases(ctx, pool, 100); err != nil || n != 1 {
					t.Fatalf("ExpireLeases = %d, %v; want 1", n, err)
				}
			}
			for range 3 {
				if _, err := retry(); !errors.Is(err, idem.ErrOutcomeUnknown) {
					t.Fatalf("retry after the lease: %v, want ErrOutcomeUnknown", err)
				}
			}
			if _, requests := gw.lookup(key); requests != 1 {
				t.Fatalf("the gateway got %d requests, want 1", requests)
			}

			// Reconciliation: the operator lists the unknown records and
			// looks each one up at the gateway.
			unknown, err := c.ListUnknown(ctx, pool, 10, nil)
			if err != nil || len(unknown) != 1 || unknown[0].Key != key || unknown[0].Token != r.Token ||
				unknown[0].Status != idem.StatusUnknown || unknown[0].Response != nil || unknown[0].LastError == "" {
				t.Fatalf("ListUnknown = %+v, %v", unknown, err)
			}
			found, _ := gw.lookup(key)
			if found != charge {
				t.Fatalf("gateway lookup %q, want %q", found, charge)
			}
			err = c.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `INSERT INTO payments (idem_key, charge) VALUES ($1, $2)`, key, found); err != nil {
					return err
				}
				return c.Resolve(ctx, tx, payScope, key, idem.Resolution{
					Token: unknown[0].Token, Succeeded: &idem.Response{Status: 201, Body: []byte(found)}, Reason: "charge found at the gateway",
				})
			})
			if err != nil {
				t.Fatal(err)
			}
			res, err := retry()
			if err != nil || !res.Replayed || res.Status != 201 || string(res.Body) != charge {
				t.Fatalf("retry after Resolve: %+v, %v", res, err)
			}
			if _, requests := gw.lookup(key); requests != 1 || count(t, pool, `SELECT count(*) FROM payments`) != 1 {
				t.Fatalf("gateway requests %d, want 1; payments %d, want 1", requests, count(t, pool, `SELECT count(*) FROM payments`))
			}
			if unknown, _ := c.ListUnknown(ctx, pool, 10, nil); len(unknown) != 0 {
				t.Fatalf("still unknown: %+v", unknown)
			}
		})
	}
}

// The gateway charges and the connection drops before its answer: the
// worker cannot tell and marks the key unknown. Nothing runs again.
func TestLostGatewayAnswerIsUnknown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	gw := newGateway(t)
	c := mustClient(t, idem.Config{})
	const key = "pay-lost"

	r, err := c.Reserve(ctx, pool, payScope, key, fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gw.charge(ctx, key, "abort-after-charge"); err == nil {
		t.Fatal("the gateway answered")
	}
	if err := c.MarkUnknown(ctx, pool, r, "gateway connection dropped after the request was sent"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Reserve(ctx, pool, payScope, key, fpA, time.Minute); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("retry: %v, want ErrOutcomeUnknown", err)
	}
	if id, requests := gw.lookup(key); id == "" || requests != 1 {
		t.Fatalf("gateway: %q, %d requests", id, requests)
	}
	row := readRow(t, pool, payScope, key)
	if row.Status != "unknown" || row.LastError == nil || !strings.Contains(*row.LastError, "dropped") {
		t.Fatalf("record %+v", row)
	}
}

// 64 concurrent Reserve calls for one key, spread over separate pools (no
// coalescing in the process): exactly one owner, the others ErrInProgress.
func TestConcurrentReserveOneOwner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	const pools, calls = 8, 64
	var ps []*pgxpool.Pool
	for range pools {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = 4 // 32 connections in all: the server is shared
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		ps = append(ps, p)
	}
	c := mustClient(t, idem.Config{})
	var owners, inProgress atomic.Int64
	errs := make(chan error, calls)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() {
			<-start
			r, err := c.Reserve(ctx, ps[i%pools], payScope, "pay-storm", fpA, time.Minute)
			switch {
			case err == nil && r.Token > 0 && !r.Replayed:
				owners.Add(1)
			case errors.Is(err, idem.ErrInProgress):
				inProgress.Add(1)
			default:
				errs <- fmt.Errorf("Reserve: %+v, %v", r, err)
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if owners.Load() != 1 || inProgress.Load() != calls-1 {
		t.Fatalf("%d owners, %d in progress; want 1 and %d", owners.Load(), inProgress.Load(), calls-1)
	}
}

// A transaction of Do holds the key (uncommitted): Reserve waits at most
// Config.Wait, answers ErrInProgress and changes nothing; once Do commits,
// Reserve replays Do's outcome.
func TestReserveWaitsForDoInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{Wait: 100 * time.Millisecond})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := c.Do(ctx, tx, payScope, "pay-do", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return charged, nil
	}); err != nil {
		t.Fatal(err)
	}
	var inProgress *idem.InProgressError
	if _, err := c.Reserve(ctx, pool, payScope, "pay-do", fpA, time.Minute); !errors.As(err, &inProgress) || inProgress.RetryAfter < time.Second {
		t.Fatalf("Reserve during Do: %v, want *InProgressError", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := c.Reserve(ctx, pool, payScope, "pay-do", fpA, time.Minute)
	if err != nil || !r.Replayed || !reflect.DeepEqual(r.Response, charged) || r.Token != 0 {
		t.Fatalf("Reserve after Do: %+v, %v", r, err)
	}
	if keyRows(t, pool) != 1 {
		t.Fatal("more than one row")
	}
}

// Complete replays exactly what it stored, and its Response is checked as
// Do checks fn's.
func TestCompleteStoresExactly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	c := mustClient(t, idem.Config{MaxResponseBytes: 64})
	r, err := c.Reserve(ctx, pool, payScope, "pay-exact", fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	before := readRow(t, pool, payScope, "pay-exact")
	for _, bad := range []struct {
		resp idem.Response
		want error
	}{
		{idem.Response{Status: 42}, idem.ErrInvalidResponse},
		{idem.Response{Status: 200, Header: map[string][]string{"X": {"\xff"}}}, idem.ErrInvalidResponse},
		{idem.Response{Status: 200, Body: make([]byte, 65)}, idem.ErrResponseTooLarge},
	} {
		if err := completeTx(ctx, c, pool, r, bad.resp); !errors.Is(err, bad.want) {
			t.Fatalf("Complete(%v): %v, want %v", bad.resp.Status, err, bad.want)
		}
	}
	if got := readRow(t, pool, payScope, "pay-exact"); !reflect.DeepEqual(got, before) {
		t.Fatalf("a refused Complete changed the row: %+v", got)
	}
	want := idem.Response{Status: 201, Header: map[string][]string{"Location": {"/p/1"}, "X-Multi": {"a", ""}}, Body: []byte("\x00\xff")}
	if err := completeTx(ctx, c, pool, r, want); err != nil {
		t.Fatal(err)
	}
	got, err := c.Reserve(ctx, pool, payScope, "pay-exact", fpA, time.Minute)
	if err != nil || !got.Replayed || !reflect.DeepEqual(got.Response, want) {
		t.Fatalf("replay %+v, %v; want %+v", got.Response, err, want)
	}
	// Do replays it too.
	res, err := c.DoInTx(ctx, pool, payScope, "pay-exact", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		t.Fatal("fn ran")
		return idem.Response{}, nil
	})
	if err != nil || !res.Replayed || !reflect.DeepEqual(res.Response, want) {
		t.Fatalf("Do replay %+v, %v", res, err)
	}
}

// A Heartbeat extends a live lease and never shortens it.
func TestHeartbeatExtends(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	r, err := idem.Reserve(ctx, pool, payScope, "pay-long", fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	longer, err := idem.Heartbeat(ctx, pool, r, time.Hour)
	if err != nil || !longer.LeaseExpiresAt.After(r.LeaseExpiresAt) || longer.Token != r.Token {
		t.Fatalf("Heartbeat: %+v, %v", longer, err)
	}
	same, err := idem.Heartbeat(ctx, pool, longer, time.Second)
	if err != nil || !same.LeaseExpiresAt.Equal(longer.LeaseExpiresAt) {
		t.Fatalf("a short Heartbeat moved the lease: %s -> %s, %v", longer.LeaseExpiresAt, same.LeaseExpiresAt, err)
	}
	if row := readRow(t, pool, payScope, "pay-long"); row.Lease == nil || !row.Lease.Equal(longer.LeaseExpiresAt) {
		t.Fatalf("stored lease %v, want %s", row.Lease, longer.LeaseExpiresAt)
	}
}

// Reserve commits before the work starts, so it needs a pool or a
// connection of its own.
func TestReserveHandles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	conn, err := pgx.Connect(ctx, pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	r, err := idem.Reserve(ctx, conn, payScope, "pay-conn", fpA, time.Minute)
	if err != nil || r.Token <= 0 {
		t.Fatalf("Reserve on a *pgx.Conn: %+v, %v", r, err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := idem.Reserve(ctx, tx, payScope, "pay-tx", fpA, time.Minute); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("Reserve on a pgx.Tx: %v, want ErrInvalidArgument", err)
	}
	if _, err := idem.Reserve(ctx, conn, payScope, "pay-tx", fpA, time.Minute); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("Reserve on a connection in a transaction: %v, want ErrInvalidArgument", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if keyRows(t, pool) != 1 {
		t.Fatal("a refused Reserve wrote a row")
	}
}

// The reservation calls count their outcomes through the client's meter
// (observe.go): Reserve like Do, the others as events.
func TestReservationMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	reader := sdkmetric.NewManualReader()
	spans := tracetest.NewSpanRecorder()
	c := mustClient(t, idem.Config{
		MeterProvider:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
	})
	check := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	reserve := func(key string, lease time.Duration) (idem.Reservation, error) {
		return c.Reserve(ctx, pool, payScope, key, fpA, lease)
	}

	a, err := reserve("a", time.Minute) // created
	check(err)
	check(completeTx(ctx, c, pool, a, charged))
	_, err = reserve("a", time.Minute) // replay
	check(err)
	b, err := reserve("b", time.Minute) // created
	check(err)
	if _, err := reserve("b", time.Minute); !errors.Is(err, idem.ErrInProgress) {
		t.Fatal(err)
	}
	check(c.FailRetryable(ctx, pool, b, "not sent")) // failed_retry
	if err := c.MarkUnknown(ctx, pool, b, "late"); !errors.Is(err, idem.ErrFenced) {
		t.Fatal(err) // fenced
	}
	_, err = reserve("z", time.Millisecond) // created
	check(err)
	waitPast(t, pool, payScope, "z", "lease_expires_at")
	if _, err := reserve("z", time.Minute); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatal(err) // unknown, zombie_key
	}
	y, err := reserve("y", time.Millisecond) // created
	check(err)
	waitPast(t, pool, payScope, "y", "lease_expires_at")
	if n, err := c.ExpireLeases(ctx, pool, 10); err != nil || n != 1 { // zombie_key
		t.Fatalf("ExpireLeases = %d, %v", n, err)
	}
	check(c.MarkUnknown(ctx, pool, y, "timeout"))                                                                    // unknown
	check(c.Resolve(ctx, pool, payScope, "y", idem.Resolution{Token: y.Token, Retryable: true}))                     // reconcile_resolved
	if err := c.Resolve(ctx, pool, payScope, "none", idem.Resolution{Token: y.Token, Retryable: true}); err == nil { // reconcile_failed
		t.Fatal("resolved a key without a record")
	}

	got := counts(t, reader)
	for name, want := range map[string]int64{
		"idem.reserve.created/payment.create":      4,
		"idem.reserve.replay/payment.create":       1,
		"idem.reserve.in_progress/payment.create":  1,
		"idem.reserve.failed_retry/payment.create": 1,
		"idem.reserve.fenced/payment.create":       1,
		"idem.reserve.unknown/payment.create":      2, // Reserve's refusal, MarkUnknown
		"idem.zombie_key/payment.create":           1, // by Reserve
		"idem.zombie_key/":                         1, // by ExpireLeases
		"idem.reconcile.resolved/payment.create":   1,
		"idem.reconcile.failed/payment.create":     1,
	} {
		if got[name] != want {
			t.Errorf("%s = %d, want %d (all: %v)", name, got[name], want, got)
		}
	}
	n := 0
	for _, s := range spans.Ended() {
		if s.Name() == "idem.Reserve" {
			n++
		}
	}
	if n != 7 {
		t.Errorf("%d idem.Reserve spans, want 7", n)
	}
}

// BenchmarkReserve compares a reservation's database work with DoInTx's on
// a fresh key: Reserve (its own transaction) plus Complete (in a second
// one), and Reserve on a key that completed (a replay). Compare ns/op as
// ratios to DoInTx; the outside call itself is not measured.
func BenchmarkReserve(b *testing.B) {
	pool := pgtest.Pool(b, idem.Migrate)
	b.Run("DoInTx", func(b *testing.B) { benchDoInTx(b, pool, benchKeys(b.N), false) })
	b.Run("ReserveComplete", func(b *testing.B) {
		ctx := b.Context()
		keys := benchKeys(b.N)
		b.ReportAllocs()
		b.ResetTimer()
		for _, key := range keys {
			r, err := idem.Reserve(ctx, pool, benchScope, "r"+key, benchFP, time.Minute)
			if err == nil {
				err = idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
					return idem.Complete(ctx, tx, r, benchResp)
				})
			}
			if err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("ReserveReplay", func(b *testing.B) {
		ctx := b.Context()
		keys := benchKeys(b.N)
		completeKeys(b, pool, keys)
		b.ReportAllocs()
		b.ResetTimer()
		for _, key := range keys {
			r, err := idem.Reserve(ctx, pool, benchScope, key, benchFP, time.Minute)
			if err != nil || !r.Replayed {
				b.Fatalf("%+v, %v", r, err)
			}
		}
	})
}
