package main

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// resolve and forget write a row of the audit trail, naming --operator or
// the user running the command; audit list shows them, newest first.
func TestCLIAuditTrail(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	scope := idem.Scope{Actor: "alice", Operation: "pay"}
	r, err := idem.Reserve(ctx, pool, scope, "p-1", idem.FingerprintParts([]byte("a")), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "timeout"); err != nil {
		t.Fatal(err)
	}
	if _, err := idem.DoInTx(ctx, pool, scope, "d-1", idem.FingerprintParts([]byte("a")),
		func(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{Status: 200}, nil }); err != nil {
		t.Fatal(err)
	}

	tok := strconv.FormatInt(r.Token, 10)
	if _, stderr, code := cli(t, url, "resolve", "alice", "pay", "p-1", "--token", tok, "--retryable",
		"--reason", "declined at the bank", "--operator", "sam"); code != 0 {
		t.Fatalf("resolve: exit %d %s", code, stderr)
	}
	if _, stderr, code := cli(t, url, "forget", "alice", "pay", "d-1", "--reason", "client reused the key"); code != 0 {
		t.Fatalf("forget: exit %d %s", code, stderr)
	}
	// A refused change writes nothing.
	if _, _, code := cli(t, url, "resolve", "alice", "pay", "p-1", "--token", tok, "--retryable", "--reason", "again"); code != exitRefused {
		t.Fatalf("stale resolve: exit %d", code)
	}
	if _, stderr, code := cli(t, url, "forget", "alice", "pay", "d-1", "--operator", " "); code != exitUsage ||
		!strings.Contains(stderr, "--operator") {
		t.Fatalf("forget with a blank operator: exit %d %s", code, stderr)
	}

	out, stderr, code := cli(t, url, "audit", "list", "--json")
	if code != 0 {
		t.Fatalf("audit list: exit %d %s", code, stderr)
	}
	var rows []struct {
		Operator, Action, Key, Verdict, Reason string
		TokenBefore                            *int64 `json:"token_before"`
		TokenAfter                             *int64 `json:"token_after"`
		Detail                                 struct {
			Forgotten *struct{ Status string } `json:"forgotten"`
		}
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatal(err, out)
	}
	me, err := user.Current()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 2 || rows[0].Action != "forget" || rows[0].Operator != me.Username || rows[0].Key != "d-1" ||
		rows[0].TokenAfter != nil || rows[0].Reason != "client reused the key" || rows[0].Detail.Forgotten == nil ||
		rows[0].Detail.Forgotten.Status != "succeeded" || rows[1].Action != "resolve" || rows[1].Operator != "sam" || rows[1].Verdict != "retryable" ||
		rows[1].Reason != "declined at the bank" || rows[1].TokenBefore == nil || *rows[1].TokenBefore != r.Token {
		t.Fatalf("audit list: %s", out)
	}
	out, _, code = cli(t, url, "audit", "list", "--operator", "sam")
	if code != 0 || strings.Count(out, "\n") != 1 || !strings.Contains(out, "sam  resolve  alice pay p-1") {
		t.Fatalf("audit list --operator sam: exit %d\n%s", code, out)
	}
	if _, _, code := cli(t, url, "audit", "list", "--action", "drop"); code != exitUsage {
		t.Fatalf("audit list --action drop: exit %d", code)
	}
	if _, _, code := cli(t, url, "audit", "show"); code != exitUsage {
		t.Fatalf("audit show: exit %d", code)
	}
}

