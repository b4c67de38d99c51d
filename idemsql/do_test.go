package idemsql_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

var scope = idem.Scope{Actor: "tenant-1", Operation: "payment.create"}

func fpOf(s string) idem.Fingerprint {
	fp, err := idem.FingerprintJSON(map[string]string{"req": s})
	if err != nil {
		panic(err)
	}
	return fp
}

// created is the Response fn returns in these tests.
var created = idem.Response{Status: 201, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: []byte(`{"id":1}`)}

func TestMigrate(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		url := pgtest.URL(t, nil)
		db := open(t, driver, url)
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		var wg sync.WaitGroup
		errs := make([]error, 4)
		for i := range errs { // concurrent runs of both forms serialize on one lock
			wg.Go(func() {
				if i == 0 {
					errs[i] = idem.Migrate(ctx, pool)
					return
				}
				errs[i] = idemsql.Migrate(ctx, db)
			})
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		res, err := idemsql.DoInTx(ctx, db, scope, "k1", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			return created, nil
		})
		if err != nil || res.Replayed {
			t.Fatalf("DoInTx after Migrate: %+v, %v", res, err)
		}
		var table string
		if err := db.QueryRowContext(ctx, `SELECT to_regclass($1)::text`, idem.MigrationTable).Scan(&table); err != nil || table != idem.MigrationTable {
			t.Fatalf("version table %q, %v", table, err)
		}
		if err := idemsql.Migrate(ctx, nil); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Fatalf("Migrate(nil) = %v", err)
		}
	})
}

