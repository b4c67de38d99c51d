package audit_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

var (
	scope = idem.Scope{Actor: "acme", Operation: "charge"}
	fp    = idem.FingerprintParts([]byte("x"))
)

func rows(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), `SELECT
		coalesce((SELECT string_agg(k::text, E'\n' ORDER BY idem_key) FROM idem_keys k), '') || E'\n--\n' ||
		coalesce((SELECT string_agg(a::text, E'\n' ORDER BY id) FROM idem_audit a), '')`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// unknownRecord returns a pool on a fresh database that holds one unknown
// outcome, of (scope, "k"), and its reservation.
func unknownRecord(t *testing.T) (*pgxpool.Pool, idem.Reservation) {
	t.Helper()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	r, err := idem.Reserve(ctx, pool, scope, "k", fp, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "timeout"); err != nil {
		t.Fatal(err)
	}
	return pool, r
}

// An operator name the trail cannot hold is refused before anything runs.
func TestOperatorChecked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, r := unknownRecord(t)
	before := rows(t, pool)
	for _, op := range []string{"", "a\x00b", "\xff", "dana.kim\x1b[8m", "a\nb", "a\u0085b", strings.Repeat("o", audit.MaxOperatorLength+1)} {
		_, _, err := audit.Resolve(ctx, pool, nil, op, scope, "k", idem.Resolution{Token: r.Token, Retryable: true})
		if !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("operator %q: %v", op, err)
		}
		if _, err := audit.ExpireLeases(ctx, pool, nil, op, audit.Filter{}, time.Now()); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("expire, operator %q: %v", op, err)
		}
	}
	if _, _, err := audit.Prune(ctx, pool, nil, "op", idem.PruneOptions{}, "ttl"); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("an unbounded audited prune: %v", err)
	}
	for _, reason := range []string{"a\x00b", "\xff", strings.Repeat("r", audit.MaxReasonLength+1)} {
		if _, _, err := audit.Prune(ctx, pool, nil, "op", idem.PruneOptions{MaxBatches: 1}, reason); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("prune, reason %q: %v", reason, err)
		}
		if _, err := audit.Forget(ctx, pool, nil, "op", scope, "k", nil, reason); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("forget, reason %q: %v", reason, err)
		}
	}
	if after := rows(t, pool); after != before {
		t.Fatalf("a refused change changed something:\n%s\n%s", before, after)
	}
}

// On a caller's transaction the change and its row are the caller's: they
// go when it rolls back, and commit with it.
func TestInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, r := unknownRecord(t)
	before := rows(t, pool)
	for _, commit := range []bool{false, true} {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		e, _, err := audit.Resolve(ctx, tx, nil, "sam", scope, "k", idem.Resolution{Token: r.Token, Retryable: true, Reason: "no charge"})
		if err != nil || e.ID == 0 || e.TokenBefore != r.Token || e.TokenAfter <= r.Token ||
			e.StatusBefore != idem.StatusUnknown || e.StatusAfter != idem.StatusFailedRetryable {
			t.Fatalf("resolve: %+v, %v", e, err)
		}
		if !commit {
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			if after := rows(t, pool); after != before {
				t.Fatalf("a rolled-back change stayed:\n%s", after)
			}
			continue
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	list, err := listAll(ctx, pool)
	if err != nil || len(list) != 1 || list[0].Operator != "sam" || list[0].Verdict != audit.VerdictRetryable {
		t.Fatalf("the trail: %+v, %v", list, err)
	}
}

func listAll(ctx context.Context, pool *pgxpool.Pool) ([]audit.Entry, error) {
	var out []audit.Entry
	err := audit.Read(ctx, pool, func(ctx context.Context, q audit.Planned) error {
		var err error
		out, err = audit.List(ctx, q, audit.ListFilter{Limit: 100})
		return err
	})
	return out, err
}

// A reservation whose worker completes it while the console's expire waits
// for its row stays completed, as with idem's ExpireLeases on Citus: the
// conditions are checked again on the row as the worker left it.
func TestExpireLeasesWaitsForTheWorker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	r, err := idem.Reserve(ctx, pool, scope, "lapsed", fp, time.Microsecond)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Millisecond)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.Complete(ctx, tx, r, idem.Response{Status: 200}); err != nil {
		t.Fatal(err)
	}
	type result struct {
		e   audit.Entry
		err error
	}
	done := make(chan result, 1)
	go func() {
		e, err := audit.ExpireLeases(ctx, pool, nil, "sam", audit.Filter{}, time.Now().Add(time.Minute))
		done <- result{e, err}
	}()
	select {
	case res := <-done:
		t.Fatalf("expire did not wait for the worker's transaction: %+v, %v", res.e, res.err)
	case <-time.After(200 * time.Millisecond):
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	res := <-done
	if res.err != nil || res.e.Changed != 0 || res.e.ID != 0 {
		t.Fatalf("expire after the worker completed: %+v, %v", res.e, res.err)
	}
	rec, err := idem.Lookup(ctx, pool, scope, "lapsed")
	if err != nil || rec.Status != idem.StatusSucceeded {
		t.Fatalf("the completed reservation: %+v, %v", rec, err)
	}
	if list, err := listAll(ctx, pool); err != nil || len(list) != 0 {
		t.Fatalf("a change that changed nothing left a row: %+v, %v", list, err)
	}
}

