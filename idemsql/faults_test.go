package idemsql_test

// Faults with both drivers: a backend terminated under a call
// (pg_terminate_backend), a connection cut right after the server
// acknowledged COMMIT (internal/testkit/relay), and that cut under concurrent load
// with duplicates and deadlocks. Each time the error is ErrUnavailable and a
// retry with the same key replays what committed, or runs what did not.

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/callertest"
	"github.com/pgidem/idem/internal/testkit/ledgertest"
)

var ledgerScope = idem.Scope{Actor: "tenant-1", Operation: "transfer"}

// write is ledgertest.Write on a *sql.Tx: debit, credit (in the transfer's
// own order, so concurrent transfers deadlock now and then) and the ledger
// entry.
func write(ctx context.Context, tx *sql.Tx, tr ledgertest.Transfer) (entry int64, err error) {
	if _, err := tx.ExecContext(ctx, `UPDATE accounts SET balance = balance - $2 WHERE id = $1`, tr.From, tr.Amount); err != nil {
		return 0, err
	}
	if _, err := tx.ExecContext(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1`, tr.To, tr.Amount); err != nil {
		return 0, err
	}
	err = tx.QueryRowContext(ctx, `INSERT INTO ledger (idem_key, from_account, to_account, amount)
		VALUES ($1, $2, $3, $4) RETURNING id`, tr.Key, tr.From, tr.To, tr.Amount).Scan(&entry)
	return entry, err
}

// transferFn is fn for tr; runs counts its executions.
func transferFn(tr ledgertest.Transfer, runs *atomic.Int64) func(context.Context, *sql.Tx) (idem.Response, error) {
	return func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		runs.Add(1)
		entry, err := write(ctx, tx, tr)
		if err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: 201, Body: ledgertest.Body(tr, entry)}, nil
	}
}

// A backend terminated while fn runs: ErrUnavailable, nothing committed,
// and the retry runs fn again on a fresh connection.
func TestFaultTerminatedBackend(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		url, _, _ := ledgertest.BehindRelay(t, nil)
		db := open(t, driver, url)
		admin, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer admin.Close()
		tr := ledgertest.Transfers(1, "kill")[0]
		fp, _ := idem.FingerprintJSON(tr)
		var runs atomic.Int64
		kill := func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			runs.Add(1)
			var pid int
			if err := tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				return idem.Response{}, err
			}
			if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
				return idem.Response{}, err
			}
			_, err := write(ctx, tx, tr)
			return idem.Response{}, err
		}
		for _, call := range []struct {
			name string
			do   func(fn func(context.Context, *sql.Tx) (idem.Response, error)) error
		}{
			{"DoInTx", func(fn func(context.Context, *sql.Tx) (idem.Response, error)) error {
				_, err := idemsql.DoInTx(ctx, db, ledgerScope, tr.Key, fp, fn)
				return err
			}},
			{"InTx+Do", func(fn func(context.Context, *sql.Tx) (idem.Response, error)) error {
				return idemsql.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
					_, err := idemsql.Do(ctx, tx, ledgerScope, tr.Key, fp, fn)
					return err
				})
			}},
		} {
			err := call.do(kill)
			if !errors.Is(err, idem.ErrUnavailable) || !idem.Unavailable(err) {
				t.Fatalf("%s: backend terminated under fn: %v, want ErrUnavailable", call.name, err)
			}
		}
		var entries int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&entries); err != nil || entries != 0 {
			t.Fatalf("%d ledger entries after terminated backends (%v)", entries, err)
		}
		res, err := idemsql.DoInTx(ctx, db, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
		if err != nil || res.Replayed {
			t.Fatalf("retry after the terminated backend: %+v, %v", res, err)
		}
		res, err = idemsql.DoInTx(ctx, db, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
		if err != nil || !res.Replayed {
			t.Fatalf("replay: %+v, %v", res, err)
		}
		if runs.Load() != 3 {
			t.Fatalf("fn ran %d times, want 3 (two killed, one committed)", runs.Load())
		}
	})
}

// A relay cuts the connection right after the server acknowledged COMMIT:
// the commit happened and the client cannot know. DoInTx returns
// ErrUnavailable; the retry replays, and the effect happened once.
func TestFaultCommitAcknowledgementLost(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		var armed atomic.Bool
		url, relayed, r := ledgertest.BehindRelay(t, func() bool { return armed.CompareAndSwap(true, false) })
		db := open(t, driver, relayed)
		direct, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer direct.Close()
		var runs atomic.Int64
		trs := ledgertest.Transfers(3, "ack")
		for i, tr := range trs {
			fp, _ := idem.FingerprintJSON(tr)
			armed.Store(true)
			_, err := idemsql.DoInTx(ctx, db, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
			if !errors.Is(err, idem.ErrUnavailable) || !idem.Unavailable(err) {
				t.Fatalf("key %s: commit acknowledgement lost: err = %v, want ErrUnavailable", tr.Key, err)
			}
			entry := callertest.CutCommit(t, r.CommitsCut(), int64(i+1), direct, tr.Key) // the commit happened
			res, err := idemsql.DoInTx(ctx, db, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
			if err != nil || !res.Replayed || !bytes.Equal(res.Body, ledgertest.Body(tr, entry)) {
				t.Fatalf("key %s: retry %+v, %v; committed %s", tr.Key, res, err, ledgertest.Body(tr, entry))
			}
		}
		if runs.Load() != int64(len(trs)) {
			t.Fatalf("fn ran %d times for %d keys", runs.Load(), len(trs))
		}
	})
}

// The same cut under load: every third COMMIT acknowledgement is lost while
// two database handles (two instances) send every key several times,
// concurrently and later, and transfers deadlock now and then. Callers
// retry ErrUnavailable and ErrInProgress with the same key. At the end
// every key took effect exactly once and every answer is the committed one.
func TestFaultCommitAcknowledgementLostUnderLoad(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
		defer cancel()
		var commits atomic.Int64
		url, relayed, r := ledgertest.BehindRelay(t, func() bool { return commits.Add(1)%3 == 0 })
		dbs := []*sql.DB{open(t, driver, relayed), open(t, driver, relayed)}
		for _, db := range dbs {
			db.SetMaxOpenConns(3)
		}
		direct, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer direct.Close()
		trs := ledgertest.Transfers(40, "cut")
		jobs := ledgertest.Schedule(trs, 4)
		var mu sync.Mutex
		answers := map[string][]ledgertest.Answer{}
		var runs, unavailable atomic.Int64
		var wg sync.WaitGroup
		sem := make(chan struct{}, 6)
		for i, tr := range jobs {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				db := dbs[i%len(dbs)]
				fp, _ := idem.FingerprintJSON(tr)
				for attempt := 0; ; attempt++ {
					res, err := idemsql.DoInTx(ctx, db, ledgerScope, tr.Key, fp, transferFn(tr, &runs))
					switch {
					case err == nil:
						mu.Lock()
						answers[tr.Key] = append(answers[tr.Key], ledgertest.Answer{Body: res.Body, Replayed: res.Replayed})
						mu.Unlock()
						return
					case attempt < 50 && errors.Is(err, idem.ErrUnavailable):
						unavailable.Add(1)
					case attempt < 50 && errors.Is(err, idem.ErrInProgress):
					default:
						t.Errorf("key %s: %v", tr.Key, err)
						return
					}
					time.Sleep(10 * time.Millisecond)
				}
			})
		}
		wg.Wait()
		t.Logf("%d calls, fn ran %d times, %d commits cut, %d ErrUnavailable", len(jobs), runs.Load(), r.CommitsCut(), unavailable.Load())
		if t.Failed() {
			return
		}
		if r.CommitsCut() == 0 || unavailable.Load() == 0 {
			t.Fatalf("%d commits cut, %d ErrUnavailable: the fault never fired", r.CommitsCut(), unavailable.Load())
		}
		ledgertest.Check(t, ctx, direct, trs, answers, func(tr ledgertest.Transfer, committed []byte) {
			fp, _ := idem.FingerprintJSON(tr)
			res, err := idemsql.DoInTx(ctx, dbs[0], ledgerScope, tr.Key, fp, transferFn(tr, &runs))
			if err != nil && errors.Is(err, idem.ErrUnavailable) { // this call's own commit cut
				res, err = idemsql.DoInTx(ctx, dbs[0], ledgerScope, tr.Key, fp, transferFn(tr, &runs))
			}
			if err != nil || !res.Replayed || !bytes.Equal(res.Body, committed) {
				t.Errorf("key %s: final retry %+v, %v", tr.Key, res, err)
			}
		})
	})
}
