package idemhttp_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
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

// Options.Fingerprint is given the request and its body: a fingerprint of
// a multipart form's fields (what DefaultFingerprint's doc advises for
// such routes) reads them through the request, and must see them, so that
// the same key with another amount is refused rather than replayed.
func TestCustomFingerprintReadsTheRequestBody(t *testing.T) {
	t.Parallel()
	pool := newPool(t, migrate)
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer,
		Fingerprint: func(r *http.Request, _ []byte) (idem.Fingerprint, error) {
			if err := r.ParseMultipartForm(1 << 20); err != nil {
				return idem.Fingerprint{}, err
			}
			return idem.FingerprintParts([]byte(r.FormValue("amount"))), nil
		}})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (actor, route) VALUES ('alice', $1)`,
			r.FormValue("amount")); err != nil {
			panic(err)
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "paid %s", r.FormValue("amount"))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(amount string) (int, string) {
		var body bytes.Buffer
		mpw := multipart.NewWriter(&body)
		_ = mpw.WriteField("amount", amount)
		_ = mpw.Close()
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/payments", &body)
		req.Header.Set("Content-Type", mpw.FormDataContentType())
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Idempotency-Key", "pay-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if status, body := post("10"); status != http.StatusCreated || body != "paid 10" {
		t.Fatalf("first: %d %s", status, body)
	}
	if status, body := post("10"); status != http.StatusCreated || body != "paid 10" {
		t.Fatalf("retry with a new boundary: %d %s", status, body)
	}
	if status, body := post("9999"); status != http.StatusUnprocessableEntity {
		t.Errorf("another amount with the same key: %d %s, want 422", status, body)
	}
}

// An outer middleware that reads a form field (a CSRF check) has consumed
// the request body before the idempotency middleware reads it; the
// handler still gets the parsed form. The fingerprint must still tell two
// forms apart: the same key with another amount is refused, not replayed.
func TestFingerprintOfAFormParsedBeforeTheMiddleware(t *testing.T) {
	t.Parallel()
	pool := newPool(t, migrate)
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer})
	csrf := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.FormValue("csrf") != "ok" {
				http.Error(w, "csrf", http.StatusForbidden)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", csrf(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (actor, route) VALUES ('alice', $1)`,
			r.FormValue("amount")); err != nil {
			panic(err)
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "paid %s", r.FormValue("amount"))
	}))))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(contentType, body string) (int, string) {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/payments", strings.NewReader(body))
		req.Header.Set("Content-Type", contentType)
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Idempotency-Key", "pay-"+contentType[:5])
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	multi := func(fields ...string) (string, string) {
		var body bytes.Buffer
		mpw := multipart.NewWriter(&body)
		for i := 0; i < len(fields); i += 2 {
			_ = mpw.WriteField(fields[i], fields[i+1])
		}
		_ = mpw.Close()
		return mpw.FormDataContentType(), body.String()
	}
	form := "application/x-www-form-urlencoded"
	if status, body := post(form, "csrf=ok&amount=10"); status != http.StatusCreated || body != "paid 10" {
		t.Fatalf("form: %d %s", status, body)
	}
	if status, body := post(form, "amount=10&csrf=ok"); status != http.StatusCreated || body != "paid 10" {
		t.Fatalf("form retry: %d %s", status, body)
	}
	if status, body := post(form, "csrf=ok&amount=9999"); status != http.StatusUnprocessableEntity {
		t.Errorf("form with another amount and the same key: %d %s, want 422", status, body)
	}
	if status, body := post(multi("csrf", "ok", "amount", "10")); status != http.StatusCreated || body != "paid 10" {
		t.Fatalf("multipart: %d %s", status, body)
	}
	if status, body := post(multi("csrf", "ok", "amount", "9999")); status != http.StatusUnprocessableEntity {
		t.Errorf("multipart with another amount and the same key: %d %s, want 422", status, body)
	}
}

