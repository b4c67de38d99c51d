package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/callertest"
)

// An fn that changes (or deletes) idem's own row of its key makes the call
// fail with idem.ErrKeyRowChanged, for Do and DoInTx with both drivers:
// nothing of fn's commits, no outcome is stored, Do leaves the caller's
// transaction usable, and the retry runs fn as a new request.
func TestFnChangingItsKeyRowStoresNothing(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := context.Background()
		db, pool := migrated(t, driver)
		if _, err := db.ExecContext(ctx, `CREATE TABLE effects (key text NOT NULL, note text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		fn := func(key, change string) func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			return func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ($1, 'fn')`, key); err != nil {
					return idem.Response{}, err
				}
				if _, err := tx.ExecContext(ctx, change, scope.Actor, scope.Operation, key); err != nil {
					return idem.Response{}, err
				}
				return created, nil
			}
		}
		calls := map[string]func(key, change string) error{
			"DoInTx": func(key, change string) error {
				_, err := idemsql.DoInTx(ctx, db, scope, key, fpOf("a"), fn(key, change))
				return err
			},
			"Do": func(key, change string) error {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer func() { _ = tx.Rollback() }()
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ($1, 'caller')`, key); err != nil {
					return err
				}
				_, doErr := idemsql.Do(ctx, tx, scope, key, fpOf("a"), fn(key, change))
				if err := tx.Commit(); err != nil {
					t.Errorf("%s: the caller's transaction is unusable after Do (%v): %v", key, doErr, err)
				}
				return doErr
			},
		}
		for callName, call := range calls {
			for column, change := range callertest.KeyRowChanges {
				key := "row-" + callName + "-" + column
				if err := call(key, change); !errors.Is(err, idem.ErrKeyRowChanged) {
					t.Errorf("%s, fn changes %s: err = %v, want ErrKeyRowChanged", callName, column, err)
				}
				checkUndone(t, db, pool, key, callName == "Do")
			}
		}
	})
}

// checkUndone checks that nothing of fn's committed for key (the caller's
// own row did, when callerRow), and that a retry runs normally.
func checkUndone(t *testing.T, db *sql.DB, pool *pgxpool.Pool, key string, callerRow bool) {
	t.Helper()
	ctx := context.Background()
	rows := func(query string) int {
		var n int
		if err := pool.QueryRow(ctx, query, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := rows(`SELECT count(*) FROM effects WHERE key = $1 AND note = 'fn'`); n != 0 {
		t.Errorf("%s: %d of fn's writes committed", key, n)
	}
	if n := rows(`SELECT count(*) FROM idem_keys WHERE idem_key = $1`); n != 0 {
		t.Errorf("%s: %d key rows committed", key, n)
	}
	if n := rows(`SELECT count(*) FROM effects WHERE key = $1 AND note = 'caller'`); callerRow && n != 1 {
		t.Errorf("%s: the caller's own write did not commit (%d rows)", key, n)
	}
	ran := 0
	for i, wantReplayed := range []bool{false, true} {
		res, err := idemsql.DoInTx(ctx, db, scope, key, fpOf("a"), func(context.Context, *sql.Tx) (idem.Response, error) {
			ran++
			return created, nil
		})
		if err != nil || res.Replayed != wantReplayed || ran != 1 {
			t.Errorf("%s: retry %d: %+v, %v, fn ran %d times", key, i, res, err, ran)
		}
	}
}
