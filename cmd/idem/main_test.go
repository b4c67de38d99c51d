package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// binary builds the command once per test run.
func binary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "idem-cli-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "idem")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			binErr = errors.New(string(out))
		}
	})
	if binErr != nil {
		t.Fatalf("go build: %v", binErr)
	}
	return binPath
}

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// cli runs the built binary with DATABASE_URL set to url and returns its
// stdout, stderr and exit code.
func cli(t *testing.T, url string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(binary(t), args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+url)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		code = exitErr.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return stdout.String(), stderr.String(), code
}

func TestCLIEndToEnd(t *testing.T) {
	ctx := context.Background()
	url := pgtest.URL(t, nil) // an empty database: the CLI migrates it
	scope := idem.Scope{Actor: "alice", Operation: "draw"}

	// Every command has --help, and usage errors exit 2.
	for _, c := range []string{"migrate", "prune", "inspect", "forget", "stats", "unknown", "resolve"} {
		out, _, code := cli(t, url, c, "--help")
		if code != 0 || !strings.Contains(out, "Usage: idem "+c) {
			t.Errorf("%s --help: exit %d\n%s", c, code, out)
		}
	}
	if _, _, code := cli(t, url, "--help"); code != 0 {
		t.Errorf("--help: exit %d", code)
	}
	if _, stderr, code := cli(t, url, "frobnicate"); code != exitUsage || !strings.Contains(stderr, "unknown command") {
		t.Errorf("unknown command: exit %d, %s", code, stderr)
	}
	if _, _, code := cli(t, url, "inspect", "only-one"); code != exitUsage {
		t.Errorf("inspect with one argument: exit %d", code)
	}
	if _, stderr, code := cli(t, "", "stats"); code != exitUsage || !strings.Contains(stderr, "DATABASE_URL") {
		t.Errorf("no database: exit %d, %s", code, stderr)
	}

	// migrate up, status, down, up.
	files, err := fs.ReadDir(idem.Migrations(), ".")
	if err != nil {
		t.Fatal(err)
	}
	n := len(files) // idem's migrations
	out, stderr, code := cli(t, url, "migrate", "up")
	if code != 0 || strings.Count(out, "applied") != n {
		t.Fatalf("migrate up: exit %d\n%s%s", code, out, stderr)
	}
	if out, _, code = cli(t, url, "migrate", "down"); code != 0 || !strings.Contains(out, "pending") {
		t.Fatalf("migrate down: exit %d\n%s", code, out)
	}
	for _, args := range [][]string{{"--json", "migrate", "status"}, {"migrate", "status", "--json"}} {
		out, _, code = cli(t, url, args...)
		var status []struct{ Applied bool }
		if code != 0 || json.Unmarshal([]byte(out), &status) != nil || len(status) != n || !status[n-2].Applied || status[n-1].Applied {
			t.Fatalf("%v: exit %d\n%s", args, code, out)
		}
	}
	if _, _, code = cli(t, url, "migrate", "up"); code != 0 {
		t.Fatal("migrate up again")
	}

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	short, _ := idem.New(idem.Config{TTL: time.Millisecond})
	ok := func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201, Body: []byte(`{"id":1}`)}, nil
	}
	if _, err := idem.DoInTx(ctx, pool, scope, "k-1", idem.FingerprintParts([]byte("a")), ok); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"old-1", "old-2", "old-3"} {
		if _, err := short.DoInTx(ctx, pool, scope, k, idem.FingerprintParts([]byte("a")), ok); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(5 * time.Millisecond)

	// inspect.
	out, _, code = cli(t, url, "inspect", "alice", "draw", "k-1")
	if code != 0 || !strings.Contains(out, "succeeded") || !strings.Contains(out, `{\"id\":1}`) {
		t.Fatalf("inspect: exit %d\n%s", code, out)
	}
	out, _, code = cli(t, url, "inspect", "--json", "alice", "draw", "k-1")
	var rec struct {
		Status   string
		Response struct{ Status int }
	}
	if code != 0 || json.Unmarshal([]byte(out), &rec) != nil || rec.Status != "succeeded" || rec.Response.Status != 201 {
		t.Fatalf("inspect --json: exit %d\n%s", code, out)
	}
	if _, _, code = cli(t, url, "inspect", "alice", "draw", "nope"); code != exitNotFound {
		t.Fatalf("inspect of a missing key: exit %d", code)
	}

	// stats.
	out, _, code = cli(t, url, "stats", "--json")
	var st struct {
		Keys  map[string]int64
		Total int64
	}
	if code != 0 || json.Unmarshal([]byte(out), &st) != nil || st.Total != 4 || st.Keys["succeeded"] != 4 {
		t.Fatalf("stats --json: exit %d\n%s", code, out)
	}

	// prune --dry-run, then prune.
	out, _, code = cli(t, url, "prune", "--dry-run")
	if code != 0 || !strings.Contains(out, "would delete 3") {
		t.Fatalf("prune --dry-run: exit %d\n%s", code, out)
	}
	out, _, code = cli(t, url, "prune", "--json")
	var pr struct{ Keys int64 }
	if code != 0 || json.Unmarshal([]byte(out), &pr) != nil || pr.Keys != 3 {
		t.Fatalf("prune --json: exit %d\n%s", code, out)
	}

	// forget: the key is free again.
	if _, _, code = cli(t, url, "forget", "alice", "draw", "k-1"); code != 0 {
		t.Fatalf("forget: exit %d", code)
	}
	if _, _, code = cli(t, url, "forget", "alice", "draw", "k-1"); code != exitNotFound {
		t.Fatalf("forget again: exit %d", code)
	}
	res, err := idem.DoInTx(ctx, pool, scope, "k-1", idem.FingerprintParts([]byte("b")), ok)
	if err != nil || res.Replayed {
		t.Fatalf("after forget: %+v, %v", res, err)
	}

	// A reservation whose outcome is unknown: listed, refused by forget,
	// resolved, then replayed.
	r, err := idem.Reserve(ctx, pool, scope, "pay-1", idem.FingerprintParts([]byte("p")), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "gateway timed out"); err != nil {
		t.Fatal(err)
	}
	out, _, code = cli(t, url, "unknown", "list")
	if code != 0 || !strings.Contains(out, "pay-1") || !strings.Contains(out, "gateway timed out") {
		t.Fatalf("unknown list: exit %d\n%s", code, out)
	}
	if _, _, code = cli(t, url, "forget", "alice", "draw", "pay-1"); code != exitRefused {
		t.Fatalf("forget of an unknown outcome: exit %d", code)
	}
	token := strconv.FormatInt(r.Token, 10)
	if !strings.Contains(out, "token "+token) {
		t.Fatalf("unknown list does not show token %s:\n%s", token, out)
	}
	if _, _, code = cli(t, url, "resolve", "alice", "draw", "pay-1", "--token", token, "--succeeded"); code != exitUsage {
		t.Fatalf("resolve without --reason: exit %d", code)
	}
	if _, _, code = cli(t, url, "resolve", "alice", "draw", "pay-1", "--succeeded", "--reason", "found"); code != exitUsage {
		t.Fatalf("resolve without --token: exit %d", code)
	}
	if _, _, code = cli(t, url, "resolve", "alice", "draw", "pay-1", "--token", strconv.FormatInt(r.Token+1, 10),
		"--succeeded", "--reason", "found"); code != exitRefused {
		t.Fatalf("resolve with another token: exit %d", code)
	}
	out, stderr, code = cli(t, url, "resolve", "alice", "draw", "pay-1", "--token", token, "--succeeded", "--status", "201",
		"--body", `{"charged":true}`, "--reason", "charge found at the gateway")
	if code != 0 {
		t.Fatalf("resolve: exit %d\n%s%s", code, out, stderr)
	}
	if _, _, code = cli(t, url, "resolve", "alice", "draw", "pay-1", "--token", token, "--retryable", "--reason", "again"); code != exitRefused {
		t.Fatalf("resolve of a resolved record: exit %d", code)
	}
	replay, err := idem.Reserve(ctx, pool, scope, "pay-1", idem.FingerprintParts([]byte("p")), time.Minute)
	if err != nil || !replay.Replayed || string(replay.Body) != `{"charged":true}` || replay.Status != 201 {
		t.Fatalf("after resolve: %+v, %v", replay, err)
	}
	out, _, code = cli(t, url, "unknown", "list", "--json")
	if code != 0 || strings.TrimSpace(out) != "[]" {
		t.Fatalf("unknown list after resolve: exit %d\n%s", code, out)
	}
}

func TestParseInterleaved(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"a", "b", "c"}, "a b c"},
		{[]string{"--json", "a", "b"}, "a b"},
		{[]string{"a", "--json", "b"}, "a b"},
		{[]string{"a", "b", "--json"}, "a b"},
		{[]string{"a", "--", "-k", "--json"}, "a -k --json"},
		{[]string{"--json", "--", "-k"}, "-k"},
		{[]string{"a", "-"}, "a -"},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		j := fs.Bool("json", false, "")
		got, err := parseInterleaved(fs, tc.args)
		if err != nil || strings.Join(got, " ") != tc.want {
			t.Errorf("%q: %q, %v; want %q", tc.args, got, err, tc.want)
		}
		if strings.Contains(strings.Join(tc.args, " "), "--json") && !strings.Contains(tc.want, "--json") && !*j {
			t.Errorf("%q: --json not set", tc.args)
		}
	}
}
