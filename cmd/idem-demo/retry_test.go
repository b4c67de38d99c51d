package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"

	"github.com/pgidem/idem/internal/demo/draw"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// faults is outer middleware that drops connections by a script: for each
// key, attempt 1, 4, 7, ... is dropped before the API sees it (the request
// is lost), attempt 2, 5, 8, ... after the commit (the response is lost),
// and the others go through.
type faults struct {
	mu       sync.Mutex
	attempts map[string]int
	before   atomic.Int64
	after    atomic.Int64
	passed   atomic.Int64
}

func (f *faults) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		f.mu.Lock()
		f.attempts[key]++
		n := f.attempts[key]
		f.mu.Unlock()
		switch n % 3 {
		case 1:
			f.before.Add(1)
			if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
				conn.Close()
			}
		case 2:
			f.after.Add(1)
			next.ServeHTTP(&dropWriter{ResponseWriter: w}, r)
		default:
			f.passed.Add(1)
			next.ServeHTTP(w, r)
		}
	})
}

// dropWriter closes the connection instead of writing the response.
type dropWriter struct {
	http.ResponseWriter
	dropped bool
}

func (d *dropWriter) WriteHeader(int) {
	if !d.dropped {
		d.dropped = true
		if conn, _, err := http.NewResponseController(d.ResponseWriter).Hijack(); err == nil {
			conn.Close()
		}
	}
}

func (d *dropWriter) Write([]byte) (int, error) {
	d.WriteHeader(http.StatusOK)
	return 0, net.ErrClosed
}

// A retrying client (go-retryablehttp, one key per intent reused on every
// retry) sends several copies of each draw at once to the demo's API
// through a server that drops connections before and after the commit.
// Every intent draws exactly once, and every copy gets the same response.
func TestRetryingClientUnderDroppedConnections(t *testing.T) {
	t.Parallel()
	const intents, copies = 8, 3 // alice's 1000 points pay for 10 draws
	pool := pgtest.Pool(t, migrateDemo)
	f := &faults{attempts: map[string]int{}}
	srv := httptest.NewServer(f.wrap(testAPI(pool)))
	t.Cleanup(srv.Close)

	client := retryablehttp.NewClient()
	client.HTTPClient = srv.Client()
	client.Logger = nil
	client.RetryMax = 50
	client.RetryWaitMin = time.Millisecond
	client.RetryWaitMax = 20 * time.Millisecond
	// A real client honours Retry-After; this one retries sooner to keep the
	// test short.
	client.Backoff = retryablehttp.LinearJitterBackoff
	client.CheckRetry = func(ctx context.Context, resp *http.Response, err error) (bool, error) {
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		if err != nil {
			return true, nil // dropped connection: retry with the same key
		}
		// 202 (the status URL's Accepted: still running) and 409: the
		// same key again later; the retry replays once the first finishes.
		return resp.StatusCode == http.StatusAccepted || resp.StatusCode == http.StatusConflict || resp.StatusCode >= 500, nil
	}

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	bodies := make([][copies][]byte, intents)
	var wg sync.WaitGroup
	for i := range intents {
		for c := range copies {
			wg.Go(func() {
				req, err := retryablehttp.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/draws",
					[]byte(`{"box_id":1,"quantity":1}`))
				if err != nil {
					t.Error(err)
					return
				}
				req.Header.Set("Authorization", "Bearer alice")
				req.Header.Set("Idempotency-Key", fmt.Sprintf("intent-%d", i))
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err != nil {
					t.Errorf("intent %d copy %d: %v", i, c, err)
					return
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				if err != nil || resp.StatusCode != http.StatusCreated {
					t.Errorf("intent %d copy %d: %d %s %v", i, c, resp.StatusCode, b, err)
				}
				bodies[i][c] = b
			})
		}
	}
	wg.Wait()
	t.Logf("dropped %d requests and %d responses, passed %d", f.before.Load(), f.after.Load(), f.passed.Load())

	batches := map[int64]bool{}
	for i := range intents {
		for c := 1; c < copies; c++ {
			if !bytes.Equal(bodies[i][0], bodies[i][c]) {
				t.Errorf("intent %d: copies got different responses: %s / %s", i, bodies[i][0], bodies[i][c])
			}
		}
		var out draw.Outcome
		if err := json.Unmarshal(bodies[i][0], &out); err == nil {
			batches[out.BatchID] = true
		}
	}
	if len(batches) != intents {
		t.Errorf("%d distinct batches in the responses of %d intents", len(batches), intents)
	}
	w, err := draw.ReadWallet(t.Context(), pool, "alice")
	if err != nil {
		t.Fatal(err)
	}
	if w.Draws != intents || w.Points != draw.SeedPoints-intents*draw.SeedPrice {
		t.Errorf("alice after %d intents: %+v", intents, w)
	}
	if f.before.Load() == 0 || f.after.Load() == 0 {
		t.Errorf("the script dropped nothing")
	}
}
