package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// demoProcess is `idem-demo serve` in a child process: this test binary
// run again with IDEM_DEMO_MAIN=1 (see TestMain).
type demoProcess struct {
	cmd  *exec.Cmd
	base string
	mu   sync.Mutex
	out  strings.Builder
	done chan error
}

// startDemo starts `idem-demo serve args...` against the server at url and
// waits until it serves.
func startDemo(t *testing.T, url string, args ...string) *demoProcess {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p := &demoProcess{done: make(chan error, 1)}
	p.cmd = exec.Command(exe, append([]string{"serve", "-addr", "127.0.0.1:0"}, args...)...)
	p.cmd.Env = append(os.Environ(), "IDEM_DEMO_MAIN=1", "DATABASE_URL="+url)
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stderr = p.cmd.Stdout
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	served := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.mu.Lock()
			p.out.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
			if m := servingRE.FindStringSubmatch(sc.Text()); m != nil {
				served <- m[1]
			}
		}
		p.done <- p.cmd.Wait()
	}()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			_ = p.cmd.Process.Kill()
		}
	})
	select {
	case p.base = <-served:
	case err := <-p.done:
		t.Fatalf("idem-demo ended before it served: %v\n%s", err, p.output())
	case <-time.After(2 * time.Minute):
		t.Fatalf("idem-demo printed no address:\n%s", p.output())
	}
	return p
}

func (p *demoProcess) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// The proof that a payment in doubt heals by itself after a crash: the
// payment service (idem-demo serve, a child process) is killed after the
// gateway charged and before Complete; nobody retries; the service starts
// again on the same database (-keep), and its recovery worker, once the
// lease has run out, resumes the payment and sends its request again with
// the same call key; the gateway, which remembers in the demo's tables,
// answers with the first charge. One charge, the payment succeeded, nothing
// for an operator; the client's late retry gets the stored payment.
func TestCrashAfterChargeResumes(t *testing.T) {
	t.Parallel()
	srv := pgtest.Server(t)
	var b [8]byte
	_, _ = rand.Read(b[:])
	name := "idemtest_crash_" + hex.EncodeToString(b[:])
	dropAtEnd(t, srv, name)
	flags := []string{"-db", name, "-lease", "1s", "-seed", "3"}

	first := startDemo(t, srv.URL, flags...)
	req, err := http.NewRequestWithContext(t.Context(), "POST", first.base+"/v1/payments", strings.NewReader(payBody))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer alice")
	req.Header.Set("Idempotency-Key", "crash-1")
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(headerCrash, "after-charge")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("the crashing payment answered %d", resp.StatusCode)
	}
	select {
	case err := <-first.done:
		var exit *exec.ExitError
		if !errors.As(err, &exit) || (runtime.GOOS != "windows" && !strings.Contains(exit.String(), "killed")) ||
			!strings.Contains(first.output(), "Killed after the charge, before Complete") {
			t.Fatalf("idem-demo ended with %v:\n%s", err, first.output())
		}
	case <-time.After(time.Minute):
		t.Fatalf("idem-demo was not killed:\n%s", first.output())
	}

	// What the crash left: a charge, and a payment in doubt.
	db, err := pgx.Connect(t.Context(), srv.DatabaseURL(name))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close(context.Background())
	scope := idem.Scope{Actor: "alice", Operation: paymentOperation}
	var charges, requests, rows int
	count := func() {
		t.Helper()
		if err := db.QueryRow(t.Context(), `SELECT (SELECT count(*) FROM gateway_charges WHERE idem_key = $1),
			(SELECT coalesce(sum(n), 0) FROM gateway_requests WHERE idem_key = $1),
			(SELECT count(*) FROM payments WHERE actor = 'alice' AND idem_key = 'crash-1')`,
			chargeKey("alice", "crash-1")).Scan(&charges, &requests, &rows); err != nil {
			t.Fatal(err)
		}
	}
	count()
	var status string
	if err := db.QueryRow(t.Context(), `SELECT status FROM idem_keys WHERE actor = $1 AND operation = $2 AND idem_key = 'crash-1'`,
		scope.Actor, scope.Operation).Scan(&status); err != nil || status != "processing" || charges != 1 || rows != 0 {
		t.Fatalf("after the crash: %s (%v), %d charges, %d payments", status, err, charges, rows)
	}

	// The restart: the recovery worker resumes the payment.
	second := startDemo(t, srv.URL, append(flags, "-keep")...)
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if err := db.QueryRow(t.Context(), `SELECT status FROM idem_keys WHERE actor = $1 AND operation = $2 AND idem_key = 'crash-1'`,
			scope.Actor, scope.Operation).Scan(&status); err != nil {
			t.Fatal(err)
		}
		if status == "succeeded" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the payment is still %s:\n%s", status, second.output())
		}
	}
	count()
	if charges != 1 || requests != 2 || rows != 1 {
		t.Fatalf("after the recovery: %d charges for %d requests, %d payments", charges, requests, rows)
	}
	for _, path := range []string{"/v1/admin/unknown", "/v1/admin/charges"} {
		r := apiCall(t, second.base, "GET", path, demoOperator, "", "")
		var out struct {
			Unknown []any
			Charges []gatewayCharge
		}
		if err := json.Unmarshal(r.body, &out); err != nil || r.status != http.StatusOK || len(out.Unknown) != 0 ||
			(path == "/v1/admin/charges" && (len(out.Charges) != 1 || out.Charges[0].ID != "ch_1")) {
			t.Fatalf("%s: %d %s", path, r.status, r.body)
		}
	}
	retry := payCall(t, second.base, "alice", "crash-1", payBody, "")
	if retry.status != http.StatusCreated || !retry.replayed || chargeID(t, retry) != "ch_1" {
		t.Fatalf("the client's retry: %d %t %s", retry.status, retry.replayed, retry.body)
	}
	if !strings.Contains(second.output(), "recovery worker resumed payments") {
		t.Errorf("the recovery worker said nothing:\n%s", second.output())
	}
	_ = second.cmd.Process.Signal(os.Interrupt)
	select {
	case err := <-second.done:
		if err != nil {
			t.Errorf("idem-demo ended with %v:\n%s", err, second.output())
		}
	case <-time.After(time.Minute):
		t.Errorf("idem-demo did not stop:\n%s", second.output())
	}
}