// Options.Operation, like Options.Fingerprint, may read the request's
// form: it must see the fields, and reading them must not take them from
// the handler.
func TestOperationReadsTheForm(t *testing.T) {
	t.Parallel()
	pool := newPool(t, migrate)
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer,
		Operation: func(r *http.Request) string { return "POST /actions " + r.FormValue("action") }})
	mux := http.NewServeMux()
	mux.Handle("POST /actions", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "%s %s", r.FormValue("action"), r.FormValue("amount"))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/actions", strings.NewReader("action=refund&amount=5"))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Authorization", "Bearer alice")
	req.Header.Set("Idempotency-Key", "act-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated || string(b) != "refund 5" {
		t.Errorf("%d %q, want 201 \"refund 5\"", resp.StatusCode, b)
	}
	var op string
	if err := pool.QueryRow(t.Context(), `SELECT operation FROM idem_keys`).Scan(&op); err != nil || op != "POST /actions refund" {
		t.Errorf("operation %q (%v)", op, err)
	}
}

// A record stored without headers (by idem.DoInTx, or an operator's
// Resolve) replays through the middleware with the outer middleware's
// headers as they are: only a name the record holds replaces or deletes
// them.
func TestReplayOfARecordWithoutHeadersKeepsTheOuterOnes(t *testing.T) {
	t.Parallel()
	pool := newPool(t, migrate)
	fp := idem.FingerprintParts([]byte("fixed"))
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer,
		Operation:   func(*http.Request) string { return "op" },
		Fingerprint: func(*http.Request, []byte) (idem.Fingerprint, error) { return fp, nil }})
	if _, err := idem.DoInTx(t.Context(), pool, idem.Scope{Actor: "alice", Operation: "op"}, "stored-by-do", fp,
		func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 200, Body: []byte(`{"ok":true}`)}, nil
		}); err != nil {
		t.Fatal(err)
	}
	outer := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			next.ServeHTTP(w, r)
		})
	}
	srv := httptest.NewServer(outer(mw(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		t.Error("the handler ran")
	}))))
	defer srv.Close()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/x", strings.NewReader(`{}`))
	req.Header.Set("Authorization", "Bearer alice")
	req.Header.Set("Idempotency-Key", "stored-by-do")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.Header.Get(idemhttp.HeaderReplayed) != "true" || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("replay: %d %v; want the outer Content-Type", resp.StatusCode, resp.Header)
	}
}

// A custom Fingerprint that parses a multipart form, behind an outer
// middleware that parsed only the URL's form, leaves the handler's form
// as the request sent it (the maps are not shared with the handler's).
func TestFingerprintParseLeavesTheHandlersForm(t *testing.T) {
	t.Parallel()
	pool := newPool(t, migrate)
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer,
		Fingerprint: func(r *http.Request, _ []byte) (idem.Fingerprint, error) {
			if err := r.ParseMultipartForm(1 << 20); err != nil {
				return idem.Fingerprint{}, err
			}
			return idem.FingerprintParts([]byte(fmt.Sprint(r.PostForm["item"]))), nil
		}})
	outer := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _ = r.ParseForm(); next.ServeHTTP(w, r) })
	}
	mux := http.NewServeMux()
	mux.Handle("POST /items", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := r.ParseMultipartForm(1 << 20); err != nil {
			panic(err)
		}
		fmt.Fprint(w, r.PostForm["item"])
	})))
	srv := httptest.NewServer(outer(mux))
	defer srv.Close()
	var b bytes.Buffer
	mpw := multipart.NewWriter(&b)
	_ = mpw.WriteField("item", "a")
	_ = mpw.WriteField("item", "b")
	_ = mpw.Close()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/items?x=1", &b)
	req.Header.Set("Content-Type", mpw.FormDataContentType())
	req.Header.Set("Authorization", "Bearer alice")
	req.Header.Set("Idempotency-Key", "form-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(got) != "[a b]" {
		t.Errorf("the handler saw items %s, want [a b]", got)
	}
}

// A Content-Type the handler set present without values (net/http's "do
// not sniff") replays so: the replay carries no sniffed type either.
func TestReplayKeepsAnUnsniffedContentType(t *testing.T) {
	t.Parallel()
	pool := newPool(t, migrate)
	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearer})
	mux := http.NewServeMux()
	mux.Handle("POST /text", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil
		fmt.Fprint(w, "hello")
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for n := range 2 {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/text", strings.NewReader(`{}`))
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Idempotency-Key", "unsniffed")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if ct, has := resp.Header["Content-Type"]; has || (resp.Header.Get(idemhttp.HeaderReplayed) == "true") != (n == 1) {
			t.Errorf("call %d: Content-Type %q (present %t), replayed %q", n, ct, has, resp.Header.Get(idemhttp.HeaderReplayed))
		}
	}
}
