package idemhttp_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// startSeed004 runs seed 004's toy receiver (testdata/seed004/server.mjs)
// with node on a free port, and returns its URL. It skips without node.
func startSeed004(t *testing.T) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed (Debian: apt-get install nodejs): seed 004's server.mjs cannot run")
	}
	src, err := os.ReadFile(filepath.Join("testdata", "seed004", "server.mjs"))
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	_ = l.Close()
	// The file listens on 4242: the copy on a port of its own, so that
	// parallel runs do not collide.
	copied := strings.Replace(string(src), ".listen(4242,", ".listen("+port+",", 1)
	if copied == string(src) {
		t.Fatal("server.mjs: no .listen(4242, to rewrite")
	}
	path := filepath.Join(t.TempDir(), "server.mjs")
	if err := os.WriteFile(path, []byte(copied), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(node, path)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := bufio.NewScanner(out)
	if !lines.Scan() || !strings.HasPrefix(lines.Text(), "listening") {
		t.Fatalf("server.mjs did not start: %q", lines.Text())
	}
	go func() {
		for lines.Scan() {
		}
	}()
	return "http://127.0.0.1:" + port
}

// charges reads the seed server's count of charges.
func charges(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url + "/charges")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var n struct{ Charges int }
	if err := json.NewDecoder(resp.Body).Decode(&n); err != nil {
		t.Fatal(err)
	}
	return n.Charges
}

// Seed 004's receiver (409 without Retry-After while a key is in
// progress), driven by the Transport's default policy with an
// AttemptTimeout shorter than its 1.5 s charge: a lost reply (the first
// attempt cut) and a concurrent duplicate each end with the stored 201 in
// one call, and one charge; the same key with another body is 422 at once;
// a refused connection is idem.ErrNotSent.
func TestSeed004(t *testing.T) {
	url := startSeed004(t)
	var attempts sync.Map // key -> attempts
	transport := &idemhttp.Transport{
		Policy: idem.RetryPolicy{AttemptTimeout: 500 * time.Millisecond},
		BeforeAttempt: func(r *http.Request, n int) error {
			attempts.Store(r.Header.Get(idemhttp.HeaderKey), n)
			return nil
		},
	}
	client := idemhttp.NewClient(transport, 20*time.Second)
	charge := func(key, body string) (*http.Response, string, error) {
		ctx := idem.WithCallKey(t.Context(), key)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/charges", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp, string(b), err
	}

	// A lost reply: the first attempt is cut at 500 ms, the next find the
	// charge in progress (409) and wait it out.
	key := idem.NewCallKey()
	resp, body, err := charge(key, "order=B-1")
	if err != nil || resp.StatusCode != http.StatusCreated || !idemhttp.Replayed(resp) {
		t.Fatalf("lost reply: %v %v %s", resp, err, body)
	}
	if n, _ := attempts.Load(key); n.(int) < 3 {
		t.Errorf("lost reply: %d attempts, want a cut one, a 409 and the replay", n)
	}
	if n := charges(t, url); n != 1 {
		t.Fatalf("%d charges after a lost reply, want 1", n)
	}

	// A concurrent duplicate: both calls end with the one stored 201.
	key = idem.NewCallKey()
	var wg sync.WaitGroup
	bodies := make([]string, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i == 1 {
				time.Sleep(200 * time.Millisecond)
			}
			resp, body, err := charge(key, "order=C-1")
			if err != nil || resp.StatusCode != http.StatusCreated {
				t.Errorf("duplicate %d: %v %v %s", i, resp, err, body)
			}
			bodies[i] = body
		}()
	}
	wg.Wait()
	if bodies[0] != bodies[1] {
		t.Errorf("the duplicates got different charges: %q, %q", bodies[0], bodies[1])
	}
	if n := charges(t, url); n != 2 {
		t.Fatalf("%d charges after a duplicate, want 2", n)
	}

	// The same key with another body: 422 at once, one attempt.
	resp, body, err = charge(key, "order=C-2")
	if err != nil || resp.StatusCode != http.StatusUnprocessableEntity {
		t.Fatalf("another body: %v %v %s", resp, err, body)
	}
	if n, _ := attempts.Load(key); n.(int) != 1 {
		t.Errorf("another body: %d attempts, want 1", n)
	}

	// A refused connection: nothing sent.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + l.Addr().String()
	_ = l.Close()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, closed+"/charges", strings.NewReader("order=D-1"))
	if _, err := client.Do(req); !errors.Is(err, idem.ErrNotSent) || errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("refused: %v", err)
	}
	if n := charges(t, url); n != 2 {
		t.Fatalf("%d charges at the end, want 2", n)
	}
}
