package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
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
	for _, c := range []string{"migrate", "prune", "inspect", "forget", "stats", "expire-leases", "unknown", "resolve"} {
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
	var pr struct {
		Keys          int64
		BodiesDropped *int64 `json:"bodies_dropped"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &pr) != nil || pr.Keys != 3 || pr.BodiesDropped == nil || *pr.BodiesDropped != 0 {
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

// runCLI runs the command line in-process and returns its stdout, stderr
// and exit code.
func runCLI(t *testing.T, url string, args ...string) (string, string, int) {
	t.Helper()
	t.Setenv("DATABASE_URL", url)
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), args, &stdout, &stderr)
	return stdout.String(), stderr.String(), code
}

// Help goes to stdout, once, and nothing to stderr.
func TestCLIHelpOnce(t *testing.T) {
	for _, args := range [][]string{
		{"--help"}, {"-h"}, {"help"}, {"--json", "--help"},
		{"inspect", "--help"}, {"inspect", "-h"}, {"help", "inspect"}, {"inspect", "a", "--help"},
		{"prune", "--help"}, {"help", "prune"}, {"resolve", "--help"},
	} {
		out, errOut, code := runCLI(t, "", args...)
		want := "Usage: idem " + args[len(args)-1]
		if len(args) == 1 || args[0] == "--json" {
			want = "Usage:\n  idem [--database-url URL]"
		} else if args[0] != "help" {
			want = "Usage: idem " + args[0]
		}
		if code != exitOK || errOut != "" || strings.Count(out, want) != 1 || strings.Count(out, "Usage") != 1 {
			t.Errorf("%q: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, out, errOut)
		}
	}
	// The built binary, as a user runs it: the same.
	for _, args := range [][]string{{"--help"}, {"stats", "--help"}} {
		out, errOut, code := cli(t, "", args...)
		if code != exitOK || errOut != "" || strings.Count(out, "Usage") != 1 {
			t.Errorf("binary %q: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, out, errOut)
		}
	}
}

// Usage errors: one line with one prefix on stderr, the usage after it,
// nothing on stdout; with --json one JSON object on stdout and nothing on
// stderr.
func TestCLIUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		line string // the first line of stderr
	}{
		{nil, "idem: no command"},
		{[]string{"frobnicate"}, `idem: unknown command "frobnicate"`},
		{[]string{"--bogus"}, "idem: flag provided but not defined: --bogus"},
		{[]string{"help", "frobnicate"}, `idem: help takes one command name at most, got "frobnicate"`},
		{[]string{"inspect", "a"}, "idem inspect: want <actor> <operation> <key>, got 1 argument(s)"},
		{[]string{"inspect", "--bogus", "a", "b", "c"}, "idem inspect: flag provided but not defined: --bogus"},
		{[]string{"prune", "--batch-size", "x"}, `idem prune: invalid value "x" for flag --batch-size: parse error`},
		{[]string{"migrate", "sideways"}, `idem migrate: want up, down or status, got "sideways"`},
		{[]string{"stats"}, "idem stats: no database: set DATABASE_URL or pass --database-url"},
		{[]string{"resolve", "a", "b", "c", "--token", "1", "--succeeded"}, "idem resolve: --reason is required: it is stored with the record for the audit trail"},
	} {
		out, errOut, code := runCLI(t, "", tc.args...)
		first, rest, _ := strings.Cut(errOut, "\n")
		if code != exitUsage || out != "" || first != tc.line || !strings.Contains(rest, "idem") {
			t.Errorf("%q: exit %d\nstdout:\n%s\nstderr:\n%s", tc.args, code, out, errOut)
		}

		// --json before the command, and after it where a command was found.
		jsonArgs := [][]string{append([]string{"--json"}, tc.args...)}
		if len(tc.args) > 0 && commands[tc.args[0]].usage != "" {
			jsonArgs = append(jsonArgs, append([]string{tc.args[0], "--json"}, tc.args[1:]...))
		}
		for _, args := range jsonArgs {
			out, errOut, code := runCLI(t, "", args...)
			_, msg, _ := strings.Cut(tc.line, ": ")
			wantJSON(t, args, out, errOut, code, exitUsage, msg)
		}
	}
}

// wantJSON checks that out is exactly one JSON error object with msg and
// code, and that nothing went to stderr.
func wantJSON(t *testing.T, args []string, out, errOut string, code, wantCode int, msg string) {
	t.Helper()
	var got struct {
		Error    string
		ExitCode int `json:"exit_code"`
	}
	dec := json.NewDecoder(strings.NewReader(out))
	err := dec.Decode(&got)
	if err != nil || dec.More() || code != wantCode || errOut != "" || got.ExitCode != wantCode || !strings.Contains(got.Error, msg) {
		t.Errorf("%q: exit %d (%v)\nstdout:\n%s\nstderr:\n%s", args, code, err, out, errOut)
	}
}

// Errors from the library carry its "idem: " prefix; the line carries one
// prefix only.
func TestCLIErrorOnePrefix(t *testing.T) {
	url := pgtest.URL(t, idem.Migrate)
	for _, args := range [][]string{{"inspect", "a", "b", "nope"}, {"forget", "a", "b", "nope"}} {
		out, errOut, code := runCLI(t, url, args...)
		want := "idem " + args[0] + ": no record for this idempotency key\n"
		if code != exitNotFound || out != "" || errOut != want {
			t.Errorf("%q: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, out, errOut)
		}
		args = append([]string{"--json"}, args...)
		out, errOut, code = runCLI(t, url, args...)
		wantJSON(t, args, out, errOut, code, exitNotFound, "no record for this idempotency key")
		if strings.Contains(out, "idem: ") {
			t.Errorf("%q: the JSON error keeps the library's prefix: %s", args, out)
		}
	}
	// A key the library refuses: a usage error, one prefix.
	out, errOut, code := runCLI(t, url, "inspect", "a", "b", "")
	if code != exitUsage || out != "" || strings.Contains(errOut, "idem: ") || !strings.HasPrefix(errOut, "idem inspect: invalid idempotency key") {
		t.Errorf("empty key: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
}

// A database where idem's migrations never ran: every command that reads
// the table says to run "idem migrate up".
func TestCLIUnmigrated(t *testing.T) {
	url := pgtest.URL(t, nil)
	const hint = "run `idem migrate up`"
	for _, args := range [][]string{
		{"stats"}, {"prune"}, {"prune", "--dry-run"}, {"inspect", "a", "b", "c"}, {"forget", "a", "b", "c"},
		{"expire-leases"}, {"unknown", "list"}, {"resolve", "a", "b", "c", "--token", "1", "--retryable", "--reason", "r"},
	} {
		out, errOut, code := runCLI(t, url, args...)
		if code != exitFailure || out != "" || strings.Count(errOut, "\n") != 1 ||
			!strings.HasPrefix(errOut, "idem "+args[0]+": ") || !strings.Contains(errOut, hint) {
			t.Errorf("%q: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, out, errOut)
		}
		args = append([]string{"--json"}, args...)
		out, errOut, code = runCLI(t, url, args...)
		wantJSON(t, args, out, errOut, code, exitFailure, hint)
	}
	// After migrate up, the same command works.
	if _, errOut, code := runCLI(t, url, "migrate", "up"); code != exitOK {
		t.Fatalf("migrate up: exit %d: %s", code, errOut)
	}
	if out, errOut, code := runCLI(t, url, "stats"); code != exitOK || errOut != "" || !strings.Contains(out, "total") {
		t.Errorf("stats after migrate up: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
}

// The operator's side of issue 15: a lapsed lease shows in unknown list
// once expire-leases turned it unknown (its token kept) and resolves with
// that token; resolve
// refuses a body that is not the JSON its content type says; migrate down
// refuses to delete outcomes unless --force.
func TestCLIOperatorCoherence(t *testing.T) {
	ctx := t.Context()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	scope := idem.Scope{Actor: "alice", Operation: "pay"}
	r, err := idem.Reserve(ctx, pool, scope, "lapsed", idem.FingerprintParts([]byte("p")), time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	token := strconv.FormatInt(r.Token, 10)
	if out, errOut, code := runCLI(t, url, "expire-leases"); code != exitOK || !strings.Contains(out, "1 reservations") {
		t.Fatalf("expire-leases: exit %d\n%s%s", code, out, errOut)
	}
	out, errOut, code := runCLI(t, url, "unknown", "list")
	if code != exitOK || !strings.Contains(out, "lapsed") || !strings.Contains(out, "token "+token) {
		t.Fatalf("unknown list does not show the lapsed lease: exit %d\n%s%s", code, out, errOut)
	}

	// A body that is not JSON, labelled JSON: refused, nothing changed.
	for _, args := range [][]string{
		{"--body", "{not json"},
		{"--body", `{"a":1}x`, "--content-type", "application/problem+json"},
	} {
		args = append([]string{"resolve", "alice", "pay", "lapsed", "--token", token, "--succeeded", "--reason", "found"}, args...)
		if _, errOut, code := runCLI(t, url, args...); code != exitUsage || !strings.Contains(errOut, "not valid JSON") {
			t.Fatalf("%q: exit %d: %s", args, code, errOut)
		}
	}
	if rec, err := idem.Lookup(ctx, pool, scope, "lapsed"); err != nil || rec.Status != idem.StatusUnknown || rec.Token != r.Token {
		t.Fatalf("after refused resolves: %+v, %v", rec, err)
	}
	// Not JSON and not labelled JSON: stored as given.
	if _, errOut, code := runCLI(t, url, "resolve", "alice", "pay", "lapsed", "--token", token, "--succeeded",
		"--reason", "found", "--body", "{not json", "--content-type", "text/plain"); code != exitOK {
		t.Fatalf("resolve with a text body: exit %d: %s", code, errOut)
	}

	// migrate down: the migrations after 2 keep every record (5 refuses to
	// drop the audit trail unless --force); 2 would delete unknown,
	// in-flight and failed_retryable records: refused unless --force.
	if _, err := idem.Reserve(ctx, pool, scope, "in-flight", idem.FingerprintParts([]byte("p")), time.Hour); err != nil {
		t.Fatal(err)
	}
	for {
		var v int64
		if err := pool.QueryRow(ctx, `SELECT max(version_id) FROM `+idem.MigrationTable).Scan(&v); err != nil {
			t.Fatal(err)
		}
		if v <= 2 {
			break
		}
		if v == 5 { // the audit trail (resolve wrote a row): refused unless --force
			if _, errOut, code := runCLI(t, url, "migrate", "down"); code != exitRefused || !strings.Contains(errOut, "audit trail") {
				t.Fatalf("migrate down deleting the audit trail: exit %d: %s", code, errOut)
			}
			if _, errOut, code := runCLI(t, url, "migrate", "down", "--force"); code != exitOK {
				t.Fatalf("migrate down --force from 5: exit %d: %s", code, errOut)
			}
			continue
		}
		if _, errOut, code := runCLI(t, url, "migrate", "down"); code != exitOK {
			t.Fatalf("migrate down from %d: exit %d: %s", v, code, errOut)
		}
	}
	_, errOut, code = runCLI(t, url, "migrate", "down")
	if code != exitRefused || !strings.Contains(errOut, "1 records") || !strings.Contains(errOut, "--force") {
		t.Fatalf("migrate down deleting a record in flight: exit %d: %s", code, errOut)
	}
	if _, errOut, code := runCLI(t, url, "migrate", "down", "--force"); code != exitOK {
		t.Fatalf("migrate down --force: exit %d: %s", code, errOut)
	}
	if _, _, code := runCLI(t, url, "migrate", "status", "--force"); code != exitUsage {
		t.Fatalf("migrate status --force: exit %d", code)
	}
}

// --force goes with down only: "migrate up --force" (or status) is a usage
// error before anything touches the database.
func TestCLIMigrateForceOnlyWithDown(t *testing.T) {
	ctx := t.Context()
	url := pgtest.URL(t, nil) // empty: up would create idem's table
	for _, args := range [][]string{{"migrate", "up", "--force"}, {"migrate", "--force", "status"}} {
		out, errOut, code := runCLI(t, url, args...)
		if code != exitUsage || out != "" || !strings.HasPrefix(errOut, "idem migrate: --force goes with down only\n") {
			t.Errorf("%q: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, out, errOut)
		}
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, _ := conn.Query(ctx, `SELECT tablename FROM pg_tables WHERE tablename LIKE 'idem%'`)
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(tables) != 0 {
		t.Fatalf("after refused migrate --force: tables %q (%v), want none", tables, err)
	}
}

// unknown list only reads: a reservation whose lease ran out is listed at
// once but stays processing, so its late worker's Complete still lands; the
// listing points to expire-leases, which turns such reservations unknown (in
// batches, until none is left) and says how many.
func TestCLIUnknownListReadOnly(t *testing.T) {
	ctx := t.Context()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	scope := idem.Scope{Actor: "alice", Operation: "pay"}
	fp := idem.FingerprintParts([]byte("p"))
	var lapsed []idem.Reservation
	for _, k := range []string{"late", "lapsed-1", "lapsed-2", "lapsed-3"} {
		r, err := idem.Reserve(ctx, pool, scope, k, fp, time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		lapsed = append(lapsed, r)
	}
	time.Sleep(20 * time.Millisecond)

	out, errOut, code := runCLI(t, url, "unknown", "list")
	if code != exitOK || errOut != "" || !strings.Contains(out, "lapsed-3") || !strings.Contains(out, "late") ||
		!strings.Contains(out, "idem expire-leases") {
		t.Fatalf("unknown list: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	var listed []map[string]any
	if out, errOut, code := runCLI(t, url, "unknown", "list", "--json"); code != exitOK || json.Unmarshal([]byte(out), &listed) != nil || len(listed) != 4 {
		t.Fatalf("unknown list --json: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if out, _, code := runCLI(t, url, "unknown", "--help"); code != exitOK || !strings.Contains(out, "idem expire-leases") {
		t.Fatalf("unknown --help does not point to expire-leases: exit %d\n%s", code, out)
	}
	// The late worker's Complete lands: nobody fenced it.
	err = idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		return idem.Complete(ctx, tx, lapsed[0], idem.Response{Status: 201, Body: []byte(`{}`)})
	})
	if err != nil {
		t.Fatalf("the late worker's Complete after unknown list: %v", err)
	}

	if _, errOut, code := runCLI(t, url, "expire-leases", "--batch", "0"); code != exitUsage || !strings.Contains(errOut, "--batch") {
		t.Fatalf("expire-leases --batch 0: exit %d: %s", code, errOut)
	}
	out, errOut, code = runCLI(t, url, "expire-leases", "--batch", "1", "--json")
	var got struct{ Expired int64 }
	if code != exitOK || errOut != "" || json.Unmarshal([]byte(out), &got) != nil || got.Expired != 3 {
		t.Fatalf("expire-leases --json: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if out, _, code := runCLI(t, url, "expire-leases"); code != exitOK || !strings.Contains(out, "0 reservations") {
		t.Fatalf("expire-leases again: exit %d\n%s", code, out)
	}
	out, _, code = runCLI(t, url, "unknown", "list")
	for _, r := range lapsed[1:] {
		if code != exitOK || !strings.Contains(out, r.Key+"  token "+strconv.FormatInt(r.Token, 10)) {
			t.Fatalf("unknown list after expire-leases: exit %d\n%s", code, out)
		}
	}
	if rec, err := idem.Lookup(ctx, pool, scope, "late"); err != nil || rec.Status != idem.StatusSucceeded {
		t.Fatalf("late: %+v, %v", rec, err)
	}
}

// freeAddr returns a loopback port nobody listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	ln.Close()
	return port
}

// A database that cannot be reached is one line, with idem named once,
// though pgx lists every address it tried on a line of its own; the JSON
// error holds no control character.
func TestCLIErrorOneLine(t *testing.T) {
	url := "postgres://postgres@localhost:" + freeAddr(t) + "/x?connect_timeout=5"
	out, errOut, code := runCLI(t, url, "stats")
	if code != exitFailure || out != "" || strings.Count(errOut, "\n") != 1 || strings.ContainsAny(errOut, "\t\r") ||
		!strings.HasPrefix(errOut, "idem stats: cannot reach the database: failed to connect to `user=postgres database=x`: ") ||
		strings.Count(errOut, "idem") != 1 {
		t.Errorf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	out, errOut, code = runCLI(t, url, "stats", "--json")
	wantJSON(t, []string{"stats", "--json"}, out, errOut, code, exitFailure, "cannot reach the database")
	if strings.Count(out, "\n") != 1 || strings.Contains(out, `\n`) || strings.Contains(out, `\t`) {
		t.Errorf("--json error with control characters: %s", out)
	}
}

// The library's errors, nested ones included, and pgx's prepared
// statements lost behind a pooler (26000, 42P05), as exit reports them: one
// line, idem named once, the fix named.
func TestCLIErrorMessages(t *testing.T) {
	lost := func(code, verb string) error {
		return &pgconn.PgError{Severity: "ERROR", Code: code,
			Message: `prepared statement "stmtcache_0123abcd" ` + verb}
	}
	for _, c := range []struct {
		err  error
		want string
	}{
		{fmt.Errorf("%w: %w", idem.ErrUnavailable, errors.New("idem: commit: conn closed")),
			"store unavailable: commit: conn closed"},
		{lost("42P05", "already exists"), "prepared statements lost behind a connection pooler (a transaction pooler such as PgBouncer in transaction mode?): " +
			"add default_query_exec_mode=exec (or cache_describe, or simple_protocol) to the connection string in DATABASE_URL or --database-url, " +
			`or run PgBouncer 1.21 or newer with max_prepared_statements > 0: ERROR: prepared statement "stmtcache_0123abcd" already exists (SQLSTATE 42P05)`},
		{fmt.Errorf("%w: %w", idem.ErrPreparedStatements, lost("26000", "does not exist")), "prepared statements lost behind a connection pooler"},
		{errors.New("first\n\tsecond\n\tsecond\n"), "first; second"},
	} {
		var stdout, stderr bytes.Buffer
		e := &env{stdout: &stdout, stderr: &stderr, name: "idem stats"}
		if code := e.exit(c.err); code != exitFailure {
			t.Errorf("%v: exit %d", c.err, code)
		}
		line := stderr.String()
		if !strings.HasPrefix(line, "idem stats: "+c.want) || strings.Count(line, "\n") != 1 || strings.Count(line, "idem") != 1 {
			t.Errorf("%v:\n%s", c.err, line)
		}
		if errors.Is(c.err, idem.ErrPreparedStatements) || strings.Contains(c.err.Error(), "stmtcache_") {
			if !strings.Contains(line, "default_query_exec_mode=exec") || !strings.Contains(line, "(SQLSTATE ") {
				t.Errorf("%v: the fix is not named:\n%s", c.err, line)
			}
		}
	}
}

// Behind PgBouncer in transaction mode, pgx's default exec mode loses its
// prepared statements. The commands' statements run in the exec mode (the
// library plans operator statements anew, and asks about Citus in the
// simple protocol), so they work there; should one fail with lost
// statements all the same, the fix is named on one line (TestExplain
// checks that message).
func TestCLIBehindPooler(t *testing.T) {
	url := pgtest.BehindPooler(t, idem.Migrate)
	for range 4 {
		out, errOut, code := runCLI(t, url, "stats")
		if code == exitOK {
			continue
		}
		if code != exitFailure || out != "" || strings.Count(errOut, "\n") != 1 ||
			!strings.HasPrefix(errOut, "idem stats: prepared statements lost behind a connection pooler") ||
			!strings.Contains(errOut, "add default_query_exec_mode=exec") {
			t.Errorf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
		}
	}
	if out, errOut, code := runCLI(t, url+"&default_query_exec_mode=exec", "stats"); code != exitOK {
		t.Errorf("exec mode: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
}

// stats prints every status, those without keys too, in both forms.
func TestCLIStatsZeroCounts(t *testing.T) {
	url := pgtest.URL(t, idem.Migrate)
	out, _, code := runCLI(t, url, "stats", "--json")
	var st struct {
		Keys  map[string]int64
		Total *int64
	}
	if code != exitOK || json.Unmarshal([]byte(out), &st) != nil || st.Total == nil || *st.Total != 0 {
		t.Fatalf("stats --json: exit %d\n%s", code, out)
	}
	text, _, code := runCLI(t, url, "stats")
	if code != exitOK {
		t.Fatalf("stats: exit %d", code)
	}
	for _, s := range []idem.Status{idem.StatusProcessing, idem.StatusSucceeded, idem.StatusRejected,
		idem.StatusFailedRetryable, idem.StatusUnknown} {
		if n, ok := st.Keys[string(s)]; !ok || n != 0 {
			t.Errorf("stats --json: %s: %d, %t\n%s", s, n, ok, out)
		}
		if !regexp.MustCompile(`(?m)^` + string(s) + ` +0$`).MatchString(text) {
			t.Errorf("stats: no line %s 0:\n%s", s, text)
		}
	}
	if len(st.Keys) != 5 {
		t.Errorf("stats --json: %d statuses\n%s", len(st.Keys), out)
	}
}

// inspect prints the same fields in text and JSON: no token or lease for
// Do's records, which have none; a reservation's token in both.
func TestCLIInspectFieldsAgree(t *testing.T) {
	ctx := t.Context()
	pool := pgtest.Pool(t, idem.Migrate)
	url := pool.Config().ConnString()
	scope := idem.Scope{Actor: "alice", Operation: "draw"}
	ok := func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201, Body: []byte("{\"id\":1}\n")}, nil
	}
	if _, err := idem.DoInTx(ctx, pool, scope, "do-1", idem.FingerprintParts([]byte("a")), ok); err != nil {
		t.Fatal(err)
	}
	r, err := idem.Reserve(ctx, pool, scope, "res-1", idem.FingerprintParts([]byte("a")), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "gateway timed out\nafter 30s"); err != nil {
		t.Fatal(err)
	}
	for key, token := range map[string]bool{"do-1": false, "res-1": true} {
		out, _, code := runCLI(t, url, "inspect", "--json", "alice", "draw", key)
		var fields map[string]any
		if code != exitOK || json.Unmarshal([]byte(out), &fields) != nil {
			t.Fatalf("%s: inspect --json: exit %d\n%s", key, code, out)
		}
		text, _, code := runCLI(t, url, "inspect", "alice", "draw", key)
		if code != exitOK {
			t.Fatalf("%s: inspect: exit %d", key, code)
		}
		var textFields []string
		for line := range strings.Lines(text) {
			name, _, _ := strings.Cut(line, " ")
			if strings.HasPrefix(name, "response_") {
				name = "response"
			}
			if !slices.Contains(textFields, name) {
				textFields = append(textFields, name)
			}
		}
		slices.Sort(textFields)
		if got := slices.Sorted(maps.Keys(fields)); !slices.Equal(got, textFields) {
			t.Errorf("%s: JSON fields %q, text fields %q\n%s\n%s", key, got, textFields, out, text)
		}
		if _, has := fields["token"]; has != token {
			t.Errorf("%s: token in the output: %t, want %t\n%s", key, has, token, out)
		}
		if strings.Count(text, "\n") != len(strings.Split(strings.TrimSpace(text), "\n")) {
			t.Errorf("%s: a value broke its line:\n%s", key, text)
		}
	}
}

// inspect tells a body dropped after its life (Config.BodyTTL) from an
// empty one, in text and JSON: a gone response shows its status and says
// it is gone, with no body or headers; body_expires_at says when the body
// goes.
func TestCLIInspectGoneBody(t *testing.T) {
	ctx := t.Context()
	pool := pgtest.Pool(t, idem.Migrate)
	url := pool.Config().ConnString()
	scope := idem.Scope{Actor: "alice", Operation: "draw"}
	c, err := idem.New(idem.Config{TTL: time.Hour, BodyTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	for key, body := range map[string]string{"empty": "", "gone": `{"id":1}`} {
		_, err := c.DoInTx(ctx, pool, scope, key, idem.FingerprintParts([]byte("a")), func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Body: []byte(body)}, nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_keys SET body_expires_at = now() WHERE idem_key = 'gone'`); err != nil {
		t.Fatal(err)
	}
	for key, gone := range map[string]bool{"empty": false, "gone": true} {
		out, _, code := runCLI(t, url, "inspect", "--json", "alice", "draw", key)
		var fields struct {
			Response      map[string]any `json:"response"`
			BodyExpiresAt *time.Time     `json:"body_expires_at"`
		}
		if code != exitOK || json.Unmarshal([]byte(out), &fields) != nil {
			t.Fatalf("%s: inspect --json: exit %d\n%s", key, code, out)
		}
		_, hasBody := fields.Response["body"]
		if fields.Response["gone"] != (map[bool]any{true: true}[gone]) || hasBody == gone || fields.Response["status"] != float64(201) {
			t.Errorf("%s: inspect --json response %v, want gone %v", key, fields.Response, gone)
		}
		if fields.BodyExpiresAt == nil { // BodyTTL: when the body goes (or went), until Prune drops it
			t.Errorf("%s: inspect --json has no body_expires_at\n%s", key, out)
		}
		text, _, code := runCLI(t, url, "inspect", "alice", "draw", key)
		if code != exitOK || strings.Contains(text, "(gone") != gone || strings.Contains(text, `response_body    ""`) == gone {
			t.Errorf("%s: inspect: exit %d, want gone %v\n%s", key, code, gone, text)
		}
	}
}

