package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// The demo serves the operator's console at /idem/ to its operator: the
// bearer token of the operator routes, or in a browser any name and that
// token as the password; a request without credentials is asked for them.
func TestConsoleMounted(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(testAPI(pgtest.Pool(t, migrateDemo)))
	t.Cleanup(srv.Close)
	for _, c := range []struct {
		name   string
		auth   func(*http.Request)
		status int
		want   string
	}{
		{"no credentials", func(*http.Request) {}, http.StatusUnauthorized, ""},
		{"a user's token", func(r *http.Request) { r.Header.Set("Authorization", "Bearer alice") }, http.StatusForbidden, ""},
		{"the operator's token", func(r *http.Request) { r.Header.Set("Authorization", "Bearer "+demoOperator) }, http.StatusOK, ">operator<"},
		{"a name and the token", func(r *http.Request) { r.SetBasicAuth("dana", demoOperator) }, http.StatusOK, ">dana<"},
		{"a name and another password", func(r *http.Request) { r.SetBasicAuth("dana", "alice") }, http.StatusForbidden, ""},
	} {
		req, err := http.NewRequestWithContext(t.Context(), "GET", srv.URL+consolePrefix+"/unknown", nil)
		if err != nil {
			t.Fatal(err)
		}
		c.auth(req)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != c.status || !strings.Contains(string(body), c.want) {
			t.Errorf("%s: %d\n%.300s", c.name, res.StatusCode, body)
		}
		if c.status == http.StatusUnauthorized && !strings.HasPrefix(res.Header.Get("WWW-Authenticate"), "Basic") {
			t.Errorf("%s: no challenge (%v)", c.name, res.Header)
		}
	}
}
