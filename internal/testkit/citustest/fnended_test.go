package citustest_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// An fn that commits the transaction of DoInTx itself, through the
// coordinator: the call returns ErrInvalidArgument, the record turns
// unknown (retries get ErrOutcomeUnknown), ListUnknown lists it and Resolve
// settles it; a row Do's fn left (committed by fn, unmarked) is marked by
// Reserve. With pgx and with idemsql's NewCitus on both drivers.
func TestFnCommittingItsTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	scope := idem.Scope{Actor: "alice", Operation: "order"}
	commit := func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		resp, err := order("alice", "c1", "book")(ctx, tx)
		if err == nil {
			err = tx.Commit(ctx)
		}
		return resp, err
	}
	_, err := idem.DoInTx(ctx, p, scope, "c1", fp("book"), commit)
	isErr(t, "fn commits", err, idem.ErrInvalidArgument)
	_, err = idem.DoInTx(ctx, p, scope, "c1", fp("book"), order("alice", "c1", "book"))
	isErr(t, "retry", err, idem.ErrOutcomeUnknown)
	if n := ordersOf(t, p, "alice", "c1"); n != 1 {
		t.Fatalf("%d orders", n)
	}

	tx, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = idem.Do(ctx, tx, scope, "c2", fp("book"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201}, tx.Commit(ctx)
	})
	isErr(t, "Do's fn commits", err, idem.ErrInvalidArgument)
	_, err = idem.Reserve(ctx, p, scope, "c2", fp("book"), time.Minute)
	isErr(t, "Reserve after Do's fn committed", err, idem.ErrOutcomeUnknown)

	settle(t, p, 2, func(rec idem.Record, res idem.Resolution) error {
		return idem.Resolve(ctx, p, rec.Scope, rec.Key, res)
	})

	eachSQLDriver(t, func(t *testing.T, p *pgxpool.Pool, db *sql.DB) {
		c, err := idemsql.NewCitus(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.DoInTx(ctx, db, scope, "s1", fp("pen"), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
			resp, err := sqlOrder("alice", "s1", "pen")(ctx, tx)
			if err == nil {
				err = tx.Commit()
			}
			return resp, err
		})
		isErr(t, "idemsql: fn commits", err, idem.ErrInvalidArgument)
		_, err = c.DoInTx(ctx, db, scope, "s1", fp("pen"), sqlOrder("alice", "s1", "pen"))
		isErr(t, "idemsql: retry", err, idem.ErrOutcomeUnknown)
		settle(t, p, 1, func(rec idem.Record, res idem.Resolution) error {
			return c.Resolve(ctx, db, rec.Scope, rec.Key, res)
		})
	})
}

// settle lists the unknown records (want of them) and resolves each as
// retryable with resolve.
func settle(t *testing.T, p *pgxpool.Pool, want int, resolve func(idem.Record, idem.Resolution) error) {
	t.Helper()
	recs, err := idem.ListUnknown(context.Background(), p, 10, nil)
	if err != nil || len(recs) != want {
		t.Fatalf("ListUnknown: %+v, %v; want %d", recs, err, want)
	}
	for _, rec := range recs {
		err := resolve(rec, idem.Resolution{Token: rec.Token, Retryable: true, Reason: "checked"})
		if err != nil && !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("Resolve %s: %v", rec.Key, err)
		}
	}
}

// An fn that commits a savepoint of the caller's transaction (a pgx.Tx
// begun on a pgx.Tx, given to Do), through the coordinator: the RELEASE
// leaves fn's writes and the claim pending in the caller's transaction,
// which Do aborts (its COMMIT rolls back): nothing of fn's, and no claim,
// commits. After fn's ROLLBACK the caller's transaction stays usable.
func TestFnEndingASavepointOfTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, p := newDB(t)
	scope := idem.Scope{Actor: "alice", Operation: "order"}
	for _, end := range []string{"commit", "rollback"} {
		key := "nested-" + end
		tx, err := p.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		nested, err := tx.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = idem.Do(ctx, nested, scope, key, fp("book"), func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			resp, err := order("alice", key, "book")(ctx, tx)
			if err == nil && end == "commit" {
				err = tx.Commit(ctx)
			} else if err == nil {
				err = tx.Rollback(ctx)
			}
			return resp, err
		})
		isErr(t, "Do's fn ends its savepoint: "+end, err, idem.ErrInvalidArgument)
		if said := map[string]string{"commit": "fn committed the", "rollback": "fn rolled back the"}[end]; !strings.Contains(err.Error(), said) {
			t.Errorf("%s: err = %v, want it to say %q", end, err, said)
		}
		commitErr := tx.Commit(ctx)
		if (commitErr == nil) != (end == "rollback") {
			t.Errorf("%s: the caller's COMMIT: %v", end, commitErr)
		}
		if n := ordersOf(t, p, "alice", key); n != 0 {
			t.Errorf("%s: %d orders committed", end, n)
		}
		if n := count(t, p, `SELECT count(*) FROM idem_keys WHERE idem_key = $1`, key); n != 0 {
			t.Errorf("%s: %d key rows committed", end, n)
		}
	}
}
