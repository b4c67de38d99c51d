// Command idem is the operator's tool for idem's table: it applies the
// migrations, prunes expired keys, looks a key up or forgets it, shows
// statistics, turns reservations whose lease ran out unknown, and lists and
// resolves the outcomes left unknown by reservations.
//
//	go run github.com/pgidem/idem/cmd/idem@latest --help
//
// It connects to DATABASE_URL (or --database-url). Every command takes
// --help, which prints the usage to stdout; --json prints a result as JSON
// for scripts. An error is one line on stderr, "idem <command>: <message>";
// with --json it is a JSON object on stdout instead,
// {"error": "<message>", "exit_code": N}, and stderr stays empty. On a
// database where idem's migrations have not run, the message says to run
// "idem migrate up".
//
// Exit codes:
//
//	0  success
//	1  failure (the database could not be reached, a statement failed, the
//	   result could not be written to stdout: said on stderr)
//	2  usage error (unknown command, bad flag or argument)
//	3  not found (no record holds the key)
//	4  refused (the key is in flight, or its record cannot be changed so)
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"mime"
	"net/http"
	"os"
	"os/signal"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/internal/pgadvice"
)

// Exit codes.
const (
	exitOK       = 0
	exitFailure  = 1
	exitUsage    = 2
	exitNotFound = 3
	exitRefused  = 4
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// usageError is a mistake on the command line: exit code 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

const mainUsage = `idem: the operator's tool for idem's idempotency keys.

Usage:
  idem [--database-url URL] [--json] <command> [flags] [arguments]

Commands:
  migrate up|down|status        apply, revert (one step) or list idem's migrations
                                (down refuses to delete records unless --force)
  prune [--dry-run]             delete expired finished keys in batches
  inspect <actor> <operation> <key>
                                show a key's record and stored response
  forget <actor> <operation> <key> [--reason R] [--operator NAME]
                                delete a finished key's record: the key is free again
  stats                         keys by status, oldest in flight, table and index size
  expire-leases [--batch N]     turn reservations whose lease ran out unknown, and fence
                                their late workers
  unknown list                  list the records whose outcome is unknown, and the leases
                                that ran out (still processing), oldest first (read-only)
  resolve <actor> <operation> <key> --token T (--succeeded [--status N] [--body B | --body-file F] | --retryable) --reason R [--operator NAME]
                                reconcile an unknown outcome
  audit list                    the operators' trail of resolve, forget and the console, newest first
  events list [--status S]      the outbox's events, newest first (--status overdue: due, unsent)
  events show|retry <destination> <id> [--reason R] [--operator NAME]
                                show an event of the outbox, or send a failed one again
  ui [--listen 127.0.0.1:8081]  serve the operator's console (credentials from IDEM_UI_TOKEN,
                                or IDEM_UI_USER and IDEM_UI_PASSWORD)

The database is DATABASE_URL unless --database-url is given. Every command
takes --help and --json (print the result as JSON).

Exit codes: 0 success, 1 failure, 2 usage error, 3 not found, 4 refused.
`

// run runs the command line args and returns the exit code.
//
// Output: a result goes to stdout, as text or, with --json, as JSON. Help
// (--help, or "help [command]") goes to stdout once. An error is one line on
// stderr, "idem <command>: <message>" (a usage error adds the usage); with
// --json it is one JSON object on stdout instead, {"error": ..., "exit_code":
// ...}, and stderr stays empty.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	top := flag.NewFlagSet("idem", flag.ContinueOnError)
	top.SetOutput(io.Discard) // run reports parse errors and prints the usage itself
	top.Usage = func() {}
	dbURL := top.String("database-url", "", "PostgreSQL connection string (default $DATABASE_URL)")
	jsonOut := top.Bool("json", false, "print the result as JSON")
	e := &env{stdout: stdout, stderr: stderr, name: "idem", usage: "\n" + mainUsage}
	if err := top.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, mainUsage)
			return exitOK
		}
		e.json = *jsonOut
		return e.exit(flagError(err))
	}
	e.json = *jsonOut
	if top.NArg() == 0 {
		return e.exit(usagef("no command"))
	}
	name, rest := top.Arg(0), top.Args()[1:]
	if name == "help" {
		return help(e, rest)
	}
	cmd, ok := commands[name]
	if !ok {
		e.usage = "Run 'idem help' for the commands.\n"
		return e.exit(usagef("unknown command %q", name))
	}
	fs := flag.NewFlagSet("idem "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	e.name = "idem " + name
	e.usage = fmt.Sprintf("Usage: idem %s\nRun 'idem %s --help' for more.\n", cmd.usage, name)
	var jsonFlag bool
	fs.BoolVar(&jsonFlag, "json", false, "print the result as JSON")
	run := cmd.flags(fs)
	positional, err := parseInterleaved(fs, rest)
	e.json = *jsonOut || jsonFlag
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, cmd.usageText(fs))
			return exitOK
		}
		return e.exit(flagError(err))
	}
	e.url = *dbURL
	if e.url == "" {
		e.url = os.Getenv("DATABASE_URL")
	}
	return e.exit(run(ctx, e, positional))
}