// migrate status aligns its columns whatever the length of the names.
func TestCLIMigrateStatusAligned(t *testing.T) {
	url := pgtest.URL(t, idem.Migrate)
	out, _, code := runCLI(t, url, "migrate", "status")
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, out)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	files, err := fs.ReadDir(idem.Migrations(), ".")
	if err != nil || len(lines) != len(files) {
		t.Fatalf("%d lines for %d migrations (%v):\n%s", len(lines), len(files), err, out)
	}
	col := strings.Index(lines[0], " applied ")
	for _, line := range lines {
		if strings.Index(line, " applied ") != col || col < 0 {
			t.Errorf("not aligned:\n%s", out)
			break
		}
	}
	// Longer names than idem's: the column follows.
	var sb strings.Builder
	e := &env{stdout: &sb}
	printMigrations(e, []migrationRow{{Version: 1, Source: "00001_a.sql"}, {Version: 12, Source: strings.Repeat("x", 60) + ".sql"}})
	lines = strings.Split(strings.TrimSuffix(sb.String(), "\n"), "\n")
	if len(lines) != 2 || strings.Index(lines[0], "pending") != strings.Index(lines[1], "pending") {
		t.Errorf("not aligned:\n%s", sb.String())
	}
}

// Every usage spells flags as the README does: --name, never -name.
func TestCLIHelpSpellsFlags(t *testing.T) {
	single := regexp.MustCompile(`(^|[\s\[(|])-[a-z]`)
	out, _, _ := runCLI(t, "", "--help")
	if single.MatchString(out) || !strings.Contains(out, "--json") || !strings.Contains(out, "--database-url") {
		t.Errorf("idem --help:\n%s", out)
	}
	for name := range commands {
		out, _, code := runCLI(t, "", name, "--help")
		if code != exitOK || single.MatchString(out) || !strings.Contains(out, "  --json\n") {
			t.Errorf("idem %s --help:\n%s", name, out)
		}
		fs := flag.NewFlagSet(name, flag.ContinueOnError)
		commands[name].flags(fs)
		fs.VisitAll(func(f *flag.Flag) {
			if !strings.Contains(out, "  --"+f.Name) {
				t.Errorf("idem %s --help lacks --%s:\n%s", name, f.Name, out)
			}
		})
	}
	_, errOut, _ := runCLI(t, "", "prune", "--batch-size", "x")
	if !strings.HasPrefix(errOut, `idem prune: invalid value "x" for flag --batch-size: `) {
		t.Errorf("a flag error spells the flag -name:\n%s", errOut)
	}
}