func TestDo(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id text PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
		runs := 0
		fn := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			runs++
			_, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ($1)`, fmt.Sprint("o", runs))
			return created, err
		}
		do := func(key string, fp idem.Fingerprint, fn func(context.Context, *sql.Tx) (idem.Response, error)) (idem.Result, error) {
			var res idem.Result
			err := idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) (err error) {
				res, err = idemsql.Do(ctx, tx, scope, key, fp, fn)
				return err
			})
			return res, err
		}
		res, err := do("k1", fpOf("a"), fn)
		if err != nil || res.Replayed || !reflect.DeepEqual(res.Response, created) {
			t.Fatalf("first call: %+v, %v", res, err)
		}
		res, err = do("k1", fpOf("a"), fn)
		if err != nil || !res.Replayed || !reflect.DeepEqual(res.Response, created) || runs != 1 {
			t.Fatalf("replay: %+v, %v, fn ran %d times", res, err, runs)
		}
		if _, err := do("k1", fpOf("b"), fn); !errors.Is(err, idem.ErrKeyReused) || runs != 1 {
			t.Fatalf("other fingerprint: %v, fn ran %d times", err, runs)
		}

		// fn fails: its writes and the claim are undone; the caller's
		// transaction goes on and commits its own writes.
		boom := errors.New("boom")
		err = idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ('before')`); err != nil {
				return err
			}
			_, err := idemsql.Do(ctx, tx, scope, "k2", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ('undone')`); err != nil {
					return idem.Response{}, err
				}
				return idem.Response{}, boom
			})
			if !errors.Is(err, boom) {
				return fmt.Errorf("Do = %v, want boom", err)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		var orders string
		if err := pool.QueryRow(ctx, `SELECT string_agg(id, ',' ORDER BY id) FROM orders`).Scan(&orders); err != nil || orders != "before,o1" {
			t.Fatalf("orders %q, %v", orders, err)
		}
		if n := keyCount(t, pool); n != 1 {
			t.Fatalf("%d keys after a failed fn, want 1", n)
		}

		// A failing statement in fn leaves the savepoint aborted: undone.
		_, err = do("k2", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			_, err := tx.ExecContext(ctx, `SELECT 1/0`)
			return idem.Response{}, err
		})
		if err == nil || !strings.Contains(err.Error(), "division by zero") {
			t.Fatalf("fn's SQL error: %v", err)
		}

		// fn panics: undone, the panic goes on.
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("no panic")
				}
			}()
			_, _ = do("k2", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) { panic("fn") })
		}()

		// Reject: stored and replayed; fn's writes undone.
		refusal := idem.Response{Status: 402, Body: []byte("no funds")}
		reject := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			runs++
			if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ('rejected')`); err != nil {
				return idem.Response{}, err
			}
			return idem.Response{}, idem.Reject(refusal)
		}
		before := runs
		for i := range 2 {
			res, err := do("k3", fpOf("a"), reject)
			if err != nil || res.Status != 402 || string(res.Body) != "no funds" || res.Replayed != (i == 1) {
				t.Fatalf("reject %d: %+v, %v", i, res, err)
			}
		}
		if runs != before+1 {
			t.Fatalf("fn ran %d times for a refusal and its replay", runs-before)
		}
		var rejected int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE id = 'rejected'`).Scan(&rejected)
		if rejected != 0 {
			t.Fatal("a refusal kept fn's writes")
		}

		// A response that cannot be stored: undone, the error is typed.
		_, err = do("k4", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			return idem.Response{Status: 42}, nil
		})
		if !errors.Is(err, idem.ErrInvalidResponse) {
			t.Fatalf("invalid response: %v", err)
		}
		// No header map: stored as NULL and replayed as nil.
		for i := range 2 {
			res, err := do("k5", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				return idem.Response{Status: 200, Body: []byte("plain")}, nil
			})
			if err != nil || res.Header != nil || string(res.Body) != "plain" || res.Replayed != (i == 1) {
				t.Fatalf("no header %d: %+v, %v", i, res, err)
			}
		}
	})
}

// Invalid input is refused with a typed error before any statement runs,
// and nothing changes. A transaction that is closed (committed or rolled
// back) or aborted is idem.ErrInvalidArgument, as in package idem.
func TestInvalidInput(t *testing.T) {
	t.Parallel()
	eachDriver(t, testInvalidInput)
}

func testInvalidInput(t *testing.T, driver string) {
	ctx := t.Context()
	db, pool := migrated(t, driver)
	fn := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) { return created, nil }
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	closed, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := closed.Commit(); err != nil {
		t.Fatal(err)
	}
	aborted, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer aborted.Rollback()
	if _, err := aborted.ExecContext(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("1/0 did not fail")
	}
	held := idem.Reservation{Scope: scope, Key: "k", Token: 1}
	for _, c := range []struct {
		name string
		err  error
		want error
	}{
		{"nil tx", second(idemsql.Do(ctx, nil, scope, "k", fpOf("a"), fn)), idem.ErrInvalidArgument},
		{"nil fn", second(idemsql.Do(ctx, tx, scope, "k", fpOf("a"), nil)), idem.ErrInvalidArgument},
		{"bad key", second(idemsql.Do(ctx, tx, scope, "a key", fpOf("a"), fn)), idem.ErrInvalidKey},
		{"empty key", second(idemsql.DoInTx(ctx, db, scope, "", fpOf("a"), fn)), idem.ErrInvalidKey},
		{"bad scope", second(idemsql.DoInTx(ctx, db, idem.Scope{Actor: "a"}, "k", fpOf("a"), fn)), idem.ErrInvalidScope},
		{"nil db", second(idemsql.DoInTx(ctx, nil, scope, "k", fpOf("a"), fn)), idem.ErrInvalidArgument},
		{"InTx nil db", idemsql.InTx(ctx, nil, func(context.Context, *sql.Tx) error { return nil }), idem.ErrInvalidArgument},
		{"InTx nil fn", idemsql.InTx(ctx, db, nil), idem.ErrInvalidArgument},
		{"Reserve lease", second(idemsql.Reserve(ctx, db, scope, "k", fpOf("a"), 0)), idem.ErrInvalidArgument},
		{"Reserve nil db", second(idemsql.Reserve(ctx, nil, scope, "k", fpOf("a"), time.Second)), idem.ErrInvalidArgument},
		{"Complete zero", idemsql.Complete(ctx, tx, idem.Reservation{}, created), idem.ErrInvalidArgument},
		{"Resolve both", idemsql.Resolve(ctx, db, scope, "k", idem.Resolution{Token: 1, Succeeded: &created, Retryable: true}), idem.ErrInvalidArgument},
		{"Resolve no token", idemsql.Resolve(ctx, db, scope, "k", idem.Resolution{Retryable: true}), idem.ErrInvalidArgument},
		{"ListUnknown limit", second(idemsql.ListUnknown(ctx, db, 0, nil)), idem.ErrInvalidArgument},
		{"ListUnknown cursor NUL", second(idemsql.ListUnknown(ctx, db, 1, &idem.Record{Scope: scope, Key: "a\x00", CreatedAt: time.Now()})), idem.ErrInvalidArgument},
		{"ListUnknown cursor time", second(idemsql.ListUnknown(ctx, db, 1, &idem.Record{Scope: scope, Key: "a", CreatedAt: time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)})), idem.ErrInvalidArgument},
		{"Prune batch", second(idemsql.Prune(ctx, db, idem.PruneOptions{BatchSize: -1})), idem.ErrInvalidArgument},
		{"DoJSON nil fn", third(idemsql.DoJSON[int](ctx, tx, scope, "k", fpOf("a"), nil)), idem.ErrInvalidArgument},
		{"Do closed tx", second(idemsql.Do(ctx, closed, scope, "k", fpOf("a"), fn)), idem.ErrInvalidArgument},
		{"Do aborted tx", second(idemsql.Do(ctx, aborted, scope, "k", fpOf("a"), fn)), idem.ErrInvalidArgument},
		{"DoJSON closed tx", third(idemsql.DoJSON(ctx, closed, scope, "k", fpOf("a"),
			func(context.Context, *sql.Tx) (int, error) { return 1, nil })), idem.ErrInvalidArgument},
		{"Complete closed tx", idemsql.Complete(ctx, closed, held, created), idem.ErrInvalidArgument},
		{"Complete aborted tx", idemsql.Complete(ctx, aborted, held, created), idem.ErrInvalidArgument},
	} {
		if !errors.Is(c.err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, c.err, c.want)
		}
	}
	if _, err := idemsql.New(idem.Config{MaxKeyLength: 5000}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("New: %v", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("the transaction is unusable after refused calls: %v", err)
	}
	if n := keyCount(t, pool); n != 0 {
		t.Fatalf("%d keys after refused calls", n)
	}
}

func second[T any](_ T, err error) error { return err }

func third[T any](_ T, _ bool, err error) error { return err }

// Concurrent duplicates on many connections: fn runs once per key, every
// caller gets the one committed response.
func TestConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		db.SetMaxOpenConns(12)
		if _, err := db.ExecContext(ctx, `CREATE TABLE effects (idem_key text, run int)`); err != nil {
			t.Fatal(err)
		}
		const keys, copies = 20, 6
		var runs atomic.Int64
		var mu sync.Mutex
		answers := map[string][][]byte{}
		fresh := map[string]int{}
		var wg sync.WaitGroup
		for i := range keys * copies {
			key := fmt.Sprintf("key-%02d", i%keys)
			wg.Go(func() {
				res, err := idemsql.DoInTx(ctx, db, scope, key, fpOf(key), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
					n := runs.Add(1)
					if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES ($1, $2)`, key, n); err != nil {
						return idem.Response{}, err
					}
					time.Sleep(5 * time.Millisecond) // twins arrive while the claim is open
					return idem.Response{Status: 201, Body: fmt.Appendf(nil, "%s run %d", key, n)}, nil
				})
				if errors.Is(err, idem.ErrInProgress) {
					return // a twin held the key longer than Config.Wait: allowed
				}
				if err != nil {
					t.Errorf("%s: %v", key, err)
					return
				}
				mu.Lock()
				answers[key] = append(answers[key], res.Body)
				if !res.Replayed {
					fresh[key]++
				}
				mu.Unlock()
			})
		}
		wg.Wait()
		rows, err := pool.Query(ctx, `SELECT idem_key, count(*), min(run) FROM effects GROUP BY idem_key`)
		if err != nil {
			t.Fatal(err)
		}
		effects := 0
		for rows.Next() {
			var key string
			var n, run int
			if err := rows.Scan(&key, &n, &run); err != nil {
				t.Fatal(err)
			}
			effects++
			if n != 1 {
				t.Errorf("%s: %d effects", key, n)
			}
			for _, a := range answers[key] {
				if want := fmt.Sprintf("%s run %d", key, run); string(a) != want {
					t.Errorf("%s: answered %q, committed %q", key, a, want)
				}
			}
			if fresh[key] > 1 {
				t.Errorf("%s: %d fresh answers", key, fresh[key])
			}
		}
		if effects != keys {
			t.Errorf("%d keys took effect, want %d", effects, keys)
		}
	})
}

