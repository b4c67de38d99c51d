package idemhttp_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// A slow export job: a duplicate that arrives while the first request runs
// gets 202 Accepted with the Location of a status URL; the client polls it
// and gets 202 until the job is done, then the job's stored response. Only
// the user who sent the request sees it.
func ExampleStatusHandler() {
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()

	userFromToken := func(r *http.Request) (string, error) {
		user, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || user == "" {
			return "", errors.New("not authenticated")
		}
		return user, nil
	}

	running, finish := make(chan struct{}), make(chan struct{})
	export := func(w http.ResponseWriter, r *http.Request) {
		close(running)
		<-finish // the slow part
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/exports/1")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"export":1}`)
	}

	mw := idemhttp.Middleware(pool, idemhttp.Options{
		Actor:     userFromToken,
		StatusURL: "/v1/idempotency",                         // 202 + Location instead of 409
		Config:    idem.Config{Wait: 100 * time.Millisecond}, // how long a duplicate waits first
	})
	mux := http.NewServeMux()
	mux.Handle("POST /exports", mw(http.HandlerFunc(export)))
	mux.Handle("GET /v1/idempotency", idemhttp.StatusHandler(pool, idemhttp.StatusOptions{Actor: userFromToken}))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	send := func(method, path, user string) *http.Response {
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(`{"year":2025}`))
		req.Header.Set("Authorization", "Bearer "+user)
		req.Header.Set("Idempotency-Key", "export-2025")
		resp, err := srv.Client().Do(req)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Printf("%s %s as %s: %d retry-after=%q replayed=%q %s\n", method, path, user,
			resp.StatusCode, resp.Header.Get("Retry-After"), resp.Header.Get("Idempotent-Replayed"), b)
		return resp
	}

	location := make(chan string, 1)
	go func() {
		<-running
		dup := send("POST", "/exports", "alice") // the user taps again
		status := dup.Header.Get("Location")
		send("GET", status, "alice") // still running
		send("GET", status, "bob")   // not bob's: 404, as for a key nobody used
		location <- status
		close(finish)
	}()
	send("POST", "/exports", "alice") // the first request, answered once the job is done
	send("GET", <-location, "alice")  // done: the stored response
	// Output:
	// POST /exports as alice: 202 retry-after="1" replayed="" {"status":"processing"}
	// GET /v1/idempotency?key=export-2025&operation=POST+%2Fexports as alice: 202 retry-after="1" replayed="" {"status":"processing"}
	// GET /v1/idempotency?key=export-2025&operation=POST+%2Fexports as bob: 404 retry-after="" replayed="" {"type":"about:blank","title":"Not Found","status":404,"code":"IDEMPOTENCY_KEY_NOT_FOUND","detail":"No request with this key is running or stored for you; send it again with the same key to run it."}
	// POST /exports as alice: 201 retry-after="" replayed="" {"export":1}
	// GET /v1/idempotency?key=export-2025&operation=POST+%2Fexports as alice: 201 retry-after="" replayed="true" {"export":1}
}