// help prints the usage of idem, or of the command named in args, to
// stdout.
func help(e *env, args []string) int {
	if len(args) == 0 {
		fmt.Fprint(e.stdout, mainUsage)
		return exitOK
	}
	cmd, ok := commands[args[0]]
	if !ok || len(args) > 1 {
		e.usage = "Run 'idem help' for the commands.\n"
		return e.exit(usagef("help takes one command name at most, got %q", strings.Join(args, " ")))
	}
	fs := flag.NewFlagSet("idem "+args[0], flag.ContinueOnError)
	fs.Bool("json", false, "print the result as JSON")
	cmd.flags(fs)
	fmt.Fprint(e.stdout, cmd.usageText(fs))
	return exitOK
}

// parseInterleaved parses fs's flags wherever they stand among the
// positional arguments ("migrate status --json" as well as "migrate --json
// status"), and returns the positional arguments. After "--" everything is
// positional.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for len(args) > 0 {
		if args[0] == "--" {
			return append(positional, args[1:]...), nil
		}
		if !strings.HasPrefix(args[0], "-") || args[0] == "-" {
			positional, args = append(positional, args[0]), args[1:]
			continue
		}
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		consumed := len(args) - len(fs.Args())
		if args[consumed-1] == "--" { // the flags ended with "--"
			return append(positional, fs.Args()...), nil
		}
		args = fs.Args()
	}
	return positional, nil
}

// command is one subcommand: flags defines its flags and returns the
// function that runs it with the remaining arguments.
type command struct {
	usage, help string
	flags       func(fs *flag.FlagSet) func(ctx context.Context, e *env, args []string) error
}

// usageText is the command's usage, with the flags defined on fs.
func (c command) usageText(fs *flag.FlagSet) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "Usage: idem %s\n\n%s\n\nFlags:\n", c.usage, c.help)
	writeFlags(&sb, fs)
	return sb.String()
}

// writeFlags lists fs's flags as the usage and the README spell them,
// --name (the flag package's own listing writes -name).
func writeFlags(w io.Writer, fs *flag.FlagSet) {
	fs.VisitAll(func(f *flag.Flag) {
		arg, usage := flag.UnquoteUsage(f)
		if arg != "" {
			arg = " " + arg
		}
		fmt.Fprintf(w, "  --%s%s\n    \t%s", f.Name, arg, strings.ReplaceAll(usage, "\n", "\n    \t"))
		if f.DefValue != "" && f.DefValue != "0" && f.DefValue != "false" {
			if _, isString := f.Value.(flag.Getter).Get().(string); isString {
				fmt.Fprintf(w, " (default %q)", f.DefValue)
			} else {
				fmt.Fprintf(w, " (default %s)", f.DefValue)
			}
		}
		fmt.Fprintln(w)
	})
}

// flagSpelling matches a flag's name in the flag package's error messages
// ("flag provided but not defined: -bogus", "invalid value "x" for flag
// -limit: ...").
var flagSpelling = regexp.MustCompile(`(: |flag |for )-{1,2}([A-Za-z][A-Za-z0-9-]*)`)

// flagError is a flag parse error as a usage error, flags spelled --name.
func flagError(err error) error {
	return usageError{flagSpelling.ReplaceAllString(err.Error(), "$1--$2")}
}

