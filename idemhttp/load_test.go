package idemhttp_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
)

// faults is outer middleware that drops connections by a script: for each
// key, attempt 1, 4, 7, ... is dropped before the middleware sees it (the
// request is lost), attempt 2, 5, 8, ... after the commit (the response is
// lost), and the others go through.
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

// A retrying client (go-retryablehttp, one key per intent reused on every
// retry) sends several copies of each request at once through a server
// that drops connections before and after the commit. Every intent ends
// with exactly one effect, and every copy with the same response.
func TestRetryingClientUnderDroppedConnections(t *testing.T) {
	t.Parallel()
	const intents, copies = 12, 3
	f := &faults{attempts: map[string]int{}}
	e := newEnv(t, envConfig{
		outer: f.wrap,
		beforeRun: func(http.ResponseWriter, *http.Request) {
			time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond) // let copies overlap
		},
	})

	client := retryablehttp.NewClient()
	client.HTTPClient = e.srv.Client()
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
		return resp.StatusCode == http.StatusConflict || resp.StatusCode >= 500, nil
	}

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	bodies := make([][copies][]byte, intents)
	var wg sync.WaitGroup
	for i := range intents {
		for c := range copies {
			wg.Go(func() {
				body := fmt.Appendf(nil, `{"intent":%d}`, i)
				req, err := retryablehttp.NewRequestWithContext(ctx, "POST", e.srv.URL+"/items", body)
				if err != nil {
					t.Error(err)
					return
				}
				req.Header.Set("Authorization", fmt.Sprintf("Bearer user-%d", i))
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
	t.Logf("dropped %d requests and %d responses, passed %d; %d handler executions",
		f.before.Load(), f.after.Load(), f.passed.Load(), e.calls.Load())

	for i := range intents {
		for c := 1; c < copies; c++ {
			if !bytes.Equal(bodies[i][0], bodies[i][c]) {
				t.Errorf("intent %d: copies got different responses: %s / %s", i, bodies[i][0], bodies[i][c])
			}
		}
		if n := e.count(`SELECT count(*) FROM effects WHERE actor = $1`, fmt.Sprintf("user-%d", i)); n != 1 {
			t.Errorf("intent %d: %d effects, want 1", i, n)
		}
	}
	if n := e.calls.Load(); n != intents {
		t.Errorf("%d executions for %d intents", n, intents)
	}
	if f.before.Load() == 0 || f.after.Load() == 0 {
		t.Errorf("the script dropped nothing")
	}
}
