package examples_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// Order is the examples' domain row.
type Order struct {
	ID       int64
	Item     string
	Quantity int
}

// gormOn is a GORM handle whose statements run in tx: a session of GORM
// opened on idemsql's transaction (no transaction of GORM's own).
func gormOn(tx *sql.Tx) (*gorm.DB, error) {
	return gorm.Open(postgres.New(postgres.Config{Conn: tx}), &gorm.Config{SkipDefaultTransaction: true})
}

// createOrderGORM is a service's handler body under GORM: idemsql.DoInTx
// begins the transaction, and GORM writes in it.
func createOrderGORM(ctx context.Context, db *sql.DB, key string, fp idem.Fingerprint, item string, quantity int) (idem.Result, error) {
	return idemsql.DoInTx(ctx, db, scope, key, fp, func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		g, err := gormOn(tx)
		if err != nil {
			return idem.Response{}, err
		}
		order := Order{Item: item, Quantity: quantity}
		if err := g.WithContext(ctx).Create(&order).Error; err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d}`, order.ID)}, nil
	})
}

// createOrderInGORMTx is the same when GORM runs the transaction: its
// *sql.Tx (the ConnPool of GORM's transaction) goes to idemsql.Do, and fn
// writes through GORM's own transaction handle.
func createOrderInGORMTx(ctx context.Context, g *gorm.DB, key string, fp idem.Fingerprint, item string, quantity int) (res idem.Result, err error) {
	err = g.WithContext(ctx).Transaction(func(gtx *gorm.DB) error {
		tx, ok := gtx.Statement.ConnPool.(*sql.Tx)
		if !ok {
			return fmt.Errorf("GORM's transaction runs on %T, not a *sql.Tx", gtx.Statement.ConnPool)
		}
		res, err = idemsql.Do(ctx, tx, scope, key, fp, func(ctx context.Context, _ *sql.Tx) (idem.Response, error) {
			order := Order{Item: item, Quantity: quantity}
			if err := gtx.Create(&order).Error; err != nil {
				return idem.Response{}, err
			}
			return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d}`, order.ID)}, nil
		})
		return err
	})
	return res, err
}

func TestGORM(t *testing.T) {
	ctx := t.Context()
	db := openDB(t)
	first, err := createOrderGORM(ctx, db, "gorm-1", fp(t, "gorm-a", 1), "gorm-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	second, err := createOrderGORM(ctx, db, "gorm-1", fp(t, "gorm-a", 1), "gorm-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "gorm-a")

	g, err := gorm.Open(postgres.New(postgres.Config{Conn: db}), &gorm.Config{})
	if err != nil {
		t.Fatal(err)
	}
	first, err = createOrderInGORMTx(ctx, g, "gorm-2", fp(t, "gorm-b", 2), "gorm-b", 2)
	if err != nil {
		t.Fatal(err)
	}
	second, err = createOrderInGORMTx(ctx, g, "gorm-2", fp(t, "gorm-b", 2), "gorm-b", 2)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "gorm-b")
}
