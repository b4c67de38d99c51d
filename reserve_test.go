package idem_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
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
}

func readRow(t *testing.T, pool *pgxpool.Pool, scope idem.Scope, key string) storedRow {
	t.Helper()
	var r storedRow
	err := pool.QueryRow(context.Background(), `
		SELECT status, fingerprint, token, lease_expires_at, last_error, response_status,
		       response_headers::text, response_body, created_at, completed_at, expires_at
		FROM idem_keys WHERE actor = $1 AND operation = $2 AND idem_key = $3`,
		scope.Actor, scope.Operation, key).Scan(&r.Status, &r.Fingerprint, &r.Token, &r.Lease, &r.LastError,
		&r.RespStatus, &r.RespHeaders, &r.RespBody, &r.Created, &r.Completed, &r.Expires)
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
// (lease_expires_at or expires_at) of the key's row.
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
	"Reserve", "Reserve(other fp)", "Complete", "FailRetryable", "MarkUnknown", "Heartbeat",
	"stale token", "ExpireLeases", "Resolve(succeeded)", "Resolve(retryable)", "Do", "Do(other fp)",
}

// stateTable is the state machine of a key, one row per state and one cell
// per event of stateEvents. A cell is the expected error, or "ok", then
// optionally ">" and the state afterwards:
//
//	run>S   the event executes: nil error, state S; for Reserve a new token
//	replay  nil error, the stored response replayed; the row unchanged
//	ok      nil error, the row unchanged
//	E       the error E (InProgress, KeyReused, OutcomeUnknown, Fenced,
//	        NotFound, NotResolvable); the row unchanged
//	X>S     X as above, then state S with the same token ("S+": a new
//	        token; "*": processing or unknown, the same token)
//
// "Complete", "FailRetryable", "MarkUnknown" and "Heartbeat" are called by
// the reservation that brought the key into the state (a token never
// issued when Do or nobody did); "stale token" calls all four with a token
// that never held the key.
var stateTable = []struct {
	state string
	cells [12]string
}{
	{"none", [12]string{"run>processing", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotFound", "NotFound", "run>succeeded", "run>succeeded"}},
	{"processing", [12]string{"InProgress", "KeyReused", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "ok>processing",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "InProgress", "KeyReused"}},
	{"processing, lease ran out", [12]string{"OutcomeUnknown>unknown", "KeyReused", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "Fenced",
		"Fenced", "ok>unknown", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown>*", "KeyReused"}},
	{"succeeded", [12]string{"replay", "KeyReused", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "replay", "KeyReused"}},
	{"rejected (Do)", [12]string{"replay", "KeyReused", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "replay", "KeyReused"}},
	{"failed_retryable", [12]string{"run>processing", "KeyReused", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "KeyReused"}},
	{"unknown", [12]string{"OutcomeUnknown", "KeyReused", "Fenced", "Fenced", "ok>unknown", "Fenced",
		"Fenced", "ok", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused"}},
	{"succeeded, past TTL", [12]string{"run>processing", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "run>succeeded"}},
	{"rejected (Do), past TTL", [12]string{"run>processing", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "run>succeeded"}},
	{"failed_retryable, past TTL", [12]string{"run>processing", "run>processing", "Fenced", "Fenced", "Fenced", "Fenced",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "run>succeeded", "run>succeeded"}},
	{"unknown, past TTL", [12]string{"OutcomeUnknown", "KeyReused", "Fenced", "Fenced", "ok>unknown", "Fenced",
		"Fenced", "ok", "ok>succeeded+", "ok>failed_retryable+", "OutcomeUnknown", "KeyReused"}},
	{"processing, past TTL", [12]string{"InProgress", "KeyReused", "ok>succeeded", "ok>failed_retryable", "ok>unknown", "ok>processing",
		"Fenced", "ok", "NotResolvable", "NotResolvable", "InProgress", "KeyReused"}},
}

var stateErrors = map[string]error{
	"InProgress": idem.ErrInProgress, "KeyReused": idem.ErrKeyReused, "OutcomeUnknown": idem.ErrOutcomeUnknown,
	"Fenced": idem.ErrFenced, "NotFound": idem.ErrNotFound, "NotResolvable": idem.ErrNotResolvable,
}

// TestStateTable puts a key into every state and applies every event to it.
// The cells of the Do columns depend on the core's side of the state
// machine.
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
		default:
			l := lease
			if base == "processing, lease ran out" {
				l = time.Millisecond
			}
			owner, err = cl.Reserve(ctx, pool, payScope, key, fpA, l)
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
		}
		if pastTTL {
			waitPast(t, pool, payScope, key, "expires_at")
		}
		want, _, _ := strings.Cut(base, ",")
		want = strings.TrimSuffix(want, " (Do)")
		if got := readRow(t, pool, payScope, key); got.Status != want {
			t.Fatalf("setup %s: row %+v", state, got)
		}
		return owner
	}

	// event applies an event; replayed and ran say what Reserve or Do did.
	event := func(t *testing.T, name, key string, owner idem.Reservation) (replayed, ran bool, err error) {
		t.Helper()
		var runs atomic.Int64
		fn := func(context.Context, pgx.Tx) (idem.Response, error) {
			runs.Add(1)
			return idem.Response{Status: 200, Body: []byte("by Do")}, nil
		}
		switch name {
		case "Reserve", "Reserve(other fp)":
			fp := fpA
			if name != "Reserve" {
				fp = fpB
			}
			r, err := c.Reserve(ctx, pool, payScope, key, fp, lease)
			if err == nil && !r.Replayed && r.Token <= 0 {
				t.Fatalf("Reserve executes without a token: %+v", r)
			}
			return r.Replayed, err == nil && !r.Replayed, err
		case "Complete":
			return false, false, completeTx(ctx, c, pool, owner, charged)
		case "FailRetryable":
			return false, false, c.FailRetryable(ctx, pool, owner, "connection refused")
		case "MarkUnknown":
			return false, false, c.MarkUnknown(ctx, pool, owner, "read timeout")
		case "Heartbeat":
			r, err := c.Heartbeat(ctx, pool, owner, 2*lease)
			if err == nil && !r.LeaseExpiresAt.After(owner.LeaseExpiresAt) {
				t.Fatalf("Heartbeat: lease %s, before %s", r.LeaseExpiresAt, owner.LeaseExpiresAt)
			}
			return false, false, err
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
					return false, false, err
				}
			}
			return false, false, idem.ErrFenced
		case "ExpireLeases":
			_, err := c.ExpireLeases(ctx, pool, 10)
			return false, false, err
		case "Resolve(succeeded)":
			return false, false, c.Resolve(ctx, pool, payScope, key, idem.Resolution{Succeeded: &resolved, Reason: "charge found"})
		case "Resolve(retryable)":
			return false, false, c.Resolve(ctx, pool, payScope, key, idem.Resolution{Retryable: true, Reason: "no charge"})
		case "Do", "Do(other fp)":
			fp := fpA
			if name != "Do" {
				fp = fpB
			}
			res, err := c.DoInTx(ctx, pool, payScope, key, fp, fn)
			if n := runs.Load(); (err == nil && !res.Replayed) != (n == 1) || n > 1 {
				t.Fatalf("%s: fn ran %d times, result %+v, err %v", name, n, res, err)
			}
			return res.Replayed, runs.Load() == 1, err
		}
		t.Fatalf("no event %q", name)
		return false, false, nil
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
				replayed, ran, err := event(t, name, key, owner)
				after := readRow(t, pool, payScope, key)

				want, state, _ := strings.Cut(cell, ">")
				newToken := strings.HasSuffix(state, "+")
				state = strings.TrimSuffix(state, "+")
				switch {
				case want == "ok" || want == "run" || want == "replay":
					if err != nil {
						t.Fatalf("%s on %s: %v, want %s", name, row.state, err, cell)
					}
				case !errors.Is(err, stateErrors[want]):
					t.Fatalf("%s on %s: err = %v, want %s", name, row.state, err, cell)
				}
				if replayed != (want == "replay") || ran != (want == "run") {
					t.Fatalf("%s on %s: replayed %t, ran %t; want %s", name, row.state, replayed, ran, cell)
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
					case want == "run" || newToken:
						if after.Token <= before.Token {
							t.Fatalf("%s on %s: token %d, before %d; want a new one", name, row.state, after.Token, before.Token)
						}
					case after.Token != before.Token:
						t.Fatalf("%s on %s: token %d, before %d; want the same", name, row.state, after.Token, before.Token)
					}
				}
				if name == "Reserve" && replayed {
					r, _ := c.Reserve(ctx, pool, payScope, key, fpA, lease)
					if before.RespStatus == nil || r.Status != int(*before.RespStatus) || string(r.Body) != string(before.RespBody) {
						t.Fatalf("replayed %+v, stored %+v", r.Response, before)
					}
				}
				if after.Status == "unknown" && before.Status == "processing" && name != "MarkUnknown" &&
					(after.LastError == nil || !strings.Contains(*after.LastError, "lease")) {
					t.Fatalf("an expired lease left last_error %v", after.LastError)
				}
			})
		}
	}
}
