package pgcontainer

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// Without a Docker engine (as on this project's machines), StartContainer
// fails with ErrNoDocker instead of hanging, panicking or logging, so
// Resolve goes on to the next step.
func TestStartContainerWithoutDocker(t *testing.T) {
	if err := probeDocker(t.Context()); err == nil {
		t.Skip("a Docker engine answers here")
	}
	start := time.Now()
	srv, err := StartContainer(t.Context())
	if err == nil {
		srv.Close()
		t.Fatal("StartContainer succeeded without Docker")
	}
	if !errors.Is(err, ErrNoDocker) {
		t.Errorf("error does not wrap ErrNoDocker: %v", err)
	}
	if !strings.Contains(err.Error(), "Docker") {
		t.Errorf("error does not mention Docker: %v", err)
	}
	// Timings are not asserted (the machine is shared); the log shows how
	// cheap the check is without any sign of Docker.
	t.Logf("%v (in %v)", err, time.Since(start))
}

// With a sign of Docker that leads nowhere (DOCKER_HOST naming a socket
// nobody listens on), the probe asks testcontainers, which fails; the
// error still wraps ErrNoDocker and names what was found.
func TestStartContainerWithDeadDockerHost(t *testing.T) {
	t.Setenv("DOCKER_HOST", "unix://"+t.TempDir()+"/docker.sock")
	start := time.Now()
	srv, err := StartContainer(t.Context())
	if err == nil {
		srv.Close()
		t.Fatal("StartContainer succeeded with a dead DOCKER_HOST")
	}
	if !errors.Is(err, ErrNoDocker) || !strings.Contains(err.Error(), "DOCKER_HOST=") {
		t.Errorf("error: %v", err)
	}
	t.Logf("%v (in %v)", err, time.Since(start))
}
