package pgxdriver

import (
	"context"
	"errors"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/driver"
)

// The claims and the completion are queued by hand in span.go, with sqlc's
// statement text: each sends what sqlc's generated method sends, the same
// text and the same arguments in the same order. A query changed in
// queries/ (a parameter added or moved) fails here, not at run time with
// arguments in the wrong columns.
func TestQueuedStatementsAreSqlcs(t *testing.T) {
	d := New(driver.Settings{TTLMicros: 5e6, LockTimeout: "250ms"}).(*Driver)
	k := driver.Key{Actor: "alice", Operation: "payment.create", Key: "k1"}
	fp := [32]byte{1, 2, 3}
	p := struct {
		actor, op, key string
		fp             []byte
		ttl            int64
		lock           string
	}{k.Actor, k.Operation, k.Key, fp[:], 5e6, "250ms"}
	for _, c := range []struct {
		name     string
		citus    bool
		takeOver bool
		sqlc     func(db.DBTX)
	}{
		{"KeyClaim", false, false, func(q db.DBTX) {
			_, _ = queries.KeyClaim(context.Background(), q, db.KeyClaimParams{Actor: p.actor, Operation: p.op,
				IdemKey: p.key, Fingerprint: p.fp, TtlMicros: p.ttl, LockTimeout: p.lock})
		}},
		{"KeyTakeOver", false, true, func(q db.DBTX) {
			_, _ = queries.KeyTakeOver(context.Background(), q, db.KeyTakeOverParams{Actor: p.actor, Operation: p.op,
				IdemKey: p.key, Fingerprint: p.fp, TtlMicros: p.ttl, LockTimeout: p.lock})
		}},
		{"KeyClaimCitus", true, false, func(q db.DBTX) {
			_, _ = queries.KeyClaimCitus(context.Background(), q, db.KeyClaimCitusParams{Actor: p.actor, Operation: p.op,
				IdemKey: p.key, Fingerprint: p.fp, TtlMicros: p.ttl})
		}},
		{"KeyTakeOverCitus", true, true, func(q db.DBTX) {
			_, _ = queries.KeyTakeOverCitus(context.Background(), q, db.KeyTakeOverCitusParams{Actor: p.actor, Operation: p.op,
				IdemKey: p.key, Fingerprint: p.fp, TtlMicros: p.ttl})
		}},
	} {
		var want recorder
		c.sqlc(&want)
		var b pgx.Batch
		if ttl := d.queueClaim(&b, driver.Claim{Key: k, Fingerprint: fp, TakeOver: c.takeOver}, fp[:], c.citus); ttl != p.ttl {
			t.Errorf("%s: queueClaim says it queued a TTL of %d µs, want %d", c.name, ttl, p.ttl)
		}
		i := 0
		if c.citus {
			i = 1 // between the SET LOCALs of the wait
		}
		if got := b.QueuedQueries[i]; got.SQL != want.sql || !reflect.DeepEqual(got.Arguments, want.args) {
			t.Errorf("%s queued as %q %#v; sqlc sends %q %#v", c.name, got.SQL, got.Arguments, want.sql, want.args)
		}
	}

	out := driver.Outcome{Key: k, Fingerprint: fp, Status: "succeeded",
		Reply: driver.Reply{Status: 201, Headers: `{"A":["b"]}`, HasHeaders: true, Body: []byte("ok")}}
	for _, citus := range []bool{false, true} {
		var want recorder
		if citus {
			_ = queries.KeyCompleteCitus(context.Background(), &want, db.KeyCompleteCitusParams{Actor: p.actor, Operation: p.op,
				IdemKey: p.key, Fingerprint: p.fp, Status: out.Status, TtlMicros: p.ttl, ResponseStatus: out.Reply.Status,
				ResponseHeaders: pgtype.Text{String: out.Reply.Headers, Valid: true}, ResponseBody: out.Reply.Body})
		} else {
			_ = queries.KeyComplete(context.Background(), &want, db.KeyCompleteParams{Actor: p.actor, Operation: p.op,
				IdemKey: p.key, Fingerprint: p.fp, Status: out.Status, TtlMicros: p.ttl, ResponseStatus: out.Reply.Status,
				ResponseHeaders: pgtype.Text{String: out.Reply.Headers, Valid: true}, ResponseBody: out.Reply.Body})
		}
		var b pgx.Batch
		d.queueComplete(&b, out, fp[:], p.ttl, citus)
		if got := b.QueuedQueries[0]; got.SQL != want.sql || !reflect.DeepEqual(got.Arguments, want.args) {
			t.Errorf("completion (Citus %v) queued as %q %#v; sqlc sends %q %#v", citus, got.SQL, got.Arguments, want.sql, want.args)
		}
	}
}

// recorder is a db.DBTX that records the statement sent and its arguments,
// and answers with an error.
type recorder struct {
	sql  string
	args []any
}

var errRecorded = errors.New("recorded")

func (r *recorder) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	r.sql, r.args = sql, args
	return pgconn.CommandTag{}, errRecorded
}

func (r *recorder) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	r.sql, r.args = sql, args
	return nil, errRecorded
}

func (r *recorder) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	r.sql, r.args = sql, args
	return errRow{}
}

type errRow struct{}

func (errRow) Scan(...any) error { return errRecorded }
