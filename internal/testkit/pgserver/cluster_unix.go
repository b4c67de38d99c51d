//go:build unix

package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	// clusterDirPrefix names the temporary directories of temp clusters.
	clusterDirPrefix = "pgserver-"
	// ownerFile, inside a cluster directory, holds the PID of the process
	// that created it, so later runs can remove directories left behind by
	// processes that died without calling Close.
	ownerFile = "owner.pid"
	// startTimeout bounds how long a fresh cluster may take to accept
	// connections.
	startTimeout = 60 * time.Second
	// stopTimeout bounds the fast shutdown in Close before escalating.
	stopTimeout = 15 * time.Second
)

// StartTempCluster creates a throwaway cluster with the local PostgreSQL
// server binaries: initdb into a new temporary directory (trust auth,
// superuser "postgres", UTF8, C locale), then postgres listening on a free
// port on 127.0.0.1, with its unix socket in the same directory and
// durability turned off (fsync, synchronous_commit, full_page_writes) for
// speed. Close stops the server and removes the directory.
//
// PostgreSQL refuses to run as root, so when the process is root both
// programs run as the user "postgres" (or "nobody" if that does not exist)
// and the directory is handed to that user.
//
// The server is a child of this process, not a daemon: on Linux it gets
// SIGQUIT (immediate shutdown) if this process dies without calling Close,
// and directories left behind that way are removed by the next call.
func StartTempCluster(ctx context.Context) (*Server, error) {
	binDir, err := findServerBinaries()
	if err != nil {
		return nil, err
	}
	cred, err := unprivilegedCredential()
	if err != nil {
		return nil, err
	}

	base := os.TempDir()
	if cred != nil || len(base) > 60 {
		// The unprivileged user must be able to reach the directory, and
		// the socket path must fit in sun_path (~104 bytes).
		base = "/tmp"
	}
	removeStaleClusters(base)

	dir, err := os.MkdirTemp(base, clusterDirPrefix)
	if err != nil {
		return nil, fmt.Errorf("initdb: %w", err)
	}
	srv, err := startCluster(ctx, binDir, dir, cred)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb (binaries in %s): %w", binDir, err)
	}
	return srv, nil
}

// startCluster does the work of StartTempCluster inside dir.
func startCluster(ctx context.Context, binDir, dir string, cred *syscall.Credential) (*Server, error) {
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return nil, err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return nil, err
		}
	}

	dataDir := filepath.Join(dir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(binDir, "initdb"),
		"-D", dataDir, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
	initdb.Dir = dir
	initdb.Env = childEnv()
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("initdb failed: %w\n%s", err, bytes.TrimSpace(out))
	}

	// Picking a free port and binding it later is racy; retry on conflict.
	var lastErr error
	for range 3 {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		proc, err := startPostgres(ctx, binDir, dir, dataDir, port, cred)
		if err == nil {
			u := url.URL{
				Scheme:   "postgres",
				User:     url.User("postgres"),
				Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
				Path:     "/postgres",
				RawQuery: "sslmode=disable",
			}
			c := &cluster{binDir: binDir, dir: dir, dataDir: dataDir, port: port, cred: cred, proc: proc}
			clusters.Store(dir, c)
			return &Server{
				URL:    u.String(),
				Source: "initdb (temp cluster at " + dir + ")",
				dir:    dir,
				stop:   c.close,
			}, nil
		}
		lastErr = err
		if !errors.Is(err, errPortInUse) {
			break
		}
	}
	return nil, lastErr
}

// cluster is a temp cluster started by StartTempCluster, kept so that
// StopImmediate and Restart can stop and start its postmaster.
type cluster struct {
	binDir, dir, dataDir string
	port                 int
	cred                 *syscall.Credential

	mu     sync.Mutex
	proc   *postgresProcess // nil while stopped
	closed bool
}

// clusters holds the running temp clusters by directory (Server.dir).
var clusters sync.Map

// close stops the postmaster and removes the cluster's directory.
func (c *cluster) close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	clusters.Delete(c.dir)
	var err error
	if c.proc != nil {
		err = c.proc.stop()
		c.proc = nil
	}
	return errors.Join(err, os.RemoveAll(c.dir))
}

// clusterOf returns the temp cluster behind s.
func clusterOf(s *Server) (*cluster, error) {
	if s != nil && s.dir != "" {
		if c, ok := clusters.Load(s.dir); ok {
			return c.(*cluster), nil
		}
	}
	return nil, errors.New("pgserver: not a running temp cluster (StartTempCluster)")
}

// StopImmediate stops the postmaster of a temp cluster with an immediate
// shutdown (SIGQUIT, what pg_ctl stop -m immediate sends): every backend is
// ended at once, open transactions are lost, and there is no checkpoint, so
// the next start runs crash recovery. It returns when the postmaster has
// exited; Restart starts it again. Stopping a stopped cluster does nothing.
// Other servers (not from StartTempCluster) give an error.
//
// The temp cluster runs with synchronous_commit=off, so an immediate
// shutdown may lose the last commits that were already acknowledged. A test
// that needs acknowledged commits to survive must turn synchronous_commit on
// in its sessions (for example with the runtime parameter
// synchronous_commit=on in the connection string).
func (s *Server) StopImmediate() error {
	c, err := clusterOf(s)
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stopImmediate()
}

