package idemhttp_test

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// The handler's ResponseWriter buffers and follows net/http's rules; it
// cannot be flushed or hijacked, since nothing may reach the client before
// the commit.
func TestResponseWriterSemantics(t *testing.T) {
	t.Parallel()
	pool := newPool(t, idem.Migrate)
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, Logger: discard})
	mux := http.NewServeMux()
	mux.Handle("POST /semantics", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, isFlusher := w.(http.Flusher)
		_, isHijacker := w.(http.Hijacker)
		rc := http.NewResponseController(w)
		flushErr := rc.Flush()
		_, _, hijackErr := rc.Hijack()
		w.Header().Set("X-Before", "1")
		w.WriteHeader(http.StatusEarlyHints) // informational: dropped
		w.WriteHeader(http.StatusAccepted)
		w.WriteHeader(http.StatusInternalServerError) // superfluous: ignored
		w.Header().Set("X-After", "1")                // after WriteHeader: not sent
		fmt.Fprintf(w, "flusher=%t hijacker=%t flush=%t hijack=%t",
			isFlusher, isHijacker, errors.Is(flushErr, http.ErrNotSupported), errors.Is(hijackErr, http.ErrNotSupported))
	})))
	mux.Handle("POST /implicit", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("implicit 200"))
	})))
	mux.Handle("POST /nobody", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
		_, err := w.Write([]byte("not allowed"))
		w.Header().Set("X-Err", fmt.Sprint(err))
	})))
	mux.Handle("POST /silent", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})))
	mux.Handle("POST /badcode", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(42)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	post := func(path string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequest("POST", srv.URL+path, nil)
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Idempotency-Key", "k"+path)
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp, string(b)
	}

	resp, body := post("/semantics")
	if resp.StatusCode != http.StatusAccepted || resp.Header.Get("X-Before") != "1" || resp.Header.Get("X-After") != "" ||
		body != "flusher=false hijacker=false flush=true hijack=true" {
		t.Errorf("semantics: %d %v %q", resp.StatusCode, resp.Header, body)
	}
	if resp, body := post("/implicit"); resp.StatusCode != http.StatusOK || body != "implicit 200" {
		t.Errorf("implicit: %d %q", resp.StatusCode, body)
	}
	if resp, body := post("/silent"); resp.StatusCode != http.StatusOK || body != "" {
		t.Errorf("silent: %d %q", resp.StatusCode, body)
	}
	// 204 has no body; the handler's Write got http.ErrBodyNotAllowed.
	// X-Err is set after WriteHeader, so it is not in the response.
	if resp, body := post("/nobody"); resp.StatusCode != http.StatusNoContent || body != "" {
		t.Errorf("nobody: %d %q", resp.StatusCode, body)
	}
	// An invalid status code panics, as net/http does: 500, nothing stored.
	if resp, _ := post("/badcode"); resp.StatusCode != http.StatusInternalServerError {
		t.Errorf("badcode: %d", resp.StatusCode)
	}
	// Replays keep the status of each.
	for path, want := range map[string]int{"/semantics": 202, "/implicit": 200, "/silent": 200, "/nobody": 204} {
		if resp, _ := post(path); resp.StatusCode != want || resp.Header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("replay %s: %d %v", path, resp.StatusCode, resp.Header)
		}
	}
}

var discard = slog.New(slog.DiscardHandler)

