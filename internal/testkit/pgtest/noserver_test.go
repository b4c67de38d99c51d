package pgtest

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// noServerChild marks the run of this test binary that
// TestNoServerStopsTheRun starts.
const noServerChild = "PGTEST_NO_SERVER_CHILD"

// Runs this test binary again, with a DATABASE_URL on which nothing listens
// and only TestNoServerChild selected. The child must stop at the first test
// that needs a server: one message naming DATABASE_URL, exit status
// exitNoServer, no failing test, no panic, and no test running after it.
// A second child of the same run (the same marker directory) stops the same
// way with one short line instead of the message.
func TestNoServerStopsTheRun(t *testing.T) {
	if os.Getenv(noServerChild) != "" {
		t.Skip("in the child run")
	}
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close() // nothing listens there now

	// Two children share one marker directory, as the test binaries of one
	// go test run share go test's work directory: the first prints the
	// message, the second one line pointing to it.
	dir := t.TempDir()
	child := func() string {
		cmd := exec.CommandContext(t.Context(), os.Args[0],
			"-test.run=^TestNoServerChild$", "-test.v", "-test.timeout=2m")
		cmd.Env = append(os.Environ(), noServerChild+"=1", noServerDirEnv+"="+dir,
			"DATABASE_URL=postgres://postgres@127.0.0.1:"+strconv.Itoa(port)+"/postgres?sslmode=disable")
		out, err := cmd.CombinedOutput()
		text := string(out)
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != exitNoServer {
			t.Fatalf("child: %v, want exit status %d; output:\n%s", err, exitNoServer, text)
		}
		for _, unwanted := range []string{"--- FAIL", "panic", "goroutine ", "after the stop"} {
			if strings.Contains(text, unwanted) {
				t.Errorf("child output holds %q:\n%s", unwanted, text)
			}
		}
		return text
	}
	text := child()
	for _, want := range []string{
		"no PostgreSQL server for these tests", // what happened, once
		"DATABASE_URL does not connect",        // why
		"never replaced by another server",     // no fallback, and what to do
	} {
		if n := strings.Count(text, want); n != 1 {
			t.Errorf("child output holds %q %d times, want once:\n%s", want, n, text)
		}
	}
	if second := child(); strings.Count(second, "pgtest") != 1 || !strings.Contains(second, noServerAgain) ||
		!strings.Contains(second, "before the stop") {
		t.Errorf("second child of the same run: want the one line %q after the test before the stop:\n%s", noServerAgain, second)
	}
	if !strings.Contains(text, "before the stop") {
		t.Errorf("the test needing no server did not run first:\n%s", text)
	}
}

// The child's tests: one needing no server, then parallel ones needing one,
// then one more that must never run.
func TestNoServerChild(t *testing.T) {
	if os.Getenv(noServerChild) == "" {
		t.Skip("run by TestNoServerStopsTheRun")
	}
	t.Run("no server needed", func(t *testing.T) { t.Log("before the stop") })
	t.Run("group", func(t *testing.T) {
		for i := range 4 {
			t.Run(strconv.Itoa(i), func(t *testing.T) {
				t.Parallel()
				Pool(t, migrateWidgets)
				t.Log("after the stop")
			})
		}
	})
	t.Run("later", func(t *testing.T) {
		if _, _, err := NewDatabase(t.Context(), nil); err != nil {
			t.Error(err)
		}
		t.Log("after the stop")
	})
}
