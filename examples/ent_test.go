package examples_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"entgo.io/ent/dialect"
	entsql "entgo.io/ent/dialect/sql"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/ent"
	"github.com/pgidem/idem/idemsql"
)

// entOn is an ent client whose statements run in tx (ent's SQL driver over
// any ExecQuerier, which a *sql.Tx is). The client is as cheap as a struct:
// build one per transaction.
func entOn(tx *sql.Tx) *ent.Client {
	return ent.NewClient(ent.Driver(entsql.NewDriver(dialect.Postgres, entsql.Conn{ExecQuerier: tx})))
}

// createOrderEnt: idemsql.DoInTx begins the transaction, and ent writes in
// it through a client over fn's *sql.Tx.
func createOrderEnt(ctx context.Context, db *sql.DB, key string, fp idem.Fingerprint, item string, quantity int) (idem.Result, error) {
	return idemsql.DoInTx(ctx, db, scope, key, fp, func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		order, err := entOn(tx).Order.Create().SetItem(item).SetQuantity(quantity).Save(ctx)
		if err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d}`, order.ID)}, nil
	})
}

// createOrderInEntTx: the service begins the transaction and runs its ent
// client over it, for idemsql.Do and for everything else the request
// writes; it commits at the end.
func createOrderInEntTx(ctx context.Context, db *sql.DB, key string, fp idem.Fingerprint, item string, quantity int) (idem.Result, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return idem.Result{}, err
	}
	defer tx.Rollback()
	client := entOn(tx)
	res, err := idemsql.Do(ctx, tx, scope, key, fp, func(ctx context.Context, _ *sql.Tx) (idem.Response, error) {
		order, err := client.Order.Create().SetItem(item).SetQuantity(quantity).Save(ctx)
		if err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d}`, order.ID)}, nil
	})
	if err != nil {
		return idem.Result{}, err
	}
	return res, tx.Commit()
}

func TestEnt(t *testing.T) {
	ctx := t.Context()
	db := openDB(t)
	first, err := createOrderEnt(ctx, db, "ent-1", fp(t, "ent-a", 1), "ent-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	second, err := createOrderEnt(ctx, db, "ent-1", fp(t, "ent-a", 1), "ent-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "ent-a")

	first, err = createOrderInEntTx(ctx, db, "ent-2", fp(t, "ent-b", 2), "ent-b", 2)
	if err != nil {
		t.Fatal(err)
	}
	second, err = createOrderInEntTx(ctx, db, "ent-2", fp(t, "ent-b", 2), "ent-b", 2)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "ent-b")
}
