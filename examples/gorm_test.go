package examples_test

import (
	"context"
	"database/sql"
	"errors"
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

// gormOn is a session of g whose statements run in tx, idemsql's
// transaction: what GORM's own Begin does, with tx in place of a
// transaction GORM would begin. g is opened once, at startup; a session
// costs no round trip and shares g's configuration and caches.
func gormOn(ctx context.Context, g *gorm.DB, tx *sql.Tx) *gorm.DB {
	s := g.Session(&gorm.Session{NewDB: true, Context: ctx, SkipDefaultTransaction: true})
	s.Statement.ConnPool = tx
	return s
}

// createOrderGORM is a service's handler body under GORM: idemsql.DoInTx
// begins the transaction on db, and GORM (g, opened on the same db) writes
// in it.
func createOrderGORM(ctx context.Context, db *sql.DB, g *gorm.DB, key string, fp idem.Fingerprint, item string, quantity int) (idem.Result, error) {
	return idemsql.DoInTx(ctx, db, scope, key, fp, func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		order := Order{Item: item, Quantity: quantity}
		if err := gormOn(ctx, g, tx).Create(&order).Error; err != nil {
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
	g, err := gorm.Open(postgres.New(postgres.Config{Conn: db}), &gorm.Config{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := createOrderGORM(ctx, db, g, "gorm-1", fp(t, "gorm-a", 1), "gorm-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	second, err := createOrderGORM(ctx, db, g, "gorm-1", fp(t, "gorm-a", 1), "gorm-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "gorm-a")

	// The session writes in idemsql's transaction, not on g's pool: when fn
	// fails, its write rolls back with the transaction.
	failed := errors.New("after the write")
	_, err = idemsql.DoInTx(ctx, db, scope, "gorm-3", fp(t, "gorm-c", 3), func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		if err := gormOn(ctx, g, tx).Create(&Order{Item: "gorm-c", Quantity: 3}).Error; err != nil {
			return idem.Response{}, err
		}
		return idem.Response{}, failed
	})
	if !errors.Is(err, failed) {
		t.Fatalf("DoInTx: %v", err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM orders WHERE item = 'gorm-c'`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d orders of gorm-c after a failed fn, want 0 (%v)", n, err)
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
