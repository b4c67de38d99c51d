package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// A database reverted below migration 00008 (no idem_refuse): DoInTx and
// Do fail with ErrUnsupported naming the function at the claim, before fn
// runs, and store nothing; the caller's transaction of Do goes on and commits its own.
// With pgx's stdlib and lib/pq.
func TestMigrateDownFrom8(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		url := pgtest.URL(t, nil)
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		if err := idem.Migrate(ctx, pool); err != nil {
			t.Fatal(err)
		}
		// Down to 7, with the columns of 00009 and 00010 put back, so that
		// idem_refuse is the only part missing.
		for _, v := range []int64{12, 11, 10, 9, 8} {
			if got, err := idem.MigrateDown(ctx, pool, idem.MigrateDownOptions{}); err != nil || got != v {
				t.Fatalf("MigrateDown: %d, %v; want %d", got, err, v)
			}
		}
		if _, err := pool.Exec(ctx, `ALTER TABLE idem_keys ADD COLUMN body_expires_at timestamptz, ADD COLUMN unknown_at timestamptz`); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `CREATE TABLE charges (id text)`); err != nil {
			t.Fatal(err)
		}
		db := open(t, driver, url)
		var ran atomic.Int64
		charge := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			ran.Add(1)
			_, err := tx.ExecContext(ctx, `INSERT INTO charges VALUES ('c1')`)
			return created, err
		}
		_, err = idemsql.DoInTx(ctx, db, scope, "k", fpOf("a"), charge)
		if !errors.Is(err, idem.ErrUnsupported) || !strings.Contains(err.Error(), "idem_refuse") {
			t.Errorf("DoInTx at version 7: %v, want ErrUnsupported naming idem_refuse", err)
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, err = idemsql.Do(ctx, tx, scope, "k2", fpOf("a"), charge)
		if !errors.Is(err, idem.ErrUnsupported) {
			t.Errorf("Do at version 7: %v, want ErrUnsupported", err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO charges VALUES ('mine')`); err != nil {
			t.Errorf("caller's tx after Do: %v", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		var keys, charges int
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM idem_keys), (SELECT count(*) FROM charges)`).Scan(&keys, &charges); err != nil || keys != 0 || charges != 1 {
			t.Errorf("after the refusals: %d keys, %d charges (the caller's own only), %v", keys, charges, err)
		}
		if n := ran.Load(); n != 0 {
			t.Errorf("fn ran %d times on a database without idem_refuse", n)
		}
	})
}
