// Command idem-bench measures what idempotency inside the business
// transaction costs, side by side with the physical floor and with the
// two-transaction pattern, against one real PostgreSQL server.
//
// Usage:
//
//	idem-bench [flags]
//
// It recreates the database idem_bench (dropped again at the end unless
// -keep), migrates it with idem.Migrate, creates the draw tables with many
// users and boxes (so no row is hot) and two more copies of idem's table,
// each migrated by idem.Migrate in a schema of its own: scale_empty, which
// starts empty, and scale_full, loaded server-side with -scale-rows keys of
// which -prune-rows are expired. Then it runs these workloads, -workers
// concurrent workers each, for -round each, in -rounds rounds; the order
// within a round rotates from round to round, so noise on the machine hits
// all of them alike:
//
//	bare        the draw transaction (debit points, take stock, insert the
//	            batch, its inventory and its ledger row) without idempotency
//	floor       bare plus one INSERT of a finished row into idem_keys
//	do          idem.Do with a fresh key in the caller's transaction
//	doInTx      idem.DoInTx with a fresh key
//	replay      idem.DoInTx with a key that already completed
//	two-tx      the claim committed in a transaction of its own, then the
//	            draw and the completion in a second one
//	storm       -storm goroutines send the same fresh key at once, key
//	            after key; a quarter of the slot measures single executions
//	scale-*     do against scale_empty, against scale_full, and against
//	            scale_full while expired keys are deleted beside it in
//	            batches of 1000 (the benchmark's own prune)
//
// -proto adds hand-written protocols (p-*) that price changes to the core
// before they are made.
//
// Between rounds it runs ANALYZE on the tables the workloads write, as
// autovacuum would; without it, statements first planned on a nearly empty
// idem_keys keep sequential-scan plans as the table grows.
//
// It prints transactions per second, latency percentiles, CPU, round trips
// and statements per transaction, allocations per call, and the goals with
// PASS or MISS; ratios are the median of the per-round ratios. The exit
// status is 1 when the benchmark could not run or a correctness check
// failed (a storm key executed other than once, any error in a workload,
// fn running on replay); a missed speed goal does not change it.
//
// -smoke runs every workload briefly on small tables (well under a minute
// including setup), to prove the benchmark still works.
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
	"github.com/pgidem/idem/internal/pgserver"
)

// options are the command-line settings.
type options struct {
	db            string
	database      string
	workers       int
	round         time.Duration
	rounds        int
	warmup        time.Duration
	scaleRows     int
	pruneRows     int
	storm         int
	stormSeparate bool
	users         int
	boxes         int
	replayKey     int
	allocOps      int
	smoke         bool
	keep          bool
	proto         bool
}