// Serialization failures and deadlocks raised by the server are retried by
// InTx and DoInTx, with either driver's error type.
func TestRetries(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, _ := migrated(t, driver)
		for _, code := range []string{"40001", "40P01"} {
			attempts := 0
			err := idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
				attempts++
				if attempts < 3 {
					_, err := tx.ExecContext(ctx, fmt.Sprintf(`DO $$BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '%s'; END$$`, code))
					return err
				}
				return nil
			})
			if err != nil || attempts != 3 {
				t.Fatalf("%s: InTx = %v after %d attempts", code, err, attempts)
			}
			attempts = 0
			res, err := idemsql.DoInTx(ctx, db, scope, "retry-"+code, fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				attempts++
				if attempts < 2 {
					_, err := tx.ExecContext(ctx, fmt.Sprintf(`DO $$BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '%s'; END$$`, code))
					return idem.Response{}, err
				}
				return created, nil
			})
			if err != nil || res.Replayed || attempts != 2 {
				t.Fatalf("%s: DoInTx = %+v, %v after %d attempts", code, res, err, attempts)
			}
		}
		c, err := idemsql.New(idem.Config{MaxRetries: -1})
		if err != nil {
			t.Fatal(err)
		}
		err = c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, `DO $$BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END$$`)
			return err
		})
		if err == nil || idem.Unavailable(err) {
			t.Fatalf("without retries: %v", err)
		}
	})
}

