// Command idem-cpu measures the CPU time one call costs, on the client (this
// process, getrusage) and on the server (the backends serving the calls,
// read from /proc: only when PostgreSQL runs on this machine), for fresh
// Do, fresh DoInTx and replays: replay, of a 44-byte body under one
// scope, and replayDraw, of a response shaped as idem-bench's draw stores
// it (internal/demo/draw's 201, its Content-Type header, a 93-byte
// Outcome, a wallet's scope per key, UUID-shaped keys). It also prints the
// client's allocations and bytes per call (runtime.MemStats, exact). Unlike
// throughput, CPU time per call moves little with the machine's other
// load, so two builds can be compared on a shared machine: it uses only
// idem's public API, so the same file builds in an older tree (copy the
// folder there; docs/benchmarks.md, "Issue 30: where the time went"). An
// older tree's Migrate may need two connections: keep -workers at 2 or
// more.
//
//	go run ./cmd/idem-cpu -calls 6000 -rounds 3
//
// -only runs only the workloads it names (do, doInTx, replay, replayDraw;
// a comma-separated list), -cpuprofile writes the client's CPU profile of
// its measured calls; run against a server under callgrind, it counts the
// server's instructions per call (docs/benchmarks.md, "Issue 30 in
// instructions").
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
)

// replayKeys is how many completed keys the replays draw from.
const replayKeys = 2000

func main() {
	admin := flag.String("db", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres"),
		"admin connection URL (a role that may create databases)")
	name := flag.String("database", "idem_cpu", "name of the database to create and drop (never one it did not create)")
	calls := flag.Int("calls", 6000, "measured calls per workload and round")
	workers := flag.Int("workers", 8, "concurrent callers, each with a connection of its own")
	rounds := flag.Int("rounds", 1, "rounds; each runs do, doInTx, replay and replayDraw in turn")
	only := flag.String("only", "", "run only these workloads, comma-separated (do, doInTx, replay, replayDraw)")
	profile := flag.String("cpuprofile", "", "write the client's CPU profile of the first measured workload's calls (first round) to this file")
	flag.Parse()
	if *calls < 1 || *workers < 1 || *rounds < 1 {
		fmt.Fprintln(os.Stderr, "idem-cpu: -calls, -workers and -rounds must be positive")
		os.Exit(2)
	}
	for w := range strings.SplitSeq(*only, ",") {
		switch w {
		case "", "do", "doInTx", "replay", "replayDraw":
		default:
			fmt.Fprintf(os.Stderr, "idem-cpu: -only %q: want do, doInTx, replay or replayDraw\n", w)
			os.Exit(2)
		}
	}
	profilePath = *profile
	if err := run(context.Background(), *admin, *name, *only, *calls, *workers, *rounds); err != nil {
		fmt.Fprintln(os.Stderr, "idem-cpu:", err)
		os.Exit(1)
	}
}

// profilePath, when set, receives the client's CPU profile of the first
// measured workload's calls (not the warm-up's).
var profilePath string

// startProfile starts the CPU profile into profilePath, once, and returns
// the function that stops it and closes the file (nil when none started).
func startProfile() (stop func() error, err error) {
	if profilePath == "" {
		return nil, nil
	}
	f, err := os.Create(profilePath)
	if err != nil {
		return nil, err
	}
	profilePath = "" // the first measured workload only
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() error { pprof.StopCPUProfile(); return f.Close() }, nil
}

