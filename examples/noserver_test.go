package examples_test

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// With no server, TestMain prints one line and exits 1 before any test
// runs. (This checks this repository's go test output; a copy of the
// examples does not need it.)
func TestNoServerOneLine(t *testing.T) {
	t.Parallel()
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "DATABASE_URL=postgres://nobody@127.0.0.1:1/x?connect_timeout=5")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	text := string(out)
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || strings.Count(text, "\n") != 1 ||
		!strings.HasPrefix(text, "examples: no PostgreSQL server") {
		t.Fatalf("%v, want exit status 1 and one line; output:\n%s", err, text)
	}
}
