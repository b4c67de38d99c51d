// Package pgadvice turns the connection errors of this module's programs
// into messages that name their fix: one line each, and, for pgx's prepared
// statements lost behind a transaction pooler, idem's own diagnosis
// (idem.ErrPreparedStatements) with the fix in the connection string the
// program was given.
package pgadvice

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

// PreparedStatementsError is a connection string's exec mode that prepares
// named statements (pgx's default), used through a transaction pooler that
// does not carry prepared statements across server connections (PgBouncer
// before 1.21, or without max_prepared_statements): the server answered
// SQLSTATE 26000 or 42P05 for one of pgx's cached statements.
// errors.Is(err, idem.ErrPreparedStatements) reports true, and errors.As
// finds the server's *pgconn.PgError.
type PreparedStatementsError struct {
	// Setting names where the connection string came from, for the
	// message: "DATABASE_URL", "DATABASE_URL or --database-url".
	Setting string
	// Err is the error as it came, the server's *pgconn.PgError in its
	// chain.
	Err error
}

func (e *PreparedStatementsError) Error() string {
	detail := e.Err.Error()
	if pgErr, ok := errors.AsType[*pgconn.PgError](e.Err); ok {
		detail = pgErr.Error() // not the library's own advice again
	}
	return fmt.Sprintf("%s (a transaction pooler such as PgBouncer in transaction mode?): "+
		"add default_query_exec_mode=exec (or cache_describe, or simple_protocol) to the connection string in %s, "+
		"or run PgBouncer 1.21 or newer with max_prepared_statements > 0: %s",
		strings.TrimPrefix(idem.ErrPreparedStatements.Error(), "idem: "), e.Setting, OneLine(detail))
}

func (e *PreparedStatementsError) Unwrap() []error {
	return []error{idem.ErrPreparedStatements, e.Err}
}

// Explain returns err as a *PreparedStatementsError naming setting when it
// is pgx's cached prepared statement missing (26000) or already there
// (42P05) on the server connection, whether idem already said so
// (idem.ErrPreparedStatements) or not; otherwise err itself.
func Explain(err error, setting string) error {
	if err == nil {
		return nil
	}
	if _, ok := errors.AsType[*PreparedStatementsError](err); ok {
		return err
	}
	if errors.Is(err, idem.ErrPreparedStatements) || lostStatement(err) {
		return &PreparedStatementsError{Setting: setting, Err: err}
	}
	return err
}

// lostStatement reports whether err is the server's answer to a statement
// of pgx's statement cache (stmtcache_…) that is missing or already there.
func lostStatement(err error) bool {
	pgErr, ok := errors.AsType[*pgconn.PgError](err)
	return ok && (pgErr.Code == pgerrcode.InvalidSQLStatementName || pgErr.Code == pgerrcode.DuplicatePreparedStatement) &&
		strings.Contains(pgErr.Message, "stmtcache_")
}

// OneLine returns msg on one line: the lines of a message that spans
// several (pgx's connection error lists one line per address tried) are
// trimmed and joined, "; " between them (or a space after a line ending in
// a colon); blank lines and lines already given are dropped, and any other
// control character becomes a space.
func OneLine(msg string) string {
	if !strings.ContainsFunc(msg, isControl) {
		return msg
	}
	var sb strings.Builder
	seen := map[string]bool{}
	for line := range strings.Lines(msg) {
		line = strings.TrimSpace(strings.Map(func(r rune) rune {
			if isControl(r) {
				return ' '
			}
			return r
		}, line))
		if line == "" || seen[line] {
			continue
		}
		seen[line] = true
		switch {
		case sb.Len() == 0:
		case strings.HasSuffix(sb.String(), ":"):
			sb.WriteByte(' ')
		default:
			sb.WriteString("; ")
		}
		sb.WriteString(line)
	}
	return sb.String()
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }
