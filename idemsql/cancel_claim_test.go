package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// A call whose context ends while its claim waits for a twin holding the
// key, on both drivers: the error says the context ended (errors.Is with
// the context's error; lib/pq reports the cancel in its own words); for Do
// on a caller's transaction begun with that context, which database/sql
// rolls back, the error says so, rather than that a savepoint was not
// undone.
func TestClaimWaitEndedByTheContext(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, pool := migrated(t, driver)
		c, err := idemsql.New(idem.Config{Wait: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		// The twin: an uncommitted claim of the key.
		twin, err := pool.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer twin.Rollback(context.Background())
		if _, err := twin.Exec(t.Context(), `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, created_at, completed_at, expires_at)
			VALUES ($1, $2, 'held', $3, 'processing', now(), now(), now() + interval '1 hour')`, scope.Actor, scope.Operation, fpOf("a")); err != nil {
			t.Fatal(err)
		}
		fn := func(context.Context, *sql.Tx) (idem.Response, error) { return idem.Response{Status: 200}, nil }

		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		_, err = c.DoInTx(ctx, db, scope, "held", fpOf("a"), fn)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("DoInTx: %v; want it to match context.DeadlineExceeded", err)
		}

		ctx, cancel = context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		_, err = c.Do(ctx, tx, scope, "held", fpOf("a"), fn)
		if !errors.Is(err, context.DeadlineExceeded) || strings.Contains(err.Error(), "savepoint was not undone") {
			t.Errorf("Do on a transaction begun with the context: %v; want the context's error, no savepoint left", err)
		}
		if n := keyCount(t, pool); n != 0 {
			t.Errorf("%d key rows", n)
		}
	})
}
