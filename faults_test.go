package idem_test

// Faults under load: a PostgreSQL restart (immediate shutdown) and a
// connection cut right after the server acknowledged COMMIT, while several
// instances (separate pools and clients) send many keys, each several times,
// and write a small ledger in fn. The invariant at the end: every key took
// effect exactly once, every answer equals the committed response, the
// ledger balances, and every error on the way was ErrUnavailable or
// ErrInProgress.
//
// The tests are sized to run in seconds. IDEM_SOAK=1 runs them longer
// (more keys, more restarts, more cuts).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgserver"
	"github.com/pgidem/idem/internal/pgtest"
	"github.com/pgidem/idem/internal/relay"
)

// soak reports whether the long form of the fault tests was asked for.
func soak() bool { return os.Getenv("IDEM_SOAK") != "" }

const (
	ledgerAccounts = 8
	ledgerOpening  = 1_000_000 // every account's opening balance
)

// ledgerMigrate installs idem's table and the ledger domain: accounts with a
// balance, and one ledger entry per executed transfer.
func ledgerMigrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, fmt.Sprintf(`
		CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO accounts SELECT g, %d FROM generate_series(1, %d) g;
		CREATE TABLE ledger (
			id bigserial PRIMARY KEY,
			idem_key text NOT NULL,
			from_account int NOT NULL REFERENCES accounts,
			to_account int NOT NULL REFERENCES accounts,
			amount bigint NOT NULL)`, ledgerOpening, ledgerAccounts))
	return err
}

// transfer is one client intent: move amount from one account to another.
type transfer struct {
	Key      string `json:"-"`
	From, To int
	Amount   int64
}

func transfers(n int, prefix string) []transfer {
	out := make([]transfer, n)
	for i := range out {
		from := 1 + rand.N(ledgerAccounts)
		to := 1 + (from+rand.N(ledgerAccounts-1))%ledgerAccounts // never from
		out[i] = transfer{Key: fmt.Sprintf("%s-%04d", prefix, i), From: from, To: to, Amount: 1 + rand.Int64N(500)}
	}
	return out
}

// transferBody is the response of the execution that wrote ledger entry id.
func transferBody(tr transfer, entry int64) []byte {
	return fmt.Appendf(nil, `{"key":%q,"entry":%d,"from":%d,"to":%d,"amount":%d}`,
		tr.Key, entry, tr.From, tr.To, tr.Amount)
}

// transferFn is fn for tr: it debits, credits (in the transfer's own order,
// so concurrent transfers deadlock now and then and are run again) and
// writes the ledger entry. runs counts its executions, committed or not.
func transferFn(tr transfer, runs *atomic.Int64) func(context.Context, pgx.Tx) (idem.Response, error) {
	return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		runs.Add(1)
		if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance - $2 WHERE id = $1`, tr.From, tr.Amount); err != nil {
			return idem.Response{}, err
		}
		if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1`, tr.To, tr.Amount); err != nil {
			return idem.Response{}, err
		}
		var entry int64
		if err := tx.QueryRow(ctx, `INSERT INTO ledger (idem_key, from_account, to_account, amount)
			VALUES ($1, $2, $3, $4) RETURNING id`, tr.Key, tr.From, tr.To, tr.Amount).Scan(&entry); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{
			Status: 201,
			Header: map[string][]string{"Content-Type": {"application/json"}},
			Body:   transferBody(tr, entry),
		}, nil
	}
}

var ledgerScope = idem.Scope{Actor: "tenant-1", Operation: "transfer"}

// instance is one application process: its own pool and idem client.
type instance struct {
	pool   *pgxpool.Pool
	client *idem.Client
}

