package idem

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/db"
)

// The hot-path statements are queued with argument lists built by hand; they
// must match what the sqlc-generated methods send, statement and order.
func TestHotArgsMatchGenerated(t *testing.T) {
	ctx := context.Background()
	c, err := New(Config{TTL: 90 * time.Second, Wait: 1500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	k := newRowKey(Scope{Actor: "actor", Operation: "op"}, "key")
	fp := FingerprintParts([]byte("x"))

	generated := func(call func(q queuer)) *pgx.QueuedQuery {
		b := &pgx.Batch{}
		call(queuer{b})
		return b.QueuedQueries[0]
	}
	check := func(name string, want *pgx.QueuedQuery, sql string, args []any) {
		t.Helper()
		if want.SQL != sql {
			t.Errorf("%s: statement differs from the generated one", name)
		}
		if !reflect.DeepEqual(want.Arguments, args) {
			t.Errorf("%s: arguments\n got %#v\nwant %#v", name, args, want.Arguments)
		}
	}

	check("KeyClaim", generated(func(q queuer) {
		_, _ = queries.KeyClaim(ctx, q, db.KeyClaimParams{
			Actor: "actor", Operation: "op", IdemKey: "key",
			Fingerprint: fp[:], TtlMicros: c.ttlMicros, LockTimeout: c.lockTimeout,
		})
	}), db.KeyClaim, c.claimArgs(k, fp[:]))

	headers, body := []byte(`{"A":["b"]}`), []byte("body")
	want := generated(func(q queuer) {
		_, _ = queries.KeyComplete(ctx, q, db.KeyCompleteParams{
			Status: statusRejected, ResponseStatus: pgtype.Int4{Int32: 402, Valid: true},
			ResponseHeaders: headers, ResponseBody: body,
			Actor: "actor", Operation: "op", IdemKey: "key",
		})
	})
	// The generated method sends a pgtype.Int4 and the headers as []byte;
	// the hand-built list an int32, which encodes the same, and the headers
	// as a string, which every query exec mode sends as JSON text.
	want.Arguments[1] = want.Arguments[1].(pgtype.Int4).Int32
	want.Arguments[2] = string(want.Arguments[2].([]byte))
	check("KeyComplete", want, db.KeyComplete, completeArgs(k, statusRejected, 402, string(headers), body))
}