func run(ctx context.Context, adminURL, name, only string, calls, workers, rounds int) error {
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	db := pgx.Identifier{name}.Sanitize()
	if err := recreate(ctx, admin, name); err != nil {
		return err
	}
	defer admin.Exec(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)") //nolint:errcheck // created above

	cfg, err := pgxpool.ParseConfig(adminURL)
	if err != nil {
		return err
	}
	cfg.ConnConfig.Database = name
	cfg.MaxConns, cfg.MinConns = int32(workers), int32(workers)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}

	scope := idem.Scope{Actor: "acct_1", Operation: "charge"}
	fp := idem.Fingerprint{1}
	header := map[string][]string{"Content-Type": {"application/json"}} // stored and replayed, as a service's
	fn := func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201, Header: header, Body: []byte(`{"id":"ch_1","amount":100,"currency":"EUR"}`)}, nil
	}
	for i := range replayKeys {
		if _, err := idem.DoInTx(ctx, pool, scope, fmt.Sprint("replay-", i), fp, fn); err != nil {
			return err
		}
	}
	// The draw's replays: keys as idem-bench's draw stores them (a wallet's
	// actor, the draw operation, a UUID-shaped key) holding a response of
	// internal/demo/draw's shape: 201, one Content-Type header, an Outcome
	// of one prize (about 90 bytes).
	// Scopes and keys are made here, so that a replay allocates only what
	// idem and pgx do.
	drawScopes, drawKeys := make([]idem.Scope, replayKeys), make([]string, replayKeys)
	drawFP := idem.Fingerprint{2}
	for i := range int64(replayKeys) {
		drawScopes[i] = idem.Scope{Actor: fmt.Sprint("u", 1+i*37%100_000), Operation: "draw"}
		drawKeys[i] = fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", i*2654435761%(1<<32), i%65536, i%4096, i%4096, i*40503)
		body := fmt.Appendf(nil, `{"batch_id":%d,"prizes":["Goose Sticker"],"points_spent":1,"points_left":%d}`,
			100_000+i, 1_000_000_000_000_000-1-i)
		drawFn := func(context.Context, pgx.Tx) (idem.Response, error) {
			return idem.Response{Status: 201, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: body}, nil
		}
		if _, err := idem.DoInTx(ctx, pool, drawScopes[i], drawKeys[i], drawFP, drawFn); err != nil {
			return err
		}
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE idem_keys"); err != nil {
		return err
	}

	var fresh atomic.Int64 // every fresh call's key is new
	workloads := []struct {
		name string
		call func(i int64) error
	}{
		{"do", func(int64) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := idem.Do(ctx, tx, scope, fmt.Sprint("fresh-", fresh.Add(1)), fp, fn)
				return err
			})
		}},
		{"doInTx", func(int64) error {
			_, err := idem.DoInTx(ctx, pool, scope, fmt.Sprint("fresh-", fresh.Add(1)), fp, fn)
			return err
		}},
		{"replay", func(i int64) error {
			res, err := idem.DoInTx(ctx, pool, scope, fmt.Sprint("replay-", i%replayKeys), fp, fn)
			if err == nil && !res.Replayed {
				err = errors.New("a replay ran fn")
			}
			return err
		}},
		{"replayDraw", func(i int64) error {
			k := i % replayKeys
			res, err := idem.DoInTx(ctx, pool, drawScopes[k], drawKeys[k], drawFP, mustNotRun)
			if err == nil && (!res.Replayed || res.Status != 201 || len(res.Body) < 80) {
				err = errors.New("a draw replay did not replay the stored draw")
			}
			return err
		}},
	}
	fmt.Printf("CPU per call (µs), %d calls on %d workers; server: the backends' user+system time from /proc; the client's allocations and bytes per call\n", calls, workers)
	for round := 1; round <= rounds; round++ {
		for _, w := range workloads {
			if only != "" && !slices.Contains(strings.Split(only, ","), w.name) {
				continue
			}
			if err := callAll(workers, calls/10+1, w.call); err != nil { // warm every connection's statement cache
				return err
			}
			backends, err := backendPIDs(ctx, admin, name)
			if err != nil {
				return err
			}
			stopProfile, err := startProfile()
			if err != nil {
				return err
			}
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			s0, c0 := serverCPU(backends), clientCPU()
			err = callAll(workers, calls, w.call)
			s1, c1 := serverCPU(backends), clientCPU()
			runtime.ReadMemStats(&m1)
			if stopProfile != nil {
				err = errors.Join(err, stopProfile())
			}
			if err != nil {
				return fmt.Errorf("%s: %w", w.name, err)
			}
			server := "n/a (the server is not on this machine, or a backend ended)"
			if s0 >= 0 && s1 >= 0 {
				server = fmt.Sprintf("%6.1f", float64(s1-s0)/float64(calls)/1e3)
			}
			fmt.Printf("round %d  %-10s server %s  client %6.1f  allocs %5.1f  bytes %6.0f\n", round, w.name, server,
				float64(c1-c0)/float64(calls)/1e3,
				float64(m1.Mallocs-m0.Mallocs)/float64(calls), float64(m1.TotalAlloc-m0.TotalAlloc)/float64(calls))
		}
	}
	return nil
}

func mustNotRun(context.Context, pgx.Tx) (idem.Response, error) {
	return idem.Response{}, errors.New("fn ran on a replay")
}

// cpuMark is the comment idem-cpu puts on the database it creates: only a
// database that carries it is ever dropped.
const cpuMark = "idem-cpu's database: dropped and recreated by every run"

// recreate creates the database name, marked as idem-cpu's. One of that
// name that exists already is dropped first only when it carries the mark
// (a run that stopped early); anything else is refused and left as it is.
func recreate(ctx context.Context, admin *pgx.Conn, name string) error {
	var mark *string
	err := admin.QueryRow(ctx, `SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1`,
		name).Scan(&mark)
	db := pgx.Identifier{name}.Sanitize()
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return err
	case mark == nil || *mark != cpuMark:
		return fmt.Errorf("database %s exists and is not idem-cpu's (it never drops a database it did not create): pass -database with another name", name)
	default:
		if _, err := admin.Exec(ctx, "DROP DATABASE "+db+" WITH (FORCE)"); err != nil {
			return err
		}
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+db); err != nil {
		return err
	}
	_, err = admin.Exec(ctx, "COMMENT ON DATABASE "+db+" IS '"+strings.ReplaceAll(cpuMark, "'", "''")+"'")
	return err
}

// callAll makes n calls on workers goroutines, numbered from 1.
func callAll(workers, n int, call func(i int64) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := next.Add(1); i <= int64(n); i = next.Add(1) {
				if err := call(i); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// backendPIDs are the server processes of the benchmark's connections.
func backendPIDs(ctx context.Context, admin *pgx.Conn, name string) ([]int, error) {
	rows, err := admin.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'", name)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int])
}

// serverCPU is the user and system time of pids in nanoseconds, read from
// /proc/PID/stat (fields 14 and 15, in clock ticks of 10 ms: Linux's
// USER_HZ, so each backend's figure is ±10 ms, about 2 % of a round of
// 6,000 calls on 8 backends); -1 when one cannot be read (the server runs
// elsewhere, or the backend ended).
func serverCPU(pids []int) int64 {
	var total int64
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return -1
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:]) // fields from the third on
		user, err1 := strconv.ParseInt(f[11], 10, 64)
		sys, err2 := strconv.ParseInt(f[12], 10, 64)
		if err1 != nil || err2 != nil {
			return -1
		}
		total += (user + sys) * 10_000_000
	}
	return total
}

// clientCPU is this process's user and system time in nanoseconds.
func clientCPU() int64 {
	var r syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &r)
	return r.Utime.Nano() + r.Stime.Nano()
}
