package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func migratePayments(ctx context.Context, pool *pgxpool.Pool) error {
	if err := migrateDemo(ctx, pool); err != nil {
		return err
	}
	return setupPayments(ctx, pool)
}

// paymentsServer serves the payment routes with a gateway the test can
// look into; the payments give up on an attempt to charge after a second, and
// their reservations have the window resumeWithin.
func paymentsServer(t *testing.T, resumeWithin time.Duration) (base string, gw *gateway, pool *pgxpool.Pool) {
	pool = pgtest.Pool(t, migratePayments)
	gw = newGateway(pool)
	t.Cleanup(gw.close)
	s := newPayments(pool, gw)
	s.gatewayTimeout, s.resumeWithin = time.Second, resumeWithin
	mux := http.NewServeMux()
	registerPayments(mux, s, slog.New(slog.DiscardHandler))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL, gw, pool
}

func payCall(t *testing.T, base, token, key, body, mode string) apiReply {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), "POST", base+"/v1/payments", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if mode != "" {
		req.Header.Set(headerGatewayMode, mode)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	if _, err := b.ReadFrom(resp.Body); err != nil {
		t.Fatal(err)
	}
	return apiReply{resp.StatusCode, resp.Header.Get(idemhttp.HeaderReplayed) == "true", b.Bytes()}
}

const payBody = `{"customerId":"cus-1","amountCents":12000,"currency":"KRW"}`

func chargeID(t *testing.T, r apiReply) string {
	t.Helper()
	var out struct{ ChargeID string }
	if err := json.Unmarshal(r.body, &out); err != nil || out.ChargeID == "" {
		t.Fatalf("%d %s: no chargeId (%v)", r.status, r.body, err)
	}
	return out.ChargeID
}

