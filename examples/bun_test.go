package examples_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/pgdialect"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// bunOrder is the orders row as Bun maps it.
type bunOrder struct {
	bun.BaseModel `bun:"table:orders"`
	ID            int64 `bun:",pk,autoincrement"`
	Item          string
	Quantity      int
}

// createOrderBun: idemsql.DoInTx begins the transaction, and Bun's queries
// run in it through Conn(tx) (a *sql.Tx is a bun.IConn).
func createOrderBun(ctx context.Context, bdb *bun.DB, key string, fp idem.Fingerprint, item string, quantity int) (idem.Result, error) {
	return idemsql.DoInTx(ctx, bdb.DB, scope, key, fp, func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		order := bunOrder{Item: item, Quantity: quantity}
		if _, err := bdb.NewInsert().Conn(tx).Model(&order).Returning("id").Exec(ctx); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d}`, order.ID)}, nil
	})
}

// createOrderInBunTx: Bun runs the transaction; bun.Tx embeds its *sql.Tx,
// which goes to idemsql.Do.
func createOrderInBunTx(ctx context.Context, bdb *bun.DB, key string, fp idem.Fingerprint, item string, quantity int) (res idem.Result, err error) {
	err = bdb.RunInTx(ctx, nil, func(ctx context.Context, btx bun.Tx) error {
		res, err = idemsql.Do(ctx, btx.Tx, scope, key, fp, func(ctx context.Context, _ *sql.Tx) (idem.Response, error) {
			order := bunOrder{Item: item, Quantity: quantity}
			if _, err := btx.NewInsert().Model(&order).Returning("id").Exec(ctx); err != nil {
				return idem.Response{}, err
			}
			return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d}`, order.ID)}, nil
		})
		return err
	})
	return res, err
}

func TestBun(t *testing.T) {
	ctx := t.Context()
	db := openDB(t)
	bdb := bun.NewDB(db, pgdialect.New())
	first, err := createOrderBun(ctx, bdb, "bun-1", fp(t, "bun-a", 1), "bun-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	second, err := createOrderBun(ctx, bdb, "bun-1", fp(t, "bun-a", 1), "bun-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "bun-a")

	first, err = createOrderInBunTx(ctx, bdb, "bun-2", fp(t, "bun-b", 2), "bun-b", 2)
	if err != nil {
		t.Fatal(err)
	}
	second, err = createOrderInBunTx(ctx, bdb, "bun-2", fp(t, "bun-b", 2), "bun-b", 2)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "bun-b")
}
