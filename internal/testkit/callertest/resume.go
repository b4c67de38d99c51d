package callertest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// Front is a front's reservation and operator calls bound to one database
// and one configuration: what the scenarios of resumable reservations
// (Resume, ResumeRace) need, for idem (PgxFront) and idemsql (SQLFront)
// alike.
type Front interface {
	ReserveWith(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint, opts idem.ReserveOptions) (idem.Reservation, error)
	// Complete runs Complete in a transaction of its own, committed when
	// Complete succeeds.
	Complete(ctx context.Context, r idem.Reservation, resp idem.Response) error
	FailRetryable(ctx context.Context, r idem.Reservation, reason string) error
	MarkUnknown(ctx context.Context, r idem.Reservation, reason string) error
	Heartbeat(ctx context.Context, r idem.Reservation, extend time.Duration) (idem.Reservation, error)
	ExpireLeases(ctx context.Context, limit int) (int64, error)
	ListUnknown(ctx context.Context, limit int, after *idem.Record) ([]idem.Record, error)
	ListResumable(ctx context.Context, limit int, after *idem.Record) ([]idem.Record, error)
	Lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error)
	Resolve(ctx context.Context, scope idem.Scope, key string, res idem.Resolution) error
	Forget(ctx context.Context, scope idem.Scope, key string) error
	Prune(ctx context.Context) (int64, error)
	// DoInTx runs DoInTx with a fn that changes nothing and answers 200.
	DoInTx(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint) (idem.Result, error)
}

// NewFront makes a Front with the configuration cfg.
type NewFront func(t testing.TB, cfg idem.Config) Front

// PgxFront returns idem's calls on pool.
func PgxFront(pool *pgxpool.Pool) NewFront {
	return func(t testing.TB, cfg idem.Config) Front {
		c, err := idem.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return front[idem.Beginner, pgx.Tx]{c, pool}
	}
}

