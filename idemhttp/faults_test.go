package idemhttp_test

// Faults through the middleware over real HTTP: clients that hang up at
// random points (before the request is sent, while the handler runs, after
// the commit before the response is read) and retry with the same key, on
// several instances (each its own pool and server), with a relay between the
// instances and PostgreSQL that loses some COMMIT acknowledgements. The
// invariant at the end: every key took effect exactly once, every 201 equals
// the committed response, the ledger balances.
//
// Sized to run in seconds; IDEM_SOAK=1 runs it longer.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/ledgertest"
)

// transfer is one client intent, sent as the request body.
type transfer = ledgertest.Transfer

// transferHandler writes the transfer in the request's transaction and
// answers 201 with the ledger entry. It locks the two accounts in id order:
// a deadlock inside a handler is answered 500, not retried.
func transferHandler(runs *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		var tr transfer
		if err := json.NewDecoder(r.Body).Decode(&tr); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		tr.Key = r.Header.Get(idemhttp.HeaderKey)
		ctx, tx := r.Context(), idemhttp.Tx(r.Context())
		_, err := tx.Exec(ctx, `SELECT 1 FROM accounts WHERE id IN ($1, $2) ORDER BY id FOR UPDATE`, tr.From, tr.To)
		var entry int64
		if err == nil {
			entry, err = ledgertest.Write(ctx, tx, tr)
		}
		if err != nil {
			// The store failed under the handler (the connection was cut):
			// answer 503, nothing is stored.
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(ledgertest.Body(tr, entry))
	}
}

// httpLoad is the clients' side: outcomes of every attempt.
type httpLoad struct {
	t       *testing.T
	servers []*httptest.Server
	client  *http.Client

	mu       sync.Mutex
	answers  map[string][]ledgertest.Answer
	hangups  int // attempts the client gave up on
	conflict int // 409 in progress
	outage   int // 503 store unavailable
	handler5 int // 503 from the handler (its statement failed on a cut connection)
}