// idem ui refuses to start without credentials, and with them serves the
// console to whoever gives them: a bearer token, or in a browser a name
// and the token.
func TestCLIConsole(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t, idem.Migrate)
	env := func(kv ...string) []string {
		var out []string
		for _, e := range os.Environ() {
			if !strings.HasPrefix(e, "IDEM_UI_") {
				out = append(out, e)
			}
		}
		return append(append(out, "DATABASE_URL="+url), kv...)
	}
	for _, kv := range [][]string{nil, {envUIUser + "=sam"}, {envUIPassword + "=x"}, {envUIToken + "= "},
		{envUIToken + "=short-token"}, {envUIUser + "=sam", envUIPassword + "=x"}} {
		cmd := exec.Command(binary(t), "ui", "--listen", "127.0.0.1:0")
		cmd.Env = env(kv...)
		out, err := cmd.CombinedOutput()
		if code := cmd.ProcessState.ExitCode(); code != exitUsage || !strings.Contains(string(out), envUIToken) &&
			!strings.Contains(string(out), "set both") && !strings.Contains(string(out), "at least 16") {
			t.Fatalf("ui with %v: exit %d (%v)\n%s", kv, code, err, out)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, binary(t), "ui", "--listen", "127.0.0.1:0", "--prefix", "/ops", "--operator", "robot")
	cmd.Env = env(envUIToken + "=s3cret-s3cret-s3cret")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Signal(os.Interrupt); _ = cmd.Wait() }()
	line, err := bufio.NewReader(stderr).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	base := strings.Fields(strings.TrimPrefix(line, "idem console on "))[0]
	get := func(path string, auth func(*http.Request)) (int, string) {
		req, _ := http.NewRequest("GET", strings.TrimSuffix(base, "/")+path, nil)
		if auth != nil {
			auth(req)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	if code, _ := get("/", nil); code != http.StatusUnauthorized {
		t.Fatalf("no credentials: %d", code)
	}
	if strings.Contains(line, "warning") {
		t.Errorf("a console on loopback warns: %s", line)
	}
	if code, _ := get("/", func(r *http.Request) { r.Header.Set("Authorization", "Bearer wrong") }); code != http.StatusUnauthorized {
		t.Fatalf("a wrong token: %d", code)
	}
	if code, body := get("/", func(r *http.Request) { r.Header.Set("Authorization", "Bearer s3cret-s3cret-s3cret") }); code != 200 ||
		!strings.Contains(body, ">robot<") {
		t.Fatalf("the token: %d\n%s", code, body)
	}
	if code, body := get("/unknown", func(r *http.Request) { r.SetBasicAuth("dana", "s3cret-s3cret-s3cret") }); code != 200 ||
		!strings.Contains(body, ">dana (token)<") {
		t.Fatalf("a name and the token: %d\n%s", code, body)
	}
	if code, _ := get("/unknown", func(r *http.Request) { r.SetBasicAuth("dana", "guess") }); code != http.StatusUnauthorized {
		t.Fatalf("a name and a wrong password: %d", code)
	}
}

// With IDEM_UI_TOKEN, anyone who has it can give any name in a browser,
// IDEM_UI_USER's too: such a name is marked as given with the token, so
// that the trail never shows it as the named operator's own sign-in.
func TestUICredentialsMarkTheToken(t *testing.T) {
	t.Parallel()
	c := &credentials{token: digest("s3cret"), user: digest("sam"), password: digest("pw"), userName: "sam", tokenOperator: "robot"}
	for _, tc := range []struct {
		name         string
		auth         func(*http.Request)
		wantOperator string
	}{
		{"bearer token", func(r *http.Request) { r.Header.Set("Authorization", "Bearer s3cret") }, "robot"},
		{"bearer, wrong token", func(r *http.Request) { r.Header.Set("Authorization", "Bearer pw") }, ""},
		{"the user and password", func(r *http.Request) { r.SetBasicAuth("sam", "pw") }, "sam"},
		{"the user's name with the token", func(r *http.Request) { r.SetBasicAuth("sam", "s3cret") }, "sam (token)"},
		{"another name with the token", func(r *http.Request) { r.SetBasicAuth("dana", "s3cret") }, "dana (token)"},
		{"the user, a wrong password", func(r *http.Request) { r.SetBasicAuth("sam", "guess") }, ""},
		{"another name with the user's password", func(r *http.Request) { r.SetBasicAuth("dana", "pw") }, ""},
		{"no name", func(r *http.Request) { r.SetBasicAuth("", "s3cret") }, ""},
		{"nothing", func(*http.Request) {}, ""},
	} {
		r := httptest.NewRequest("GET", "/", nil)
		tc.auth(r)
		if got := c.operator(r); got != tc.wantOperator {
			t.Errorf("%s: operator %q, want %q", tc.name, got, tc.wantOperator)
		}
	}
}

// audit list prints stored strings with their control characters escaped:
// a hostile actor, key, operator or reason never reaches the terminal raw,
// so it cannot forge, hide or recolour a line; --json keeps them exact.
func TestCLIAuditEscapes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	forged := "\r\x1b[2K2026-01-01T00:00:00Z  dana.kim  resolve"
	hostile := []string{
		"mallory" + forged,          // actor
		"pay\x1b[8m",                // operation
		"k\u202e\x07\x00\xff",       // key: bidi override, bell, NUL (stripped below), invalid UTF-8
		"dana.kim\x1b[8m (token)",   // operator
		"ok\nforged line\x1b]0;t\a", // reason
	}
	hostile[2] = strings.ReplaceAll(hostile[2], "\x00", "") // text cannot hold NUL
	hostile[2] = strings.ToValidUTF8(hostile[2], "")        // nor invalid UTF-8
	if _, err := pool.Exec(ctx, `INSERT INTO idem_audit (actor, operation, idem_key, operator, action, reason, changed,
		token_before, status_before) VALUES ($1, $2, $3, $4, 'forget', $5, 1, 7, 'succeeded')`,
		hostile[0], hostile[1], hostile[2], hostile[3], hostile[4]); err != nil {
		t.Fatal(err)
	}
	out, stderr, code := cli(t, url, "audit", "list")
	if code != 0 {
		t.Fatalf("audit list: exit %d %s", code, stderr)
	}
	line := strings.TrimSuffix(out, "\n")
	for i, r := range line {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == '\u202e' {
			t.Fatalf("a raw control character %U at byte %d:\n%q", r, i, out)
		}
	}
	for _, want := range []string{`\x1b[2K`, `\r`, `\u202e`, `\a`, `"dana.kim\x1b[8m (token)"`, `\nforged line`} {
		if !strings.Contains(line, want) {
			t.Errorf("%s is not shown escaped:\n%s", want, line)
		}
	}
	out, _, code = cli(t, url, "audit", "list", "--json")
	var rows []struct{ Actor, Operation, Key, Operator, Reason string }
	if err := json.Unmarshal([]byte(out), &rows); code != 0 || err != nil || len(rows) != 1 {
		t.Fatalf("audit list --json: exit %d %v %s", code, err, out)
	}
	if got := []string{rows[0].Actor, rows[0].Operation, rows[0].Key, rows[0].Operator, rows[0].Reason}; strings.Join(got, "|") != strings.Join(hostile, "|") {
		t.Fatalf("--json changed the stored strings: %q", got)
	}
}