// SQLFront returns idemsql's calls on db, with a NewCitus Client when
// citus is set.
func SQLFront(db *sql.DB, citus bool) NewFront {
	return func(t testing.TB, cfg idem.Config) Front {
		newClient := idemsql.New
		if citus {
			newClient = idemsql.NewCitus
		}
		c, err := newClient(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return front[*sql.DB, *sql.Tx]{c, db}
	}
}

// client is what idem.Client and idemsql.Client have alike: their calls on
// a handle TDB and a transaction TTx.
type client[TDB, TTx any] interface {
	ReserveWith(ctx context.Context, db TDB, scope idem.Scope, key string, fp idem.Fingerprint, opts idem.ReserveOptions) (idem.Reservation, error)
	InTx(ctx context.Context, db TDB, fn func(ctx context.Context, tx TTx) error) error
	Complete(ctx context.Context, tx TTx, r idem.Reservation, resp idem.Response) error
	FailRetryable(ctx context.Context, db TDB, r idem.Reservation, reason string) error
	MarkUnknown(ctx context.Context, db TDB, r idem.Reservation, reason string) error
	Heartbeat(ctx context.Context, db TDB, r idem.Reservation, extend time.Duration) (idem.Reservation, error)
	ExpireLeases(ctx context.Context, db TDB, limit int) (int64, error)
	ListUnknown(ctx context.Context, db TDB, limit int, after *idem.Record) ([]idem.Record, error)
	ListResumable(ctx context.Context, db TDB, limit int, after *idem.Record) ([]idem.Record, error)
	Lookup(ctx context.Context, db TDB, scope idem.Scope, key string) (idem.Record, error)
	Resolve(ctx context.Context, db TDB, scope idem.Scope, key string, res idem.Resolution) error
	Forget(ctx context.Context, db TDB, scope idem.Scope, key string) error
	Prune(ctx context.Context, db TDB, opts idem.PruneOptions) (int64, error)
	DoInTx(ctx context.Context, db TDB, scope idem.Scope, key string, fp idem.Fingerprint,
		fn func(ctx context.Context, tx TTx) (idem.Response, error)) (idem.Result, error)
}

// front is a Front over a client and its handle.
type front[TDB, TTx any] struct {
	c  client[TDB, TTx]
	db TDB
}

func (f front[TDB, TTx]) ReserveWith(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint, opts idem.ReserveOptions) (idem.Reservation, error) {
	return f.c.ReserveWith(ctx, f.db, scope, key, fp, opts)
}
func (f front[TDB, TTx]) Complete(ctx context.Context, r idem.Reservation, resp idem.Response) error {
	return f.c.InTx(ctx, f.db, func(ctx context.Context, tx TTx) error { return f.c.Complete(ctx, tx, r, resp) })
}
func (f front[TDB, TTx]) FailRetryable(ctx context.Context, r idem.Reservation, reason string) error {
	return f.c.FailRetryable(ctx, f.db, r, reason)
}
func (f front[TDB, TTx]) MarkUnknown(ctx context.Context, r idem.Reservation, reason string) error {
	return f.c.MarkUnknown(ctx, f.db, r, reason)
}
func (f front[TDB, TTx]) Heartbeat(ctx context.Context, r idem.Reservation, extend time.Duration) (idem.Reservation, error) {
	return f.c.Heartbeat(ctx, f.db, r, extend)
}
func (f front[TDB, TTx]) ExpireLeases(ctx context.Context, limit int) (int64, error) {
	return f.c.ExpireLeases(ctx, f.db, limit)
}
func (f front[TDB, TTx]) ListUnknown(ctx context.Context, limit int, after *idem.Record) ([]idem.Record, error) {
	return f.c.ListUnknown(ctx, f.db, limit, after)
}
func (f front[TDB, TTx]) ListResumable(ctx context.Context, limit int, after *idem.Record) ([]idem.Record, error) {
	return f.c.ListResumable(ctx, f.db, limit, after)
}
func (f front[TDB, TTx]) Lookup(ctx context.Context, scope idem.Scope, key string) (idem.Record, error) {
	return f.c.Lookup(ctx, f.db, scope, key)
}
func (f front[TDB, TTx]) Resolve(ctx context.Context, scope idem.Scope, key string, res idem.Resolution) error {
	return f.c.Resolve(ctx, f.db, scope, key, res)
}
func (f front[TDB, TTx]) Forget(ctx context.Context, scope idem.Scope, key string) error {
	return f.c.Forget(ctx, f.db, scope, key)
}
func (f front[TDB, TTx]) Prune(ctx context.Context) (int64, error) {
	return f.c.Prune(ctx, f.db, idem.PruneOptions{})
}
func (f front[TDB, TTx]) DoInTx(ctx context.Context, scope idem.Scope, key string, fp idem.Fingerprint) (idem.Result, error) {
	return f.c.DoInTx(ctx, f.db, scope, key, fp, func(context.Context, TTx) (idem.Response, error) {
		return idem.Response{Status: 200}, nil
	})
}

// Gateway stands in for a provider that deduplicates by key: it charges
// once per key and answers every repeat of the key with the first charge.
// It counts the requests and the charges of each key.
type Gateway struct {
	mu       sync.Mutex
	charges  map[string]string // by key: the charge
	requests map[string]int
}

// NewGateway returns an empty Gateway.
func NewGateway() *Gateway {
	return &Gateway{charges: map[string]string{}, requests: map[string]int{}}
}

// Charge charges under key, or answers the charge made under it before.
func (g *Gateway) Charge(key string) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.requests[key]++
	id, ok := g.charges[key]
	if !ok {
		id = fmt.Sprintf("ch_%d", len(g.charges)+1)
		g.charges[key] = id
	}
	return id
}

// Counts returns how many charges and requests key has had: a provider that
// deduplicates makes one charge however many requests come.
func (g *Gateway) Counts(key string) (charges, requests int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.charges[key]; ok {
		charges = 1
	}
	return charges, g.requests[key]
}

// Charges returns how many charges the gateway made in all.
func (g *Gateway) Charges() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.charges)
}

