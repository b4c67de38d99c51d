package idemhttp_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// Past Config.BodyTTL, a retry of the same request is answered 410
// IDEMPOTENCY_RESPONSE_EXPIRED naming the status it finished with (with
// the key's lifetime), and the handler does not run again; a different
// request with the key is still 422. Prune drops the bodies; the answer
// stays the same. StatusHandler answers the key's status URL the same 410,
// and with the key's lifetime as the retry gets it.
func TestResponseExpired(t *testing.T) {
	t.Parallel()
	const life = time.Second // three requests and a status poll fit in it
	e := newEnv(t, envConfig{
		opts: idemhttp.Options{Config: idem.Config{TTL: time.Hour, BodyTTL: life}},
		routes: func(mux *http.ServeMux, pool *pgxpool.Pool) {
			mux.Handle("GET "+statusPath, idemhttp.StatusHandler(pool, idemhttp.StatusOptions{Actor: bearer}))
		},
	})
	c := call{path: "/items", actor: "alice", key: "key-gone", body: `{"n":1}`}
	if first := e.do(c); first.status != http.StatusCreated {
		t.Fatalf("first: %s", first)
	}
	if again := e.do(c); !again.replayed() || again.status != http.StatusCreated {
		t.Fatalf("retry inside BodyTTL: %s", again)
	}
	if r := e.do(call{method: "GET", path: statusOf("POST /items", c.key), actor: "alice"}); r.status != http.StatusCreated ||
		!r.replayed() || r.header.Get(idemhttp.HeaderKeyLifetime) != "3600" {
		t.Errorf("status URL inside BodyTTL: %s %v, want the 201 replayed with %s 3600", r, r.header, idemhttp.HeaderKeyLifetime)
	}
	time.Sleep(life + 100*time.Millisecond)
	ran := e.calls.Load()
	check := func(when string) {
		t.Helper()
		gone := e.do(c)
		if gone.status != http.StatusGone || gone.problem(t) != idemhttp.CodeResponseExpired ||
			!strings.Contains(string(gone.body), "status 201") || gone.header.Get(idemhttp.HeaderKeyLifetime) != "3600" {
			t.Errorf("retry %s: %s %v, want 410 %s naming status 201", when, gone, gone.header, idemhttp.CodeResponseExpired)
		}
		if r := e.do(call{method: "GET", path: statusOf("POST /items", c.key), actor: "alice"}); r.status != http.StatusGone ||
			r.problem(t) != idemhttp.CodeResponseExpired || r.header.Get(idemhttp.HeaderKeyLifetime) != "3600" {
			t.Errorf("status URL %s: %s %v, want 410 %s with %s 3600", when, r, r.header, idemhttp.CodeResponseExpired, idemhttp.HeaderKeyLifetime)
		}
		other := c
		other.body = `{"n":2}`
		if r := e.do(other); r.status != http.StatusUnprocessableEntity || r.problem(t) != idemhttp.CodeKeyReused {
			t.Errorf("another request %s: %s, want 422", when, r)
		}
		if e.calls.Load() != ran {
			t.Errorf("%s: the handler ran %d more times", when, e.calls.Load()-ran)
		}
	}
	check("past BodyTTL")
	if _, err := idem.Prune(t.Context(), e.pool, idem.PruneOptions{}); err != nil {
		t.Fatal(err)
	}
	check("after Prune")
}
