// Package callertest holds what the tests of package idem and of package
// idemsql share about the caller's side of a call: the ways fn can break
// idem's own key row, the statements of another session that get in a
// call's way, and the tally of what became of the caller's transaction when
// calls were cancelled at random.
package callertest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// KeyRowChanges are the ways fn can change the idem_keys row of the key it
// runs under (every column the completion relies on, and the row itself),
// each a statement with the actor, operation and key as $1, $2 and $3.
var KeyRowChanges = map[string]string{
	"status":      `UPDATE idem_keys SET status = 'succeeded' WHERE actor = $1 AND operation = $2 AND idem_key = $3`,
	"fingerprint": `UPDATE idem_keys SET fingerprint = sha256(fingerprint) WHERE actor = $1 AND operation = $2 AND idem_key = $3`,
	"token":       `UPDATE idem_keys SET token = 7 WHERE actor = $1 AND operation = $2 AND idem_key = $3`,
	"lease":       `UPDATE idem_keys SET lease_expires_at = now() + interval '1 hour' WHERE actor = $1 AND operation = $2 AND idem_key = $3`,
	"expires_at":  `UPDATE idem_keys SET expires_at = now() - interval '1 second' WHERE actor = $1 AND operation = $2 AND idem_key = $3`,
	"delete":      `DELETE FROM idem_keys WHERE actor = $1 AND operation = $2 AND idem_key = $3`,
}

// Statements of another session that get in a call's way: a lock of the
// whole table, and a claim of the key "held" (actor, operation and
// fingerprint as $1, $2 and $3) kept open.
const (
	LockTable = `LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE`
	HoldKey   = `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at) ` +
		`VALUES ($1, $2, 'held', $3, 'processing', now() + interval '1 hour')`
)

// Refusal is a call that idem refuses, on keys the test sets up: "stored"
// (stored with one fingerprint) and "unknown" (a reservation marked
// unknown).
type Refusal struct {
	Name string
	Key  string
	// Reused: the call comes with another fingerprint than the stored one.
	Reused bool
	// Other is a statement another session runs, and keeps open while the
	// call runs (HoldKey takes the actor, operation and fingerprint); ""
	// for none.
	Other string
	// NilFn: the call has no fn.
	NilFn bool
	// Want is the refusal.
	Want error
}

// Refusals are the refusals every front is tested with.
var Refusals = []Refusal{
	{Name: "table locked", Key: "new", Other: LockTable, Want: idem.ErrInProgress},
	{Name: "held by a twin", Key: "held", Other: HoldKey, Want: idem.ErrInProgress},
	{Name: "key reused", Key: "stored", Reused: true, Want: idem.ErrKeyReused},
	{Name: "outcome unknown", Key: "unknown", Want: idem.ErrOutcomeUnknown},
	{Name: "nil fn", Key: "new", NilFn: true, Want: idem.ErrInvalidArgument},
}

// FailedClaim is a call on a connection where calls ran before (pgx's
// caches hold the claim's statements), while a twin holds the key "held"
// (HoldKey): its claim fails, or, for "stored", claims nothing.
type FailedClaim struct {
	Name string
	// InTx: the call is DoInTx on the connection; otherwise Do in a
	// transaction on it.
	InTx bool
	// Key is "held", or "stored", called with another fingerprint than the
	// stored one (ErrKeyReused).
	Key string
	// Cancel: the call's context ends while its claim waits for the twin;
	// otherwise the Client's Wait runs out first (ErrInProgress).
	Cancel bool
}

// FailedClaims are the failed claims every front is tested with on a warm
// connection.
var FailedClaims = []FailedClaim{
	{Name: "Do refused", Key: "held"},
	{Name: "Do cancelled", Key: "held", Cancel: true},
	{Name: "Do key reused", Key: "stored"},
	{Name: "DoInTx refused", InTx: true, Key: "held"},
	{Name: "DoInTx cancelled", InTx: true, Key: "held", Cancel: true},
}

// Config is the configuration of the Client that makes the call.
func (f FailedClaim) Config() idem.Config {
	if f.Cancel {
		return idem.Config{Wait: time.Minute}
	}
	return idem.Config{Wait: 20 * time.Millisecond}
}

// Context is the call's context: one that ends 50ms in with Cancel.
func (f FailedClaim) Context() (context.Context, context.CancelFunc) {
	if f.Cancel {
		return context.WithTimeout(context.Background(), 50*time.Millisecond)
	}
	return context.WithCancel(context.Background())
}

// CancelRequests makes a done context cancel the statement in flight with a
// cancel request (pgconn.CancelRequestContextWatcherHandler) instead of
// closing the connection: the statement fails, the connection lives on.
func CancelRequests(cfg *pgx.ConnConfig) {
	cfg.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: 5 * time.Second}
	}
}

// Aborted reports whether err, the answer to a statement in the caller's
// transaction, says the transaction is aborted (25P02).
func Aborted(err error) bool { return dberr.SQLState(err) == pgerrcode.InFailedSQLTransaction }

