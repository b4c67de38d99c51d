package idemui_test

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// A record whose body Prune dropped (Config.BodyTTL) says so on its page
// and in the API, with its status kept and no body, rather than showing an
// empty body as if the answer had been empty.
func TestRecordResponseGone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	c, err := idem.New(idem.Config{BodyTTL: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "acme", Operation: "charge"}
	plain, err := idem.New(idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"gone", "kept"} {
		cl := c
		if key == "kept" {
			cl = plain
		}
		if _, err := cl.DoInTx(ctx, e.pool, scope, key, fp, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(5 * time.Millisecond)
	if _, err := c.Prune(ctx, e.pool, idem.PruneOptions{}); err != nil {
		t.Fatal(err)
	}

	page := e.get(keyPage(scope, "gone"))
	if page.status != http.StatusOK || strings.Contains(page.body, "The body is empty") {
		t.Fatalf("the page of a dropped body: %d\n%s", page.status, page.body)
	}
	// It says what was dropped, and what the key still does.
	for _, want := range []string{"dropped after its body TTL (<code>Config.BodyTTL</code>)",
		"still refuses a different request", "<code>idem.ErrResponseGone</code>", "HTTP 410"} {
		if !strings.Contains(page.body, want) {
			t.Errorf("the page of a dropped body does not say %q:\n%s", want, page.body)
		}
	}
	if page := e.get(keyPage(scope, "kept")); strings.Contains(page.body, "dropped after") || !strings.Contains(page.body, "ch_1") {
		t.Fatalf("the page of a kept body: %d\n%s", page.status, page.body)
	}

	res := e.get("/idem/api/keys/acme/charge/gone")
	var out struct {
		Record struct {
			ResponseGone bool `json:"response_gone"`
			Response     *struct {
				Status int     `json:"status"`
				Body   *string `json:"body"`
			} `json:"response"`
		} `json:"record"`
	}
	err = json.Unmarshal([]byte(res.body), &out)
	rec := out.Record
	if err != nil || !rec.ResponseGone || rec.Response == nil ||
		rec.Response.Status != 201 || rec.Response.Body != nil {
		t.Fatalf("the API's record of a dropped body: %v\n%s", err, res.body)
	}
	// The API's table of the record's fields names it.
	doc, err := os.ReadFile("../docs/console.md")
	if err != nil {
		t.Fatal(err)
	}
	documented := false
	for _, line := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(line, "| `GET api/keys/{actor}/{operation}/{key}` |") {
			documented = strings.Contains(line, "`response_gone`")
		}
	}
	if !documented {
		t.Error("docs/console.md's row of GET api/keys/... does not name response_gone")
	}
}

// A record whose body has a life of its own (Config.BodyTTL) shows when it
// goes: on its page, on its timeline and in the API (body_expires_at);
// one whose body lives as long as the key shows none.
func TestRecordBodyExpiresAt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	c, err := idem.New(idem.Config{TTL: 2 * time.Hour, BodyTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	plain, err := idem.New(idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "acme", Operation: "charge"}
	for key, cl := range map[string]*idem.Client{"short": c, "whole": plain} {
		if _, err := cl.DoInTx(ctx, e.pool, scope, key, fp, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	rec, err := c.Lookup(ctx, e.pool, scope, "short")
	if err != nil || rec.BodyExpiresAt.IsZero() {
		t.Fatalf("Lookup: %+v, %v", rec, err)
	}
	for key, want := range map[string]bool{"short": true, "whole": false} {
		page := e.get(keyPage(scope, key))
		if page.status != http.StatusOK || strings.Contains(page.body, "<dt>Body kept</dt>") != want ||
			strings.Contains(page.body, "The stored body&#39;s life ends") != want {
			t.Errorf("the page of %s: %d, want the body's time shown: %v\n%s", key, page.status, want, page.body)
		}
		var out struct {
			Record struct {
				BodyExpiresAt *time.Time `json:"body_expires_at"`
			} `json:"record"`
		}
		res := e.get("/idem/api/keys/acme/charge/" + key)
		if err := json.Unmarshal([]byte(res.body), &out); err != nil || (out.Record.BodyExpiresAt != nil) != want ||
			want && !out.Record.BodyExpiresAt.Equal(rec.BodyExpiresAt) {
			t.Errorf("api/keys of %s: %v\n%s", key, err, res.body)
		}
	}
}

// The console's prune drops the stored bodies past their time as Prune
// does, and says so: in its answer, its message and its audit row (it
// used to say "Nothing changed" and write no row).
func TestPruneDropsBodiesAudited(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	c, err := idem.New(idem.Config{BodyTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "acme", Operation: "charge"}
	for _, key := range []string{"a", "b", "c"} {
		if _, err := c.DoInTx(ctx, e.pool, scope, key, fp, func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.pool.Exec(ctx, `UPDATE idem_keys SET body_expires_at = now() WHERE idem_key IN ('a', 'b')`); err != nil {
		t.Fatal(err)
	}
	res := e.postJSON("/idem/api/prune", map[string]any{"reason": "bodies past their time"})
	var out struct {
		BodiesDropped int64 `json:"bodies_dropped"`
		Audit         *struct {
			Detail map[string]any `json:"detail"`
		} `json:"audit"`
	}
	if err := json.Unmarshal([]byte(res.body), &out); err != nil || res.status != http.StatusOK || out.BodiesDropped != 2 ||
		out.Audit == nil || out.Audit.Detail["bodies_dropped"] != float64(2) {
		t.Fatalf("api/prune: %d %v\n%s", res.status, err, res.body)
	}
	var n int
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE response_body IS NULL`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d bodies dropped, want 2 (%v)", n, err)
	}
	res = e.postJSON("/idem/api/prune", map[string]any{"reason": "again"})
	out.Audit = nil
	if err := json.Unmarshal([]byte(res.body), &out); err != nil || out.BodiesDropped != 0 || out.Audit != nil {
		t.Fatalf("api/prune again: %d %v\n%s", res.status, err, res.body)
	}
}