// ResumeScope is the scope of the resume scenarios' keys.
var ResumeScope = idem.Scope{Actor: "alice", Operation: "payment.create"}

// waitFor polls cond every few milliseconds until it holds, or fails t
// after ten seconds: the database clock decides leases and windows, so the
// scenarios wait until a statement sees them pass.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited 10s for %s", what)
		}
	}
}

// listed reports whether list's first page holds key.
func listed(t testing.TB, list func(ctx context.Context, limit int, after *idem.Record) ([]idem.Record, error), key string) bool {
	t.Helper()
	recs, err := list(context.Background(), 100, nil)
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(recs, func(r idem.Record) bool { return r.Key == key })
}

// Resume is the life of reservations made with a window, through one
// front: an attempt whose lease ran out inside its window is left alone by
// ExpireLeases, listed by ListResumable and not by ListUnknown, and resumed
// by the next Reserve (with or without a window of its own: the stored one
// counts) with a new token, its lease no later than the window, while the
// stale worker is fenced; an attempt marked unknown inside its window is
// resumed too; Do, Forget and Prune leave attempts in doubt alone, Resolve
// settles one inside its window; past the window an attempt in doubt is a
// person's, as without one. Options out of range are refused and change
// nothing.
func Resume(t *testing.T, newFront NewFront) {
	ctx := context.Background()
	f := newFront(t, idem.Config{Wait: 200 * time.Millisecond})
	scope, fp, gw := ResumeScope, idem.FingerprintParts([]byte("12000 KRW")), NewGateway()
	paid := idem.Response{Status: 201, Body: []byte(`{"charge":"ch_1"}`)}
	window := idem.ReserveOptions{Lease: 50 * time.Millisecond, ResumeWithin: time.Hour}
	isErr := func(what string, err, want error) {
		t.Helper()
		if !errors.Is(err, want) {
			t.Fatalf("%s: %v, want %v", what, err, want)
		}
	}

	// Bad options: refused, nothing stored.
	for _, opts := range []idem.ReserveOptions{
		{ResumeWithin: -time.Second},
		{Lease: -time.Second},
		{Lease: time.Nanosecond},
		{Lease: time.Minute, ResumeWithin: time.Second},
		{ResumeWithin: time.Second}, // shorter than the default lease
	} {
		_, err := f.ReserveWith(ctx, scope, "bad", fp, opts)
		isErr(fmt.Sprintf("ReserveWith(%+v)", opts), err, idem.ErrInvalidArgument)
	}
	if _, err := f.Lookup(ctx, scope, "bad"); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("a refused ReserveWith stored a record: %v", err)
	}

	// The first attempt charges, and its worker vanishes before Complete.
	first, err := f.ReserveWith(ctx, scope, "k1", fp, window)
	if err != nil || first.Resumed || first.Token <= 0 {
		t.Fatalf("ReserveWith: %+v, %v", first, err)
	}
	gw.Charge(first.CallKey("charge"))
	rec, err := f.Lookup(ctx, scope, "k1")
	if err != nil || rec.ResumeUntil.IsZero() || rec.ResumeUntil.Before(rec.CreatedAt.Add(time.Hour-time.Minute)) {
		t.Fatalf("the window of a new key: %+v, %v", rec, err)
	}
	window1 := rec.ResumeUntil
	waitFor(t, "the lease to run out", func() bool { return listed(t, f.ListResumable, "k1") })
	if n, err := f.ExpireLeases(ctx, 100); err != nil || n != 0 {
		t.Fatalf("ExpireLeases inside the window: %d, %v", n, err)
	}
	if listed(t, f.ListUnknown, "k1") {
		t.Fatal("ListUnknown lists an attempt inside its window")
	}
	_, err = f.DoInTx(ctx, scope, "k1", fp)
	isErr("DoInTx on an attempt in doubt inside its window", err, idem.ErrOutcomeUnknown)
	isErr("Forget of an attempt in doubt inside its window", f.Forget(ctx, scope, "k1"), idem.ErrOutcomeUnknown)
	_, err = f.ReserveWith(ctx, scope, "k1", idem.FingerprintParts([]byte("other")), window)
	isErr("ReserveWith with another fingerprint", err, idem.ErrKeyReused)

	// The next Reserve, without a window of its own, resumes it.
	resumed, err := f.ReserveWith(ctx, scope, "k1", fp, idem.ReserveOptions{Lease: 2 * time.Hour})
	if err != nil || !resumed.Resumed || resumed.Token <= first.Token || resumed.CallKey("charge") != first.CallKey("charge") {
		t.Fatalf("the resume: %+v, %v (first %+v)", resumed, err, first)
	}
	rec, err = f.Lookup(ctx, scope, "k1")
	if err != nil || !rec.ResumeUntil.Equal(window1) || !rec.LeaseExpiresAt.Equal(window1) || !resumed.LeaseExpiresAt.Equal(window1) {
		t.Fatalf("a resume keeps the window and its lease ends with it: %+v (reservation %+v), %v", rec, resumed, err)
	}
	if listed(t, f.ListResumable, "k1") {
		t.Fatal("ListResumable lists an attempt whose lease runs")
	}
	isErr("the stale worker's Complete", f.Complete(ctx, first, paid), idem.ErrFenced)
	isErr("the stale worker's MarkUnknown", f.MarkUnknown(ctx, first, "late"), idem.ErrFenced)
	if hb, err := f.Heartbeat(ctx, resumed, 3*time.Hour); err != nil || !hb.LeaseExpiresAt.Equal(window1) {
		t.Fatalf("the resumed lease extended past the window: %+v, %v", hb, err)
	}

	// Its worker gives up without an answer: unknown, inside the window,
	// resumed again.
	if err := f.MarkUnknown(ctx, resumed, "no answer"); err != nil {
		t.Fatal(err)
	}
	if !listed(t, f.ListResumable, "k1") || listed(t, f.ListUnknown, "k1") {
		t.Fatal("an unknown attempt inside its window is ListResumable's, not ListUnknown's")
	}
	_, err = f.DoInTx(ctx, scope, "k1", fp)
	isErr("DoInTx on an unknown attempt inside its window", err, idem.ErrOutcomeUnknown)
	again, err := f.ReserveWith(ctx, scope, "k1", fp, window)
	if err != nil || !again.Resumed || again.Token <= resumed.Token {
		t.Fatalf("the resume of an unknown attempt: %+v, %v", again, err)
	}
	if id := gw.Charge(again.CallKey("charge")); id != "ch_1" {
		t.Fatalf("the gateway charged again: %s", id)
	}
	if err := f.Complete(ctx, again, paid); err != nil {
		t.Fatal(err)
	}
	if r, err := f.ReserveWith(ctx, scope, "k1", fp, window); err != nil || !r.Replayed {
		t.Fatalf("after Complete: %+v, %v", r, err)
	}
	if charges, requests := gw.Counts(first.CallKey("charge")); charges != 1 || requests != 2 {
		t.Fatalf("%d charges for %d requests", charges, requests)
	}

	// FailRetryable inside the window: the next attempt keeps the window.
	r2, err := f.ReserveWith(ctx, scope, "k2", fp, window)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.FailRetryable(ctx, r2, "refused before charging"); err != nil {
		t.Fatal(err)
	}
	before, _ := f.Lookup(ctx, scope, "k2")
	r2b, err := f.ReserveWith(ctx, scope, "k2", fp, idem.ReserveOptions{})
	after, _ := f.Lookup(ctx, scope, "k2")
	if err != nil || r2b.Resumed || !after.ResumeUntil.Equal(before.ResumeUntil) || after.ResumeUntil.IsZero() {
		t.Fatalf("a new attempt after FailRetryable: %+v, %v; window %s, before %s", r2b, err, after.ResumeUntil, before.ResumeUntil)
	}

	// Resolve settles an attempt in doubt inside its window.
	r3, err := f.ReserveWith(ctx, scope, "k3", fp, window)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.MarkUnknown(ctx, r3, "no answer"); err != nil {
		t.Fatal(err)
	}
	if err := f.Resolve(ctx, scope, "k3", idem.Resolution{Token: r3.Token, Succeeded: &paid, Reason: "found"}); err != nil {
		t.Fatalf("Resolve inside the window: %v", err)
	}
	if r, err := f.ReserveWith(ctx, scope, "k3", fp, window); err != nil || !r.Replayed {
		t.Fatalf("after Resolve: %+v, %v", r, err)
	}

	// Past the window, an attempt in doubt is a person's, as without one.
	short := idem.ReserveOptions{Lease: time.Millisecond, ResumeWithin: 20 * time.Millisecond}
	r4, err := f.ReserveWith(ctx, scope, "k4", fp, short)
	if err != nil {
		t.Fatal(err)
	}
	r5, err := f.ReserveWith(ctx, scope, "k5", fp, short)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.MarkUnknown(ctx, r5, "no answer"); err != nil {
		t.Fatal(err)
	}
	var expired int64
	waitFor(t, "the window to end", func() bool {
		n, err := f.ExpireLeases(ctx, 100)
		if err != nil {
			t.Fatal(err)
		}
		expired += n
		// k5's window ends a little after k4's: it was reserved later.
		return expired == 1 && !listed(t, f.ListResumable, "k5")
	})
	if !listed(t, f.ListUnknown, "k4") || !listed(t, f.ListUnknown, "k5") || listed(t, f.ListResumable, "k4") || listed(t, f.ListResumable, "k5") {
		t.Fatal("past the window, attempts in doubt are ListUnknown's")
	}
	for _, key := range []string{"k4", "k5"} {
		_, err := f.ReserveWith(ctx, scope, key, fp, window)
		isErr("ReserveWith past the window", err, idem.ErrOutcomeUnknown)
	}
	if rec, err := f.Lookup(ctx, scope, "k4"); err != nil || rec.Token != r4.Token || rec.Status != idem.StatusUnknown {
		t.Fatalf("past the window: %+v, %v", rec, err)
	}

	// Prune never deletes an attempt in doubt, past its TTL inside its
	// window or not.
	ttl := newFront(t, idem.Config{TTL: time.Millisecond})
	r6, err := ttl.ReserveWith(ctx, scope, "k6", fp, idem.ReserveOptions{Lease: time.Millisecond, ResumeWithin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the lease and the TTL to run out", func() bool { return listed(t, f.ListResumable, "k6") })
	time.Sleep(5 * time.Millisecond)
	if _, err := ttl.Prune(ctx); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"k4", "k5", "k6"} {
		if _, err := f.Lookup(ctx, scope, key); err != nil {
			t.Fatalf("Prune deleted %s, in doubt: %v", key, err)
		}
	}
	if r, err := ttl.ReserveWith(ctx, scope, "k6", fp, idem.ReserveOptions{}); err != nil || !r.Resumed || r.Token <= r6.Token {
		t.Fatalf("the resume past the TTL, inside the window: %+v, %v", r, err)
	}
}

