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
	"github.com/pgidem/idem/internal/testkit/callertest"
	"github.com/pgidem/idem/internal/testkit/ledgertest"
	"github.com/pgidem/idem/internal/testkit/pgserver"
)

// soak reports whether the long form of the fault tests was asked for.
func soak() bool { return os.Getenv("IDEM_SOAK") != "" }

// transfer is one client intent (ledgertest's domain).
type transfer = ledgertest.Transfer

// transferFn is fn for tr: ledgertest.Write (debit and credit in the
// transfer's own order, so concurrent transfers deadlock now and then and
// are run again). runs counts its executions, committed or not.
func transferFn(tr transfer, runs *atomic.Int64) func(context.Context, pgx.Tx) (idem.Response, error) {
	return func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		runs.Add(1)
		entry, err := ledgertest.Write(ctx, tx, tr)
		if err != nil {
			return idem.Response{}, err
		}
		return idem.Response{
			Status: 201,
			Header: map[string][]string{"Content-Type": {"application/json"}},
			Body:   ledgertest.Body(tr, entry),
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

// load sends requests for transfers from many goroutines spread over the
// instances, and retries each request with the same key until it gets an
// answer, as a client does. It records every answer and every error.
type load struct {
	t         *testing.T
	instances []instance
	workers   int // goroutines per instance
	runs      atomic.Int64

	mu          sync.Mutex
	answers     map[string][]ledgertest.Answer
	unavailable int // errors that wrap ErrUnavailable
	inProgress  int // ErrInProgress
	done        atomic.Int64
	inFlight    atomic.Int64
}

func newLoad(t *testing.T, instances []instance, workers int) *load {
	return &load{t: t, instances: instances, workers: workers, answers: map[string][]ledgertest.Answer{}}
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
			l.answers[tr.Key] = append(l.answers[tr.Key], ledgertest.Answer{Body: res.Body, Replayed: res.Replayed})
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

// check verifies ledgertest's invariant on the database behind pool for
// trs, all of which must have been answered; the final retry of each key
// must replay the committed body without running fn.
func (l *load) check(ctx context.Context, pool *pgxpool.Pool, trs []transfer) {
	l.t.Helper()
	ledgertest.Check(l.t, ctx, pool, trs, l.answers, func(tr transfer, committed []byte) {
		fp, _ := idem.FingerprintJSON(tr)
		res, err := idem.DoInTx(ctx, pool, ledgerScope, tr.Key, fp, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{}, errors.New("fn ran for a key that committed")
		})
		if err != nil || !res.Replayed || !bytes.Equal(res.Body, committed) || res.Status != 201 {
			l.t.Errorf("key %s: final replay %d %s (replayed %v), %v; committed %s", tr.Key, res.Status, res.Body, res.Replayed, err, committed)
		}
	})
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
	if err := ledgertest.Migrate(ctx, setup); err != nil {
		t.Fatal(err)
	}
	setup.Close()

	instances := newInstances(t, srv.URL, 4, 4, true)
	l := newLoad(t, instances, 4)
	trs := ledgertest.Transfers(keys, "restart")
	jobs := ledgertest.Schedule(trs, copies)

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
	var armed atomic.Bool
	url, relayed, r := ledgertest.BehindRelay(t, func() bool { return armed.CompareAndSwap(true, false) })
	in := newInstances(t, relayed, 1, 2, false)[0]
	direct, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()

	var runs atomic.Int64
	l := newLoad(t, []instance{in}, 1)
	trs := ledgertest.Transfers(3, "ack")
	for i, tr := range trs {
		fp, _ := idem.FingerprintJSON(tr)
		armed.Store(true)
		_, err := in.client.DoInTx(ctx, in.pool, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
		if !errors.Is(err, idem.ErrUnavailable) || !idem.Unavailable(err) {
			t.Fatalf("key %s: commit acknowledgement lost: err = %v, want ErrUnavailable", tr.Key, err)
		}
		entry := callertest.CutCommit(t, r.CommitsCut(), int64(i+1), direct, tr.Key) // the commit happened
		res, err := in.client.DoInTx(ctx, in.pool, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
		if err != nil || !res.Replayed || !bytes.Equal(res.Body, ledgertest.Body(tr, entry)) {
			t.Fatalf("key %s: retry %+v, %v; committed %s", tr.Key, res, err, ledgertest.Body(tr, entry))
		}
		l.answers[tr.Key] = []ledgertest.Answer{{Body: res.Body, Replayed: res.Replayed}}
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
	var commits atomic.Int64
	url, relayed, r := ledgertest.BehindRelay(t, func() bool { return commits.Add(1)%3 == 0 })
	l := newLoad(t, newInstances(t, relayed, 3, 2, false), 3)
	trs := ledgertest.Transfers(keys, "cut")
	l.run(ctx, ledgertest.Schedule(trs, copies))
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
