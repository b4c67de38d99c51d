package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// A runnable example connects as a service does, to DATABASE_URL. Under
// Main that is set before the examples run, even when no test ran first to
// resolve the server (go test -run Example).
func ExampleMain() {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		fmt.Println("DATABASE_URL is not set")
		return
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close(ctx)
	var one int
	err = conn.QueryRow(ctx, "select 1").Scan(&one)
	fmt.Println(one, err)
	// Output: 1 <nil>
}

// examplesChild marks the run of this test binary that
// TestMainResolvesForExamples starts.
const examplesChild = "PGTEST_EXAMPLES_CHILD"

// Runs this test binary again with DATABASE_URL unset and only ExampleMain
// selected: no test resolves the server before the example runs, so Main
// must, and export its URL.
func TestMainResolvesForExamples(t *testing.T) {
	if os.Getenv(examplesChild) != "" || os.Getenv(noServerChild) != "" {
		t.Skip("in a child run")
	}
	t.Parallel()
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^ExampleMain$", "-test.v", "-test.timeout=5m")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, examplesChild+"=1", noServerDirEnv+"="+t.TempDir())
	out, err := cmd.CombinedOutput()
	text := string(out)
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.ExitCode() == exitNoServer && strings.Contains(text, "no PostgreSQL server") {
		t.Skip("no server found without DATABASE_URL (localhost:5432 or initdb), which this test needs")
	}
	if err != nil || !strings.Contains(text, "--- PASS: ExampleMain") || strings.Contains(text, "panic") {
		t.Fatalf("child: %v; output:\n%s", err, text)
	}
}

func TestSelectsExample(t *testing.T) {
	for _, tc := range []struct {
		run, skip, name string
		want            bool
	}{
		{"", "", "ExampleDo", true},
		{"Example", "", "ExampleDo", true},
		{"^ExampleDo$", "", "ExampleDo", true},
		{"^ExampleDo$", "", "ExampleDoInTx", false},
		{"TestX", "", "ExampleDo", false},
		{"Example/sub", "", "ExampleDo", true},
		{"Example", "Do", "ExampleDo", false},
		{"Example", "Do/sub", "ExampleDo", true},
		{"[", "", "ExampleDo", true}, // a pattern testing refuses: assume it may run
	} {
		if got := selectsExample(tc.run, tc.skip, tc.name); got != tc.want {
			t.Errorf("selectsExample(%q, %q, %q) = %v, want %v", tc.run, tc.skip, tc.name, got, tc.want)
		}
	}
}
