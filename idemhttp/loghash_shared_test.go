package idemhttp_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

// The middleware and the status handler given the same Config (as
// StatusOptions.Config asks: the middleware's), here without a
// LogHashKey, hash a key alike in their log records, so that an operator
// can follow one request's key from the one to the other.
func TestMiddlewareAndStatusHandlerHashKeysAlike(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// Nothing listens on port 1: both log "store unavailable" with the key's hash.
	dead, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/idem?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer dead.Close()
	var logs testlog.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	cfg := idem.Config{}
	mw := idemhttp.Middleware(dead, idemhttp.Options{Actor: bearer, Logger: log, Config: cfg,
		Operation: func(*http.Request) string { return "pay" }})
	status := idemhttp.StatusHandler(dead, idemhttp.StatusOptions{Actor: bearer, Logger: log, Config: cfg})
	const key = "follow-me-1"

	post := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader(`{}`))
	post.Header.Set("Authorization", "Bearer alice")
	post.Header.Set("Idempotency-Key", key)
	post.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })).ServeHTTP(w, post)
	if w.Code < 500 {
		t.Fatalf("middleware on a dead database: %d", w.Code)
	}
	get := httptest.NewRequest(http.MethodGet, "/idempotency?"+idemhttp.StatusParamOperation+"=pay&"+idemhttp.StatusParamKey+"="+key, nil)
	get.Header.Set("Authorization", "Bearer alice")
	w = httptest.NewRecorder()
	status.ServeHTTP(w, get)
	if w.Code < 500 {
		t.Fatalf("status handler on a dead database: %d", w.Code)
	}
	hashes := regexp.MustCompile(`"key_hash":"([0-9a-f]+)"`).FindAllStringSubmatch(logs.String(), -1)
	if len(hashes) < 2 {
		t.Fatalf("want a key_hash from each:\n%s", logs.String())
	}
	for _, h := range hashes[1:] {
		if h[1] != hashes[0][1] {
			t.Fatalf("the same key hashes as %s and %s:\n%s", hashes[0][1], h[1], logs.String())
		}
	}
}