// A short or blank secret is refused, saying why.
func TestUISecretTooShort(t *testing.T) {
	for _, v := range []string{" ", strings.Repeat(" ", 20), "x", strings.Repeat("x", minSecret-1)} {
		if err := checkSecret(envUIToken, v); err == nil || !strings.Contains(err.Error(), envUIToken) {
			t.Errorf("secret %q: %v", v, err)
		}
	}
	if err := checkSecret(envUIPassword, strings.Repeat("x", minSecret)); err != nil {
		t.Errorf("a secret of %d bytes: %v", minSecret, err)
	}
}

// Repeated failed sign-ins from one address are answered 429 for longer
// and longer; other addresses, and a success, are not held back; every
// answer, 401 and 429 included, carries the console's security headers.
func TestUISlowsRepeatedFailures(t *testing.T) {
	t.Parallel()
	c := &credentials{token: digest("s3cret-s3cret-s3cret"), tokenOperator: "robot"}
	f := newFailures()
	h := c.authenticate(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(200) }), f)
	try := func(addr, token string) *http.Response {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = addr + ":4000"
		if token != "" {
			r.Header.Set("Authorization", "Bearer "+token)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		res := w.Result()
		if csp := res.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") ||
			res.Header.Get("X-Frame-Options") != "DENY" {
			t.Errorf("answer %d lacks the security headers: %v", res.StatusCode, res.Header)
		}
		return res
	}
	for i := range failuresAllowed {
		if res := try("10.0.0.1", "guess"); res.StatusCode != http.StatusUnauthorized {
			t.Fatalf("failure %d: %d", i+1, res.StatusCode)
		}
	}
	if res := try("10.0.0.1", ""); res.StatusCode != http.StatusUnauthorized {
		t.Fatalf("no credentials: %d", res.StatusCode)
	}
	if res := try("10.0.0.1", "guess"); res.StatusCode != http.StatusUnauthorized {
		t.Fatalf("one failure too many is still answered: %d", res.StatusCode)
	}
	res := try("10.0.0.1", "s3cret-s3cret-s3cret")
	if res.StatusCode != http.StatusTooManyRequests || res.Header.Get("Retry-After") == "" {
		t.Fatalf("after %d failures: %d, Retry-After %q", failuresAllowed+1, res.StatusCode, res.Header.Get("Retry-After"))
	}
	if res := try("10.0.0.2", "s3cret-s3cret-s3cret"); res.StatusCode != 200 {
		t.Fatalf("another address: %d", res.StatusCode)
	}
	// The waits grow, up to a bound (on a clock of the test's own).
	g := newFailures()
	now := time.Unix(0, 0)
	var last time.Duration
	for i := range failuresAllowed + 30 {
		g.fail("a", now)
		w := g.wait("a", now)
		if i < failuresAllowed && w != 0 || i >= failuresAllowed && (w < last || w > maxFailureWait || w == 0) {
			t.Fatalf("failure %d: wait %s after %s", i+1, w, last)
		}
		last = w
	}
	if last != maxFailureWait {
		t.Fatalf("the wait stops at %s, want %s", last, maxFailureWait)
	}
	g.forget("a")
	if w := g.wait("a", now); w != 0 {
		t.Fatalf("after a success: wait %s", w)
	}
}

