// Package drivertest is the conformance suite of idem's drivers: one set
// of tests of the Driver, Span and Executor contract (package driver),
// which every driver runs (pgxdriver; sqldriver with pgx's stdlib and with
// lib/pq) against a real PostgreSQL. Exercise is its entry.
package drivertest

import (
	"context"
	"errors"
	"testing"

	"github.com/pgidem/idem/internal/driver"
)

// Harness is what a driver's test gives the suite.
type Harness[TTx, TDB any] struct {
	// New returns the driver under test with settings s.
	New func(s driver.Settings) driver.Driver[TTx, TDB]
	// DB opens a handle on a fresh database migrated by idem, closed when
	// the test ends.
	DB func(t *testing.T) TDB
	// Exec runs a statement of fn's in tx, as fn would.
	Exec func(ctx context.Context, tx TTx, sql string) error
	// Commit commits tx as fn would, through the database package.
	Commit func(ctx context.Context, tx TTx) error
	// Count runs a count(*) query on db, outside any call.
	Count func(t *testing.T, db TDB, query string) int
	// InUse is the number of db's connections in use (taken from its pool
	// and not given back).
	InUse func(db TDB) int
	// Nest gives tx as a handle that transactions are begun on (as
	// savepoints of tx), when the database package has such handles (pgx:
	// a pgx.Tx is a Beginner); nil when it has none (database/sql).
	Nest func(tx TTx) TDB
}

// settings are the suite's: a day's TTL, a short wait.
var settings = driver.Settings{TTLMicros: 86_400_000_000, LockTimeout: "200ms"}

// sqlState is the SQLSTATE an interpreted error keeps ("" for none).
func sqlState(err error) string {
	var de *driver.Error
	if errors.As(err, &de) {
		return de.SQLState
	}
	return ""
}

func key(name string) driver.Key { return driver.Key{Actor: "alice", Operation: "op", Key: name} }

var fpA = [32]byte{1}

var reply = driver.Reply{Status: 201, Headers: `{"Content-Type":["text/plain"]}`, HasHeaders: true, Body: []byte("ok")}

