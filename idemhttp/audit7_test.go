package idemhttp_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

// A stored header that an outer middleware set and the handler deleted is
// absent from the first response, so it must be absent from the replay
// too: the replay is the stored response, not the outer middleware's
// defaults.
func TestReplayOmitsStoredHeaderTheHandlerDeleted(t *testing.T) {
	t.Parallel()
	pool := newPool(t, migrate)
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer})
	outer := func(next http.Handler) http.Handler { // a JSON API's default
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			next.ServeHTTP(w, r)
		})
	}
	mux := http.NewServeMux()
	mux.Handle("POST /items", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (actor, route) VALUES ('alice', 'x')`); err != nil {
			panic(err)
		}
		w.Header().Del("Content-Type") // no body, no type
		w.WriteHeader(http.StatusNoContent)
	})))
	srv := httptest.NewServer(outer(mux))
	defer srv.Close()

	post := func() *http.Response {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/items", strings.NewReader(`{}`))
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Idempotency-Key", "deleted-header")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	first := post()
	if first.StatusCode != http.StatusNoContent || first.Header.Get("Content-Type") != "" {
		t.Fatalf("first: %d %v", first.StatusCode, first.Header)
	}
	again := post()
	if again.StatusCode != http.StatusNoContent || again.Header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatalf("replay: %d %v", again.StatusCode, again.Header)
	}
	if v := again.Header.Values("Content-Type"); len(v) != 0 {
		t.Errorf("replay carries Content-Type %q, which the first response did not", v)
	}
}