// ResumeRace puts a recovery worker's race on one front: attempts that
// charged and whose worker vanished, each raced for by two recovery workers
// (ListResumable, then ReserveWith) and the client's retry (ReserveWith),
// each on its own connection. Exactly one of them resumes each attempt
// (the token), the others are refused (ErrInProgress) or get the replay of
// its outcome; the gateway charges once per attempt; the vanished worker is
// fenced; nothing is left for a person.
func ResumeRace(t *testing.T, newFront NewFront, rounds int) {
	ctx := context.Background()
	f := newFront(t, idem.Config{Wait: 2 * time.Second})
	scope, fp, gw := ResumeScope, idem.FingerprintParts([]byte("12000 KRW")), NewGateway()
	// The attempts that vanish hold short leases; those that resume them a
	// lease that outlasts the round, so that a second resume can only come
	// from a race, never from a slow winner.
	vanishing := idem.ReserveOptions{Lease: 20 * time.Millisecond, ResumeWithin: time.Hour}
	opts := idem.ReserveOptions{Lease: time.Minute, ResumeWithin: time.Hour}
	paid := func(charge string) idem.Response { return idem.Response{Status: 201, Body: []byte(charge)} }

	stale := make(map[string]idem.Reservation, rounds)
	for i := range rounds {
		key := fmt.Sprintf("race-%d", i)
		r, err := f.ReserveWith(ctx, scope, key, fp, vanishing)
		if err != nil {
			t.Fatal(err)
		}
		gw.Charge(r.CallKey("charge"))
		stale[key] = r
	}
	waitFor(t, "the leases to run out", func() bool {
		recs, err := f.ListResumable(ctx, rounds+1, nil)
		if err != nil {
			t.Fatal(err)
		}
		return len(recs) == rounds
	})

	// attempt resumes key's attempt when it can, makes the call again and
	// completes it; it reports whether it resumed.
	var fenced, inProgress, replays atomic.Int64
	attempt := func(key string) bool {
		r, err := f.ReserveWith(ctx, scope, key, fp, opts)
		switch {
		case errors.Is(err, idem.ErrInProgress):
			inProgress.Add(1)
			return false
		case err != nil:
			t.Errorf("%s: %v", key, err)
			return false
		case r.Replayed:
			replays.Add(1)
			return false
		case !r.Resumed:
			t.Errorf("%s: executed without resuming: %+v", key, r)
			return false
		}
		charge := gw.Charge(r.CallKey("charge"))
		if err := f.Complete(ctx, r, paid(charge)); errors.Is(err, idem.ErrFenced) {
			fenced.Add(1)
		} else if err != nil {
			t.Errorf("%s: Complete: %v", key, err)
		}
		return true
	}
	var wins sync.Map // key -> *atomic.Int64
	win := func(key string) {
		n, _ := wins.LoadOrStore(key, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
	}
	for i := range rounds {
		key := fmt.Sprintf("race-%d", i)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for range 2 { // recovery workers
			wg.Go(func() {
				<-start
				recs, err := f.ListResumable(ctx, rounds, nil)
				if err != nil {
					t.Error(err)
					return
				}
				for _, rec := range recs {
					if rec.Key == key && attempt(key) {
						win(key)
					}
				}
			})
		}
		wg.Go(func() { // the client's retry
			<-start
			if attempt(key) {
				win(key)
			}
		})
		close(start)
		wg.Wait()
	}
	for key, r := range stale {
		n, _ := wins.Load(key)
		if n == nil || n.(*atomic.Int64).Load() != 1 {
			t.Errorf("%s: resumed %v times, want once", key, n)
		}
		if err := f.Complete(ctx, r, paid("late")); !errors.Is(err, idem.ErrFenced) {
			t.Errorf("%s: the vanished worker's Complete: %v, want ErrFenced", key, err)
		}
		if charges, _ := gw.Counts(r.CallKey("charge")); charges != 1 {
			t.Errorf("%s: %d charges", key, charges)
		}
		rec, err := f.Lookup(ctx, scope, key)
		if err != nil || rec.Status != idem.StatusSucceeded {
			t.Errorf("%s: %+v, %v", key, rec, err)
		}
	}
	if fenced.Load() != 0 || gw.Charges() != rounds {
		t.Errorf("%d resumes fenced, %d charges for %d attempts", fenced.Load(), gw.Charges(), rounds)
	}
	for _, list := range []func(context.Context, int, *idem.Record) ([]idem.Record, error){f.ListUnknown, f.ListResumable} {
		if recs, err := list(ctx, 10, nil); err != nil || len(recs) != 0 {
			t.Errorf("left over: %+v, %v", recs, err)
		}
	}
	t.Logf("%d attempts: %d refusals in progress, %d replays", rounds, inProgress.Load(), replays.Load())
}