// send posts tr with its key to a random instance until it reads a 201 in
// full. On some attempts the client hangs up at a random moment.
func (l *httpLoad) send(ctx context.Context, tr transfer) {
	body, _ := json.Marshal(tr)
	for attempt := 0; ; attempt++ {
		if ctx.Err() != nil {
			l.t.Errorf("key %s: no answer after %d attempts", tr.Key, attempt)
			return
		}
		srv := l.servers[rand.N(len(l.servers))]
		actx, cancel := context.WithCancel(ctx)
		hangup := rand.N(3)
		if hangup == 1 {
			// Hang up at a random moment: before, during or after the
			// handler's transaction.
			time.AfterFunc(time.Duration(rand.N(4000))*time.Microsecond, cancel)
		}
		req, _ := http.NewRequestWithContext(actx, http.MethodPost, srv.URL+"/transfers", bytes.NewReader(body))
		req.Header.Set(idemhttp.HeaderKey, tr.Key)
		req.Header.Set("Authorization", "Bearer tenant-1")
		req.Header.Set("Content-Type", "application/json")
		resp, err := l.client.Do(req)
		if err == nil && hangup == 2 {
			// Hang up once the response has started, before reading it.
			cancel()
		}
		var got []byte
		if err == nil {
			got, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		cancel()
		if err != nil {
			if !errors.Is(err, context.Canceled) {
				l.t.Errorf("key %s: %v", tr.Key, err)
				return
			}
			l.count(&l.hangups)
			continue
		}
		switch code := problemCode(got); {
		case resp.StatusCode == http.StatusCreated:
			l.mu.Lock()
			l.answers[tr.Key] = append(l.answers[tr.Key], ledgertest.Answer{Body: got, Replayed: resp.Header.Get(idemhttp.HeaderReplayed) == "true"})
			l.mu.Unlock()
			return
		case resp.StatusCode == http.StatusConflict && code == idemhttp.CodeInProgress:
			l.count(&l.conflict)
		case resp.StatusCode == http.StatusServiceUnavailable && code == idemhttp.CodeStoreUnavailable:
			l.count(&l.outage)
		case resp.StatusCode == http.StatusServiceUnavailable && code == "":
			l.count(&l.handler5)
		default:
			l.t.Errorf("key %s: unexpected answer %d %s", tr.Key, resp.StatusCode, got)
			return
		}
		time.Sleep(time.Duration(2+rand.N(10)) * time.Millisecond)
	}
}

func (l *httpLoad) count(n *int) {
	l.mu.Lock()
	*n++
	l.mu.Unlock()
}

// problemCode returns the code of a problem+json body, or "".
func problemCode(body []byte) string {
	var p struct {
		Code string `json:"code"`
	}
	if json.Unmarshal(body, &p) != nil {
		return ""
	}
	return p.Code
}

func TestFaultClientsHangUpAndCommitsGetLost(t *testing.T) {
	t.Parallel()
	keys, copies, instances := 60, 4, 3
	if os.Getenv("IDEM_SOAK") != "" {
		keys, copies = 1500, 5
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	var commits atomic.Int64
	var cutting atomic.Bool // every fourth COMMIT acknowledgement is lost
	cutting.Store(true)
	url, relayed, rl := ledgertest.BehindRelay(t, func() bool {
		return cutting.Load() && commits.Add(1)%4 == 0
	})

	var runs atomic.Int64
	l := &httpLoad{t: t, answers: map[string][]ledgertest.Answer{}, client: &http.Client{
		Transport: &http.Transport{MaxIdleConnsPerHost: 16},
	}}
	defer l.client.CloseIdleConnections()
	for range instances {
		cfg, err := pgxpool.ParseConfig(relayed)
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = 2
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		mw := idemhttp.Middleware(pool, idemhttp.Options{
			Actor:  bearer,
			Config: idem.Config{Wait: 500 * time.Millisecond},
			Logger: slog.New(slog.DiscardHandler),
		})
		mux := http.NewServeMux()
		mux.Handle("POST /transfers", mw(transferHandler(&runs)))
		srv := httptest.NewServer(mux)
		defer srv.Close()
		l.servers = append(l.servers, srv)
	}

	trs := ledgertest.Transfers(keys, "http")
	jobs := ledgertest.Schedule(trs, copies)

	queue := make(chan transfer)
	var wg sync.WaitGroup
	for range 12 {
		wg.Go(func() {
			for tr := range queue {
				l.send(ctx, tr)
			}
		})
	}
	for _, tr := range jobs {
		queue <- tr
	}
	close(queue)
	wg.Wait()
	t.Logf("%d keys, %d requests: %d handler runs, %d hang-ups, %d 409, %d 503 store unavailable, %d 503 from the handler; %d commits cut",
		keys, len(jobs), runs.Load(), l.hangups, l.conflict, l.outage, l.handler5, rl.CommitsCut())
	if t.Failed() {
		return
	}
	if l.hangups == 0 || rl.CommitsCut() == 0 {
		t.Fatalf("%d hang-ups, %d commits cut: the faults never fired", l.hangups, rl.CommitsCut())
	}

	// The invariant, read directly (not through the relay).
	cutting.Store(false)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ledgertest.Check(t, ctx, pool, trs, l.answers, func(tr transfer, committed []byte) {
		// A last retry, on any instance, replays the committed response.
		body, _ := json.Marshal(tr)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, l.servers[0].URL+"/transfers", bytes.NewReader(body))
		req.Header.Set(idemhttp.HeaderKey, tr.Key)
		req.Header.Set("Authorization", "Bearer tenant-1")
		req.Header.Set("Content-Type", "application/json")
		before := runs.Load()
		resp, err := l.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated || resp.Header.Get(idemhttp.HeaderReplayed) != "true" ||
			!bytes.Equal(got, committed) || runs.Load() != before {
			t.Errorf("key %s: final retry %d %s (replayed %q), committed %s", tr.Key, resp.StatusCode, got,
				resp.Header.Get(idemhttp.HeaderReplayed), committed)
		}
	})
}