// Exercise runs the suite against h.
func Exercise[TTx, TDB any](t *testing.T, h Harness[TTx, TDB]) {
	exerciseErrors(t, h)
	exerciseFnEnded(t, h)
	exerciseExecutor(t, h)
	t.Run("CheckDBAndNilTx", func(t *testing.T) {
		d := h.New(settings)
		var zeroDB TDB
		if d.CheckDB(zeroDB, false) == nil || d.CheckDB(zeroDB, true) == nil {
			t.Error("CheckDB accepts a nil handle")
		}
		if s, _, err := d.OwnSpan(zeroDB); err == nil || s != nil {
			t.Error("OwnSpan accepts a nil handle")
		}
		var zeroTx TTx
		if !d.NilTx(zeroTx) {
			t.Error("NilTx(nil) = false")
		}
		if d.TxClosed(nil) || d.TxClosed(errors.New("other")) {
			t.Error("TxClosed of an unrelated error")
		}
	})
	t.Run("OwnSpanClaimCompleteRead", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		s := ownSpan(t, d, db)
		_, claimed, begun, err := s.Claim(ctx, driver.Claim{Key: key("k"), Fingerprint: fpA})
		if err != nil || !claimed || !begun {
			t.Fatalf("Claim: %v %v %v", claimed, begun, err)
		}
		if err := s.Complete(ctx, driver.Outcome{Key: key("k"), Fingerprint: fpA, Status: "succeeded", Reply: reply}); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		// The key is held by a committed row: the next claim claims
		// nothing, and Read reads the row and ends the span.
		_, claimed, begun, err = s.Claim(ctx, driver.Claim{Key: key("k"), Fingerprint: fpA})
		if err != nil || claimed || !begun {
			t.Fatalf("Claim of a held key: %v %v %v", claimed, begun, err)
		}
		row, found, err := s.Read(ctx, key("k"))
		if err != nil || !found || row.Status != "succeeded" || !row.Stored.Valid || row.Stored.Status != 201 ||
			string(row.Stored.Body) != "ok" || [32]byte(row.Fingerprint) != fpA || row.Expired || row.Leased {
			t.Fatalf("Read: %+v %v %v", row, found, err)
		}
		_, claimed, _, err = s.Claim(ctx, driver.Claim{Key: key("gone"), Fingerprint: fpA})
		if err != nil || !claimed {
			t.Fatalf("Claim: %v %v", claimed, err)
		}
		if err := s.Undo(ctx); err != nil {
			t.Fatalf("Undo: %v", err)
		}
		if n := h.Count(t, db, `SELECT count(*) FROM idem_keys`); n != 1 {
			t.Fatalf("%d rows after Undo, want 1", n)
		}
	})
	t.Run("ReadTellsAnEmptyBodyFromAGoneOne", func(t *testing.T) {
		// An empty body is stored as an empty bytea, which is not a
		// dropped one (some drivers read it as nil: lib/pq in bytea's
		// escape format); a body Prune dropped (NULL), one whose time has
		// passed, and one set NULL before its time (idem never writes
		// that; an operator might) are gone, for Read (KeyGet, judged in
		// Go) and KeyLookup (judged in SQL) alike.
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		s := ownSpan(t, d, db)
		empty := driver.Reply{Status: 204, Body: []byte{}}
		succeed(t, s, empty, "empty", "dropped", "due", "early")
		// Drop one body as Prune does, and set another's time in the past,
		// in the transaction of a call that commits them.
		tx, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key("writer"), Fingerprint: fpA})
		if err != nil || !claimed {
			t.Fatalf("Claim writer: %v %v", claimed, err)
		}
		for _, q := range []string{
			`UPDATE idem_keys SET response_body = NULL, response_headers = NULL WHERE idem_key = 'dropped'`,
			`UPDATE idem_keys SET body_expires_at = now() - interval '1 second' WHERE idem_key = 'due'`,
			`UPDATE idem_keys SET response_body = NULL, body_expires_at = now() + interval '1 hour' WHERE idem_key = 'early'`,
		} {
			if err := h.Exec(ctx, tx, q); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Complete(ctx, driver.Outcome{Key: key("writer"), Fingerprint: fpA, Status: "succeeded", Reply: empty}); err != nil {
			t.Fatalf("Complete writer: %v", err)
		}
		for _, c := range []struct {
			name string
			gone bool
		}{{"empty", false}, {"dropped", true}, {"due", true}, {"early", true}} {
			if _, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key(c.name), Fingerprint: fpA}); err != nil || claimed {
				t.Fatalf("Claim of held %s: %v %v", c.name, claimed, err)
			}
			row, found, err := s.Read(ctx, key(c.name))
			if err != nil || !found || !row.Stored.Valid || row.Stored.Status != 204 || row.Stored.Gone != c.gone {
				t.Fatalf("Read %s: %+v %v %v, want gone %v", c.name, row, found, err, c.gone)
			}
			if !c.gone && len(row.Stored.Body) != 0 {
				t.Errorf("Read %s: body %#v, want an empty one", c.name, row.Stored.Body)
			}
			tx, err := d.Begin(ctx, db)
			if err != nil {
				t.Fatal(err)
			}
			rec, err := d.Executor(tx).KeyLookup(ctx, key(c.name))
			d.Rollback(ctx, db, tx)
			if err != nil || rec.Stored.Gone != c.gone || rec.Stored.Status != 204 {
				t.Errorf("KeyLookup %s: %+v %v, want gone %v", c.name, rec.Stored, err, c.gone)
			}
		}
	})
	t.Run("ReadJudgesTheRowsTimes", func(t *testing.T) {
		// Read judges the row's times against the database's now() of
		// its own statement (driver.Row.Judge): expired, leased, the
		// lease's time left. An expiry of 'infinity' (idem never writes
		// one; an operator might) is never expired: Read says so, or
		// fails (database/sql's drivers cannot scan it into a time).
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		s := ownSpan(t, d, db)
		names := []string{"live", "expired", "forever", "leased"}
		succeed(t, s, reply, names...)
		tx, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key("writer"), Fingerprint: fpA})
		if err != nil || !claimed {
			t.Fatalf("Claim writer: %v %v", claimed, err)
		}
		for _, q := range []string{
			`UPDATE idem_keys SET expires_at = now() - interval '1 second' WHERE idem_key = 'expired'`,
			`UPDATE idem_keys SET expires_at = 'infinity' WHERE idem_key = 'forever'`,
			`UPDATE idem_keys SET status = 'processing', token = 7, completed_at = NULL,
			        lease_expires_at = now() + interval '90 seconds' WHERE idem_key = 'leased'`,
		} {
			if err := h.Exec(ctx, tx, q); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Complete(ctx, driver.Outcome{Key: key("writer"), Fingerprint: fpA, Status: "succeeded", Reply: reply}); err != nil {
			t.Fatalf("Complete writer: %v", err)
		}
		for _, name := range names {
			if _, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key(name), Fingerprint: fpA}); err != nil || claimed {
				t.Fatalf("Claim of held %s: %v %v", name, claimed, err)
			}
			row, found, err := s.Read(ctx, key(name))
			switch {
			case name == "forever" && err != nil:
				continue
			case err != nil || !found:
				t.Fatalf("Read %s: %+v %v %v", name, row, found, err)
			case row.Expired != (name == "expired"):
				t.Errorf("Read %s: expired %v", name, row.Expired)
			case row.Leased != (name == "leased"):
				t.Errorf("Read %s: leased %v", name, row.Leased)
			case name == "leased" && (row.LeaseLeftMs <= 80_000 || row.LeaseLeftMs > 90_000):
				t.Errorf("Read %s: %d ms of its lease left, want about 90 s", name, row.LeaseLeftMs)
			case name != "leased" && row.LeaseLeftMs != 0:
				t.Errorf("Read %s: %d ms of a lease left, want none", name, row.LeaseLeftMs)
			}
		}
	})
	t.Run("OwnSpanHoldsAConnectionInItsTransactions", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		s := ownSpan(t, d, db)
		inUse := func(step string, want int) {
			t.Helper()
			if n := h.InUse(db); n != want {
				t.Fatalf("%s: %d connections in use, want %d", step, n, want)
			}
		}
		inUse("OwnSpan", 0)
		if _, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key("k"), Fingerprint: fpA}); err != nil || !claimed {
			t.Fatal(claimed, err)
		}
		inUse("Claim", 1)
		if err := s.Complete(ctx, driver.Outcome{Key: key("k"), Fingerprint: fpA, Status: "succeeded", Reply: reply}); err != nil {
			t.Fatal(err)
		}
		inUse("Complete", 0)
		if _, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key("k"), Fingerprint: fpA}); err != nil || claimed {
			t.Fatal(claimed, err)
		}
		if _, found, err := s.Read(ctx, key("k")); err != nil || !found {
			t.Fatal(found, err)
		}
		inUse("Read", 0)
		if s.Lost() {
			t.Error("a span that gave its connection back is lost")
		}
		if _, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key("u"), Fingerprint: fpA}); err != nil || !claimed {
			t.Fatal(claimed, err)
		}
		if err := s.Undo(ctx); err != nil {
			t.Fatal(err)
		}
		s.Close()
		inUse("Undo and Close", 0)
		s.Close()
	})
	t.Run("CompleteInAbortedTxIsErrTxAborted", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		s := ownSpan(t, d, db)
		tx, _, _, err := s.Claim(ctx, driver.Claim{Key: key("a"), Fingerprint: fpA})
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Exec(ctx, tx, `SELECT 1/0`); err == nil {
			t.Fatal("1/0 succeeded")
		}
		err = s.Complete(ctx, driver.Outcome{Key: key("a"), Fingerprint: fpA, Status: "succeeded", Reply: reply})
		if !errors.Is(err, driver.ErrTxAborted) || sqlState(err) != "25P02" || errors.Is(d.Interpret(err), driver.ErrUnavailable) {
			t.Fatalf("Complete: %v (SQLSTATE %q), want ErrTxAborted with 25P02", err, sqlState(err))
		}
		if err := s.Undo(ctx); err != nil {
			t.Fatalf("Undo: %v", err)
		}
		if n := h.Count(t, db, `SELECT count(*) FROM idem_keys`); n != 0 {
			t.Fatalf("%d rows", n)
		}
	})
	t.Run("FnCommitsThenOrphaned", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		s := ownSpan(t, d, db)
		tx, _, _, err := s.Claim(ctx, driver.Claim{Key: key("o"), Fingerprint: fpA})
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Commit(ctx, tx); err != nil {
			t.Fatal(err)
		}
		if err := s.Undo(ctx); !d.TxClosed(err) {
			t.Fatalf("Undo after fn's COMMIT: %v, want TxClosed", err)
		}
		n, _, err := s.Orphaned(ctx, key("o"), fpA, "why")
		if err != nil || n != 1 {
			t.Fatalf("Orphaned: %d, %v", n, err)
		}
		n, now, err := s.Orphaned(ctx, key("o"), fpA, "why")
		if err != nil || n != 0 || now.Status != "unknown" || now.LastError != "why" {
			t.Fatalf("Orphaned again: %d, %+v, %v", n, now, err)
		}
		if _, _, err := s.Orphaned(ctx, key("none"), fpA, "why"); !errors.Is(err, driver.ErrNoRows) {
			t.Fatalf("Orphaned of no row: %v, want ErrNoRows", err)
		}
	})
	t.Run("ClaimWaitsAtMostWait", func(t *testing.T) {
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
		if !errors.Is(d.Interpret(err), driver.ErrLockNotAvailable) || sqlState(d.Interpret(err)) != "55P03" || !begun {
			t.Fatalf("Claim of a key in flight: begun %v, %v; want 55P03", begun, err)
		}
		if err := s.Undo(ctx); err != nil {
			t.Fatalf("Undo: %v", err)
		}
	})
	t.Run("SavepointSpan", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		tx, err := d.Begin(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Rollback(ctx, db, tx) // after a failure: the pool closes only once tx is over
		s := d.SavepointSpan(tx)
		if _, claimed, begun, err := s.Claim(ctx, driver.Claim{Key: key("s"), Fingerprint: fpA}); err != nil || !claimed || !begun {
			t.Fatal(claimed, begun, err)
		}
		if err := s.Undo(ctx); err != nil {
			t.Fatalf("Undo: %v", err)
		}
		if _, claimed, _, err := s.Claim(ctx, driver.Claim{Key: key("s"), Fingerprint: fpA}); err != nil || !claimed {
			t.Fatal(claimed, err)
		}
		if err := s.Complete(ctx, driver.Outcome{Key: key("s"), Fingerprint: fpA, Status: "rejected", Reply: reply}); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		if s.Lost() {
			t.Error("a savepoint span is lost")
		}
		if _, _, err := s.Orphaned(ctx, key("s"), fpA, "why"); err == nil {
			t.Error("Orphaned on a savepoint span succeeded")
		}
		if err := d.Commit(ctx, tx); err != nil {
			t.Fatal(err)
		}
		if n := h.Count(t, db, `SELECT count(*) FROM idem_keys WHERE status = 'rejected'`); n != 1 {
			t.Fatalf("%d rows", n)
		}
	})
	t.Run("Executor", func(t *testing.T) {
		ctx := t.Context()
		d := h.New(settings)
		db := h.DB(t)
		tx, err := d.Begin(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Rollback(ctx, db, tx)
		ex := d.Executor(tx)
		if err := ex.UseIndexes(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := ex.KeyLookup(ctx, key("none")); !errors.Is(err, driver.ErrNoRows) {
			t.Errorf("KeyLookup of no row: %v, want ErrNoRows", err)
		}
		r := driver.Reserve{Key: key("r"), Fingerprint: fpA, Lease: 60e9}
		got, err := ex.ReserveInsertOrLock(ctx, r)
		if err != nil || !got.Inserted || got.Token <= 0 || got.LeaseExpiresAt.IsZero() {
			t.Fatalf("ReserveInsertOrLock: %+v, %v", got, err)
		}
		again, err := ex.ReserveInsertOrLock(ctx, r)
		if err != nil || again.Inserted || !again.Found || again.Row.Token != got.Token || again.Row.Status != "processing" {
			t.Fatalf("ReserveInsertOrLock again: %+v, %v", again, err)
		}
		if _, err := ex.ReserveHeartbeat(ctx, key("r"), got.Token+1, 60e9, false); !errors.Is(err, driver.ErrNoRows) {
			t.Errorf("ReserveHeartbeat with a stale token: %v, want ErrNoRows", err)
		}
		if n, err := ex.ReserveComplete(ctx, key("r"), got.Token+1, reply); err != nil || n != 0 {
			t.Errorf("ReserveComplete with a stale token: %d, %v", n, err)
		}
		if n, err := ex.ReserveComplete(ctx, key("r"), got.Token, reply); err != nil || n != 1 {
			t.Errorf("ReserveComplete: %d, %v", n, err)
		}
		rec, err := ex.KeyLookup(ctx, key("r"))
		if err != nil || rec.Status != "succeeded" || rec.Token != got.Token || !rec.Stored.Valid {
			t.Errorf("KeyLookup: %+v, %v", rec, err)
		}
		stats, err := ex.KeyStats(ctx)
		if err != nil || len(stats) != 1 || stats[0].Status != "succeeded" || stats[0].Keys != 1 {
			t.Errorf("KeyStats: %+v, %v", stats, err)
		}
		if n, err := ex.KeyPrune(ctx, 10); err != nil || n != 0 {
			t.Errorf("KeyPrune: %d, %v", n, err)
		}
		if n, err := ex.KeyDropBodies(ctx, 10); err != nil || n != 0 { // a reservation keeps its body
			t.Errorf("KeyDropBodies: %d, %v", n, err)
		}
	})
}

// ownSpan is DoInTx's span on db, closed when the test ends.
// succeed claims each key in s and completes it with r, as calls whose fn
// succeeded.
func succeed[TTx any](t *testing.T, s driver.Span[TTx], r driver.Reply, names ...string) {
	t.Helper()
	for _, name := range names {
		if _, claimed, _, err := s.Claim(t.Context(), driver.Claim{Key: key(name), Fingerprint: fpA}); err != nil || !claimed {
			t.Fatalf("Claim %s: %v %v", name, claimed, err)
		}
		if err := s.Complete(t.Context(), driver.Outcome{Key: key(name), Fingerprint: fpA, Status: "succeeded", Reply: r}); err != nil {
			t.Fatalf("Complete %s: %v", name, err)
		}
	}
}

func ownSpan[TTx, TDB any](t *testing.T, d driver.Driver[TTx, TDB], db TDB) driver.Span[TTx] {
	t.Helper()
	s, _, err := d.OwnSpan(db)
	if err != nil || s == nil {
		t.Fatalf("OwnSpan: %v %v", s, err)
	}
	t.Cleanup(s.Close)
	return s
}
