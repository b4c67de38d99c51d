package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// auditCommand is "idem audit list": the operators' trail.
var auditCommand = command{
	usage: "audit list [--limit N] [--operator NAME] [--action A] [--actor A] [--operation O] [--key K]",
	help: "Lists the audit trail, newest first: every change made with resolve, forget, or the console\n" +
		"(idem ui, or idemui in a service), with who made it, on which record and attempt, and why. The\n" +
		"filters match exactly; an empty one matches every row.",
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		var f audit.ListFilter
		fs.IntVar(&f.Limit, "limit", 100, "list at most `N` rows")
		fs.StringVar(&f.Operator, "operator", "", "only the rows of the operator `NAME`")
		fs.StringVar(&f.Action, "action", "", "only the `action` resolve, forget, expire_leases, prune or retry_event")
		fs.StringVar(&f.Scope.Actor, "actor", "", "only the rows about the keys of the `actor`")
		fs.StringVar(&f.Scope.Operation, "operation", "", "only the rows about the keys of the `operation`")
		fs.StringVar(&f.Key, "key", "", "only the rows about the `key`")
		return func(ctx context.Context, e *env, args []string) error { return auditList(ctx, e, args, f) }
	},
}

// operatorFlag defines --operator on fs, for the commands that change a
// record and write the audit trail: its default is the name of the user
// running the command.
func operatorFlag(fs *flag.FlagSet, p *string) {
	fs.StringVar(p, "operator", osUser(), "the operator `NAME` recorded in the audit trail")
}

// osUser is the name of the user running the command ("" when unknown).
func osUser() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return os.Getenv("USER")
}

// checkOperator refuses an empty --operator before anything runs.
func checkOperator(operator string) error {
	if strings.TrimSpace(operator) == "" {
		return usagef("--operator is required here (the name of the user running idem is unknown): the audit trail records who acted")
	}
	return nil
}

func auditList(ctx context.Context, e *env, args []string, f audit.ListFilter) error {
	if err := wantArgs(args, 1, "list"); err != nil {
		return err
	}
	if args[0] != "list" {
		return usagef("want list, got %q", args[0])
	}
	if f.Limit <= 0 {
		return usagef("--limit must be positive")
	}
	switch f.Action {
	case "", audit.ActionResolve, audit.ActionForget, audit.ActionExpireLeases, audit.ActionPrune, audit.ActionRetryEvent:
	default:
		return usagef("--action %q is not one of resolve, forget, expire_leases, prune, retry_event", f.Action)
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	var entries []audit.Entry
	err = audit.Read(ctx, pool, func(ctx context.Context, q audit.Planned) error {
		entries, err = audit.List(ctx, q, f)
		return err
	})
	if err != nil {
		return err
	}
	out := make([]map[string]any, 0, len(entries))
	var sb strings.Builder
	for _, a := range entries {
		out = append(out, entryJSON(a))
		fmt.Fprintf(&sb, "%s  %s  %s", a.At.UTC().Format(time.RFC3339), shown(a.Operator), shown(a.Action))
		if a.Key != "" {
			fmt.Fprintf(&sb, "  %s %s %s", shown(a.Scope.Actor), shown(a.Scope.Operation), shown(a.Key))
		}
		switch {
		case a.HasBefore && a.HasAfter:
			fmt.Fprintf(&sb, "  token %d -> %d  %s -> %s", a.TokenBefore, a.TokenAfter, shown(string(a.StatusBefore)), shown(string(a.StatusAfter)))
		case a.HasBefore:
			fmt.Fprintf(&sb, "  token %d  %s -> deleted", a.TokenBefore, shown(string(a.StatusBefore)))
		default:
			fmt.Fprintf(&sb, "  %d records", a.Changed)
		}
		if a.Verdict != "" {
			fmt.Fprintf(&sb, "  verdict %s", shown(string(a.Verdict)))
		}
		if a.Reason != "" {
			fmt.Fprintf(&sb, "  reason %s", strconv.QuoteToGraphic(a.Reason))
		}
		sb.WriteByte('\n')
	}
	if len(entries) == 0 {
		sb.WriteString("no audit rows\n")
	}
	return e.print(out, sb.String())
}

// shown is a stored string as a line of the trail prints it: as it is when
// every rune is a graphic character other than space, quote or backslash;
// otherwise quoted, Go style, with control characters, invalid UTF-8 and
// other invisible runes escaped. A stored string can then never move the
// cursor, recolour, hide or forge a line of the terminal showing it.
func shown(s string) string {
	if s == "" {
		return `""`
	}
	for _, r := range s {
		if !unicode.IsGraphic(r) || unicode.IsSpace(r) || r == '"' || r == '\\' || r == utf8.RuneError {
			return strconv.QuoteToGraphic(s)
		}
	}
	return s
}

// entryJSON is a row of the trail as --json prints it.
func entryJSON(a audit.Entry) map[string]any {
	out := map[string]any{"id": a.ID, "at": a.At, "operator": a.Operator, "action": a.Action, "changed": a.Changed}
	if a.Key != "" {
		out["actor"], out["operation"], out["key"] = a.Scope.Actor, a.Scope.Operation, a.Key
	}
	if a.HasBefore {
		out["token_before"], out["status_before"] = a.TokenBefore, a.StatusBefore
	}
	if a.HasAfter {
		out["token_after"], out["status_after"] = a.TokenAfter, a.StatusAfter
	}
	if a.Verdict != "" {
		out["verdict"] = a.Verdict
	}
	if a.Reason != "" {
		out["reason"] = a.Reason
	}
	if a.Detail != nil {
		out["detail"] = json.RawMessage(a.Detail)
	}
	return out
}

// auditedResolve is idem.Resolve with its audit row, as resolve runs it.
func auditedResolve(ctx context.Context, db idem.Beginner, operator string, scope idem.Scope, key string, res idem.Resolution) error {
	_, _, err := audit.Resolve(ctx, db, operatorClient, operator, scope, key, res)
	return err
}

// auditedForget is idem.Forget with its audit row, as forget runs it.
func auditedForget(ctx context.Context, db idem.Beginner, operator string, scope idem.Scope, key, reason string) error {
	_, err := audit.Forget(ctx, db, operatorClient, operator, scope, key, nil, reason)
	return err
}