// A twin that holds the key longer than Config.Wait: ErrInProgress.
func TestWait(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, _ := migrated(t, driver)
		c, err := idemsql.New(idem.Config{Wait: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		holding, release := make(chan struct{}), make(chan struct{})
		done := make(chan error)
		go func() {
			_, err := c.DoInTx(ctx, db, scope, "held", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
				close(holding)
				<-release
				return created, nil
			})
			done <- err
		}()
		<-holding
		_, err = c.DoInTx(ctx, db, scope, "held", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			t.Error("fn ran for a held key")
			return created, nil
		})
		var ipe *idem.InProgressError
		if !errors.As(err, &ipe) || !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("held key: %v", err)
		}
		close(release)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		res, err := c.DoInTx(ctx, db, scope, "held", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			return idem.Response{}, errors.New("ran again")
		})
		if err != nil || !res.Replayed || !bytes.Equal(res.Body, created.Body) {
			t.Fatalf("after the holder committed: %+v, %v", res, err)
		}
	})
}

// Keys stored by package idem (pgx) are replayed by idemsql and the other
// way round: one table, one state machine.
func TestSharedWithIdem(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		if _, err := idem.DoInTx(ctx, pool, scope, "from-pgx", fpOf("a"), func(context.Context, pgxTx) (idem.Response, error) {
			return created, nil
		}); err != nil {
			t.Fatal(err)
		}
		res, err := idemsql.DoInTx(ctx, db, scope, "from-pgx", fpOf("a"), func(context.Context, *sql.Tx) (idem.Response, error) {
			return idem.Response{}, errors.New("ran again")
		})
		if err != nil || !res.Replayed || !reflect.DeepEqual(res.Response, created) {
			t.Fatalf("idemsql replaying idem's key: %+v, %v", res, err)
		}
		if _, err := idemsql.DoInTx(ctx, db, scope, "from-sql", fpOf("a"), func(context.Context, *sql.Tx) (idem.Response, error) {
			return created, nil
		}); err != nil {
			t.Fatal(err)
		}
		res, err = idem.DoInTx(ctx, pool, scope, "from-sql", fpOf("a"), func(context.Context, pgxTx) (idem.Response, error) {
			return idem.Response{}, errors.New("ran again")
		})
		if err != nil || !res.Replayed || !reflect.DeepEqual(res.Response, created) {
			t.Fatalf("idem replaying idemsql's key: %+v, %v", res, err)
		}
		if _, err := idemsql.DoInTx(ctx, db, scope, "from-sql", fpOf("b"), func(context.Context, *sql.Tx) (idem.Response, error) {
			return created, nil
		}); !errors.Is(err, idem.ErrKeyReused) {
			t.Fatalf("reused key: %v", err)
		}
	})
}

func TestDoJSON(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, _ := migrated(t, driver)
		type order struct {
			ID    string `json:"id"`
			Total int    `json:"total"`
		}
		for i := range 2 {
			o, replayed, err := idemsql.DoInTxJSON(ctx, db, scope, "json-1", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (order, error) {
				return order{ID: "o1", Total: 42}, nil
			})
			if err != nil || o != (order{ID: "o1", Total: 42}) || replayed != (i == 1) {
				t.Fatalf("DoInTxJSON %d: %+v %v %v", i, o, replayed, err)
			}
		}
		for i := range 2 {
			var o order
			var replayed bool
			err := idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) (err error) {
				o, replayed, err = idemsql.DoJSON(ctx, tx, scope, "json-2", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (order, error) {
					return order{}, idem.RejectJSON(409, map[string]string{"error": "sold out"})
				})
				var rej *idem.RejectedError
				if errors.As(err, &rej) && rej.Status == 409 {
					return nil // a refusal commits
				}
				return err
			})
			if err != nil || replayed != (i == 1) || o != (order{}) {
				t.Fatalf("DoJSON refusal %d: %+v %v %v", i, o, replayed, err)
			}
		}
	})
}

// A handle limited to one open connection migrates, with concurrent runs
// too (goose's lock keeps a connection while the migrations run on another:
// Migrate lets the handle open a second one for the run, the runs of one
// process on one handle take turns, and the limit of one comes back).
func TestMigrateOnOneConnection(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		db := open(t, driver, pgtest.URL(t, nil))
		db.SetMaxOpenConns(1)
		var wg sync.WaitGroup
		errs := make([]error, 3)
		for i := range errs {
			wg.Go(func() { errs[i] = idemsql.Migrate(ctx, db) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		if n := db.Stats().MaxOpenConnections; n != 1 {
			t.Fatalf("MaxOpenConnections %d after Migrate, want 1", n)
		}
		if _, err := idemsql.DoInTx(ctx, db, scope, "k1", fpOf("a"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			return created, nil
		}); err != nil {
			t.Fatal(err)
		}
	})
}
