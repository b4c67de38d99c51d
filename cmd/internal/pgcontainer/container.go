// Package pgcontainer starts a throwaway PostgreSQL container with
// testcontainers-go for the programs and tests of this module, which import
// it for its side effect:
//
//	import _ "github.com/pgidem/idem/cmd/internal/pgcontainer"
//
// Its init function registers [StartContainer] with
// [pgserver.RegisterContainer], so [pgserver.Resolve] tries, in order:
// DATABASE_URL, localhost:5432, a container (when a Docker engine answers),
// a temporary initdb cluster. It lives in this module, not in the
// library's, so that a service importing idem and idemhttp gains no Docker
// modules; the library's own tests resolve without the container step.
package pgcontainer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem/internal/testkit/pgserver"
	"github.com/testcontainers/testcontainers-go"
	tclog "github.com/testcontainers/testcontainers-go/log"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
)

// ContainerImage is the image StartContainer runs.
const ContainerImage = "postgres:16-alpine"

// dockerProbeTimeout bounds the check that a Docker engine answers, for the
// case where a socket or DOCKER_HOST exists but nothing responds.
const dockerProbeTimeout = 5 * time.Second

// ErrNoDocker is wrapped by the error StartContainer returns when no Docker
// engine answers.
var ErrNoDocker = errors.New("no Docker engine answers")

func init() {
	pgserver.RegisterContainer("testcontainers", "start a Docker engine (used through testcontainers)", StartContainer)
}

// StartContainer starts a throwaway PostgreSQL container (ContainerImage)
// with testcontainers-go. Close terminates it.
//
// Before touching testcontainers it checks cheaply for signs of a Docker
// engine (DOCKER_HOST, ~/.testcontainers.properties, a docker.sock in the
// usual places); without any it fails with [ErrNoDocker] in microseconds.
// testcontainers is used with a silent logger and its panics are recovered.
// Pulling the image on first use can take a while; ctx bounds it.
func StartContainer(ctx context.Context) (*pgserver.Server, error) {
	if err := probeDocker(ctx); err != nil {
		return nil, err
	}
	var srv *pgserver.Server
	err := recoverPanic(func() error {
		var err error
		srv, err = runContainer(ctx)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("testcontainers: %w", err)
	}
	return srv, nil
}

// runContainer starts the container and waits until it accepts connections.
func runContainer(ctx context.Context) (*pgserver.Server, error) {
	quiet := testcontainers.WithLogger(tclog.NewNoopLogger())
	ctr, err := tcpostgres.Run(ctx, ContainerImage,
		quiet,
		tcpostgres.BasicWaitStrategies(),
		testcontainers.WithCmdArgs("-c", "max_connections=300"),
	)
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr)
		return nil, err
	}
	connString, err := ctr.ConnectionString(ctx, "sslmode=disable")
	if err == nil {
		err = pgserver.Ping(ctx, connString)
	}
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr)
		return nil, err
	}
	return pgserver.Started(connString, "testcontainers ("+ContainerImage+")", func() error {
		return recoverPanic(func() error { return testcontainers.TerminateContainer(ctr) })
	}), nil
}

// probeDocker reports whether a Docker engine answers, without letting
// testcontainers panic, log or hang.
func probeDocker(ctx context.Context) error {
	hints := dockerHints()
	if len(hints) == 0 {
		return fmt.Errorf("%w: DOCKER_HOST is not set and no Docker socket was found (checked %s)",
			ErrNoDocker, strings.Join(dockerSocketPaths(), ", "))
	}

	ctx, cancel := context.WithTimeout(ctx, dockerProbeTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		// NewDockerProvider does not take a context, so the probe runs in
		// its own goroutine, which is abandoned if it hangs.
		done <- recoverPanic(func() error {
			p, err := testcontainers.NewDockerProvider(testcontainers.WithLogger(tclog.NewNoopLogger()))
			if err != nil {
				return err
			}
			return p.Health(ctx) // Health also closes the provider.
		})
	}()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("%w (found %s): %v", ErrNoDocker, strings.Join(hints, ", "), err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%w (found %s): no answer within %v", ErrNoDocker, strings.Join(hints, ", "), dockerProbeTimeout)
	}
}

// dockerHints lists the signs of a Docker engine that exist on this machine.
func dockerHints() []string {
	var hints []string
	if h := os.Getenv("DOCKER_HOST"); h != "" {
		hints = append(hints, "DOCKER_HOST="+h)
	}
	if home, err := os.UserHomeDir(); err == nil {
		props := filepath.Join(home, ".testcontainers.properties")
		if _, err := os.Stat(props); err == nil {
			hints = append(hints, props)
		}
	}
	for _, p := range dockerSocketPaths() {
		if _, err := os.Stat(p); err == nil {
			hints = append(hints, p)
		}
	}
	return hints
}

// dockerSocketPaths are the places testcontainers looks for a Docker socket.
func dockerSocketPaths() []string {
	paths := []string{"/var/run/docker.sock"}
	if dir := os.Getenv("XDG_RUNTIME_DIR"); dir != "" {
		paths = append(paths, filepath.Join(dir, "docker.sock"))
	}
	if home, err := os.UserHomeDir(); err == nil {
		paths = append(paths,
			filepath.Join(home, ".docker", "run", "docker.sock"),
			filepath.Join(home, ".docker", "desktop", "docker.sock"))
	}
	paths = append(paths, filepath.Join("/run/user", strconv.Itoa(os.Getuid()), "docker.sock"))
	return paths
}

// recoverPanic runs fn and turns a panic into an error.
func recoverPanic(fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return fn()
}
