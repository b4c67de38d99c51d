package idemhttp_test

import (
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// A stored response, fresh or replayed, tells the client how long its key
// is remembered (Idem-Key-Lifetime, in seconds): the operation's TTL from
// Config.TTLFor, else Config.TTL, the largest time.Duration included. A
// response that was not stored (a transient failure) does not.
func TestKeyLifetimeHeader(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{Config: idem.Config{
		TTL: 2 * time.Hour,
		TTLFor: func(op string) time.Duration {
			if strings.Contains(op, "/refuse") {
				return 90*time.Second + time.Millisecond // rounded up to whole seconds
			}
			return 0
		},
	}}})
	for _, tc := range []struct {
		path, want string
	}{
		{"/items", "7200"},
		{"/refuse", "91"},
	} {
		c := call{path: tc.path, actor: "alice", key: "key-" + strings.TrimPrefix(tc.path, "/"), body: `{}`}
		first := e.do(c)
		again := e.do(c)
		if !again.replayed() {
			t.Fatalf("%s: retry not replayed: %s", tc.path, again)
		}
		for name, r := range map[string]reply{"first": first, "replay": again} {
			if got := r.header.Get(idemhttp.HeaderKeyLifetime); got != tc.want {
				t.Errorf("%s %s: %s %q, want %q", tc.path, name, idemhttp.HeaderKeyLifetime, got, tc.want)
			}
		}
	}
	failed := e.do(call{path: "/fail", actor: "alice", key: "key-fail", body: `{}`})
	if failed.status != http.StatusInternalServerError || failed.header.Get(idemhttp.HeaderKeyLifetime) != "" {
		t.Errorf("a response not stored: %s with %s %q, want none", failed, idemhttp.HeaderKeyLifetime, failed.header.Get(idemhttp.HeaderKeyLifetime))
	}
}

// The largest TTL (a time.Duration of math.MaxInt64, a common "forever") is
// said in whole seconds too, rounded up: 9,223,372,036.85 s.
func TestKeyLifetimeHeaderLargestTTL(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{Config: idem.Config{TTL: math.MaxInt64}}})
	c := call{path: "/items", actor: "alice", key: "key-forever", body: `{}`}
	for _, name := range []string{"first", "replay"} {
		if r := e.do(c); r.header.Get(idemhttp.HeaderKeyLifetime) != "9223372037" {
			t.Errorf("%s: %s with %s %q, want 9223372037", name, r, idemhttp.HeaderKeyLifetime, r.header.Get(idemhttp.HeaderKeyLifetime))
		}
	}
}
