// Command idem-demo shows what idem guarantees on a real PostgreSQL server.
//
// Usage:
//
//	idem-demo [run] [-db idem_demo]
//	idem-demo serve [-addr 127.0.0.1:8080] [-seed N] [-db idem_demo] [-keep] [-lease 30s] [-resume-within 23h]
//
// run (the default) finds a server (DATABASE_URL, localhost:5432, Docker, or
// a temporary initdb cluster), creates the database idem_demo on it if it is
// missing (-db names another), resets the demo's tables in it, installs
// idem's table and the Goose Kuzi draw tables, and puts the draw API through
// the failure scenarios of the design: a retry after a lost response, a
// reused key, concurrent duplicates, a failure before commit and a stored
// refusal; then payments through a fake card gateway (an HTTP server of its
// own, reached through idemhttp.Transport with the reservation's call key,
// deduplicating by key for 24 hours in the demo's tables) with
// idem.ReserveWith: a retry; the gateway's answer lost, and the
// transport's retry healing it; without a window, a timeout after the
// charge that becomes an unknown outcome and an operator resolving it; a
// worker paused past its lease; a gateway that refused; and, with a window
// (ReserveOptions.ResumeWithin), a timeout after the charge that the
// client's retry resumes, and a service stopped after the charge that a
// recovery worker resumes after the restart. It prints a table of what
// happened and of the numbers read back from the database, and exits with
// status 1 if any invariant fails. The database is left in place for
// inspection.
//
// The demo only ever changes a database of its own: one it created, found
// empty, or found holding only an older demo's tables. It marks it with its
// table idem_demo and resets it (every table in it dropped and created
// again) at the start of each run. It refuses a database that holds tables
// it did not create, never drops a database, and never ends another
// session. Runs on one database take turns: a run
// waits (and says so) while another run or serve holds it, so concurrent
// runs on one server all pass.
//
// serve prepares the same database (-keep: keeps the tables of the last run
// or serve instead, a restart) and serves the draw API over HTTP on a
// loopback address, with idemhttp in front of it, until SIGINT or SIGTERM,
// and runs the payments' recovery worker every second (idem.ListResumable,
// ReserveWith, the same request with the same call key, Complete):
//
//	POST /v1/draws           {"box_id":1,"quantity":2}, with an Idempotency-Key header
//	                         (X-Demo-Delay: 6s holds the key that long, to try a duplicate in flight)
//	GET  /v1/idempotency     ?key=K&operation=O: the status URL of a draw (202 Accepted while it runs)
//	GET  /v1/wallets/{user}  points and prizes of the caller
//	POST /v1/payments        {"customerId":"cus-1","amountCents":12000,"currency":"KRW"},
//	                         with an Idempotency-Key header (X-Demo-Gateway: reply-lost,
//	                         timeout-after-charge or unavailable tells the fake gateway to
//	                         misbehave; X-Demo-Crash: after-charge kills the demo after the
//	                         charge, before Complete)
//	GET  /v1/admin/unknown   payments whose outcome is unknown and need a person (Bearer operator)
//	POST /v1/admin/resolve   {"actor":"alice","key":"..."}: resolve one at the gateway (Bearer operator)
//	GET  /v1/admin/charges   the gateway's charges (Bearer operator)
//
// The bearer token is the user name (alice or bob). -seed makes the prize
// picks repeatable. Payments are reserved with a lease of -lease and a
// window of -resume-within (0: none), in which a payment in doubt resumes
// by itself: by the client's retry, or by the recovery worker once its
// lease has run out.
//
// A connection string that goes through a transaction pooler in pgx's
// default exec mode fails at the start with idem's diagnosis
// (idem.ErrPreparedStatements) and the setting that fixes it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	_ "github.com/pgidem/idem/cmd/internal/pgcontainer" // Resolve may start a Docker container
	"github.com/pgidem/idem/internal/testkit/pgserver"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	cmd, args := "run", os.Args[1:]
	switch {
	case len(args) == 0:
	case args[0] == "-h" || args[0] == "-help" || args[0] == "--help":
		cmd = "help"
	case !isFlag(args[0]): // "idem-demo -db x" runs
		cmd, args = args[0], args[1:]
	}
	var err error
	switch cmd {
	case "run":
		var name string
		name, err = parseRunFlags(args, os.Stderr)
		if err == nil {
			err = run(ctx, os.Stdout, name)
		}
	case "serve":
		var cfg serveConfig
		cfg, err = parseServeFlags(args, os.Stderr)
		if err == nil {
			err = serve(ctx, os.Stdout, cfg)
		}
	case "help":
		usage(os.Stdout)
		return
	default:
		fmt.Fprintf(os.Stderr, "idem-demo: unknown command %q\n", cmd)
		usage(os.Stderr)
		os.Exit(2)
	}
	switch {
	case errors.Is(err, flag.ErrHelp):
	case errors.As(err, new(usageError)):
		fmt.Fprintln(os.Stderr, "idem-demo:", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "idem-demo:", err)
		os.Exit(1)
	}
}

// isFlag reports whether arg is a flag ("-db", "--help") rather than a
// command.
func isFlag(arg string) bool { return len(arg) > 1 && arg[0] == '-' }

func usage(w io.Writer) {
	fmt.Fprintln(w, `usage: idem-demo [run] [-db idem_demo]
       idem-demo serve [-addr 127.0.0.1:8080] [-seed N] [-db idem_demo] [-keep] [-lease 30s] [-resume-within 23h]

  run     run the draw and payment scenarios in the database idem_demo (default)
  serve   serve the draw and payments APIs and the operator's console (/idem/)
          over HTTP on a loopback address until interrupted

Both create the database if it is missing and reset the demo's tables in it
(serve -keep keeps them: a restart); they refuse a database that holds tables
the demo did not create. run -h and serve -h list the flags.`)
}

// usageError is a mistake on the command line: exit status 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// parseRunFlags parses the flags of run and returns the database name.
func parseRunFlags(args []string, errOut io.Writer) (string, error) {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.SetOutput(errOut)
	name := fs.String("db", defaultDatabase, "`name` of the demo's database: created if missing, its tables reset (idem, then [a-z0-9_])")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return "", err
		}
		return "", usageError{"run: " + err.Error()}
	}
	if fs.NArg() > 0 {
		return "", usageError{fmt.Sprintf("run: unexpected argument %q", fs.Arg(0))}
	}
	return *name, checkDatabaseName(*name)
}

// run resolves a server, prepares the database called name on it and runs
// the scenarios. It returns an error if the database cannot be prepared or
// any scenario fails.
func run(ctx context.Context, out io.Writer, name string) error {
	srv, err := pgserver.Resolve(ctx)
	if err != nil {
		return err
	}
	defer srv.Close()
	return runOn(ctx, out, srv, name)
}

// runOn is run on srv.
func runOn(ctx context.Context, out io.Writer, srv *pgserver.Server, name string) error {
	fmt.Fprintf(out, "PostgreSQL from %s; database %s\n\n", srv.Source, name)
	db, err := openDatabase(ctx, srv, name, out, false)
	if err != nil {
		return err
	}
	defer db.Close()

	failed := runScenarios(ctx, out, db.pool)
	if failed > 0 {
		return fmt.Errorf("%d scenario(s) failed", failed)
	}
	fmt.Fprintln(out, "\nAll scenarios ok: every draw was charged and stocked exactly once, every payment charged at most once, and every payment.succeeded webhook processed once.")
	return nil
}
