// Command idem-demo shows what idem guarantees on a real PostgreSQL server.
//
// Usage:
//
//	idem-demo [run]
//	idem-demo serve [-addr 127.0.0.1:8080] [-seed N] [-db idem_demo]
//
// run (the default) finds a server (DATABASE_URL, localhost:5432, Docker, or
// a temporary initdb cluster), recreates the database idem_demo on it,
// installs idem's table and the Goose Kuzi draw tables, and puts the draw
// API through the failure scenarios of the design: a retry after a lost
// response, a reused key, concurrent duplicates, a failure before commit and
// a stored refusal; then payments through a fake card gateway with
// idem.Reserve: a retry, a timeout after the charge that becomes an unknown
// outcome, an operator resolving it, a worker paused past its lease, and a
// gateway that refused. It prints a table of what happened and of the numbers
// read back from the database, and exits with status 1 if any invariant
// fails. The database is left in place for inspection.
//
// serve recreates the same database and serves the draw API over HTTP on a
// loopback address, with idemhttp in front of it, until SIGINT or SIGTERM:
//
//	POST /v1/draws           {"box_id":1,"quantity":2}, with an Idempotency-Key header
//	GET  /v1/wallets/{user}  points and prizes of the caller
//	POST /v1/payments        {"customerId":"cus-1","amountCents":12000,"currency":"KRW"},
//	                         with an Idempotency-Key header (X-Demo-Gateway: timeout-after-charge
//	                         or unavailable tells the fake gateway to misbehave)
//	GET  /v1/admin/unknown   payments whose outcome is unknown (Bearer operator)
//	POST /v1/admin/resolve   {"actor":"alice","key":"..."}: resolve one at the gateway (Bearer operator)
//	GET  /v1/admin/charges   the gateway's charges (Bearer operator)
//
// The bearer token is the user name (alice or bob). -seed makes the prize
// picks repeatable.
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

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	_ "github.com/pgidem/idem/cmd/internal/pgcontainer" // Resolve may start a Docker container
	"github.com/pgidem/idem/internal/draw"
	"github.com/pgidem/idem/internal/pgserver"
)

// database is the database the demo recreates on every run.
const database = "idem_demo"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	cmd := "run"
	if len(os.Args) > 1 {
		cmd = os.Args[1]
	}
	var err error
	switch cmd {
	case "run":
		err = run(ctx, os.Stdout)
	case "serve":
		var cfg serveConfig
		cfg, err = parseServeFlags(os.Args[2:], os.Stderr)
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "idem-demo:", err)
			os.Exit(2)
		}
		err = serve(ctx, os.Stdout, cfg)
	case "help", "-h", "-help", "--help":
		usage(os.Stdout)
		return
	default:
		fmt.Fprintf(os.Stderr, "idem-demo: unknown command %q\n", cmd)
		usage(os.Stderr)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "idem-demo:", err)
		os.Exit(1)
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, `usage: idem-demo [run]
       idem-demo serve [-addr 127.0.0.1:8080] [-seed N] [-db idem_demo]

  run     recreate the database idem_demo and run the draw scenarios (default)
  serve   recreate the database and serve the draw API over HTTP on a loopback
          address until interrupted (serve -h lists the flags)`)
}

// run prepares the database and runs the scenarios. It returns an error if
// the database cannot be prepared or any scenario fails.
func run(ctx context.Context, out io.Writer) error {
	srv, err := pgserver.Resolve(ctx)
	if err != nil {
		return err
	}
	defer srv.Close()
	fmt.Fprintf(out, "PostgreSQL from %s; database %s\n\n", srv.Source, database)

	pool, err := openDatabase(ctx, srv, database)
	if err != nil {
		return err
	}
	defer pool.Close()

	failed := runScenarios(ctx, out, pool)
	if failed > 0 {
		return fmt.Errorf("%d scenario(s) failed", failed)
	}
	fmt.Fprintln(out, "\nAll scenarios ok: every draw was charged and stocked exactly once, and every payment charged at most once.")
	return nil
}

// openDatabase drops and recreates the database called name, installs
// idem's migrations and the draw tables and seeds, and returns a pool with
// enough connections for the concurrent scenario.
func openDatabase(ctx context.Context, srv *pgserver.Server, name string) (*pgxpool.Pool, error) {
	admin, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", srv.Source, err)
	}
	defer admin.Close(context.Background())
	ident := pgx.Identifier{name}.Sanitize()
	for _, sql := range []string{
		"DROP DATABASE IF EXISTS " + ident + " WITH (FORCE)",
		"CREATE DATABASE " + ident,
	} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			return nil, fmt.Errorf("%s: %w", sql, err)
		}
	}

	cfg, err := pgxpool.ParseConfig(srv.DatabaseURL(name))
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = duplicates + 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := idem.Migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if err := draw.Setup(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}
