// Command idem-bench measures what idempotency costs inside the business
// transaction, as ratios against the bare transaction, the floor (the same
// transaction plus one INSERT of a finished key row) and the
// two-transaction pattern, against one real PostgreSQL server.
//
// Usage:
//
//	idem-bench [-smoke] [-latency D] [-stale] [flags]
//
// It recreates the database idem_bench (dropped at the end unless -keep;
// it refuses a database of that name that it did not create, or that a
// session uses)
// and runs the workloads bare, floor, do, doInTx, replay and two-tx over two
// business transactions, light (two UPDATEs and an INSERT) and draw
// (internal/demo/draw), in interleaved rounds: every round runs each workload
// for -round with -workers workers, in an order that rotates from round to
// round. Ratios are the median of the per-round ratios. The storm sends
// -storm same-key calls at once from separate Clients; the scale run
// compares DoInTx's p99 on an empty key table with its p99 on one holding
// -scale-rows keys while idem.Prune deletes the expired ones beside it.
//
// -storage runs only the storage run (storage.go): bytes per retained key
// of the heap, each index and TOAST in steady state and after VACUUM FULL,
// the HOT share of completions, and WAL per fresh call against the
// floor's. -smoke runs a small one after the rest, and fails when a
// retained key takes more bytes than the layout allows.
//
// -relay runs only the outbox run (outbox.go): idem.Relay's throughput
// against a hand-written FOR UPDATE SKIP LOCKED poller with the same no-op
// sender, in interleaved rounds, commit-to-send at idle with LISTEN/NOTIFY,
// and the claim's plan with -relay-pending pending events (a claim that
// does not walk the due index is a failure). -smoke runs a small one.
//
// -latency D puts the database behind an in-process relay that adds D to
// every round trip. -stale runs the light workloads twice in every round:
// against a key table analyzed between rounds, and against one analyzed
// while empty and never again. -smoke runs everything tiny (seconds), to
// prove the benchmark works; CI runs it.
//
// The exit status is 1 when the benchmark cannot run or a correctness check
// fails (a storm key executed other than once, an error in a workload, fn
// running on replay); a missed speed goal is reported as MISS only.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	_ "github.com/pgidem/idem/cmd/internal/pgcontainer" // Resolve may start a Docker container
	"github.com/pgidem/idem/internal/testkit/pgserver"
)

// options are the command-line settings.
type options struct {
	db, database                   string
	round, warmup, latency         time.Duration
	workers, rounds, storm         int
	users, boxes, replayKeys       int
	scaleRows, expiredRows, allocs int
	prunePause                     time.Duration
	stale, smoke, keep             bool
	storage                        bool // the storage run alone (-smoke runs it after the rest)
	storageKeys, storageWALCalls   int
	storageFillfactor              int
	storageBodyTTL                 time.Duration
	storageVacuumScale             float64
	storageFloor                   bool // the storage run writes the floor's row, not DoInTx's
	storageRate                    float64
	relay                          bool // the outbox run alone (-smoke runs a small one too)
	relayRounds, relayEvents       int
	relayLatencyEvents             int
	relayPending                   int
}