// Migrating down from 5 drops the trail only when it is empty, or forced.
func TestMigrateDownKeepsTheTrail(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	version := func() int64 {
		var v int64
		if err := pool.QueryRow(ctx, `SELECT max(version_id) FROM `+idem.MigrationTable+` WHERE is_applied`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	downTo5 := func() { // past the migrations after 5, which keep everything
		for version() > 5 {
			if _, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The trail gets a row while the schema is the code's (the latest).
	if _, err := idem.DoInTx(ctx, pool, scope, "done", fp, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 200}, nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := audit.Forget(ctx, pool, nil, "sam", scope, "done", nil, "reused"); err != nil {
		t.Fatal(err)
	}
	downTo5()
	_, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{})
	if !errors.Is(err, idem.ErrDowngradeDeletesRecords) || !strings.Contains(err.Error(), "1 rows of the operators' audit trail") || version() != 5 {
		t.Fatalf("MigrateDown with a trail: %v (version %d)", err, version())
	}
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{Force: true}); err != nil || v != 5 {
		t.Fatalf("forced: %d, %v", v, err)
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	downTo5()
	if v, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || v != 5 {
		t.Fatalf("an empty trail goes without force: %d, %v", v, err)
	}
}

// rollbackSpy is a Beginner whose transactions report, when their Rollback
// is called, whether its context has a deadline and whether it is done.
type rollbackSpy struct {
	pool      *pgxpool.Pool
	rollbacks chan [2]bool
}

func (s rollbackSpy) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := s.pool.Begin(ctx)
	return spiedTx{tx, s.rollbacks}, err
}

type spiedTx struct {
	pgx.Tx
	rollbacks chan [2]bool
}

func (t spiedTx) Rollback(ctx context.Context) error {
	_, bounded := ctx.Deadline()
	t.rollbacks <- [2]bool{bounded, ctx.Err() != nil}
	return t.Tx.Rollback(ctx)
}

// Read rolls its transaction back also when the caller's context is done,
// with a bounded context (a server that stops answering cannot hold the
// page forever).
func TestReadRollbackIsBounded(t *testing.T) {
	t.Parallel()
	spy := rollbackSpy{pgtest.Pool(t, idem.Migrate), make(chan [2]bool, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	err := audit.Read(ctx, spy, func(ctx context.Context, q audit.Planned) error {
		cancel()
		return ctx.Err()
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Read: %v", err)
	}
	if rb := <-spy.rollbacks; !rb[0] || rb[1] {
		t.Fatalf("Rollback's context: deadline %v, done %v; want a deadline, not done", rb[0], rb[1])
	}
}

// expirable counts, in a read transaction, what ExpireLeases with f and the
// returned cutoff may change.
func expirable(t *testing.T, pool *pgxpool.Pool, f audit.Filter) (int64, time.Time) {
	t.Helper()
	var n int64
	var cutoff time.Time
	err := audit.Read(context.Background(), pool, func(ctx context.Context, q audit.Planned) error {
		var err error
		n, cutoff, err = audit.ExpirableCount(ctx, q, f)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return n, cutoff
}

// A reservation inside its window when the leases were counted is not the
// count's, and ExpireLeases with the count's cutoff leaves it alone when
// the window has ended by the time the operator confirms.
func TestExpireLeasesWindowEndsAfterTheCount(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	const window = time.Second
	if _, err := idem.Reserve(ctx, pool, scope, "no-window", fp, time.Microsecond); err != nil {
		t.Fatal(err)
	}
	if _, err := idem.ReserveWith(ctx, pool, scope, "in-window", fp,
		idem.ReserveOptions{Lease: time.Microsecond, ResumeWithin: window}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Millisecond)
	n, cutoff := expirable(t, pool, audit.Filter{})
	if n != 1 {
		t.Fatalf("counted %d leases, want 1 (the one in its window is resuming)", n)
	}
	rec, err := idem.Lookup(ctx, pool, scope, "in-window")
	if err != nil {
		t.Fatal(err)
	}
	if !rec.ResumeUntil.After(cutoff) {
		t.Fatalf("the window ended (%s) before the count (%s): the test machine is too slow", rec.ResumeUntil, cutoff)
	}
	time.Sleep(time.Until(rec.ResumeUntil) + 50*time.Millisecond)
	e, err := audit.ExpireLeases(ctx, pool, nil, "sam", audit.Filter{}, cutoff)
	if err != nil || e.Changed != 1 {
		t.Fatalf("expire: changed %d, want the 1 counted (%v)", e.Changed, err)
	}
	if rec, err := idem.Lookup(ctx, pool, scope, "in-window"); err != nil || rec.Status != idem.StatusProcessing {
		t.Fatalf("a reservation whose window ended after the count was expired: %+v, %v", rec, err)
	}
}

// A reservation too young for the age filter when the leases were counted
// is not the count's, even when it is old enough by the time the operator
// confirms.
func TestExpireLeasesAgeAtTheCount(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	const age = time.Second
	if _, err := idem.Reserve(ctx, pool, scope, "old", fp, time.Microsecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(age + 50*time.Millisecond)
	if _, err := idem.Reserve(ctx, pool, scope, "young", fp, time.Microsecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Millisecond)
	f := audit.Filter{MinAge: age}
	n, cutoff := expirable(t, pool, f)
	if n != 1 {
		t.Fatalf("counted %d leases older than %s, want 1", n, age)
	}
	rec, err := idem.Lookup(ctx, pool, scope, "young")
	if err != nil {
		t.Fatal(err)
	}
	if !rec.CreatedAt.Add(age).After(cutoff) {
		t.Fatalf("the young reservation (%s) was old enough at the count (%s): the test machine is too slow", rec.CreatedAt, cutoff)
	}
	time.Sleep(time.Until(rec.CreatedAt.Add(age)) + 50*time.Millisecond)
	e, err := audit.ExpireLeases(ctx, pool, nil, "sam", f, cutoff)
	if err != nil || e.Changed != 1 {
		t.Fatalf("expire: changed %d, want the 1 counted (%v)", e.Changed, err)
	}
	for key, want := range map[string]idem.Status{"old": idem.StatusUnknown, "young": idem.StatusProcessing} {
		if rec, err := idem.Lookup(ctx, pool, scope, key); err != nil || rec.Status != want {
			t.Fatalf("%s after the expiry: %+v, %v; want %s", key, rec, err, want)
		}
	}
}

// A verdict or a forget waits at most LockTimeout for a record another
// transaction holds, then gives up with ErrBusy, and changes nothing.
func TestBusyRecord(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, r := unknownRecord(t)
	if _, err := idem.DoInTx(ctx, pool, scope, "done", fp, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 200}, nil
	}); err != nil {
		t.Fatal(err)
	}
	before := rows(t, pool)
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SELECT 1 FROM idem_keys FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	go func() {
		_, _, err := audit.Resolve(ctx, pool, nil, "sam", scope, "k", idem.Resolution{Token: r.Token, Retryable: true, Reason: "no charge"})
		errs <- err
	}()
	go func() {
		_, err := audit.Forget(ctx, pool, nil, "sam", scope, "done", nil, "reused")
		errs <- err
	}()
	for range 2 {
		select {
		case err := <-errs:
			if !errors.Is(err, audit.ErrBusy) {
				t.Errorf("a change on a held record: %v, want ErrBusy", err)
			}
		case <-time.After(10 * audit.LockTimeout):
			t.Fatal("a change waited for a held record far longer than LockTimeout")
		}
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if after := rows(t, pool); after != before {
		t.Fatalf("a busy change changed something:\n%s\n%s", before, after)
	}
}

// A bulk verdict with no record, too many, or no single verdict and reason
// is refused before anything runs.
func TestResolveManyRefusesBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, r := unknownRecord(t)
	before := rows(t, pool)
	one := []audit.Target{{Scope: scope, Key: "k", Token: r.Token}}
	many := make([]audit.Target, audit.MaxBulk+1)
	for i := range many {
		many[i] = one[0]
	}
	for name, tc := range map[string]struct {
		targets []audit.Target
		res     idem.Resolution
	}{
		"none":       {nil, idem.Resolution{Retryable: true, Reason: "r"}},
		"too many":   {many, idem.Resolution{Retryable: true, Reason: "r"}},
		"no verdict": {one, idem.Resolution{Reason: "r"}},
		"both":       {one, idem.Resolution{Retryable: true, Succeeded: &idem.Response{Status: 200}, Reason: "r"}},
		"no reason":  {one, idem.Resolution{Retryable: true}},
	} {
		if _, err := audit.ResolveMany(ctx, pool, nil, "sam", tc.targets, tc.res, nil); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := audit.ResolveMany(ctx, pool, nil, "sam\x1b[8m", one, idem.Resolution{Retryable: true, Reason: "r"}, nil); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("a bad operator: %v", err)
	}
	if after := rows(t, pool); after != before {
		t.Fatalf("a refused bulk verdict changed something:\n%s\n%s", before, after)
	}
	b, err := audit.ResolveMany(ctx, pool, nil, "sam", append(one, audit.Target{Scope: scope, Key: "gone", Token: 1}),
		idem.Resolution{Retryable: true, Reason: "no charge"}, map[string]any{"selected": 2})
	if err != nil || b.Entry.Changed != 1 || len(b.Skipped) != 1 || b.Entry.ID == 0 {
		t.Fatalf("a bulk verdict: %+v, %v", b, err)
	}
}

// The copy of a forgotten record whose body was dropped (Config.BodyTTL)
// says so, with the status alone: not an empty body.
func TestForgetCopyOfAGoneBody(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, idem.Migrate)
	c, err := idem.New(idem.Config{BodyTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "a", Operation: "o"}
	if _, err := c.DoInTx(ctx, pool, scope, "k", idem.FingerprintParts([]byte("k")), func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201, Body: []byte(`{"id":1}`)}, nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_keys SET body_expires_at = now()`); err != nil {
		t.Fatal(err)
	}
	e, err := audit.Forget(ctx, pool, nil, "sam", scope, "k", nil, "reused")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Forgotten audit.RecordCopy `json:"forgotten"`
	}
	if err := json.Unmarshal(e.Detail, &d); err != nil || d.Forgotten.Response == nil || !d.Forgotten.Response.Gone ||
		d.Forgotten.Response.Status != 201 || d.Forgotten.Response.Body != nil || d.Forgotten.Response.BodyBase64 != nil {
		t.Fatalf("the forgotten copy: %s (%v)", e.Detail, err)
	}
}