func TestPaymentsAPI(t *testing.T) {
	t.Parallel()
	base, gw, pool := paymentsServer(t, 0)

	// A payment and its retry (the same request, fields in another order).
	first := payCall(t, base, "alice", "p1", payBody, "")
	if first.status != http.StatusCreated || first.replayed {
		t.Fatalf("pay: %d %s", first.status, first.body)
	}
	again := payCall(t, base, "alice", "p1", `{"currency":"KRW","amountCents":12000,"customerId":"cus-1"}`, "")
	if again.status != http.StatusCreated || !again.replayed || !bytes.Equal(again.body, first.body) {
		t.Fatalf("retry: %d %t %s", again.status, again.replayed, again.body)
	}
	if r := payCall(t, base, "alice", "p1", `{"customerId":"cus-1","amountCents":99,"currency":"KRW"}`, ""); r.status != http.StatusUnprocessableEntity || problemCode(t, r) != idemhttp.CodeKeyReused {
		t.Fatalf("reused key: %d %s", r.status, r.body)
	}
	if c, _ := lookupCharge(t, gw, "alice", "p1"); c.Requests != 1 || c.ID != chargeID(t, first) {
		t.Fatalf("gateway: %+v", c)
	}

	// Requests refused before anything is reserved; a corrected retry runs.
	for _, c := range []struct {
		token, key, body string
		status           int
		code             string
	}{
		{"", "p2", payBody, http.StatusUnauthorized, idemhttp.CodeUnauthenticated},
		{"alice", "", payBody, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"alice", "p 2", payBody, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"alice", "p2", `{"customerId":"cus-1","amountCents":-5,"currency":"KRW"}`, http.StatusUnprocessableEntity, "INVALID_PAYMENT"},
		{"alice", "p2", `{"customerId":"cus-1","amountCents":5,"currency":"EUR"}`, http.StatusUnprocessableEntity, "INVALID_PAYMENT"},
		{"alice", "p2", `{"customerId":"cus-1","amountCents":5,"currency":"KRW","extra":1}`, http.StatusUnprocessableEntity, "INVALID_PAYMENT"},
	} {
		if r := payCall(t, base, c.token, c.key, c.body, ""); r.status != c.status || problemCode(t, r) != c.code {
			t.Errorf("%q %q %s: %d %s", c.token, c.key, c.body, r.status, r.body)
		}
	}
	if r := payCall(t, base, "alice", "p2", payBody, ""); r.status != http.StatusCreated || r.replayed {
		t.Fatalf("corrected retry: %d %s", r.status, r.body)
	}

	// A decline is an answer of the gateway: stored and replayed.
	big := `{"customerId":"cus-1","amountCents":2000000,"currency":"KRW"}`
	for i := range 2 {
		if r := payCall(t, base, "alice", "p3", big, ""); r.status != http.StatusPaymentRequired || problemCode(t, r) != "CARD_DECLINED" || r.replayed != (i == 1) {
			t.Fatalf("decline %d: %d %t %s", i, r.status, r.replayed, r.body)
		}
	}

	// The gateway refuses before charging: the retry runs and charges once.
	if r := payCall(t, base, "alice", "p4", payBody, modeUnavailable); r.status != http.StatusServiceUnavailable || problemCode(t, r) != "GATEWAY_UNAVAILABLE" {
		t.Fatalf("unavailable: %d %s", r.status, r.body)
	}
	if r := payCall(t, base, "alice", "p4", payBody, ""); r.status != http.StatusCreated || r.replayed {
		t.Fatalf("retry after unavailable: %d %s", r.status, r.body)
	}

	// The gateway charges and its answer is lost: unknown until resolved.
	if r := payCall(t, base, "alice", "p5", payBody, modeTimeoutAfterCharge); r.status != http.StatusGatewayTimeout || problemCode(t, r) != "GATEWAY_TIMEOUT" {
		t.Fatalf("timeout: %d %s", r.status, r.body)
	}
	for range 2 {
		if r := payCall(t, base, "alice", "p5", payBody, ""); r.status != http.StatusConflict || problemCode(t, r) != idemhttp.CodeOutcomeUnknown {
			t.Fatalf("retry of an unknown payment: %d %s", r.status, r.body)
		}
	}
	admin := func(method, path, token, body string) apiReply {
		t.Helper()
		return apiCall(t, base, method, path, token, "", body)
	}
	if r := admin("GET", "/v1/admin/unknown", "alice", ""); r.status != http.StatusForbidden {
		t.Fatalf("unknown list as alice: %d %s", r.status, r.body)
	}
	if r := admin("GET", "/v1/admin/unknown", demoOperator, ""); r.status != http.StatusOK || !bytes.Contains(r.body, []byte(`"key": "p5"`)) {
		t.Fatalf("unknown list: %d %s", r.status, r.body)
	}
	r := admin("POST", "/v1/admin/resolve", demoOperator, `{"actor":"alice","key":"p5"}`)
	charge, _ := lookupCharge(t, gw, "alice", "p5")
	if r.status != http.StatusOK || !bytes.Contains(r.body, []byte(charge.ID)) {
		t.Fatalf("resolve: %d %s", r.status, r.body)
	}
	resolved := payCall(t, base, "alice", "p5", payBody, "")
	if resolved.status != http.StatusCreated || !resolved.replayed || chargeID(t, resolved) != charge.ID {
		t.Fatalf("retry after resolve: %d %t %s", resolved.status, resolved.replayed, resolved.body)
	}
	// Only the first call's attempts reached the gateway.
	if c, _ := lookupCharge(t, gw, "alice", "p5"); c.Requests != newPayments(nil, nil).gatewayPolicy.MaxAttempts {
		t.Fatalf("the unknown payment reached the gateway %d times", c.Requests)
	}
	for _, c := range []struct {
		body   string
		status int
	}{
		{`{"actor":"alice","key":"p5"}`, http.StatusConflict},   // resolved already
		{`{"actor":"alice","key":"nope"}`, http.StatusNotFound}, // no such payment
		{`{"actor":"alice"}`, http.StatusBadRequest},
	} {
		if r := admin("POST", "/v1/admin/resolve", demoOperator, c.body); r.status != c.status {
			t.Errorf("resolve %s: %d %s", c.body, r.status, r.body)
		}
	}

	var payments, charges int
	if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM payments`).Scan(&payments); err != nil {
		t.Fatal(err)
	}
	charges = len(listCharges(t, gw))
	if payments != 4 || charges != 4 { // p1, p2, p4, p5
		t.Fatalf("%d payments, %d charges; want 4 and 4", payments, charges)
	}
}

// The external scenarios of `idem-demo run` pass on a database of their
// own (run itself recreates idem_demo).
func TestRunScenarios(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, migrateDemo)
	var out bytes.Buffer
	if failed := runScenarios(t.Context(), &out, pool); failed != 0 {
		t.Fatalf("%d scenarios failed:\n%s", failed, out.String())
	}
	for _, sc := range scenarios {
		if !strings.Contains(out.String(), sc.name) {
			t.Errorf("no row for %q:\n%s", sc.name, out.String())
		}
	}
	// The rows the docs show are the run's, spaces aside.
	words := func(s string) string { return strings.Join(strings.Fields(s), " ") }
	rows := docRunOutputs(t)
	if len(rows) == 0 {
		t.Error("no marked run output in README.md or docs/")
	}
	for row, where := range rows {
		if !strings.Contains(words(out.String()), words(row)) {
			t.Errorf("%s: the docs show a row the run does not print:\n%s", where, row)
		}
	}
	t.Logf("\n%s", out.String())
}