func main() {
	var o options
	flag.StringVar(&o.db, "db", "", "admin connection URL (default: resolved like the tests: DATABASE_URL, localhost:5432, Docker, a temporary initdb cluster)")
	flag.StringVar(&o.database, "database", "idem_bench", "name of the database to recreate")
	flag.IntVar(&o.workers, "workers", 8, "concurrent workers per workload")
	flag.DurationVar(&o.round, "round", time.Second, "duration of each workload in each round")
	flag.IntVar(&o.rounds, "rounds", 15, "rounds")
	flag.DurationVar(&o.warmup, "warmup", 500*time.Millisecond, "unmeasured run of each workload before the rounds")
	flag.DurationVar(&o.latency, "latency", 0, "round-trip time a delaying relay adds between the benchmark and the database")
	flag.BoolVar(&o.stale, "stale", false, "light workloads against a fresh key table and one analyzed while empty, never again")
	flag.IntVar(&o.storm, "storm", 64, "same-key calls at once in the storm, each from its own idem.Client")
	flag.IntVar(&o.users, "users", 100_000, "accounts (light) and wallets (draw)")
	flag.IntVar(&o.boxes, "boxes", 10_000, "items (light) and boxes (draw)")
	flag.IntVar(&o.replayKeys, "replay-keys", 2_000, "completed keys per replay workload")
	flag.IntVar(&o.scaleRows, "scale-rows", 3_000_000, "keys in the full table of the scale run (0: no scale run; default off with -latency and -stale)")
	flag.IntVar(&o.expiredRows, "expired-rows", 2_500_000, "expired keys among them, for Prune")
	flag.DurationVar(&o.prunePause, "prune-pause", 0, "pause between Prune's batches of 1000 in the scale run (0: back to back)")
	flag.IntVar(&o.allocs, "alloc-calls", 1_000, "calls per allocation count")
	flag.BoolVar(&o.smoke, "smoke", false, "everything tiny, to prove the benchmark works (seconds)")
	flag.BoolVar(&o.storage, "storage", false, "only the storage run: bytes per retained key, HOT share, WAL per call (-smoke runs a small one too)")
	flag.IntVar(&o.storageKeys, "storage-keys", 100_000, "keys the storage run retains in steady state (its TTL is -storage-keys / -storage-rate)")
	flag.Float64Var(&o.storageRate, "storage-rate", 1000, "fresh calls per second in the storage run")
	flag.IntVar(&o.storageWALCalls, "storage-wal-calls", 2_000, "calls per workload in the storage run's WAL count")
	flag.IntVar(&o.storageFillfactor, "storage-fillfactor", 0, "fillfactor of idem_keys in the storage run (0: the migrations')")
	flag.Float64Var(&o.storageVacuumScale, "storage-vacuum-scale", 0, "autovacuum_vacuum_scale_factor of idem_keys in the storage run (0: the migrations')")
	flag.BoolVar(&o.relay, "relay", false, "only the outbox run: Relay against a hand-written SKIP LOCKED poller, commit-to-send with LISTEN, the claim's plan (-smoke runs a small one too)")
	flag.IntVar(&o.relayRounds, "relay-rounds", 5, "interleaved rounds of the outbox run")
	flag.IntVar(&o.relayEvents, "relay-events", 20_000, "backlogged events each contender sends in each round")
	flag.IntVar(&o.relayLatencyEvents, "relay-latency-events", 200, "events published one at a time for commit-to-send")
	flag.IntVar(&o.relayPending, "relay-pending", 1_000_000, "pending events under the claim whose plan is checked")
	flag.BoolVar(&o.storageFloor, "storage-floor", false, "the storage run writes each key once, as the floor does (one INSERT of a finished row), not by DoInTx's claim and completion")
	flag.DurationVar(&o.storageBodyTTL, "storage-body-ttl", 0, "Config.BodyTTL of the storage run: stored bodies dropped by Prune this long after the claim (0: kept as long as the key)")
	flag.BoolVar(&o.keep, "keep", false, "keep the database after the run")
	flag.Parse()
	if flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if o.smoke {
		o.shrink(set)
	}
	if (o.latency > 0 || o.stale || o.storage || o.relay) && !set["scale-rows"] {
		o.scaleRows, o.expiredRows = 0, 0 // the scale goal is a local, fresh one
	}
	if err := o.check(); err != nil {
		fmt.Fprintln(os.Stderr, "idem-bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "idem-bench:", err)
		os.Exit(1)
	}
}

// shrink sets the smoke sizes of every flag not given.
func (o *options) shrink(set map[string]bool) {
	for name, apply := range map[string]func(){
		"round":                func() { o.round = 150 * time.Millisecond },
		"rounds":               func() { o.rounds = 2 },
		"warmup":               func() { o.warmup = 50 * time.Millisecond },
		"workers":              func() { o.workers = 4 },
		"storm":                func() { o.storm = 16 },
		"users":                func() { o.users = 2_000 },
		"boxes":                func() { o.boxes = 200 },
		"replay-keys":          func() { o.replayKeys = 100 },
		"scale-rows":           func() { o.scaleRows = 20_000 },
		"expired-rows":         func() { o.expiredRows = 15_000 },
		"alloc-calls":          func() { o.allocs = 50 },
		"storage-keys":         func() { o.storageKeys = 2_000 },
		"storage-rate":         func() { o.storageRate = 250 },
		"storage-wal-calls":    func() { o.storageWALCalls = 200 },
		"relay-rounds":         func() { o.relayRounds = 2 },
		"relay-events":         func() { o.relayEvents = 500 },
		"relay-latency-events": func() { o.relayLatencyEvents = 10 },
		"relay-pending":        func() { o.relayPending = 20_000 },
	} {
		if !set[name] {
			apply()
		}
	}
}

func (o *options) check() error {
	switch {
	case o.workers < 1 || o.rounds < 1 || o.round <= 0 || o.warmup < 0:
		return errors.New("-workers and -rounds must be at least 1, -round positive")
	case o.storm < 2:
		return errors.New("-storm must be at least 2")
	case o.users < 1 || o.boxes < 1 || o.replayKeys < 1 || o.allocs < 1:
		return errors.New("-users, -boxes, -replay-keys and -alloc-calls must be positive")
	case o.scaleRows < 0 || o.expiredRows < 0 || o.expiredRows > o.scaleRows:
		return errors.New("-expired-rows must be between 0 and -scale-rows")
	case o.latency < 0:
		return errors.New("-latency must not be negative")
	}
	if o.relayRounds < 1 || o.relayEvents < 1 || o.relayLatencyEvents < 1 || o.relayPending < 1 {
		return errors.New("-relay-rounds, -relay-events, -relay-latency-events and -relay-pending must be positive")
	}
	return o.storageCheck()
}

// run resolves the server, prepares the database, measures and reports.
func run(ctx context.Context, out io.Writer, o options) error {
	started := time.Now()
	var srv *pgserver.Server
	var err error
	if o.db != "" {
		srv, err = pgserver.FromURL(ctx, o.db, "-db")
	} else {
		srv, err = pgserver.Resolve(ctx)
	}
	if err != nil {
		return err
	}
	defer srv.Close()

	fmt.Fprintf(out, "idem-bench: PostgreSQL from %s, database %s\n", srv.Source, o.database)
	fmt.Fprintf(out, "machine: %s/%s, %d CPUs, %s%s\n", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.Version(), revision())
	fmt.Fprintf(out, "settings: -workers %d -round %s -rounds %d -latency %s -stale=%t -storm %d -users %d -boxes %d -scale-rows %d -expired-rows %d\n",
		o.workers, o.round, o.rounds, o.latency, o.stale, o.storm, o.users, o.boxes, o.scaleRows, o.expiredRows)

	b, err := setup(ctx, out, srv, o)
	if err != nil {
		return err
	}
	defer b.close(srv)
	failures := 0
	if !o.storage && !o.relay {
		rep, err := b.measure(ctx, out)
		if err != nil {
			return err
		}
		failures += rep.print(out)
	}
	if o.storage || o.smoke {
		n, err := b.runStorage(ctx, out)
		if err != nil {
			return err
		}
		failures += n
	}
	if o.relay || o.smoke {
		n, err := b.runOutbox(ctx, out)
		if err != nil {
			return err
		}
		failures += n
	}
	fmt.Fprintf(out, "\ntotal time %s\n", time.Since(started).Round(time.Second))
	if failures > 0 {
		return fmt.Errorf("%d correctness check(s) failed", failures)
	}
	return nil
}

// revision names the commit the benchmark runs, when known: from the
// build, or else from git in the working directory.
func revision() string {
	var rev, dirty string
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch {
			case s.Key == "vcs.revision":
				rev = s.Value[:min(12, len(s.Value))]
			case s.Key == "vcs.modified" && s.Value == "true":
				dirty = " with uncommitted changes"
			}
		}
	}
	if rev == "" {
		head, err := exec.Command("git", "rev-parse", "--short=12", "HEAD").Output()
		if err != nil {
			return ""
		}
		rev = strings.TrimSpace(string(head))
		if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
			dirty = " with uncommitted changes"
		}
	}
	return ", idem " + rev + dirty
}