func newInstances(t *testing.T, url string, n, conns int, syncCommit bool) []instance {
	t.Helper()
	out := make([]instance, n)
	for i := range out {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = int32(conns)
		if syncCommit {
			// The throwaway cluster runs with synchronous_commit off; an
			// immediate shutdown would then lose acknowledged commits.
			cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "on"
		}
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		client, err := idem.New(idem.Config{Wait: 500 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		out[i] = instance{pool: pool, client: client}
	}
	return out
}

// answer is what one client call got back in the end.
type answer struct {
	body     []byte
	replayed bool
}

// load sends requests for transfers from many goroutines spread over the
// instances, and retries each request with the same key until it gets an
// answer, as a client does. It records every answer and every error.
type load struct {
	t         *testing.T
	instances []instance
	workers   int // goroutines per instance
	runs      atomic.Int64

	mu          sync.Mutex
	answers     map[string][]answer
	unavailable int // errors that wrap ErrUnavailable
	inProgress  int // ErrInProgress
	done        atomic.Int64
	inFlight    atomic.Int64
}

func newLoad(t *testing.T, instances []instance, workers int) *load {
	return &load{t: t, instances: instances, workers: workers, answers: map[string][]answer{}}
}

// schedule returns the requests to send for trs: each key twice in a row
// (concurrent duplicates, on the same or on different instances), then each
// key copies-2 more times in a shuffled order (later duplicates, some while
// the first is still running).
func schedule(trs []transfer, copies int) []transfer {
	var jobs []transfer
	for _, tr := range trs {
		jobs = append(jobs, tr, tr)
	}
	var later []transfer
	for range copies - 2 {
		later = append(later, trs...)
	}
	rand.Shuffle(len(later), func(i, j int) { later[i], later[j] = later[j], later[i] })
	return append(jobs, later...)
}

// run sends jobs and returns when every one has an answer or ctx is done.
func (l *load) run(ctx context.Context, jobs []transfer) {
	queue := make(chan transfer)
	var wg sync.WaitGroup
	for _, in := range l.instances {
		for range l.workers {
			wg.Go(func() {
				for tr := range queue {
					l.send(ctx, in, tr)
					l.inFlight.Add(-1)
					l.done.Add(1)
				}
			})
		}
	}
	for _, tr := range jobs {
		l.inFlight.Add(1)
		select {
		case queue <- tr:
		case <-ctx.Done():
			l.inFlight.Add(-1)
		}
	}
	close(queue)
	wg.Wait()
}

// send calls DoInTx for tr until it answers, checking every error on the
// way: ErrUnavailable (the store failed: retry) or ErrInProgress (a
// duplicate holds the key: retry), nothing else.
func (l *load) send(ctx context.Context, in instance, tr transfer) {
	fp, err := idem.FingerprintJSON(tr)
	if err != nil {
		l.t.Error(err)
		return
	}
	for attempt := 0; ; attempt++ {
		res, err := in.client.DoInTx(ctx, in.pool, ledgerScope, tr.Key, fp, transferFn(tr, &l.runs))
		if err == nil {
			l.mu.Lock()
			l.answers[tr.Key] = append(l.answers[tr.Key], answer{body: res.Body, replayed: res.Replayed})
			l.mu.Unlock()
			return
		}
		if ctx.Err() != nil {
			l.t.Errorf("key %s: no answer after %d attempts: %v", tr.Key, attempt+1, err)
			return
		}
		l.mu.Lock()
		switch {
		case errors.Is(err, idem.ErrUnavailable) && idem.Unavailable(err):
			l.unavailable++
		case errors.Is(err, idem.ErrInProgress) && !idem.Unavailable(err):
			l.inProgress++
		case idem.Unavailable(err):
			l.t.Errorf("key %s: a store failure without ErrUnavailable: %v", tr.Key, err)
		default:
			l.t.Errorf("key %s: unexpected error: %v", tr.Key, err)
		}
		l.mu.Unlock()
		if l.t.Failed() {
			return
		}
		sleepCtx(ctx, time.Duration(5+rand.N(20))*time.Millisecond)
	}
}

func sleepCtx(ctx context.Context, d time.Duration) {
	select {
	case <-time.After(d):
	case <-ctx.Done():
	}
}

// check verifies the invariant on the database behind pool for trs, all of
// which must have been answered:
//   - each key has exactly one ledger entry, matching its transfer;
//   - every answer for it is the body of that entry's execution, and at most
//     one of them is not a replay;
//   - a new request with each key replays that body and does not run fn;
//   - every account's balance is its opening balance plus its ledger
//     entries, and the total is unchanged.
func (l *load) check(ctx context.Context, pool *pgxpool.Pool, trs []transfer) {
	t := l.t
	t.Helper()
	entries := map[string][]int64{}
	want := map[int]int64{}
	for i := 1; i <= ledgerAccounts; i++ {
		want[i] = ledgerOpening
	}
	rows, err := pool.Query(ctx, `SELECT id, idem_key, from_account, to_account, amount FROM ledger`)
	if err != nil {
		t.Fatal(err)
	}
	byKey := map[string]transfer{}
	for _, tr := range trs {
		byKey[tr.Key] = tr
	}
	for rows.Next() {
		var id, amount int64
		var key string
		var from, to int
		if err := rows.Scan(&id, &key, &from, &to, &amount); err != nil {
			t.Fatal(err)
		}
		tr, ok := byKey[key]
		if !ok || tr.From != from || tr.To != to || tr.Amount != amount {
			t.Errorf("ledger entry %d (%s %d->%d %d) matches no transfer", id, key, from, to, amount)
		}
		entries[key] = append(entries[key], id)
		want[from] -= amount
		want[to] += amount
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	for _, tr := range trs {
		ids := entries[tr.Key]
		if len(ids) != 1 {
			t.Errorf("key %s: %d ledger entries, want exactly 1", tr.Key, len(ids))
			continue
		}
		committed := transferBody(tr, ids[0])
		fresh := 0
		for _, a := range l.answers[tr.Key] {
			if !bytes.Equal(a.body, committed) {
				t.Errorf("key %s: answered %s, committed %s", tr.Key, a.body, committed)
			}
			if !a.replayed {
				fresh++
			}
		}
		if len(l.answers[tr.Key]) == 0 {
			t.Errorf("key %s: never answered", tr.Key)
		}
		if fresh > 1 {
			t.Errorf("key %s: %d answers were not replays", tr.Key, fresh)
		}
		fp, _ := idem.FingerprintJSON(tr)
		res, err := idem.DoInTx(ctx, pool, ledgerScope, tr.Key, fp, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{}, errors.New("fn ran for a key that committed")
		})
		if err != nil || !res.Replayed || !bytes.Equal(res.Body, committed) || res.Status != 201 {
			t.Errorf("key %s: final replay %d %s (replayed %v), %v; committed %s", tr.Key, res.Status, res.Body, res.Replayed, err, committed)
		}
	}

	var total int64
	rows, err = pool.Query(ctx, `SELECT id, balance FROM accounts`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int
		var balance int64
		if err := rows.Scan(&id, &balance); err != nil {
			t.Fatal(err)
		}
		if balance != want[id] {
			t.Errorf("account %d: balance %d, ledger says %d", id, balance, want[id])
		}
		total += balance
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if total != ledgerAccounts*ledgerOpening {
		t.Errorf("total balance %d, want %d", total, ledgerAccounts*ledgerOpening)
	}
}

func (l *load) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, as := range l.answers {
		n += len(as)
	}
	return fmt.Sprintf("%d answers for %d keys, %d fn runs, %d ErrUnavailable, %d ErrInProgress",
		n, len(l.answers), l.runs.Load(), l.unavailable, l.inProgress)
}

// A PostgreSQL restart with an immediate shutdown, twice, in the middle of
// the load (once straight back up, once after a pause during which
// connections are refused). Clients retry with the same key until answered.
func TestFaultRestartUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	t.Parallel()
	keys, copies, restarts := 120, 4, 2
	if soak() {
		keys, copies, restarts = 2000, 5, 8
	}
	srv, err := pgserver.StartTempCluster(t.Context())
	if errors.Is(err, pgserver.ErrNoBinaries) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	setup, err := pgxpool.New(ctx, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if err := ledgerMigrate(ctx, setup); err != nil {
		t.Fatal(err)
	}
	setup.Close()

	instances := newInstances(t, srv.URL, 4, 4, true)
	l := newLoad(t, instances, 4)
	trs := transfers(keys, "restart")
	jobs := schedule(trs, copies)

	// The restarts happen at even steps of progress, while requests are in
	// flight.
	restarted := make(chan error, 1)
	go func() {
		var err error
		defer func() { restarted <- err }()
		for i := 1; i <= restarts; i++ {
			for l.done.Load() < int64(len(jobs)*i/(restarts+1)) {
				if ctx.Err() != nil {
					err = ctx.Err()
					return
				}
				time.Sleep(2 * time.Millisecond)
			}
			if l.inFlight.Load() == 0 {
				err = fmt.Errorf("restart %d: no request in flight", i)
				return
			}
			if i%2 == 0 {
				// Down for a while: new connections are refused.
				if err = srv.StopImmediate(); err != nil {
					return
				}
				time.Sleep(300 * time.Millisecond)
			}
			if err = srv.Restart(ctx); err != nil {
				return
			}
		}
	}()
	l.run(ctx, jobs)
	if err := <-restarted; err != nil {
		t.Fatal(err)
	}
	t.Log(l.summary())
	if t.Failed() {
		return
	}
	if l.unavailable == 0 {
		t.Error("no request saw the restarts")
	}
	check, err := pgxpool.New(ctx, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer check.Close()
	l.check(ctx, check, trs)
}

// A relay between the instances and the server cuts the connection right
// after the server acknowledged a COMMIT: the commit happened and the client
// cannot know. The client gets ErrUnavailable and retries with the same key
// on a fresh connection: the retry replays, and the effect happened once.
func TestFaultCommitAcknowledgementLost(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := pgtest.URL(t, ledgerMigrate)
	target, err := relay.Target(url)
	if err != nil {
		t.Fatal(err)
	}
	var armed atomic.Bool
	r, err := relay.Start(target, relay.Options{DropAfterCommit: func() bool { return armed.CompareAndSwap(true, false) }})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	relayed, err := r.ConnString(url)
	if err != nil {
		t.Fatal(err)
	}
	in := newInstances(t, relayed, 1, 2, false)[0]
	direct, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()

	var runs atomic.Int64
	l := newLoad(t, []instance{in}, 1)
	trs := transfers(3, "ack")
	for i, tr := range trs {
		fp, _ := idem.FingerprintJSON(tr)
		armed.Store(true)
		_, err := in.client.DoInTx(ctx, in.pool, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
		if !errors.Is(err, idem.ErrUnavailable) || !idem.Unavailable(err) {
			t.Fatalf("key %s: commit acknowledgement lost: err = %v, want ErrUnavailable", tr.Key, err)
		}
		if r.CommitsCut() != int64(i+1) {
			t.Fatalf("key %s: %d cuts, want %d", tr.Key, r.CommitsCut(), i+1)
		}
		// The commit happened.
		var entry int64
		if err := direct.QueryRow(ctx, `SELECT id FROM ledger WHERE idem_key = $1`, tr.Key).Scan(&entry); err != nil {
			t.Fatalf("key %s: the cut commit did not commit: %v", tr.Key, err)
		}
		res, err := in.client.DoInTx(ctx, in.pool, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
		if err != nil || !res.Replayed || !bytes.Equal(res.Body, transferBody(tr, entry)) {
			t.Fatalf("key %s: retry %+v, %v; committed %s", tr.Key, res, err, transferBody(tr, entry))
		}
		l.answers[tr.Key] = []answer{{body: res.Body, replayed: res.Replayed}}
	}
	if runs.Load() != int64(len(trs)) {
		t.Fatalf("fn ran %d times for %d keys", runs.Load(), len(trs))
	}
	l.check(ctx, direct, trs)
}

// The same cut under load: every third COMMIT acknowledgement is lost, on
// several instances with concurrent and later duplicates.
func TestFaultCommitAcknowledgementLostUnderLoad(t *testing.T) {
	t.Parallel()
	keys, copies := 100, 4
	if soak() {
		keys, copies = 2000, 5
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	url := pgtest.URL(t, ledgerMigrate)
	target, err := relay.Target(url)
	if err != nil {
		t.Fatal(err)
	}
	var commits atomic.Int64
	r, err := relay.Start(target, relay.Options{DropAfterCommit: func() bool { return commits.Add(1)%3 == 0 }})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	relayed, err := r.ConnString(url)
	if err != nil {
		t.Fatal(err)
	}
	l := newLoad(t, newInstances(t, relayed, 3, 2, false), 3)
	trs := transfers(keys, "cut")
	l.run(ctx, schedule(trs, copies))
	t.Logf("%s; %d commits cut", l.summary(), r.CommitsCut())
	if t.Failed() {
		return
	}
	if r.CommitsCut() == 0 || l.unavailable == 0 {
		t.Fatalf("%d commits cut, %d ErrUnavailable: the fault never fired", r.CommitsCut(), l.unavailable)
	}
	direct, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	l.check(ctx, direct, trs)
}
