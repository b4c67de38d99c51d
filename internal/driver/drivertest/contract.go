package drivertest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// The rest of the contract: what each method answers and each error it
// can return, in the driver package's terms (Driver.Interpret); fn that
// ends its transaction (TxClosed, Orphaned, Enclosing); every statement of
// the Executor.

// exerciseErrors: Interpret, and the errors of the spans' statements that
// the core tells apart.
func exerciseErrors[TTx, TDB any](t *testing.T, h Harness[TTx, TDB]) {
	t.Run("InterpretLeavesOtherErrors", func(t *testing.T) {
		d := h.New(settings)
		other := errors.New("other")
		if d.Interpret(nil) != nil || d.Interpret(other) != other {
			t.Error("Interpret changed nil or an error of no database")
		}
		if got := d.Interpret(driver.ErrNoRows); got != driver.ErrNoRows {
			t.Errorf("Interpret(ErrNoRows) = %v", got)
		}
	})
	t.Run("InterpretServerErrors", func(t *testing.T) {
		exerciseServerErrors(t, h)
	})
	t.Run("ClaimWaitIsErrLockNotAvailable", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		holder := ownSpan(t, d, db)
		if _, claimed, _, err := holder.Claim(ctx, driver.Claim{Key: key("w"), Fingerprint: fpA}); err != nil || !claimed {
			t.Fatal(claimed, err)
		}
		defer func() { _ = holder.Undo(ctx) }()
		s := ownSpan(t, d, db)
		_, _, begun, err := s.Claim(ctx, driver.Claim{Key: key("w"), Fingerprint: fpA})
		ierr := d.Interpret(err)
		if !begun || !errors.Is(ierr, driver.ErrLockNotAvailable) || errors.Is(ierr, driver.ErrUnavailable) ||
			!errors.Is(ierr, err) || d.Interpret(ierr) != ierr {
			t.Fatalf("Claim of a key in flight: begun %v, %v; want ErrLockNotAvailable keeping the error", begun, ierr)
		}
		if s.Lost() {
			t.Error("a lock wait lost the connection")
		}
		if err := s.Undo(ctx); err != nil {
			t.Fatalf("Undo: %v", err)
		}
	})
	t.Run("CompleteWhenFnChangedTheRowIsErrKeyRowChanged", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		for _, own := range []bool{true, false} {
			var s driver.Span[TTx]
			var tx TTx
			if own {
				s = ownSpan(t, d, db)
			} else {
				var err error
				if tx, err = d.Begin(ctx, db); err != nil {
					t.Fatal(err)
				}
				s = d.SavepointSpan(tx)
			}
			k := key("changed")
			stx, claimed, _, err := s.Claim(ctx, driver.Claim{Key: k, Fingerprint: fpA})
			if err != nil || !claimed {
				t.Fatal(claimed, err)
			}
			if err := h.Exec(ctx, stx, `UPDATE idem_keys SET fingerprint = '\x00' WHERE actor = 'alice' AND idem_key = 'changed'`); err != nil {
				t.Fatal(err)
			}
			err = s.Complete(ctx, driver.Outcome{Key: k, Fingerprint: fpA, Status: "succeeded", Reply: reply})
			if ierr := d.Interpret(err); !errors.Is(ierr, driver.ErrKeyRowChanged) || sqlState(ierr) != driver.StateKeyRowChanged ||
				errors.Is(ierr, driver.ErrUnavailable) || d.TxClosed(err) {
				t.Fatalf("own %v: Complete after fn changed the row: %v (SQLSTATE %q), want ErrKeyRowChanged", own, err, sqlState(ierr))
			}
			// The end did not run: the span is still there to undo.
			if err := s.Undo(ctx); err != nil {
				t.Fatalf("own %v: Undo: %v", own, err)
			}
			if !own {
				if err := d.Commit(ctx, tx); err != nil {
					t.Fatalf("the caller's transaction after ErrKeyRowChanged: %v", err)
				}
			}
			if n := h.Count(t, db, `SELECT count(*) FROM idem_keys`); n != 0 {
				t.Fatalf("own %v: %d rows after ErrKeyRowChanged", own, n)
			}
		}
	})
	t.Run("ReadOfAKeyNoRowHolds", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		s := ownSpan(t, d, db)
		if _, _, _, err := s.Claim(ctx, driver.Claim{Key: key("x"), Fingerprint: fpA}); err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, driver.Outcome{Key: key("x"), Fingerprint: fpA, Status: "succeeded", Reply: reply}); err != nil {
			t.Fatal(err)
		}
		// A claim that claims nothing, then a Read that finds no row (the
		// row went away in between, as after a Forget).
		if _, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key("x"), Fingerprint: fpA}); err != nil || claimed {
			t.Fatal(claimed, err)
		}
		row, found, err := s.Read(ctx, key("none"))
		if err != nil || found || row.Status != "" {
			t.Fatalf("Read of no row: %+v, %v, %v", row, found, err)
		}
		// Read ended the span: the next round begins afresh.
		if _, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key("y"), Fingerprint: fpA}); err != nil || !claimed {
			t.Fatalf("Claim after Read: %v, %v", claimed, err)
		}
		if err := s.Undo(ctx); err != nil {
			t.Fatal(err)
		}
		if n := h.Count(t, db, `SELECT count(*) FROM idem_keys`); n != 1 {
			t.Fatalf("%d rows after Read and Undo, want x's", n)
		}
	})
	t.Run("BeginCommitRollbackNested", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		if d.Nested(db) {
			t.Error("Nested of a pool or database")
		}
		if err := d.CheckDB(db, true); err != nil {
			t.Errorf("CheckDB of a pool or database: %v", err)
		}
		if _, f1, err := d.OwnSpan(db); err != nil {
			t.Errorf("OwnSpan of a pool or database: %v", err)
		} else if _, f2, _ := d.OwnSpan(db); f1 != f2 {
			t.Error("OwnSpan's flight is not stable for one handle")
		}
		tx, err := d.Begin(ctx, db)
		if err != nil || d.NilTx(tx) {
			t.Fatalf("Begin: %v", err)
		}
		if err := h.Exec(ctx, tx, `INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
			VALUES ('alice', 'op', 'b', '\x01', 'processing', now() + interval '1 hour')`); err != nil {
			t.Fatal(err)
		}
		if lost := d.Rollback(ctx, db, tx); lost {
			t.Error("Rollback says the connection is lost")
		}
		if err := d.Commit(ctx, tx); !d.TxClosed(err) {
			t.Errorf("Commit after Rollback: %v, want TxClosed", err)
		}
		if n := h.Count(t, db, `SELECT count(*) FROM idem_keys`); n != 0 {
			t.Fatalf("%d rows after Rollback", n)
		}
		// CtxEndsTx: a transaction begun with a context that then ends is
		// rolled back by the database package, or stays open.
		cctx, cancel := context.WithCancel(ctx)
		tx, err = d.Begin(cctx, db)
		if err != nil {
			t.Fatal(err)
		}
		cancel()
		deadline := time.Now().Add(5 * time.Second)
		err = h.Exec(ctx, tx, `SELECT 1`)
		for d.CtxEndsTx() && !d.TxClosed(err) && time.Now().Before(deadline) { // database/sql rolls back in a goroutine
			time.Sleep(10 * time.Millisecond)
			err = h.Exec(ctx, tx, `SELECT 1`)
		}
		if d.TxClosed(err) != d.CtxEndsTx() {
			t.Errorf("a statement after the transaction's context ended: %v; CtxEndsTx says %t", err, d.CtxEndsTx())
		}
		d.Rollback(ctx, db, tx)
		if h.Nest == nil {
			return
		}
		outer, err := d.Begin(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Rollback(ctx, db, outer)
		nest := h.Nest(outer)
		if !d.Nested(nest) || d.CheckDB(nest, true) == nil || d.CheckDB(nest, false) != nil {
			t.Error("a transaction as a handle: not Nested, or CheckDB lets Reserve commit in it, or refuses DoInTx")
		}
		if s, flight, err := d.OwnSpan(nest); s != nil || flight != nil || err != nil {
			t.Errorf("OwnSpan of a transaction: %v, %v, %v; want none", s, flight, err)
		}
	})
}