func (c *cluster) stopImmediate() error {
	if c.proc == nil {
		return nil
	}
	p := c.proc
	_ = p.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-p.exited:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.exited
	}
	c.proc = nil
	return nil
}

// Restart stops the postmaster of a temp cluster with an immediate shutdown
// if it is running (see StopImmediate), starts it again on the same port and
// data directory, and returns once it accepts connections again (after
// crash recovery). s.URL stays valid. Other servers give an error.
func (s *Server) Restart(ctx context.Context) error {
	c, err := clusterOf(s)
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errors.New("pgserver: temp cluster closed")
	}
	if err := c.stopImmediate(); err != nil {
		return err
	}
	// The port was free a moment ago; a stranger may have taken it since,
	// and the kernel may take a moment to release it: retry briefly.
	for attempt := 0; ; attempt++ {
		proc, err := startPostgres(ctx, c.binDir, c.dir, c.dataDir, c.port, c.cred)
		if err == nil {
			c.proc = proc
			return nil
		}
		if !errors.Is(err, errPortInUse) || attempt >= 20 || ctx.Err() != nil {
			return fmt.Errorf("pgserver: restart: %w", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// errPortInUse means postgres could not bind its port.
var errPortInUse = errors.New("port already in use")

// postgresProcess is a running postmaster started by startPostgres.
type postgresProcess struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed when cmd.Wait returns
}

// startPostgres runs the postmaster on port and waits until it accepts
// connections. The process deliberately does not use ctx: it must outlive
// the call. ctx only bounds the wait.
func startPostgres(ctx context.Context, binDir, dir, dataDir string, port int, cred *syscall.Credential) (*postgresProcess, error) {
	logPath := filepath.Join(dir, "postgres.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close() // the child has its own copy

	socketDir := dir
	if len(dir)+len("/.s.PGSQL.65535") >= 100 {
		socketDir = "" // too long for a unix socket path; TCP only
	}
	cmd := exec.Command(filepath.Join(binDir, "postgres"),
		"-D", dataDir,
		"-p", strconv.Itoa(port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories="+socketDir,
		"-c", "fsync=off",
		"-c", "synchronous_commit=off",
		"-c", "full_page_writes=off",
		"-c", "max_connections=300",
	)
	cmd.Dir = dir
	cmd.Env = childEnv()
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: cred,
		Setpgid:    true, // keep terminal signals (Ctrl-C) for us to handle
	}
	setParentDeathSignal(cmd.SysProcAttr, syscall.SIGQUIT)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &postgresProcess{cmd: cmd, exited: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.exited)
	}()

	connString := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-p.exited:
			log, _ := os.ReadFile(logPath)
			err := fmt.Errorf("postgres exited during startup: %s", bytes.TrimSpace(log))
			if bytes.Contains(log, []byte("could not bind")) || bytes.Contains(log, []byte("already in use")) {
				err = fmt.Errorf("%w: %w", errPortInUse, err)
			}
			return nil, err
		case <-ctx.Done():
			_ = p.stop()
			log, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("postgres did not accept connections: %w; log:\n%s", ctx.Err(), bytes.TrimSpace(log))
		case <-tick.C:
			if Ping(ctx, connString) == nil {
				return p, nil
			}
		}
	}
}

// stop shuts the postmaster down: fast shutdown (SIGINT) first, then
// immediate shutdown (SIGQUIT), then SIGKILL.
func (p *postgresProcess) stop() error {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGQUIT, syscall.SIGKILL} {
		select {
		case <-p.exited:
			return nil
		default:
		}
		_ = p.cmd.Process.Signal(sig)
		select {
		case <-p.exited:
			return nil
		case <-time.After(stopTimeout):
		}
	}
	return fmt.Errorf("postgres (pid %d) did not exit", p.cmd.Process.Pid)
}

// freePort asks the kernel for a free TCP port on the loopback interface.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// childEnv is this process's environment without libpq's PG* variables
// (PGDATA, PGPORT, … would change what initdb and postgres do), in the C
// locale.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PG") || strings.HasPrefix(kv, "LC_") || strings.HasPrefix(kv, "LANG=") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "LANG=C", "LC_ALL=C")
}

// unprivilegedCredential returns nil when this process is not root, and
// otherwise the credentials of the user "postgres", or of "nobody".
func unprivilegedCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	var errs []error
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err := errors.Join(err1, err2); err != nil {
			errs = append(errs, err)
			continue
		}
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, nil
	}
	return nil, fmt.Errorf("running as root and no unprivileged user to run postgres as: %w", errors.Join(errs...))
}

// removeStaleClusters removes temp cluster directories under base whose
// creating process and postmaster are both gone (left behind by processes
// that died without calling Close). Errors are ignored: this is tidying.
func removeStaleClusters(base string) {
	dirs, _ := filepath.Glob(filepath.Join(base, clusterDirPrefix+"*"))
	for _, dir := range dirs {
		owner, ok := readPID(filepath.Join(dir, ownerFile))
		if !ok || processAlive(owner) {
			continue // not ours, being set up, or still in use
		}
		if pm, ok := readPID(filepath.Join(dir, "data", "postmaster.pid")); ok && processAlive(pm) {
			continue
		}
		_ = os.RemoveAll(dir)
	}
}

// readPID reads a PID from the first line of path.
func readPID(path string) (int, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	return pid, err == nil && pid > 0
}

// processAlive reports whether a process with this PID exists.
func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