func main() {
	var o options
	flag.StringVar(&o.db, "db", "", "admin connection URL of the server (default: resolved like the tests: "+
		"DATABASE_URL, localhost:5432, Docker, a temporary initdb cluster)")
	flag.StringVar(&o.database, "database", "idem_bench", "name of the database to recreate on the server")
	flag.IntVar(&o.workers, "workers", 8, "concurrent workers per workload")
	flag.DurationVar(&o.round, "round", time.Second, "duration of each workload in each round")
	flag.IntVar(&o.rounds, "rounds", 15, "number of rounds")
	flag.DurationVar(&o.warmup, "warmup", 500*time.Millisecond, "unmeasured warm-up run of each workload")
	flag.IntVar(&o.scaleRows, "scale-rows", 3_000_000, "keys in the full key table of the scale workloads")
	flag.IntVar(&o.pruneRows, "prune-rows", 1_000_000, "expired keys among them, pruned during scale-prune")
	flag.IntVar(&o.storm, "storm", 64, "goroutines sending the same key at once in the storm")
	flag.BoolVar(&o.stormSeparate, "storm-separate", false, "give every storm goroutine its own idem.Client, so duplicates meet in the database as from separate processes instead of coalescing in this one")
	flag.IntVar(&o.users, "users", 100_000, "wallets in the draw tables")
	flag.IntVar(&o.boxes, "boxes", 10_000, "boxes in the draw tables")
	flag.IntVar(&o.replayKey, "replay-keys", 2_000, "completed keys the replay workload draws from")
	flag.IntVar(&o.allocOps, "alloc-ops", 3_000, "calls per allocation measurement")
	flag.BoolVar(&o.smoke, "smoke", false, "tiny run (a few hundred ms per workload, small tables) to prove the benchmark works")
	flag.BoolVar(&o.keep, "keep", false, "keep the database after the run")
	flag.BoolVar(&o.proto, "proto", false, "also run the prototype workloads (p-*): hand-written protocols that price core design changes")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: idem-bench [flags]")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}
	if o.smoke {
		o.applySmoke()
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

// applySmoke shrinks every setting that was not given on the command line.
func (o *options) applySmoke() {
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	small := map[string]func(){
		"round":       func() { o.round = 250 * time.Millisecond },
		"rounds":      func() { o.rounds = 2 },
		"warmup":      func() { o.warmup = 100 * time.Millisecond },
		"scale-rows":  func() { o.scaleRows = 30_000 },
		"prune-rows":  func() { o.pruneRows = 10_000 },
		"users":       func() { o.users = 5_000 },
		"boxes":       func() { o.boxes = 500 },
		"replay-keys": func() { o.replayKey = 200 },
		"alloc-ops":   func() { o.allocOps = 200 },
	}
	for name, apply := range small {
		if !set[name] {
			apply()
		}
	}
}

func (o *options) check() error {
	switch {
	case o.workers < 1:
		return errors.New("-workers must be at least 1")
	case o.round <= 0 || o.rounds < 1:
		return errors.New("-round must be positive and -rounds at least 1")
	case o.storm < 2:
		return errors.New("-storm must be at least 2")
	case o.users < 1 || o.boxes < 1 || o.replayKey < 1 || o.allocOps < 1:
		return errors.New("-users, -boxes, -replay-keys and -alloc-ops must be positive")
	case o.pruneRows < 0 || o.scaleRows < o.pruneRows:
		return errors.New("-prune-rows must be between 0 and -scale-rows")
	}
	return nil
}

// run resolves the server, prepares the database, runs the benchmark and
// prints the report.
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
	fmt.Fprintf(out, "machine: %s/%s, %d CPUs (GOMAXPROCS %d), %s%s\n",
		runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), buildInfo())
	fmt.Fprintf(out, "settings: -workers %d -round %s -rounds %d -storm %d -scale-rows %d -prune-rows %d -users %d -boxes %d\n\n",
		o.workers, o.round, o.rounds, o.storm, o.scaleRows, o.pruneRows, o.users, o.boxes)

	b, err := setup(ctx, out, srv, o)
	if err != nil {
		return err
	}
	defer b.close(ctx, srv, o)

	rep, err := b.measure(ctx, out)
	if err != nil {
		return err
	}
	rep.print(out)
	fmt.Fprintf(out, "\ntotal time %s\n", time.Since(started).Round(time.Second))
	if rep.failures > 0 {
		return fmt.Errorf("%d correctness check(s) failed", rep.failures)
	}
	return nil
}

// buildInfo names the revision of idem the benchmark runs, when known:
// from the build, or else from git in the working directory.
func buildInfo() string {
	var rev string
	var dirty bool
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
	}
	if rev == "" {
		out, err := exec.Command("git", "rev-parse", "HEAD").Output()
		if err != nil {
			return ""
		}
		rev = strings.TrimSpace(string(out))
		// Uncommitted changes to the library itself (not to this command).
		st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!cmd/idem-bench").Output()
		dirty = err == nil && len(st) > 0
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if dirty {
		rev += " with uncommitted changes"
	}
	return ", idem " + rev
}