var commands = map[string]command{
	"migrate": {
		usage: "migrate up|down|status [--force]",
		help: "Applies idem's migrations (up), reverts the latest one (down), or lists them (status). They are\nrecorded in their own goose table, " + idem.MigrationTable + ", apart from the application's.\n" +
			"down refuses (exit 4, nothing changed) when reverting would delete records whose outcome may have\nhappened (unknown, in flight, failed_retryable; for the first migration, every record): their keys\nwould run again; or drop the audit trail (00005), the resume windows of records in doubt (00006),\nor undelivered events of the outbox (00007); or replay records whose body was dropped\n(Config.BodyTTL) as empty responses (00009).\n--force reverts anyway.",
		flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			force := fs.Bool("force", false, "with down: revert even when that deletes records whose outcome may have happened")
			return func(ctx context.Context, e *env, args []string) error { return migrate(ctx, e, args, *force) }
		},
	},
	"prune": {
		usage: "prune [--dry-run] [--batch-size N] [--max-batches N]",
		help: "Deletes finished keys past their TTL, oldest first, in batches of one short transaction each,\n" +
			"then drops the stored bodies and headers past their life (Config.BodyTTL) in the same way: those\n" +
			"keys stay, with their status, until their TTL. Keys in flight and unknown outcomes are never\n" +
			"touched; several pruners may run at once.",
		flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			var opts idem.PruneOptions
			fs.BoolVar(&opts.DryRun, "dry-run", false, "count the keys that would be deleted, delete (and drop) nothing")
			fs.IntVar(&opts.BatchSize, "batch-size", idem.DefaultPruneBatchSize, "`N` keys per batch (one transaction each)")
			fs.IntVar(&opts.MaxBatches, "max-batches", 0, "stop after `N` batches of keys, and N of bodies (0: until none is left)")
			return func(ctx context.Context, e *env, args []string) error { return prune(ctx, e, args, opts) }
		},
	},
	"inspect": {
		usage: "inspect <actor> <operation> <key>",
		help:  "Shows the record of a key: status, fingerprint, timestamps, lease and token, and the stored\nresponse. Claims of transactions still open are not visible.",
		flags: func(*flag.FlagSet) func(context.Context, *env, []string) error { return inspect },
	},
	"forget": {
		usage: "forget <actor> <operation> <key> [--reason R] [--operator NAME]",
		help:  "Deletes the record of a finished key (succeeded, rejected, failed_retryable), so that the next\nrequest with it runs as a new one: for a client stuck on a key it reused. A key in flight, or whose\noutcome is unknown (resolve it first), is refused with exit code 4. It writes a row of the audit\ntrail (idem audit list) in the same transaction, naming --operator, with --reason and a copy of the\nrecord it deleted (status, response, fingerprint, token, times).",
		flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			var operator, reason string
			operatorFlag(fs, &operator)
			fs.StringVar(&reason, "reason", "", "the reason `R` for forgetting, kept in the audit trail")
			return func(ctx context.Context, e *env, args []string) error { return forget(ctx, e, args, operator, reason) }
		},
	},
	"stats": {
		usage: "stats",
		help:  "Counts the keys in each status and shows the oldest key in flight and the oldest unknown\noutcome, and the size of the table and its indexes. It reads every row.",
		flags: func(*flag.FlagSet) func(context.Context, *env, []string) error { return stats },
	},
	"expire-leases": {
		usage: "expire-leases [--batch N]",
		help: "Turns the reservations whose lease ran out before they recorded an outcome (still processing)\ninto unknown outcomes, their token kept, as the library's ExpireLeases does: in batches of one\n" +
			"short transaction each, until none is left, and prints how many. unknown list then shows them.\n" +
			"Their workers are fenced: a Complete that comes late is refused (ErrFenced) and the record\nwaits for resolve. A reservation inside its window (ReserveOptions.ResumeWithin) is left for its\nrecovery worker until the window ends.",
		flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			batch := fs.Int("batch", 1000, "`N` reservations per batch (one transaction each)")
			return func(ctx context.Context, e *env, args []string) error { return expireLeases(ctx, e, args, *batch) }
		},
	},
	"unknown": {
		usage: "unknown list [--limit N]",
		help: "Lists the records whose outcome is unknown (a reservation may or may not have done its work)\nand that need a person, oldest first: not those inside their window (ReserveOptions.ResumeWithin),\nwhich resume by themselves. Reconcile each with resolve after checking the outside system. It only reads:\n" +
			"a reservation whose lease ran out is listed at once, still processing (its status says so; its\nworker may still complete it): idem expire-leases turns it unknown and fences that worker.",
		flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			limit := fs.Int("limit", 100, "list at most `N` records")
			return func(ctx context.Context, e *env, args []string) error { return unknownList(ctx, e, args, *limit) }
		},
	},
	"resolve": {
		usage: "resolve <actor> <operation> <key> --token T (--succeeded [--status N] [--body B | --body-file F] | --retryable) --reason R [--operator NAME]",
		help:  "Reconciles a record whose outcome is unknown (or whose lease ran out): --succeeded stores the\nresponse found at the outside system, to be replayed; --retryable says the work certainly did not\nhappen, so the next request with the key runs it. The reservation that held the key is fenced.\n--token names the attempt the verdict is about (as unknown list and inspect show it); when the record\nholds another token now, nothing changes and resolve fails: inspect the record again. It writes a\nrow of the audit trail (idem audit list) in the same transaction, naming --operator.",
		flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			var o resolveFlags
			fs.Int64Var(&o.token, "token", 0, "the token `T` of the attempt being resolved, as unknown list and inspect show it (required)")
			fs.BoolVar(&o.succeeded, "succeeded", false, "the work happened: store a response")
			fs.BoolVar(&o.retryable, "retryable", false, "the work certainly did not happen: let it run again")
			fs.IntVar(&o.status, "status", 200, "with --succeeded: the stored response's status `N`, 200 to 599 (a 204 or 304 has no body)")
			fs.StringVar(&o.body, "body", "", "with --succeeded: the stored response's body `B`")
			fs.StringVar(&o.bodyFile, "body-file", "", "with --succeeded: read the body from the file `F`")
			fs.StringVar(&o.contentType, "content-type", "application/json", "with --succeeded and a body: the body's media `type` (its Content-Type header)")
			fs.StringVar(&o.reason, "reason", "", "the reason `R` for the verdict, stored with the record for the audit trail (required)")
			operatorFlag(fs, &o.operator)
			return func(ctx context.Context, e *env, args []string) error {
				fs.Visit(func(f *flag.Flag) { o.given = append(o.given, f.Name) })
				return resolve(ctx, e, args, o)
			}
		},
	},
	"audit":  auditCommand,
	"ui":     uiCommand,
	"events": eventsCommand,
}

