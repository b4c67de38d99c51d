package pgadvice

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

func TestExplain(t *testing.T) {
	stmt := func(code, name string) error {
		return &pgconn.PgError{Severity: "ERROR", Code: code, Message: fmt.Sprintf("prepared statement %q already exists", name)}
	}
	for _, c := range []struct {
		err       error
		explained bool
	}{
		{stmt("42P05", "stmtcache_ab12"), true},
		{fmt.Errorf("migrate: %w", stmt("26000", "stmtcache_ab12")), true},
		{fmt.Errorf("%w: set the pool's mode: %w", idem.ErrPreparedStatements, stmt("42P05", "stmtcache_ab12")), true},
		{stmt("42P05", "mine"), false}, // a statement of the caller's own, not pgx's cache
		{stmt("42P01", "stmtcache_ab12"), false},
		{errors.New("stmtcache_ab12"), false},
	} {
		got := Explain(c.err, "DATABASE_URL")
		lost, ok := errors.AsType[*PreparedStatementsError](got)
		switch {
		case ok != c.explained:
			t.Errorf("%v: explained %t, want %t", c.err, ok, c.explained)
		case !ok && got != c.err:
			t.Errorf("%v: changed to %v", c.err, got)
		case ok && (!errors.Is(got, idem.ErrPreparedStatements) || !errors.Is(got, c.err) || lost.Setting != "DATABASE_URL" ||
			!strings.Contains(got.Error(), "add default_query_exec_mode=exec (or cache_describe, or simple_protocol) to the connection string in DATABASE_URL") ||
			strings.Contains(got.Error(), "idem: ") || strings.Contains(got.Error(), "set the pool's mode") ||
			!strings.HasSuffix(got.Error(), ": "+serverError(c.err))):
			t.Errorf("%v: %v", c.err, got)
		case ok && Explain(got, "elsewhere") != got:
			t.Errorf("%v: explained twice", c.err)
		}
	}
	if Explain(nil, "DATABASE_URL") != nil {
		t.Error("Explain(nil) is not nil")
	}
}

// serverError is the text of the server's error in err's chain.
func serverError(err error) string {
	pgErr, _ := errors.AsType[*pgconn.PgError](err)
	return pgErr.Error()
}

func TestOneLine(t *testing.T) {
	for in, want := range map[string]string{
		"plain": "plain",
		"failed to connect:\n\ta: refused\n\tb: refused": "failed to connect: a: refused; b: refused",
		"failed to connect:\n\ta: refused\n\ta: refused": "failed to connect: a: refused",
		"one\r\ntwo\n\nthree\x00four\n":                  "one; two; three four",
	} {
		if got := OneLine(in); got != want {
			t.Errorf("OneLine(%q) = %q, want %q", in, got, want)
		}
	}
}