// exerciseFnEnded: fn commits or rolls back the transaction the span runs
// it in.
func exerciseFnEnded[TTx, TDB any](t *testing.T, h Harness[TTx, TDB]) {
	t.Run("FnRollsBackOwnTx", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		s := ownSpan(t, d, db)
		tx, _, _, err := s.Claim(ctx, driver.Claim{Key: key("rb"), Fingerprint: fpA})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Rollback(ctx, db, tx); err {
			t.Fatal("lost")
		}
		err = s.Complete(ctx, driver.Outcome{Key: key("rb"), Fingerprint: fpA, Status: "succeeded", Reply: reply})
		if !d.TxClosed(err) {
			t.Fatalf("Complete after fn's ROLLBACK: %v, want TxClosed", err)
		}
		// Orphaned finds no row: the claim went with fn's rollback.
		if _, _, err := s.Orphaned(ctx, key("rb"), fpA, "why"); !errors.Is(err, driver.ErrNoRows) {
			t.Fatalf("Orphaned after fn's ROLLBACK: %v, want ErrNoRows", err)
		}
	})
	t.Run("FnCommitsTheCallersTx", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		tx, err := d.Begin(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		s := d.SavepointSpan(tx)
		stx, _, _, err := s.Claim(ctx, driver.Claim{Key: key("c"), Fingerprint: fpA})
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Commit(ctx, stx); err != nil {
			t.Fatal(err)
		}
		if err := s.Undo(ctx); !d.TxClosed(err) {
			t.Fatalf("Undo after fn's COMMIT: %v, want TxClosed", err)
		}
		enc, err := s.Enclosing(ctx, key("c"), fpA)
		if enc != driver.NoEnclosing || err != nil {
			t.Fatalf("Enclosing of a transaction of its own: %v, %v; want NoEnclosing", enc, err)
		}
	})
	if h.Nest == nil {
		return
	}
	for _, commit := range []bool{true, false} {
		name := "FnRollsBackASavepoint"
		if commit {
			name = "FnCommitsASavepoint"
		}
		t.Run(name, func(t *testing.T) {
			ctx := t.Context()
			d := h.New(settings)
			db := h.DB(t)
			outer, err := d.Begin(ctx, db)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Rollback(ctx, db, outer)
			inner, err := d.Begin(ctx, h.Nest(outer))
			if err != nil {
				t.Fatal(err)
			}
			s := d.SavepointSpan(inner)
			if _, _, _, err := s.Claim(ctx, driver.Claim{Key: key("n"), Fingerprint: fpA}); err != nil {
				t.Fatal(err)
			}
			if commit {
				err = h.Commit(ctx, inner)
			} else {
				_ = d.Rollback(ctx, db, inner)
			}
			if err != nil {
				t.Fatal(err)
			}
			want := driver.EnclosingUsable
			if commit {
				want = driver.EnclosingAborted
			}
			if enc, err := s.Enclosing(ctx, key("n"), fpA); enc != want || err != nil {
				t.Fatalf("Enclosing: %v, %v; want %v", enc, err, want)
			}
			err = h.Exec(ctx, outer, `SELECT 1`)
			if aborted := errors.Is(d.Interpret(err), driver.ErrTxAborted); aborted != commit {
				t.Fatalf("the enclosing transaction: %v; aborted %v, want %v", err, aborted, commit)
			}
			if commit {
				// Aborted already: Enclosing cannot tell, and says so.
				if enc, err := s.Enclosing(ctx, key("n"), fpA); enc != driver.EnclosingUnknown || err != nil {
					t.Fatalf("Enclosing again: %v, %v; want EnclosingUnknown", enc, err)
				}
			}
		})
	}
}