// idem ui warns when it listens beyond loopback without TLS.
func TestUIExposedWarning(t *testing.T) {
	for _, tc := range []struct {
		addr string
		tls  bool
		warn bool
	}{{"127.0.0.1:8081", false, false}, {"[::1]:8081", false, false}, {"0.0.0.0:8081", false, true},
		{"10.1.2.3:8081", false, true}, {"0.0.0.0:8081", true, false}} {
		a, err := net.ResolveTCPAddr("tcp", tc.addr)
		if err != nil {
			t.Fatal(err)
		}
		if got := exposedWarning(a, tc.tls); (got != "") != tc.warn {
			t.Errorf("%s, TLS %v: warning %q", tc.addr, tc.tls, got)
		}
	}
}

// With --tls-cert and --tls-key, idem ui serves HTTPS; one without the
// other is refused.
func TestCLIConsoleTLS(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.URL(t, idem.Migrate)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idem ui test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	environ := append(os.Environ(), "DATABASE_URL="+dbURL, envUIToken+"=s3cret-s3cret-s3cret")

	half := exec.Command(binary(t), "ui", "--listen", "127.0.0.1:0", "--operator", "robot", "--tls-cert", certFile)
	half.Env = environ
	if out, _ := half.CombinedOutput(); half.ProcessState.ExitCode() != exitUsage || !strings.Contains(string(out), "go together") {
		t.Fatalf("--tls-cert alone: exit %d\n%s", half.ProcessState.ExitCode(), out)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, binary(t), "ui", "--listen", "127.0.0.1:0", "--operator", "robot", "--tls-cert", certFile, "--tls-key", keyFile)
	cmd.Env = environ
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Signal(os.Interrupt); _ = cmd.Wait() }()
	line, err := bufio.NewReader(stderr).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	base := strings.Fields(strings.TrimPrefix(line, "idem console on "))[0]
	if !strings.HasPrefix(base, "https://") {
		t.Fatalf("idem ui with TLS says %q", line)
	}
	pool := x509.NewCertPool()
	pool.AddCert(must(x509.ParseCertificate(der)))
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	res, err := client.Get(base)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusUnauthorized || !strings.Contains(res.Header.Get("Content-Security-Policy"), "default-src 'none'") {
		t.Fatalf("HTTPS without credentials: %d %v", res.StatusCode, res.Header)
	}
	req, _ := http.NewRequest("GET", base, nil)
	req.Header.Set("Authorization", "Bearer s3cret-s3cret-s3cret")
	if res, err = client.Do(req); err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 200 {
		t.Fatalf("HTTPS with the token: %d", res.StatusCode)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// The slowdown cannot be dodged: the addresses of one IPv6 /64 (what one
// client usually holds) count as one, and failures from many other
// addresses do not push out an address that is held back.
func TestUIFailuresCannotBeDodged(t *testing.T) {
	t.Parallel()
	c := &credentials{token: digest("s3cret-s3cret-s3cret"), tokenOperator: "robot"}
	f := newFailures()
	h := c.authenticate(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(200) }), f)
	try := func(remote, token string) int {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = remote
		r.Header.Set("Authorization", "Bearer "+token)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w.Code
	}
	for i := range failuresAllowed + 1 {
		try(fmt.Sprintf("[2001:db8:1:2::%x]:4000", i+1), "guess")
	}
	if code := try("[2001:db8:1:2:ffff::9]:4000", "s3cret-s3cret-s3cret"); code != http.StatusTooManyRequests {
		t.Errorf("another address of the same /64 after %d failures: %d, not 429", failuresAllowed+1, code)
	}
	if code := try("[2001:db8:1:3::1]:4000", "s3cret-s3cret-s3cret"); code != 200 {
		t.Errorf("another /64: %d", code)
	}
	// A held-back address, then failures from many others (on a clock of
	// the test's own, so that the wait does not end meanwhile).
	g := newFailures()
	now := time.Unix(0, 0)
	for range failuresAllowed + 1 {
		g.fail("192.0.2.7", now)
	}
	for i := range 2 * maxFailureAddresses {
		g.fail(fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), now)
	}
	if w := g.wait("192.0.2.7", now); w == 0 {
		t.Errorf("a held-back address after failures from %d others is not held back", 2*maxFailureAddresses)
	}
	if n := len(g.m); n > maxFailureAddresses {
		t.Errorf("%d addresses kept, more than %d", n, maxFailureAddresses)
	}
}