// env is what a command runs with.
type env struct {
	url            string
	json           bool
	stdout, stderr io.Writer
	name           string // "idem" or "idem <command>": the prefix of error messages
	usage          string // printed after a usage error (text output only)
}

// pool connects to the database.
func (e *env) pool(ctx context.Context) (*pgxpool.Pool, error) {
	if e.url == "" {
		return nil, usagef("no database: set DATABASE_URL or pass --database-url")
	}
	cfg, err := pgxpool.ParseConfig(e.url)
	if err != nil {
		return nil, usagef("bad database URL: %v", err)
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("cannot reach the database: %w", err)
	}
	return pool, nil
}

// print writes v as JSON with --json, or text otherwise. A result that
// cannot be written (a full disk, a closed pipe) is a writeError: the
// command fails.
func (e *env) print(v any, text string) error {
	var err error
	if e.json {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(v)
	} else {
		_, err = fmt.Fprint(e.stdout, text)
	}
	if err != nil {
		return writeError{err}
	}
	return nil
}

// writeError is a result that could not be written to stdout: exit code
// 1, reported on stderr even with --json (stdout is what failed).
type writeError struct{ err error }

func (w writeError) Error() string { return "writing the result: " + w.err.Error() }
func (w writeError) Unwrap() error { return w.err }

// exit reports err and returns the exit code for it.
func (e *env) exit(err error) int {
	if err == nil {
		return exitOK
	}
	code := exitFailure
	var ue usageError
	switch {
	case errors.As(err, &ue):
		code = exitUsage
	case errors.Is(err, idem.ErrNotFound), errors.Is(err, idem.ErrEventNotFound):
		code = exitNotFound
	case errors.Is(err, idem.ErrNotResolvable), errors.Is(err, idem.ErrInProgress), errors.Is(err, idem.ErrOutcomeUnknown),
		errors.Is(err, idem.ErrFenced), errors.Is(err, idem.ErrDowngradeDeletesRecords), errors.Is(err, idem.ErrEventNotFailed):
		code = exitRefused
	case errors.Is(err, idem.ErrInvalidKey), errors.Is(err, idem.ErrInvalidScope), errors.Is(err, idem.ErrInvalidArgument),
		errors.Is(err, idem.ErrInvalidResponse), errors.Is(err, idem.ErrResponseTooLarge):
		code = exitUsage
	}
	msg := message(err)
	if e.json && !errors.As(err, new(writeError)) {
		_ = json.NewEncoder(e.stdout).Encode(map[string]any{"error": msg, "exit_code": code})
		return code
	}
	fmt.Fprintf(e.stderr, "%s: %s\n", e.name, msg)
	if code == exitUsage && errors.As(err, &ue) {
		fmt.Fprint(e.stderr, e.usage)
	}
	return code
}

// message is err's text for the one line exit prints after the command's
// name: on one line (pgadvice.OneLine: pgx lists each address it tried on a
// line of its own), without the library's "idem: " prefixes (the line has
// one already); pgx's prepared statements lost behind a transaction pooler
// name the setting that fixes it (pgadvice.Explain), and an error saying
// that a table or column is missing (idem's migrations have not run) says
// how to create them.
func message(err error) string {
	err = pgadvice.Explain(err, "DATABASE_URL or --database-url")
	msg := strings.TrimPrefix(strings.ReplaceAll(pgadvice.OneLine(err.Error()), ": idem: ", ": "), "idem: ")
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.UndefinedTable || pgErr.Code == pgerrcode.UndefinedColumn) {
		msg = "idem's table is missing or not up to date in this database: run `idem migrate up` (" + msg + ")"
	}
	return msg
}

