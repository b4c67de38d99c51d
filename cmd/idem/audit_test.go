package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/user"
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
	if _, stderr, code := cli(t, url, "forget", "alice", "pay", "d-1"); code != 0 {
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
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatal(err, out)
	}
	me, err := user.Current()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 2 || rows[0].Action != "forget" || rows[0].Operator != me.Username || rows[0].Key != "d-1" ||
		rows[0].TokenAfter != nil || rows[1].Action != "resolve" || rows[1].Operator != "sam" || rows[1].Verdict != "retryable" ||
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
	for _, kv := range [][]string{nil, {envUIUser + "=sam"}, {envUIPassword + "=x"}} {
		cmd := exec.Command(binary(t), "ui", "--listen", "127.0.0.1:0")
		cmd.Env = env(kv...)
		out, err := cmd.CombinedOutput()
		if code := cmd.ProcessState.ExitCode(); code != exitUsage || !strings.Contains(string(out), envUIToken) &&
			!strings.Contains(string(out), "set both") {
			t.Fatalf("ui with %v: exit %d (%v)\n%s", kv, code, err, out)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, binary(t), "ui", "--listen", "127.0.0.1:0", "--prefix", "/ops", "--operator", "robot")
	cmd.Env = env(envUIToken + "=s3cret")
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
	if code, _ := get("/", func(r *http.Request) { r.Header.Set("Authorization", "Bearer wrong") }); code != http.StatusUnauthorized {
		t.Fatalf("a wrong token: %d", code)
	}
	if code, body := get("/", func(r *http.Request) { r.Header.Set("Authorization", "Bearer s3cret") }); code != 200 ||
		!strings.Contains(body, ">robot<") {
		t.Fatalf("the token: %d\n%s", code, body)
	}
	if code, body := get("/unknown", func(r *http.Request) { r.SetBasicAuth("dana", "s3cret") }); code != 200 ||
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