func TestDefaultFingerprint(t *testing.T) {
	t.Parallel()
	fp := func(method, target, contentType, body string) idem.Fingerprint {
		t.Helper()
		r := httptest.NewRequest(method, target, strings.NewReader(body))
		if contentType != "" {
			r.Header.Set("Content-Type", contentType)
		}
		f, err := idemhttp.DefaultFingerprint(r, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	same := [][2]idem.Fingerprint{
		{fp("POST", "/a", "application/json", `{"x":1,"y":[true,null]}`), fp("POST", "/a", "application/json; charset=utf-8", ` {"y":[true, null],"x":1.0} `)},
		{fp("POST", "/a", "application/json", `{"x":1}`), fp("POST", "/a", "application/merge-patch+json", `{"x":1}`)},
		{fp("POST", "/a", "application/x-www-form-urlencoded", "b=2&a=1&a=0"), fp("POST", "/a", "application/x-www-form-urlencoded", "a=1&b=2&a=0")},
		{fp("POST", "/a", "application/x-www-form-urlencoded", "a=x+y"), fp("POST", "/a", "application/x-www-form-urlencoded", "a=x%20y")},
		{fp("POST", "/a?b=2&a=1", "", ""), fp("POST", "/a?a=1&b=2", "", "")},
		{fp("POST", "/a", "text/plain", "raw"), fp("POST", "/a", "application/octet-stream", "raw")},
		{fp("POST", "/a", "application/json", `{"x":1,`), fp("POST", "/a", "text/plain", `{"x":1,`)},
	}
	for i, p := range same {
		if p[0] != p[1] {
			t.Errorf("same %d: fingerprints differ", i)
		}
	}
	differ := [][2]idem.Fingerprint{
		{fp("POST", "/a", "application/json", `{"x":1}`), fp("POST", "/a", "application/json", `{"x":2}`)},
		{fp("POST", "/a", "application/json", `{"x":1}`), fp("PATCH", "/a", "application/json", `{"x":1}`)},
		{fp("POST", "/a", "application/json", `{"x":1}`), fp("POST", "/b", "application/json", `{"x":1}`)},
		{fp("POST", "/a", "application/json", `{"x":1}`), fp("POST", "/a?x=1", "application/json", `{"x":1}`)},
		{fp("POST", "/a", "application/json", `{"x":1}`), fp("POST", "/a", "text/plain", `{"x":1}`)},
		{fp("POST", "/a", "text/plain", `a b`), fp("POST", "/a", "text/plain", `a  b`)},
		{fp("POST", "/a", "application/x-www-form-urlencoded", "a=1&a=2"), fp("POST", "/a", "application/x-www-form-urlencoded", "a=2&a=1")},
		{fp("POST", "/"+url.PathEscape("a/b"), "", ""), fp("POST", "/a/b", "", "")},
	}
	for i, p := range differ {
		if p[0] == p[1] {
			t.Errorf("differ %d: fingerprints equal", i)
		}
	}
}

func TestDefaultOperationBounds(t *testing.T) {
	t.Parallel()
	long := httptest.NewRequest("POST", "/"+strings.Repeat("x", 400), nil)
	op := idemhttp.DefaultOperation(long)
	if err := idem.ValidateScope(idem.Scope{Actor: "a", Operation: op}); err != nil || !strings.HasPrefix(op, "POST sha256:") {
		t.Errorf("long path: %q %v", op, err)
	}
	odd := httptest.NewRequest("POST", "/a%00%ff", nil)
	if op := idemhttp.DefaultOperation(odd); op != "POST /a%00%ff" {
		t.Errorf("escaped path: %q", op)
	}
	odd.Pattern = "POST example.com/{x}"
	if op := idemhttp.DefaultOperation(odd); op != "POST example.com/{x}" {
		t.Errorf("pattern: %q", op)
	}
}

// Two more of net/http's rules a handler can see: an empty write after a
// 204 is no error, and a write past the Content-Length the handler
// declared is refused (http.ErrContentLength); each handler reports what
// its writes returned, with and without the middleware.
func TestResponseWriterWritesAsNetHTTP(t *testing.T) {
	t.Parallel()
	pool := newPool(t, idem.Migrate)
	type result struct{ empty204, past error }
	handler := func(got chan<- result) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var res result
			if r.URL.Path == "/204" {
				w.WriteHeader(http.StatusNoContent)
				_, res.empty204 = w.Write(nil)
			} else {
				w.Header().Set("Content-Length", "3")
				_, res.past = w.Write([]byte("hello"))
				if _, err := w.Write([]byte("abc")); err == nil {
					res.past = errors.New("a write after the refused one was accepted")
				}
			}
			got <- res
		})
	}
	for _, path := range []string{"/204", "/length"} {
		plainGot, mwGot := make(chan result, 1), make(chan result, 1)
		plain := httptest.NewServer(handler(plainGot))
		wrapped := httptest.NewServer(idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer, Logger: discard})(handler(mwGot)))
		for _, srv := range []*httptest.Server{plain, wrapped} {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+path, nil)
			req.Header.Set("Authorization", "Bearer alice")
			req.Header.Set("Idempotency-Key", "k"+path)
			if resp, err := srv.Client().Do(req); err == nil {
				resp.Body.Close()
			}
			srv.Close()
		}
		p, m := <-plainGot, <-mwGot
		if !errors.Is(m.empty204, p.empty204) || !errors.Is(m.past, p.past) || (m.past == nil) != (p.past == nil) {
			t.Errorf("%s: net/http %+v, the middleware %+v", path, p, m)
		}
	}
}