// wantArgs checks the number of positional arguments.
func wantArgs(args []string, n int, what string) error {
	if len(args) != n {
		return usagef("want %s, got %d argument(s)", what, len(args))
	}
	return nil
}

func migrate(ctx context.Context, e *env, args []string, force bool) error {
	if err := wantArgs(args, 1, "up, down or status"); err != nil {
		return err
	}
	switch args[0] {
	case "up", "down", "status":
	default:
		return usagef("want up, down or status, got %q", args[0])
	}
	if force && args[0] != "down" {
		return usagef("--force goes with down only")
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if args[0] == "up" {
		// The library's own path: the one services run at start-up.
		if err := idem.Migrate(ctx, pool); err != nil {
			return err
		}
	}
	if args[0] == "down" {
		// The library's path, which refuses to delete outcomes unless forced.
		version, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{Force: force})
		if err != nil {
			return err
		}
		if version != 0 {
			fmt.Fprintf(e.stderr, "reverted version %d\n", version)
		}
	}
	// The status only reads the version table: no lock. goose's Status
	// creates the table when it is missing (a write, which a read-only
	// connection refuses): without the table, every migration is pending.
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, db, idem.Migrations(),
		goose.WithTableName(idem.MigrationTable), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return err
	}
	var versioned bool
	// goose's own test of the table (in the current schema), planned anew
	// (no prepared statement for a transaction pooler to lose).
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_tables
		WHERE (current_schema() IS NULL OR schemaname = current_schema()) AND tablename = $1)`,
		pgx.QueryExecModeExec, idem.MigrationTable).Scan(&versioned); err != nil {
		return err
	}
	var rows []migrationRow
	if !versioned {
		for _, s := range provider.ListSources() {
			rows = append(rows, migrationRow{Version: s.Version, Source: s.Path})
		}
		return printMigrations(e, rows)
	}
	statuses, err := provider.Status(ctx)
	if err != nil {
		return err
	}
	var latest int64
	for _, s := range statuses {
		r := migrationRow{Version: s.Source.Version, Source: s.Source.Path, Applied: s.State == goose.StateApplied}
		if r.Applied {
			t := s.AppliedAt
			r.AppliedAt = &t
		}
		rows = append(rows, r)
		latest = max(latest, r.Version)
	}
	// Versions a later release of idem applied, which goose's status (the
	// files of this release) leaves out: the database is ahead.
	later, err := pool.Query(ctx, `SELECT version_id, max(tstamp) FROM `+idem.MigrationTable+`
		WHERE version_id > $1 AND is_applied GROUP BY version_id ORDER BY version_id`, pgx.QueryExecModeExec, latest)
	if err != nil {
		return err
	}
	for later.Next() {
		var r migrationRow
		var at time.Time
		if err := later.Scan(&r.Version, &at); err != nil {
			later.Close()
			return err
		}
		r.Source, r.Applied, r.AppliedAt = laterSource, true, &at
		rows = append(rows, r)
	}
	if err := later.Err(); err != nil {
		return err
	}
	return printMigrations(e, rows)
}

// laterSource stands for the file of a migration that a later release of
// idem applied, which this one does not ship.
const laterSource = "(not in this release of idem)"

// migrationRow is one migration as migrate prints it.
type migrationRow struct {
	Version   int64      `json:"version"`
	Source    string     `json:"source"`
	Applied   bool       `json:"applied"`
	AppliedAt *time.Time `json:"applied_at,omitempty"`
}

// printMigrations prints rows as JSON, or as text with the file names
// padded to the longest.
func printMigrations(e *env, rows []migrationRow) error {
	width := 0
	for _, r := range rows {
		width = max(width, len(r.Source))
	}
	var sb strings.Builder
	for _, r := range rows {
		when := "pending"
		if r.Applied {
			when = "applied " + r.AppliedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(&sb, "%5d  %-*s  %s\n", r.Version, width, r.Source, when)
	}
	return e.print(rows, sb.String())
}

func prune(ctx context.Context, e *env, args []string, opts idem.PruneOptions) error {
	if err := wantArgs(args, 0, "no arguments"); err != nil {
		return err
	}
	if opts.BatchSize <= 0 || opts.MaxBatches < 0 {
		return usagef("--batch-size must be positive and --max-batches not negative")
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	res, err := idem.PruneReport(ctx, pool, opts)
	if err != nil && (res.KeysDeleted > 0 || res.BodiesDropped > 0) {
		// What it did before it failed stays done: say so.
		return fmt.Errorf("deleted %d expired keys and dropped %d stored bodies, then failed: %w",
			res.KeysDeleted, res.BodiesDropped, err)
	}
	if err != nil {
		return err
	}
	text := fmt.Sprintf("would delete %d expired keys\n", res.KeysDeleted)
	if !opts.DryRun {
		text = fmt.Sprintf("deleted %d expired keys, dropped %d stored bodies past their life (Config.BodyTTL)\n",
			res.KeysDeleted, res.BodiesDropped)
	}
	return e.print(map[string]any{"dry_run": opts.DryRun, "keys": res.KeysDeleted, "bodies_dropped": res.BodiesDropped}, text)
}

// invisible reports whether r, in a value inspect prints, could move the
// cursor, hide text or reorder it (a control character, a format character
// such as U+202E, invalid UTF-8): the value is then quoted.
func invisible(r rune) bool {
	return r != ' ' && !unicode.IsGraphic(r) || r == utf8.RuneError
}

// operatorClient makes the calls of the commands that act on one stored
// record (inspect, forget, resolve) and of the console (ui): it accepts
// every key a service may have stored (Config.MaxKeyLength may be up to
// 1024 bytes; with the default 255 a longer key could be listed but not
// opened or settled). A key longer than the service's own limit finds no
// record.
var operatorClient = func() *idem.Client {
	c, err := idem.New(idem.Config{MaxKeyLength: 1024})
	if err != nil {
		panic(err)
	}
	return c
}()

// keyArgs parses <actor> <operation> <key>.
func keyArgs(args []string) (idem.Scope, string, error) {
	if err := wantArgs(args, 3, "<actor> <operation> <key>"); err != nil {
		return idem.Scope{}, "", err
	}
	return idem.Scope{Actor: args[0], Operation: args[1]}, args[2], nil
}

func inspect(ctx context.Context, e *env, args []string) error {
	scope, key, err := keyArgs(args)
	if err != nil {
		return err
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	rec, err := operatorClient.Lookup(ctx, pool, scope, key)
	if err != nil {
		return err
	}
	return e.print(recordJSON(rec), recordText(rec))
}

func forget(ctx context.Context, e *env, args []string, operator, reason string) error {
	scope, key, err := keyArgs(args)
	if err != nil {
		return err
	}
	if err := checkOperator(operator); err != nil {
		return err
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := auditedForget(ctx, pool, operator, scope, key, strings.TrimSpace(reason)); err != nil {
		return err
	}
	return e.print(map[string]any{"forgotten": true}, "forgotten: the key is free again\n")
}

func stats(ctx context.Context, e *env, args []string) error {
	if err := wantArgs(args, 0, "no arguments"); err != nil {
		return err
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	st, err := idem.ReadStats(ctx, pool)
	if err != nil {
		return err
	}
	// Every status, those with no keys too, in both forms.
	statuses := []idem.Status{idem.StatusProcessing, idem.StatusSucceeded, idem.StatusRejected,
		idem.StatusFailedRetryable, idem.StatusUnknown}
	for s := range st.Keys {
		if !slices.Contains(statuses, s) {
			statuses = append(statuses, s)
		}
	}
	var sb strings.Builder
	var total int64
	keys := make(map[idem.Status]int64, len(statuses))
	for _, s := range statuses {
		fmt.Fprintf(&sb, "%-17s %d\n", s, st.Keys[s])
		keys[s] = st.Keys[s]
		total += st.Keys[s]
	}
	fmt.Fprintf(&sb, "%-17s %d\n", "total", total)
	if !st.OldestProcessing.IsZero() {
		fmt.Fprintf(&sb, "oldest processing %s (%s ago)\n", st.OldestProcessing.UTC().Format(time.RFC3339), time.Since(st.OldestProcessing).Round(time.Second))
	}
	if !st.OldestUnknown.IsZero() {
		fmt.Fprintf(&sb, "oldest unknown    %s (%s ago)\n", st.OldestUnknown.UTC().Format(time.RFC3339), time.Since(st.OldestUnknown).Round(time.Second))
	}
	fmt.Fprintf(&sb, "table size        %d bytes\nindex size        %d bytes\n", st.TableBytes, st.IndexBytes)
	out := map[string]any{"keys": keys, "total": total, "table_bytes": st.TableBytes, "index_bytes": st.IndexBytes}
	if !st.OldestProcessing.IsZero() {
		out["oldest_processing"] = st.OldestProcessing
	}
	if !st.OldestUnknown.IsZero() {
		out["oldest_unknown"] = st.OldestUnknown
	}
	return e.print(out, sb.String())
}

func unknownList(ctx context.Context, e *env, args []string, limit int) error {
	if err := wantArgs(args, 1, "list"); err != nil {
		return err
	}
	if args[0] != "list" {
		return usagef("want list, got %q", args[0])
	}
	if limit <= 0 {
		return usagef("--limit must be positive")
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	var all []idem.Record
	var after *idem.Record
	for len(all) < limit {
		page, err := idem.ListUnknown(ctx, pool, min(limit-len(all), 500), after)
		if err != nil {
			return err
		}
		all = append(all, page...)
		if len(page) == 0 || len(all) >= limit {
			break
		}
		after = &page[len(page)-1]
	}
	out := make([]map[string]any, 0, len(all))
	var sb strings.Builder
	for _, r := range all {
		out = append(out, recordJSON(r))
		// Stored strings shown so that none can move the cursor or
		// forge a line (as audit list shows them).
		fmt.Fprintf(&sb, "%s  %s  %s  %s  token %d  %s  %s\n", r.CreatedAt.UTC().Format(time.RFC3339),
			shown(r.Scope.Actor), shown(r.Scope.Operation), shown(r.Key), r.Token, r.Status, shown(r.LastError))
	}
	if len(all) == 0 {
		sb.WriteString("no unknown outcomes\n")
	}
	sb.WriteString(expireLeasesHint)
	return e.print(out, sb.String())
}

// expireLeasesHint ends the text output of unknown list.
const expireLeasesHint = "(reservations whose lease ran out are listed at once, still processing; `idem expire-leases` turns them unknown and fences their late workers)\n"

func expireLeases(ctx context.Context, e *env, args []string, batch int) error {
	if err := wantArgs(args, 0, "no arguments"); err != nil {
		return err
	}
	if batch <= 0 {
		return usagef("--batch must be positive")
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	// A batch that comes back full may leave more behind: go on until one
	// does not.
	var expired int64
	for {
		n, err := idem.ExpireLeases(ctx, pool, batch)
		expired += n
		if err != nil && expired > 0 {
			// The batches before committed: say so.
			return fmt.Errorf("turned %d reservations whose lease ran out unknown, then failed: %w", expired, err)
		}
		if err != nil {
			return err
		}
		if n < int64(batch) {
			break
		}
	}
	return e.print(map[string]any{"expired": expired},
		fmt.Sprintf("%d reservations whose lease ran out turned unknown: see idem unknown list\n", expired))
}

type resolveFlags struct {
	succeeded, retryable bool
	status               int
	body, bodyFile       string
	contentType          string
	reason               string
	token                int64
	operator             string
	given                []string // the flags given on the command line
}

func resolve(ctx context.Context, e *env, args []string, o resolveFlags) error {
	scope, key, err := keyArgs(args)
	if err != nil {
		return err
	}
	if o.token <= 0 {
		return usagef("--token is required: the token of the attempt being resolved, as unknown list and inspect show it")
	}
	if o.succeeded == o.retryable {
		return usagef("give exactly one of --succeeded and --retryable")
	}
	if o.retryable {
		// A response given with --retryable is a contradiction: refused
		// rather than ignored (did the operator mean --succeeded?).
		for _, name := range []string{"status", "body", "body-file", "content-type"} {
			if slices.Contains(o.given, name) {
				return usagef("--%s goes with --succeeded only: --retryable stores no response", name)
			}
		}
	}
	if strings.TrimSpace(o.reason) == "" {
		return usagef("--reason is required: it is stored with the record for the audit trail")
	}
	if err := checkOperator(o.operator); err != nil {
		return err
	}
	res := idem.Resolution{Token: o.token, Retryable: o.retryable, Reason: o.reason}
	if o.succeeded {
		if o.body != "" && o.bodyFile != "" {
			return usagef("give --body or --body-file, not both")
		}
		body := []byte(o.body)
		if o.bodyFile != "" {
			if body, err = os.ReadFile(o.bodyFile); err != nil {
				return usagef("--body-file: %v", err)
			}
		}
		// As the console: a status the client can be answered again, and
		// no body for one that has none.
		if o.status < 200 || o.status > 599 {
			return usagef("--status %d is not a status a client can be answered again: give one from 200 to 599", o.status)
		}
		if (o.status == http.StatusNoContent || o.status == http.StatusNotModified) && len(body) > 0 {
			return usagef("a %d answer has no body, and this one has %d bytes: drop the body, or give the status the service answered with it", o.status, len(body))
		}
		if len(body) > 0 && isJSONType(o.contentType) && !json.Valid(body) {
			return usagef("the body is not valid JSON, and --content-type says %s: fix the body or give the right --content-type", o.contentType)
		}
		resp := &idem.Response{Status: o.status, Body: body}
		if len(body) > 0 && o.contentType != "" {
			resp.Header = map[string][]string{"Content-Type": {o.contentType}}
		}
		res.Succeeded = resp
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := auditedResolve(ctx, pool, o.operator, scope, key, res); err != nil {
		return err
	}
	verdict := "succeeded: the stored response is replayed from now on"
	if o.retryable {
		verdict = "failed_retryable: the next request with the key runs again"
	}
	return e.print(map[string]any{"resolved": true, "retryable": o.retryable}, "resolved as "+verdict+"\n")
}

// isJSONType reports whether the media type ct says JSON: application/json
// or a +json type such as application/problem+json.
func isJSONType(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		return false
	}
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}

// field is one field of a record as inspect and unknown list print it.
type field struct {
	name  string
	value any
}

// recordFields are the fields of r that both forms print, in the text
// form's order: a field the record does not have (a token and a lease,
// which Do's records never hold; completed_at before completion; a
// window, a time it became unknown; a response, an error or a reason) is
// left out of both.
func recordFields(r idem.Record) []field {
	f := []field{
		{"actor", r.Scope.Actor}, {"operation", r.Scope.Operation}, {"key", r.Key},
		{"status", string(r.Status)}, {"fingerprint", r.Fingerprint.String()}, {"created_at", r.CreatedAt},
	}
	if !r.CompletedAt.IsZero() {
		f = append(f, field{"completed_at", r.CompletedAt})
	}
	f = append(f, field{"expires_at", r.ExpiresAt})
	if !r.BodyExpiresAt.IsZero() {
		f = append(f, field{"body_expires_at", r.BodyExpiresAt})
	}
	if r.Token != 0 {
		f = append(f, field{"token", r.Token})
	}
	if !r.LeaseExpiresAt.IsZero() {
		f = append(f, field{"lease_expires_at", r.LeaseExpiresAt})
	}
	if !r.ResumeUntil.IsZero() {
		// The end of the key's window: an attempt in doubt before it
		// resumes by itself (unknown list leaves it out).
		f = append(f, field{"resume_until", r.ResumeUntil})
	}
	if !r.UnknownAt.IsZero() {
		f = append(f, field{"unknown_at", r.UnknownAt})
	}
	if r.LastError != "" {
		f = append(f, field{"last_error", r.LastError})
	}
	if r.ResolveReason != "" {
		f = append(f, field{"resolve_reason", r.ResolveReason})
	}
	switch {
	case r.Response != nil && r.ResponseGone:
		// Its body and headers were dropped (Config.BodyTTL): an empty
		// body would say the response had none.
		f = append(f, field{"response", map[string]any{"status": r.Response.Status, "gone": true}})
	case r.Response != nil:
		resp := map[string]any{"status": r.Response.Status}
		if len(r.Response.Header) > 0 {
			resp["header"] = r.Response.Header // left out when there is none, not null
		}
		if utf8.Valid(r.Response.Body) {
			resp["body"] = string(r.Response.Body)
		} else {
			// JSON strings hold text: bytes that are not UTF-8 (a gzip
			// body) would come out as U+FFFD. encoding/json writes a
			// []byte as base64.
			resp["body_base64"] = r.Response.Body
		}
		f = append(f, field{"response", resp})
	}
	return f
}

// recordJSON is a Record as --json prints it.
func recordJSON(r idem.Record) map[string]any {
	out := map[string]any{}
	for _, f := range recordFields(r) {
		out[f.name] = f.value
	}
	return out
}

// recordText is a Record as inspect prints it: the fields of recordJSON,
// one a line (the response's status, each header and the body each on a
// line of its own), a value with a control character quoted.
func recordText(r idem.Record) string {
	var sb strings.Builder
	line := func(name, value string) {
		if strings.ContainsFunc(value, invisible) {
			value = strconv.QuoteToGraphic(value)
		}
		fmt.Fprintf(&sb, "%-16s %s\n", name, value)
	}
	for _, f := range recordFields(r) {
		switch v := f.value.(type) {
		case time.Time:
			line(f.name, v.UTC().Format(time.RFC3339Nano))
		case map[string]any: // the response
			line("response_status", fmt.Sprint(r.Response.Status))
			if r.ResponseGone {
				line("response_body", "(gone: dropped with its headers after the body's life, Config.BodyTTL)")
				continue
			}
			for _, name := range slices.Sorted(maps.Keys(r.Response.Header)) {
				values := r.Response.Header[name]
				if values != nil && len(values) == 0 { // idemhttp: the handler deleted it
					line("response_header", name+" (removed on replay)")
					continue
				}
				line("response_header", name+": "+strings.Join(values, ", "))
			}
			line("response_body", strconv.Quote(string(r.Response.Body)))
		default:
			line(f.name, fmt.Sprint(v))
		}
	}
	return sb.String()
}
