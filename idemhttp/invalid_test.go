package idemhttp_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

// A request the handler refuses with Invalid is not stored: the handler's
// write and the claim roll back, a retry of the same bad request runs
// again, and the corrected request with the same key runs and is stored.
func TestInvalidIsNotStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	bad := call{path: "/validate", actor: "alice", key: "order-1", body: `{"qty":"two"}`}
	for i := range 2 {
		r := e.do(bad)
		if r.status != http.StatusBadRequest || string(r.body) != `{"code":"INVALID_QTY"}` || r.replayed() {
			t.Fatalf("bad request %d: %s", i, r)
		}
		if s := e.state(); s != (state{calls: i + 1}) {
			t.Fatalf("after bad request %d: %+v, want the write and the key rolled back", i, s)
		}
	}

	fixed := bad
	fixed.body = `{"qty":2}`
	first := e.do(fixed)
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("corrected request with the same key: %s", first)
	}
	again := e.do(fixed)
	if again.status != http.StatusCreated || !again.replayed() || string(again.body) != string(first.body) {
		t.Errorf("retry of the corrected request: %s replayed=%t", again, again.replayed())
	}
	if s := e.state(); s != (state{calls: 3, effects: 1, keys: 1}) {
		t.Errorf("after the corrected request: %+v", s)
	}

	// The key now belongs to the corrected request.
	if r := e.do(bad); r.status != http.StatusUnprocessableEntity || r.problem(t) != idemhttp.CodeKeyReused {
		t.Errorf("bad request after the key was used: %s", r)
	}
	if s := e.state(); s != (state{calls: 3, effects: 1, keys: 1}) {
		t.Errorf("the refused reuse changed something: %+v", s)
	}
}

// Invalid followed by 2xx is a handler bug: rolled back, answered 500 and
// logged; followed by 5xx, the handler's answer goes out, unstored.
func TestInvalidWithOtherStatuses(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	r := e.do(call{path: "/validate?status=201", actor: "alice", key: "s-201", body: `{}`})
	if r.status != http.StatusInternalServerError || r.problem(t) != idemhttp.CodeInternal {
		t.Errorf("Invalid then 201: %s", r)
	}
	if !strings.Contains(e.logs.String(), "called Invalid but answered 201") {
		t.Errorf("the handler bug is not logged:\n%s", e.logs.String())
	}
	for range 2 {
		r = e.do(call{path: "/validate?status=503", actor: "alice", key: "s-503", body: `{}`})
		if r.status != http.StatusServiceUnavailable || string(r.body) != `{"code":"INVALID_QTY"}` || r.replayed() {
			t.Errorf("Invalid then 503: %s", r)
		}
	}
	if s := e.state(); s != (state{calls: 3}) {
		t.Errorf("after the handler bugs: %+v", s)
	}
}

// Without a key (Options.KeyOptional) Invalid changes nothing for a 4xx:
// rolled back, as every 4xx is there; a 2xx after it is still a bug.
func TestInvalidWithoutKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: idemhttp.Options{KeyOptional: true}})
	if r := e.do(call{path: "/validate", actor: "alice", body: `{"qty":0}`}); r.status != http.StatusBadRequest {
		t.Errorf("bad request without a key: %s", r)
	}
	r := e.do(call{path: "/validate?status=200", actor: "alice", body: `{"qty":0}`})
	if r.status != http.StatusInternalServerError || r.problem(t) != idemhttp.CodeInternal {
		t.Errorf("Invalid then 200 without a key: %s", r)
	}
	if r := e.do(call{path: "/validate", actor: "alice", body: `{"qty":1}`}); r.status != http.StatusCreated {
		t.Errorf("good request without a key: %s", r)
	}
	if s := e.state(); s != (state{calls: 3, effects: 1}) {
		t.Errorf("after the requests without a key: %+v", s)
	}
}

// Outside a covered request Invalid does nothing.
func TestInvalidOutsideARequest(t *testing.T) {
	idemhttp.Invalid(context.Background())
	idemhttp.Invalid(t.Context())
}