// An incident's commands on what services store: a key up to 1024 bytes
// (Config.MaxKeyLength's limit) opens and settles; resolve refuses a
// status the client could not be answered again, as the console does,
// changing nothing; unknown list shows stored strings so that none can
// move the cursor or hide a line, and says which records are still
// processing (a lease that ran out).
func TestCLIIncident(t *testing.T) {
	ctx := t.Context()
	pool := pgtest.Pool(t, idem.Migrate)
	url := pool.Config().ConnString()
	long, err := idem.New(idem.Config{MaxKeyLength: 1024})
	if err != nil {
		t.Fatal(err)
	}
	scope := idem.Scope{Actor: "alice\x1b[2K", Operation: "pay"}
	key := strings.Repeat("k", 306)
	r, err := long.Reserve(ctx, pool, scope, key, idem.FingerprintParts([]byte("p")), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := long.MarkUnknown(ctx, pool, r, "provider said: 502\r\x1b[2K"); err != nil {
		t.Fatal(err)
	}
	out, _, code := runCLI(t, url, "unknown", "list")
	if code != exitOK || strings.ContainsAny(out, "\r\x1b") || !strings.Contains(out, `"provider said: 502\r\x1b[2K"`) ||
		!strings.Contains(out, "  unknown  ") {
		t.Errorf("unknown list: exit %d\n%q", code, out)
	}
	if out, errOut, code := runCLI(t, url, "inspect", scope.Actor, "pay", key); code != exitOK || !strings.Contains(out, "unknown") ||
		strings.ContainsAny(out, "\r\x1b") {
		t.Errorf("inspect of a 306-byte key: exit %d\n%s%s", code, out, errOut)
	}
	token := strconv.FormatInt(r.Token, 10)
	for _, bad := range [][]string{{"--status", "101"}, {"--status", "0"}, {"--status", "600"}, {"--status", "204", "--body", `{"a":1}`}} {
		args := append([]string{"resolve", scope.Actor, "pay", key, "--token", token, "--succeeded", "--reason", "found"}, bad...)
		if _, errOut, code := runCLI(t, url, args...); code != exitUsage || !strings.Contains(errOut, "status") {
			t.Errorf("resolve %v: exit %d: %s", bad, code, errOut)
		}
	}
	if rec, err := long.Lookup(ctx, pool, scope, key); err != nil || rec.Status != idem.StatusUnknown {
		t.Fatalf("after refused verdicts: %+v, %v", rec, err)
	}
	if _, errOut, code := runCLI(t, url, "resolve", scope.Actor, "pay", key, "--token", token, "--succeeded", "--status", "204",
		"--reason", "found"); code != exitOK {
		t.Fatalf("resolve of a 306-byte key: exit %d: %s", code, errOut)
	}
	if rec, err := long.Lookup(ctx, pool, scope, key); err != nil || rec.Status != idem.StatusSucceeded || rec.Response.Status != 204 {
		t.Fatalf("after the verdict: %+v, %v", rec, err)
	}
}

// The flags of a --succeeded verdict's response given with --retryable
// are a contradiction (did the operator mean --succeeded?): refused as a
// usage error, the record unchanged, rather than ignored.
func TestCLIResolveRetryableRefusesResponseFlags(t *testing.T) {
	ctx := t.Context()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	scope := idem.Scope{Actor: "alice", Operation: "pay"}
	r, err := idem.Reserve(ctx, pool, scope, "doubt", idem.FingerprintParts([]byte("p")), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "timeout"); err != nil {
		t.Fatal(err)
	}
	token := strconv.FormatInt(r.Token, 10)
	bodyFile := filepath.Join(t.TempDir(), "body.json")
	if err := os.WriteFile(bodyFile, []byte(`{"charged":true}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, extra := range [][]string{
		{"--body", `{"charged":true}`},
		{"--body-file", bodyFile},
		{"--status", "201"},
		{"--content-type", "text/plain"},
	} {
		args := append([]string{"resolve", "alice", "pay", "doubt", "--token", token, "--retryable", "--reason", "checked"}, extra...)
		out, errOut, code := runCLI(t, url, args...)
		if code != exitUsage {
			t.Errorf("%q: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", args, code, exitUsage, out, errOut)
		}
		if rec, err := idem.Lookup(ctx, pool, scope, "doubt"); err != nil || rec.Status != idem.StatusUnknown {
			t.Fatalf("after %q: %s, %v; want the record still unknown", args, rec.Status, err)
		}
	}
}

// A prune that fails part-way says what it did before it failed (the keys
// it deleted stay deleted), in text and in the JSON error.
func TestCLIPrunePartialFailureSaysWhatItDid(t *testing.T) {
	ctx := t.Context()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// Five expired keys to delete, and one whose body's life has passed;
	// dropping bodies (an UPDATE) fails after the keys were deleted.
	if _, err := pool.Exec(ctx, `INSERT INTO idem_keys
		(actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at, body_expires_at)
		SELECT 'a', 'op', 'k' || i, '\x00', 'succeeded', 200, '\x7b7d',
		       CASE WHEN i <= 5 THEN now() - interval '1 hour' ELSE now() + interval '1 hour' END,
		       CASE WHEN i > 5 THEN now() - interval '1 minute' END
		FROM generate_series(1, 6) i`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE FUNCTION no_update() RETURNS trigger LANGUAGE plpgsql AS
		$$BEGIN RAISE EXCEPTION 'updates refused'; END$$;
		CREATE TRIGGER no_update BEFORE UPDATE ON idem_keys FOR EACH ROW EXECUTE FUNCTION no_update()`); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := runCLI(t, url, "prune")
	if code != exitFailure || out != "" || !strings.Contains(errOut, "updates refused") || !strings.Contains(errOut, "deleted 5 expired keys") {
		t.Errorf("prune: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys`).Scan(&left); err != nil || left != 1 {
		t.Fatalf("%d rows left (%v), want 1", left, err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO idem_keys
		(actor, operation, idem_key, fingerprint, status, response_status, response_body, expires_at)
		SELECT 'a', 'op', 'j' || i, '\x00', 'succeeded', 200, '\x', now() - interval '1 hour'
		FROM generate_series(1, 3) i`); err != nil {
		t.Fatal(err)
	}
	args := []string{"--json", "prune"}
	out, errOut, code = runCLI(t, url, args...)
	wantJSON(t, args, out, errOut, code, exitFailure, "deleted 3 expired keys")
}

// idem --help names every subcommand of every command (events list, not
// only events show and retry), as its own usage line does.
func TestCLIHelpNamesEverySubcommand(t *testing.T) {
	out, _, _ := runCLI(t, "", "--help")
	for name, cmd := range commands {
		for alt := range strings.SplitSeq(cmd.usage, " | ") {
			words := strings.Fields(alt)
			if len(words) < 2 || words[0] != name || strings.ContainsAny(words[1][:1], "<[-(") {
				continue // no subcommand
			}
			for verb := range strings.SplitSeq(words[1], "|") {
				if !regexp.MustCompile(`(?m)^  ` + regexp.QuoteMeta(name) + ` .*\b` + regexp.QuoteMeta(verb) + `\b`).MatchString(out) {
					t.Errorf("idem --help lacks %s %s:\n%s", name, verb, out)
				}
			}
		}
	}
}

// inspect shows every time the record holds: when its attempt became
// unknown and the end of its key's window (an attempt in doubt inside it
// resumes by itself, and unknown list leaves it out), in text and JSON.
func TestCLIInspectShowsUnknownAtAndWindow(t *testing.T) {
	ctx := t.Context()
	pool := pgtest.Pool(t, idem.Migrate)
	url := pool.Config().ConnString()
	scope := idem.Scope{Actor: "alice", Operation: "pay"}
	r, err := idem.ReserveWith(ctx, pool, scope, "windowed", idem.FingerprintParts([]byte("a")),
		idem.ReserveOptions{Lease: time.Minute, ResumeWithin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.MarkUnknown(ctx, pool, r, "gateway timed out"); err != nil {
		t.Fatal(err)
	}
	rec, err := idem.Lookup(ctx, pool, scope, "windowed")
	if err != nil || rec.UnknownAt.IsZero() || rec.ResumeUntil.IsZero() {
		t.Fatalf("Lookup: %+v, %v", rec, err)
	}
	out, _, code := runCLI(t, url, "inspect", "--json", "alice", "pay", "windowed")
	var fields map[string]any
	if code != exitOK || json.Unmarshal([]byte(out), &fields) != nil {
		t.Fatalf("inspect --json: exit %d\n%s", code, out)
	}
	text, _, _ := runCLI(t, url, "inspect", "alice", "pay", "windowed")
	for name, want := range map[string]time.Time{"unknown_at": rec.UnknownAt, "resume_until": rec.ResumeUntil} {
		if got, _ := fields[name].(string); got != want.Format(time.RFC3339Nano) {
			t.Errorf("inspect --json %s = %q, want %s\n%s", name, got, want.Format(time.RFC3339Nano), out)
		}
		if !strings.Contains(text, name+" ") || !strings.Contains(text, want.UTC().Format(time.RFC3339Nano)) {
			t.Errorf("inspect lacks %s %s:\n%s", name, want.UTC().Format(time.RFC3339Nano), text)
		}
	}
}

// An expire-leases that fails after a batch says how many reservations it
// turned unknown before (its batches committed), in text and JSON.
func TestCLIExpireLeasesPartialFailureSaysWhatItDid(t *testing.T) {
	ctx := t.Context()
	url := pgtest.URL(t, idem.Migrate)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	scope := idem.Scope{Actor: "alice", Operation: "pay"}
	for i := range 4 {
		if _, err := idem.Reserve(ctx, pool, scope, fmt.Sprint("lapsed-", i), idem.FingerprintParts([]byte("p")), time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(20 * time.Millisecond)
	// The first row updated passes, the next one fails: the first batch of
	// one commits, the second fails.
	if _, err := pool.Exec(ctx, `CREATE SEQUENCE updates;
		CREATE FUNCTION second_update_fails() RETURNS trigger LANGUAGE plpgsql AS
		$$BEGIN IF nextval('updates') > 1 THEN RAISE EXCEPTION 'updates refused'; END IF; RETURN NEW; END$$;
		CREATE TRIGGER second_update_fails BEFORE UPDATE ON idem_keys FOR EACH ROW EXECUTE FUNCTION second_update_fails()`); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := runCLI(t, url, "expire-leases", "--batch", "1")
	if code != exitFailure || out != "" || !strings.Contains(errOut, "updates refused") || !strings.Contains(errOut, "turned 1 ") {
		t.Errorf("expire-leases: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	var unknown int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys WHERE status = 'unknown'`).Scan(&unknown); err != nil || unknown != 1 {
		t.Fatalf("%d unknown (%v), want 1", unknown, err)
	}
	if _, err := pool.Exec(ctx, `ALTER SEQUENCE updates RESTART`); err != nil {
		t.Fatal(err)
	}
	args := []string{"--json", "expire-leases", "--batch", "1"}
	out, errOut, code = runCLI(t, url, args...)
	wantJSON(t, args, out, errOut, code, exitFailure, "turned 1 ")
}

// failingWriter fails every write, as a full disk or a closed pipe does.
type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("no space left on device") }

// A result that cannot be written is a failure (exit 1, said on stderr),
// not a success with nothing printed: a script reading `idem stats --json
// > out.json` on a full disk must not take an empty file for the answer.
func TestCLIResultWriteFailureExits1(t *testing.T) {
	url := pgtest.URL(t, idem.Migrate)
	t.Setenv("DATABASE_URL", url)
	for _, args := range [][]string{{"stats"}, {"--json", "stats"}, {"prune", "--dry-run"}, {"unknown", "list", "--json"}} {
		var stderr bytes.Buffer
		code := run(t.Context(), args, failingWriter{}, &stderr)
		if code != exitFailure || !strings.Contains(stderr.String(), "no space left on device") {
			t.Errorf("%q with a failing stdout: exit %d, stderr %q", args, code, stderr.String())
		}
	}
	// The status of a database never migrated too.
	t.Setenv("DATABASE_URL", pgtest.URL(t, nil))
	for _, args := range [][]string{{"migrate", "status"}, {"--json", "migrate", "status"}} {
		var stderr bytes.Buffer
		if code := run(t.Context(), args, failingWriter{}, &stderr); code != exitFailure {
			t.Errorf("%q of a database never migrated, with a failing stdout: exit %d, stderr %q", args, code, stderr.String())
		}
	}
}

// idem prune --help says everything prune changes: it also drops the
// stored bodies past their life (Config.BodyTTL), which its output counts.
func TestCLIPruneHelpSaysItDropsBodies(t *testing.T) {
	out, _, code := runCLI(t, "", "prune", "--help")
	if code != exitOK || !strings.Contains(out, "bodies") || !strings.Contains(out, "BodyTTL") {
		t.Errorf("idem prune --help does not say it drops stored bodies:\n%s", out)
	}
}

// inspect --json gives back a stored body that is not UTF-8 text (a gzip
// body stored with its Content-Encoding) byte for byte, as body_base64,
// instead of replacing its bytes with U+FFFD.
func TestCLIInspectBinaryBody(t *testing.T) {
	ctx := t.Context()
	pool := pgtest.Pool(t, idem.Migrate)
	url := pool.Config().ConnString()
	scope := idem.Scope{Actor: "alice", Operation: "draw"}
	body := []byte{0x1f, 0x8b, 0x08, 0x00, 0xff, 0xfe, 'o', 'k'}
	if _, err := idem.DoInTx(ctx, pool, scope, "gz-1", idem.FingerprintParts([]byte("a")), func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 200, Header: map[string][]string{"Content-Encoding": {"gzip"}}, Body: body}, nil
	}); err != nil {
		t.Fatal(err)
	}
	out, _, code := runCLI(t, url, "inspect", "--json", "alice", "draw", "gz-1")
	var rec struct {
		Response struct {
			Body       *string
			BodyBase64 *[]byte `json:"body_base64"`
		}
	}
	if code != exitOK || json.Unmarshal([]byte(out), &rec) != nil {
		t.Fatalf("inspect --json: exit %d\n%s", code, out)
	}
	switch {
	case rec.Response.BodyBase64 != nil && bytes.Equal(*rec.Response.BodyBase64, body) && rec.Response.Body == nil:
	default:
		t.Errorf("inspect --json does not give the body back:\n%s", out)
	}
	// A text body stays "body".
	if _, err := idem.DoInTx(ctx, pool, scope, "text-1", idem.FingerprintParts([]byte("a")), func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 200, Body: []byte(`{"ok":true}`)}, nil
	}); err != nil {
		t.Fatal(err)
	}
	out, _, _ = runCLI(t, url, "inspect", "--json", "alice", "draw", "text-1")
	if !strings.Contains(out, `"body": "{\"ok\":true}"`) || strings.Contains(out, "body_base64") {
		t.Errorf("a text body:\n%s", out)
	}
}

