package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// The claim bounds its wait for a twin by Config.Wait, not by the caller's
// lock_timeout, and the caller's lock_timeout is in force again inside fn
// and after the call, on every path of Do and DoInTx: claimed, held by a
// committed row, twin rolled back, twin committed, wait ran out, take-over
// of an expired row, take-over of a failed_retryable reservation.
func TestBoundedWaitOnEveryPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	const callers = "7s" // the caller's lock_timeout, longer than any wait here
	patient := mustClient(t, idem.Config{Wait: 20 * time.Second})
	hasty := mustClient(t, idem.Config{Wait: 300 * time.Millisecond})

	ok := func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201, Body: []byte("first")}, nil
	}
	// twin holds an uncommitted claim of key (completed in its transaction)
	// until end is called with commit or not.
	twin := func(t *testing.T, key string) (end func(commit bool)) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := idem.Do(ctx, tx, scope, key, fpA, ok); err != nil {
			t.Fatal(err)
		}
		return func(commit bool) {
			if commit {
				err = tx.Commit(ctx)
			} else {
				err = tx.Rollback(ctx)
			}
			if err != nil {
				t.Error(err)
			}
		}
	}
	// waiting returns once a session waits for a lock (the call, on its
	// twin's claim).
	waiting := func(t *testing.T) {
		for range 2000 {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
				t.Error(err)
				return
			}
			if n > 0 {
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Error("the call never waited")
	}
	paths := []struct {
		name    string
		client  *idem.Client
		prepare func(t *testing.T, key string) (whileWaiting func())
		ran     bool // fn ran
		wantErr error
	}{
		{name: "claimed", client: patient, ran: true},
		{name: "committed row", client: patient, prepare: func(t *testing.T, key string) func() {
			if _, err := idem.DoInTx(ctx, pool, scope, key, fpA, ok); err != nil {
				t.Fatal(err)
			}
			return nil
		}},
		{name: "twin rolled back", client: patient, ran: true, prepare: func(t *testing.T, key string) func() {
			end := twin(t, key)
			return func() { waiting(t); end(false) }
		}},
		{name: "twin committed", client: patient, prepare: func(t *testing.T, key string) func() {
			end := twin(t, key)
			return func() { waiting(t); end(true) }
		}},
		{name: "wait ran out", client: hasty, wantErr: idem.ErrInProgress, prepare: func(t *testing.T, key string) func() {
			end := twin(t, key)
			t.Cleanup(func() { end(false) })
			return nil
		}},
		{name: "take-over", client: patient, ran: true, prepare: func(t *testing.T, key string) func() {
			if _, err := idem.DoInTx(ctx, pool, scope, key, fpA, ok); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `UPDATE idem_keys SET expires_at = now() - interval '1 second'
				WHERE idem_key = $1`, key); err != nil {
				t.Fatal(err)
			}
			return nil
		}},
		{name: "failed_retryable", client: patient, ran: true, prepare: func(t *testing.T, key string) func() {
			r, err := idem.Reserve(ctx, pool, scope, key, fpA, time.Minute)
			if err == nil {
				err = idem.FailRetryable(ctx, pool, r, "declined")
			}
			if err != nil {
				t.Fatal(err)
			}
			return nil
		}},
	}
	calls := map[string]func(t *testing.T, c *idem.Client, key string, fn func(context.Context, pgx.Tx) (idem.Response, error)) (idem.Result, string, error){
		// Do in a transaction whose lock_timeout is the caller's (SET LOCAL).
		"Do": func(t *testing.T, c *idem.Client, key string, fn func(context.Context, pgx.Tx) (idem.Response, error)) (idem.Result, string, error) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '`+callers+`'`); err != nil {
				t.Fatal(err)
			}
			res, err := c.Do(ctx, tx, scope, key, fpA, fn)
			return res, showLockTimeout(t, tx), errors.Join(err, tx.Commit(ctx))
		},
		// DoInTx on a connection whose lock_timeout is the caller's (SET).
		"DoInTx": func(t *testing.T, c *idem.Client, key string, fn func(context.Context, pgx.Tx) (idem.Response, error)) (idem.Result, string, error) {
			conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			if _, err := conn.Exec(ctx, `SET lock_timeout = '`+callers+`'`); err != nil {
				t.Fatal(err)
			}
			res, err := c.DoInTx(ctx, conn, scope, key, fpA, fn)
			return res, showLockTimeout(t, conn), err
		},
	}
	for callName, call := range calls {
		for _, path := range paths {
			t.Run(callName+"/"+path.name, func(t *testing.T) {
				key := strings.ReplaceAll(fmt.Sprintf("wait-%s-%s", callName, path.name), " ", "-")
				var whileWaiting func()
				if path.prepare != nil {
					whileWaiting = path.prepare(t, key)
				}
				done := make(chan struct{})
				if whileWaiting != nil {
					go func() { defer close(done); whileWaiting() }()
				} else {
					close(done)
				}
				var inFn string
				start := time.Now()
				res, after, err := call(t, path.client, key, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
					inFn = showLockTimeout(t, tx)
					return idem.Response{Status: 201, Body: []byte("second")}, nil
				})
				elapsed := time.Since(start)
				<-done
				if !errors.Is(err, path.wantErr) {
					t.Fatalf("err = %v, want %v", err, path.wantErr)
				}
				if ran := inFn != ""; ran != path.ran || (err == nil && res.Replayed == path.ran) {
					t.Fatalf("fn ran: %v, replayed: %v; want fn to run: %v", ran, res.Replayed, path.ran)
				}
				if path.ran && inFn != callers {
					t.Errorf("lock_timeout in fn = %q, want the caller's %s", inFn, callers)
				}
				if after != callers {
					t.Errorf("lock_timeout after the call = %q, want the caller's %s", after, callers)
				}
				if errors.Is(err, idem.ErrInProgress) && elapsed > 5*time.Second {
					t.Errorf("gave up after %s: the caller's lock_timeout bounded the wait, not Config.Wait", elapsed)
				}
			})
		}
	}
}

func showLockTimeout(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) string {
	t.Helper()
	var lt string
	if err := q.QueryRow(context.Background(), `SHOW lock_timeout`).Scan(&lt); err != nil {
		t.Fatal(err)
	}
	return lt
}