// IsRefusal reports whether err is a refusal that promises the caller's
// transaction is as it was before the call.
func IsRefusal(err error) bool {
	return errors.Is(err, idem.ErrInProgress) || errors.Is(err, idem.ErrKeyReused) ||
		errors.Is(err, idem.ErrOutcomeUnknown) || errors.Is(err, idem.ErrInvalidArgument)
}

// Tally counts what became of the caller's transaction after calls whose
// context was cancelled at random.
type Tally struct {
	Refusals            int // a refusal, the transaction usable
	Others              int // another outcome, the transaction usable
	AbortedAfterRefusal int // a refusal, the transaction aborted: a broken promise
	AbortedOther        int // another error, the transaction aborted
	Lost                int // the connection is gone
	// An error of each kind, to show.
	other, aborted, lost error
}

// Add counts a call that returned err, after which the caller's
// transaction was aborted, or its connection lost. It reports whether the
// call broke its promise: a refusal that left the transaction aborted.
func (t *Tally) Add(err error, aborted, lost bool) (broken bool) {
	refusal := IsRefusal(err)
	switch {
	case lost:
		t.Lost++
		t.lost = err
	case refusal && aborted:
		t.AbortedAfterRefusal++
		return true
	case refusal:
		t.Refusals++
	case aborted:
		t.AbortedOther++
		t.aborted = err
	default:
		t.Others++
		t.other = err
	}
	return false
}

func (t *Tally) String() string {
	return fmt.Sprintf("%d refusals (transaction usable), %d other outcomes usable (such as %v), "+
		"%d aborted after another error (such as %v), %d connections lost (such as %v), %d aborted after a refusal",
		t.Refusals, t.Others, t.other, t.AbortedOther, t.aborted, t.Lost, t.lost, t.AbortedAfterRefusal)
}

// Trials is n, or an eighth of it (at least one) with -short.
func Trials(n int) int {
	if testing.Short() {
		return max(1, n/8)
	}
	return n
}

// Trial is one call of Cancelled: it opens a fresh connection and a caller's
// transaction, calls idem for trial number i with the context begin
// returns (begin right before the call: the clock starts there), and
// reports whether the caller's transaction was then aborted, or its
// connection lost, and the call's error.
type Trial func(begin func() context.Context, i int) (aborted, lost bool, err error)

// Cancelled runs trial n times, each with a context cancelled after a random
// delay up to how long a call takes here (the longest of three run without
// cancelling), so that cancellations land anywhere in a call, and returns
// the tally. A refusal that left the caller's transaction aborted fails t.
func Cancelled(t testing.TB, n int, trial Trial) *Tally {
	t.Helper()
	var span time.Duration
	for i := range 3 {
		var start time.Time
		_, _, _ = trial(func() context.Context { start = time.Now(); return context.Background() }, i)
		span = max(span, time.Since(start))
	}
	tally := &Tally{}
	for i := range n {
		ctx, cancel := context.WithCancel(context.Background())
		var stop *time.Timer
		aborted, lost, err := trial(func() context.Context { stop = time.AfterFunc(rand.N(span+1), cancel); return ctx }, i)
		if stop != nil {
			stop.Stop()
		}
		cancel()
		if tally.Add(err, aborted, lost) {
			t.Errorf("trial %d: the call refused (%v) and left the caller's transaction aborted", i, err)
		}
	}
	return tally
}

// CutCommit checks, after the commit of key's call was cut (the relay
// dropped its acknowledgement, the cuts-th time), that the relay counted
// it and that the commit happened: the ledger entry of key is there, read
// on direct. It returns the entry's id.
func CutCommit(t testing.TB, cutsSoFar, cuts int64, direct interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, key string) int64 {
	t.Helper()
	if cutsSoFar != cuts {
		t.Fatalf("key %s: %d cuts, want %d", key, cutsSoFar, cuts)
	}
	var entry int64
	if err := direct.QueryRow(context.Background(), `SELECT id FROM ledger WHERE idem_key = $1`, key).Scan(&entry); err != nil {
		t.Fatalf("key %s: the cut commit did not commit: %v", key, err)
	}
	return entry
}

// Pooled runs n calls of call at once (call numbers its key with i) behind
// a transaction pooler in pgx's default exec mode: each either succeeds or
// fails with an error that check accepts (it names the fix). The test is
// skipped when none failed: the pooler keeps prepared statements.
func Pooled(t testing.TB, n int, call func(i int, key string) error, check func(key string, err error)) {
	t.Helper()
	var failed atomic.Int64
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			key := fmt.Sprintf("default-%d", i)
			if err := call(i, key); err != nil {
				failed.Add(1)
				check(key, err)
			}
		})
	}
	wg.Wait()
	if failed.Load() == 0 {
		t.Skip("no call failed: this pooler keeps prepared statements (PgBouncer 1.21+ with max_prepared_statements > 0)")
	}
	t.Logf("%d of %d calls failed, each with the fix named", failed.Load(), n)
}