// exerciseExecutor: every statement of the Executor, its answers and its
// errors.
func exerciseExecutor[TTx, TDB any](t *testing.T, h Harness[TTx, TDB]) {
	t.Run("ExecutorLifecycle", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		inTx := func(f func(ex driver.Executor) error) {
			t.Helper()
			tx, err := d.Begin(ctx, db)
			if err != nil {
				t.Fatal(err)
			}
			committed := false
			defer func() { // also when f fails the test: the connection goes back
				if !committed {
					d.Rollback(ctx, db, tx)
				}
			}()
			if err := f(d.Executor(tx)); err != nil {
				t.Fatal(err)
			}
			committed = true
			if err := d.Commit(ctx, tx); err != nil {
				t.Fatal(err)
			}
		}
		k := key("life")
		r := driver.Reserve{Key: k, Fingerprint: fpA, Lease: time.Hour}
		var token int64
		inTx(func(ex driver.Executor) error {
			got, err := ex.ReserveInsertOrLock(ctx, r)
			if err != nil || !got.Inserted {
				t.Fatalf("ReserveInsertOrLock: %+v, %v", got, err)
			}
			token = got.Token
			if n, err := ex.ReserveFailRetryable(ctx, k, token, "certainly not sent"); err != nil || n != 1 {
				t.Fatalf("ReserveFailRetryable: %d, %v", n, err)
			}
			return nil
		})
		inTx(func(ex driver.Executor) error {
			found, err := ex.ReserveInsertOrLock(ctx, r)
			if err != nil || found.Inserted || !found.Found || found.Row.Status != "failed_retryable" || found.Row.Token != token {
				t.Fatalf("ReserveInsertOrLock of a failed_retryable row: %+v, %v", found, err)
			}
			next, lease, err := ex.ReserveAcquire(ctx, r, token, driver.NewAttempt)
			if err != nil || next <= token || lease.IsZero() {
				t.Fatalf("ReserveAcquire: %d, %v, %v", next, lease, err)
			}
			token = next
			if _, err := ex.ReserveHeartbeat(ctx, k, token, time.Hour, false); err != nil {
				t.Fatalf("ReserveHeartbeat: %v", err)
			}
			if n, err := ex.ReserveMarkUnknown(ctx, k, token+1, "stale"); err != nil || n != 0 {
				t.Fatalf("ReserveMarkUnknown with a stale token: %d, %v", n, err)
			}
			if n, err := ex.ReserveMarkUnknown(ctx, k, token, "timeout"); err != nil || n != 1 {
				t.Fatalf("ReserveMarkUnknown: %d, %v", n, err)
			}
			return nil
		})
		inTx(func(ex driver.Executor) error {
			if err := ex.UseIndexes(ctx); err != nil {
				return err
			}
			unknown, err := ex.ReserveListUnknown(ctx, nil, 10)
			if err != nil || len(unknown) != 1 || unknown[0].Key != k || unknown[0].LastError != "timeout" {
				t.Fatalf("ReserveListUnknown: %+v, %v", unknown, err)
			}
			after := &driver.Cursor{CreatedAt: unknown[0].CreatedAt, Key: k}
			if more, err := ex.ReserveListUnknown(ctx, after, 10); err != nil || len(more) != 0 {
				t.Fatalf("ReserveListUnknown after the last: %+v, %v", more, err)
			}
			if resumable, err := ex.ReserveListResumable(ctx, nil, 10); err != nil || len(resumable) != 0 {
				t.Fatalf("ReserveListResumable without windows: %+v, %v", resumable, err)
			}
			row, err := ex.ReserveLock(ctx, k)
			if err != nil || row.Status != "unknown" {
				t.Fatalf("ReserveLock: %+v, %v", row, err)
			}
			if _, err := ex.ReserveLock(ctx, key("none")); !errors.Is(err, driver.ErrNoRows) {
				t.Fatalf("ReserveLock of no row: %v, want ErrNoRows", err)
			}
			n, err := ex.ReserveResolve(ctx, k, row.Token, driver.Resolve{Status: "succeeded", Reply: &reply, Reason: "charged"})
			if err != nil || n != 1 {
				t.Fatalf("ReserveResolve: %d, %v", n, err)
			}
			rec, err := ex.KeyLookup(ctx, k)
			if err != nil || rec.Status != "succeeded" || rec.ResolveReason != "charged" || string(rec.Stored.Body) != "ok" {
				t.Fatalf("KeyLookup after Resolve: %+v, %v", rec, err)
			}
			if n, err := ex.KeyMarkUnknown(ctx, k, fpA, "why"); err != nil || n != 0 {
				t.Fatalf("KeyMarkUnknown of a finished row: %d, %v", n, err)
			}
			return nil
		})
		// KeyLockForForget does not wait for a transaction that holds the
		// row: ErrLockNotAvailable.
		holder, err := d.Begin(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.Executor(holder).ReserveLock(ctx, k); err != nil {
			t.Fatal(err)
		}
		tx, err := d.Begin(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		_, _, err = d.Executor(tx).KeyLockForForget(ctx, k)
		d.Rollback(ctx, db, tx)
		d.Rollback(ctx, db, holder)
		if !errors.Is(d.Interpret(err), driver.ErrLockNotAvailable) || sqlState(d.Interpret(err)) != "55P03" {
			t.Fatalf("KeyLockForForget of a held row: %v, want ErrLockNotAvailable", err)
		}
		inTx(func(ex driver.Executor) error {
			status, ranOut, err := ex.KeyLockForForget(ctx, k)
			if err != nil || status != "succeeded" || ranOut {
				t.Fatalf("KeyLockForForget: %q, %v, %v", status, ranOut, err)
			}
			if _, _, err := ex.KeyLockForForget(ctx, key("none")); !errors.Is(err, driver.ErrNoRows) {
				t.Fatalf("KeyLockForForget of no row: %v, want ErrNoRows", err)
			}
			return ex.KeyForget(ctx, k)
		})
		inTx(func(ex driver.Executor) error {
			if _, err := ex.KeyLookup(ctx, k); !errors.Is(err, driver.ErrNoRows) {
				t.Fatalf("KeyLookup after KeyForget: %v, want ErrNoRows", err)
			}
			if err := ex.WalkIndexes(ctx); err != nil {
				return err
			}
			if n, err := ex.ReserveExpireLeases(ctx, "lease ran out", 10); err != nil || n != 0 {
				t.Fatalf("ReserveExpireLeases: %d, %v", n, err)
			}
			if n, err := ex.KeyCountPrunable(ctx); err != nil || n != 0 {
				t.Fatalf("KeyCountPrunable: %d, %v", n, err)
			}
			return nil
		})
		inTx(func(ex driver.Executor) error {
			if table, index, err := ex.KeyTableSize(ctx); err != nil || table < 0 || index <= 0 {
				t.Fatalf("KeyTableSize: %d, %d, %v", table, index, err)
			}
			return nil
		})
	})
	t.Run("ExecutorMaintenance", func(t *testing.T) {
		// Each maintenance statement with rows to act on, and each kind of
		// attempt ReserveAcquire hands a row over for.
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		inTx := func(f func(tx TTx, ex driver.Executor)) {
			t.Helper()
			tx, err := d.Begin(ctx, db)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Rollback(ctx, db, tx) // when f fails the test
			f(tx, d.Executor(tx))
			if err := d.Commit(ctx, tx); err != nil {
				t.Fatal(err)
			}
		}
		exec := func(tx TTx, sql string) {
			t.Helper()
			if err := h.Exec(ctx, tx, sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		s := ownSpan(t, d, db)
		succeed(t, s, reply, "old-1", "old-2", "old-3", "body-1", "body-2", "live")
		window := driver.Reserve{Key: key("window"), Fingerprint: fpA, Lease: time.Hour, ResumeWithin: 2 * time.Hour}
		ranOut := driver.Reserve{Key: key("ran-out"), Fingerprint: fpA, Lease: time.Hour}
		inTx(func(tx TTx, ex driver.Executor) {
			for _, r := range []driver.Reserve{window, ranOut} {
				if got, err := ex.ReserveInsertOrLock(ctx, r); err != nil || !got.Inserted {
					t.Fatalf("ReserveInsertOrLock %s: %+v, %v", r.Key.Key, got, err)
				}
			}
			exec(tx, `UPDATE idem_keys SET expires_at = now() - interval '1 second' WHERE idem_key LIKE 'old-%'`)
			exec(tx, `UPDATE idem_keys SET body_expires_at = now() - interval '1 second' WHERE idem_key LIKE 'body-%'`)
			exec(tx, `UPDATE idem_keys SET lease_expires_at = now() - interval '1 second' WHERE idem_key IN ('window', 'ran-out')`)
		})
		inTx(func(_ TTx, ex driver.Executor) {
			if err := ex.WalkIndexes(ctx); err != nil {
				t.Fatal(err)
			}
			if n, err := ex.KeyCountPrunable(ctx); err != nil || n != 3 {
				t.Fatalf("KeyCountPrunable: %d, %v; want 3", n, err)
			}
			if n, err := ex.KeyPrune(ctx, 2); err != nil || n != 2 {
				t.Fatalf("KeyPrune of a batch of 2: %d, %v", n, err)
			}
			if n, err := ex.KeyPrune(ctx, 10); err != nil || n != 1 {
				t.Fatalf("KeyPrune of the rest: %d, %v; want 1", n, err)
			}
			if n, err := ex.KeyDropBodies(ctx, 10); err != nil || n != 2 {
				t.Fatalf("KeyDropBodies: %d, %v; want 2", n, err)
			}
			// The lease outside a window turns unknown; the one inside
			// its window stays for the next Reserve to resume.
			if n, err := ex.ReserveExpireLeases(ctx, "lease ran out", 10); err != nil || n != 1 {
				t.Fatalf("ReserveExpireLeases: %d, %v; want 1", n, err)
			}
		})
		inTx(func(_ TTx, ex driver.Executor) {
			if err := ex.UseIndexes(ctx); err != nil {
				t.Fatal(err)
			}
			for name, gone := range map[string]bool{"body-1": true, "live": false} {
				if rec, err := ex.KeyLookup(ctx, key(name)); err != nil || rec.Stored.Gone != gone {
					t.Fatalf("KeyLookup %s: %+v, %v; want gone %v", name, rec.Stored, err, gone)
				}
			}
			if _, err := ex.KeyLookup(ctx, key("old-1")); !errors.Is(err, driver.ErrNoRows) {
				t.Fatalf("KeyLookup of a pruned key: %v, want ErrNoRows", err)
			}
			unknown, err := ex.ReserveListUnknown(ctx, nil, 10)
			if err != nil || len(unknown) != 1 || unknown[0].Key != ranOut.Key || unknown[0].LastError != "lease ran out" {
				t.Fatalf("ReserveListUnknown: %+v, %v", unknown, err)
			}
			resumable, err := ex.ReserveListResumable(ctx, nil, 10)
			if err != nil || len(resumable) != 1 || resumable[0].Key != window.Key || resumable[0].ResumeUntil.IsZero() {
				t.Fatalf("ReserveListResumable: %+v, %v", resumable, err)
			}
			// Resume: a new token, a lease no later than the window.
			row, err := ex.ReserveLock(ctx, window.Key)
			if err != nil || !row.InWindow {
				t.Fatalf("ReserveLock of a key in its window: %+v, %v", row, err)
			}
			next, lease, err := ex.ReserveAcquire(ctx, window, row.Token, driver.Resume)
			if err != nil || next <= row.Token || lease.IsZero() || lease.After(resumable[0].ResumeUntil) {
				t.Fatalf("ReserveAcquire to resume: %d, %v, %v (window until %v)", next, lease, err, resumable[0].ResumeUntil)
			}
			// A verdict of failed_retryable, then a new request: a new
			// token and a window of its own.
			row, err = ex.ReserveLock(ctx, ranOut.Key)
			if err != nil || row.Status != "unknown" {
				t.Fatalf("ReserveLock: %+v, %v", row, err)
			}
			if n, err := ex.ReserveResolve(ctx, ranOut.Key, row.Token, driver.Resolve{Status: "failed_retryable", Reason: "not charged"}); err != nil || n != 1 {
				t.Fatalf("ReserveResolve to failed_retryable: %d, %v", n, err)
			}
			rec, err := ex.KeyLookup(ctx, ranOut.Key)
			if err != nil || rec.Status != "failed_retryable" || rec.ResolveReason != "not charged" || rec.Stored.Valid {
				t.Fatalf("KeyLookup after Resolve: %+v, %v", rec, err)
			}
			fresh := ranOut
			fresh.ResumeWithin = time.Hour
			next, lease, err = ex.ReserveAcquire(ctx, fresh, rec.Token, driver.NewRequest)
			if err != nil || next <= rec.Token || lease.IsZero() {
				t.Fatalf("ReserveAcquire for a new request: %d, %v, %v", next, lease, err)
			}
			if rec, err := ex.KeyLookup(ctx, ranOut.Key); err != nil || rec.Status != "processing" || rec.ResumeUntil.IsZero() ||
				rec.ResolveReason != "" || rec.LastError != "" {
				t.Fatalf("KeyLookup of the new request: %+v, %v", rec, err)
			}
		})
		if fix := d.PreparedStatementsFix(); strings.ContainsAny(fix, "\r\n") {
			t.Errorf("PreparedStatementsFix spans lines: %q", fix)
		}
	})
	t.Run("ExecutorInAbortedTx", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		tx, err := d.Begin(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Rollback(ctx, db, tx)
		if err := h.Exec(ctx, tx, `SELECT 1/0`); err == nil {
			t.Fatal("1/0 succeeded")
		}
		_, err = d.Executor(tx).KeyLookup(ctx, key("k"))
		if ierr := d.Interpret(err); !errors.Is(ierr, driver.ErrTxAborted) || sqlState(ierr) != "25P02" || errors.Is(err, driver.ErrNoRows) {
			t.Fatalf("KeyLookup in an aborted transaction: %v, want ErrTxAborted", err)
		}
	})
}

// exerciseServerErrors: what the server says, as each database package
// brings it, in the driver package's terms. A statement timeout and a
// session the server ends are unavailability (the server's); a lock wait
// that ran out is not, nor is it retryable; a serialization failure and a
// deadlock are retryable only; a statement's own failure shows no fault
// and comes back as it is. The SQLSTATE stays. (The classes idem reads by code alone are raised
// through idem_refuse, as the server would raise them.)
func exerciseServerErrors[TTx, TDB any](t *testing.T, h Harness[TTx, TDB]) {
	ctx := t.Context()
	d := h.New(settings)
	db := h.DB(t)
	unavailable := driver.ErrUnavailable | driver.ErrServerUnavailable
	all := unavailable | driver.ErrLockNotAvailable | driver.ErrRetryable | driver.ErrTxAborted
	check := func(name string, err error, state string, want driver.Fault) {
		t.Helper()
		ierr := d.Interpret(err)
		if want == 0 && ierr != err {
			t.Errorf("%s: Interpret(%v) = %#v, want it as it is", name, err, ierr)
		}
		if err == nil || want != 0 && sqlState(ierr) != state || !errors.Is(ierr, err) {
			t.Errorf("%s: %v (SQLSTATE %q), want SQLSTATE %s kept", name, err, sqlState(ierr), state)
		}
		for f := driver.Fault(1); f <= all; f <<= 1 {
			if f&all != 0 && errors.Is(ierr, f) != (want&f != 0) {
				t.Errorf("%s: %v: %s is %v", name, err, f, errors.Is(ierr, f))
			}
		}
	}
	begin := func() TTx {
		t.Helper()
		tx, err := d.Begin(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		return tx
	}

	tx := begin()
	if err := h.Exec(ctx, tx, `SET LOCAL statement_timeout = '20ms'`); err != nil {
		t.Fatal(err)
	}
	check("statement timeout", h.Exec(ctx, tx, `SELECT pg_sleep(5)`), "57014", unavailable)
	if d.Rollback(ctx, db, tx) {
		t.Error("a statement timeout lost the connection")
	}

	holder := begin()
	if err := h.Exec(ctx, holder, `SELECT pg_advisory_xact_lock(7)`); err != nil {
		t.Fatal(err)
	}
	tx = begin()
	if err := h.Exec(ctx, tx, `SET LOCAL lock_timeout = '20ms'`); err != nil {
		t.Fatal(err)
	}
	check("lock timeout", h.Exec(ctx, tx, `SELECT pg_advisory_xact_lock(7)`), "55P03", driver.ErrLockNotAvailable)
	check("aborted", h.Exec(ctx, tx, `SELECT 1`), "25P02", driver.ErrTxAborted)
	d.Rollback(ctx, db, tx)
	d.Rollback(ctx, db, holder)

	for _, c := range []struct {
		state string
		want  driver.Fault
	}{
		{"40001", driver.ErrRetryable},
		{"40P01", driver.ErrRetryable},
		{"57P01", unavailable}, // admin shutdown, as the server says it
		{"53300", unavailable}, // too many connections
		{"08006", unavailable}, // connection failure
		{"23505", 0},           // fn's own: a unique violation
	} {
		tx := begin()
		check(c.state, h.Exec(ctx, tx, `SELECT idem_refuse('`+c.state+`', 'as the server says it')`), c.state, c.want)
		d.Rollback(ctx, db, tx)
	}

	// The server ends the session under a statement: unavailable, and
	// the handle serves the next transaction on another connection.
	tx = begin()
	err := h.Exec(ctx, tx, `SELECT pg_terminate_backend(pg_backend_pid())`)
	if ierr := d.Interpret(err); !errors.Is(ierr, driver.ErrUnavailable) || errors.Is(ierr, driver.ErrRetryable) ||
		errors.Is(ierr, driver.ErrLockNotAvailable) {
		t.Errorf("session ended by the server: %v, want ErrUnavailable", err)
	}
	d.Rollback(ctx, db, tx)
	tx = begin()
	if err := h.Exec(ctx, tx, `SELECT 1`); err != nil {
		t.Errorf("after a session ended: %v", err)
	}
	d.Rollback(ctx, db, tx)
}