// inspect --json leaves out what a record does not have: a response with
// no header has no "header" (not null), as the audit trail's copy does.
func TestCLIInspectNoHeaderLeftOut(t *testing.T) {
	ctx := t.Context()
	pool := pgtest.Pool(t, idem.Migrate)
	url := pool.Config().ConnString()
	scope := idem.Scope{Actor: "alice", Operation: "draw"}
	if _, err := idem.DoInTx(ctx, pool, scope, "bare-1", idem.FingerprintParts([]byte("a")), func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 200, Body: []byte(`{}`)}, nil
	}); err != nil {
		t.Fatal(err)
	}
	out, _, code := runCLI(t, url, "inspect", "--json", "alice", "draw", "bare-1")
	var rec struct{ Response map[string]any }
	if code != exitOK || json.Unmarshal([]byte(out), &rec) != nil || rec.Response == nil {
		t.Fatalf("inspect --json: exit %d\n%s", code, out)
	}
	if _, has := rec.Response["header"]; has {
		t.Errorf("a response without headers shows \"header\":\n%s", out)
	}
}

// migrate status only reads: on a database where idem's migrations never
// ran it lists every migration pending and creates nothing, also over a
// read-only connection (a standby, a role that may not create tables).
func TestCLIMigrateStatusReadsOnly(t *testing.T) {
	ctx := t.Context()
	url := pgtest.URL(t, nil)
	readOnly := url + map[bool]string{true: "&", false: "?"}[strings.Contains(url, "?")] +
		"options=-c%20default_transaction_read_only%3Don"
	files, err := fs.ReadDir(idem.Migrations(), ".")
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range []string{readOnly, url} {
		out, errOut, code := runCLI(t, u, "migrate", "status")
		if code != exitOK || errOut != "" || strings.Count(out, " pending\n") != len(files) {
			t.Errorf("migrate status of an empty database: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
		}
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, _ := conn.Query(ctx, `SELECT tablename FROM pg_tables WHERE tablename LIKE 'idem%'`)
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(tables) != 0 {
		t.Fatalf("after migrate status: tables %q (%v), want none", tables, err)
	}
	// Migrated, read-only too.
	if _, errOut, code := runCLI(t, url, "migrate", "up"); code != exitOK {
		t.Fatalf("migrate up: exit %d: %s", code, errOut)
	}
	out, errOut, code := runCLI(t, readOnly, "migrate", "status")
	if code != exitOK || strings.Count(out, " applied ") != len(files) {
		t.Errorf("migrate status read-only, migrated: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
}

// migrate --help names every migration whose Down refuses (SQLSTATE IDMDN)
// beyond the first two, which it describes: an operator reading why down
// refused finds the reason there.
func TestCLIMigrateHelpNamesEveryRefusal(t *testing.T) {
	out, _, code := runCLI(t, "", "migrate", "--help")
	if code != exitOK {
		t.Fatalf("exit %d", code)
	}
	files, err := fs.Glob(idem.Migrations(), "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		body, err := fs.ReadFile(idem.Migrations(), f)
		if err != nil {
			t.Fatal(err)
		}
		_, down, _ := strings.Cut(string(body), "-- +goose Down")
		if number := f[:5]; strings.Contains(down, "IDMDN") && number > "00002" && !strings.Contains(out, number) {
			t.Errorf("migrate --help does not name %s, whose Down refuses:\n%s", f, out)
		}
	}
}

// migrate status of a database that a later release of idem migrated
// lists the versions this release does not ship too, applied: the database
// is not shown as current when it is ahead.
func TestCLIMigrateStatusShowsLaterVersions(t *testing.T) {
	ctx := t.Context()
	url := pgtest.URL(t, idem.Migrate)
	files, err := fs.Glob(idem.Migrations(), "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	later := len(files) + 1
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `INSERT INTO `+idem.MigrationTable+` (version_id, is_applied) VALUES ($1, true)`, later); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := runCLI(t, url, "migrate", "status")
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if code != exitOK || len(lines) != later || !strings.HasPrefix(strings.TrimSpace(lines[later-1]), strconv.Itoa(later)+" ") ||
		!strings.Contains(lines[later-1], " applied ") {
		t.Fatalf("migrate status at version %d: exit %d\nstdout:\n%s\nstderr:\n%s", later, code, out, errOut)
	}
	out, _, _ = runCLI(t, url, "--json", "migrate", "status")
	var rows []struct {
		Version int  `json:"version"`
		Applied bool `json:"applied"`
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil || len(rows) != later || rows[later-1].Version != later || !rows[later-1].Applied {
		t.Fatalf("migrate status --json at version %d (%v):\n%s", later, err, out)
	}
}
