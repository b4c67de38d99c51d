package examples_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"github.com/jmoiron/sqlx"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// sqlxOrder is the orders row as sqlx maps it.
type sqlxOrder struct {
	ID       int64  `db:"id"`
	Item     string `db:"item"`
	Quantity int    `db:"quantity"`
}

// insertOrder writes an order in tx with a named query, bound for
// PostgreSQL by xdb (BindNamed), and returns its id.
func insertOrder(ctx context.Context, xdb *sqlx.DB, tx *sql.Tx, order sqlxOrder) (int64, error) {
	query, args, err := xdb.BindNamed(`INSERT INTO orders (item, quantity) VALUES (:item, :quantity) RETURNING id`, order)
	if err != nil {
		return 0, err
	}
	var id int64
	err = tx.QueryRowContext(ctx, query, args...).Scan(&id)
	return id, err
}

// createOrderSQLX: idemsql.DoInTx begins the transaction on the *sql.DB
// under sqlx (xdb.DB), and the write runs in it.
func createOrderSQLX(ctx context.Context, xdb *sqlx.DB, key string, fp idem.Fingerprint, item string, quantity int) (idem.Result, error) {
	return idemsql.DoInTx(ctx, xdb.DB, scope, key, fp, func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
		id, err := insertOrder(ctx, xdb, tx, sqlxOrder{Item: item, Quantity: quantity})
		if err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d}`, id)}, nil
	})
}

// createOrderInSQLXTx: sqlx begins the transaction; sqlx.Tx embeds its
// *sql.Tx, which goes to idemsql.Do, and fn uses sqlx's transaction.
func createOrderInSQLXTx(ctx context.Context, xdb *sqlx.DB, key string, fp idem.Fingerprint, item string, quantity int) (idem.Result, error) {
	xtx, err := xdb.BeginTxx(ctx, nil)
	if err != nil {
		return idem.Result{}, err
	}
	defer xtx.Rollback()
	res, err := idemsql.Do(ctx, xtx.Tx, scope, key, fp, func(ctx context.Context, _ *sql.Tx) (idem.Response, error) {
		var id int64
		err := xtx.GetContext(ctx, &id, `INSERT INTO orders (item, quantity) VALUES ($1, $2) RETURNING id`, item, quantity)
		if err != nil {
			return idem.Response{}, err
		}
		return idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"order":%d}`, id)}, nil
	})
	if err != nil {
		return idem.Result{}, err
	}
	return res, xtx.Commit()
}

func TestSQLX(t *testing.T) {
	ctx := t.Context()
	db := openDB(t)
	xdb := sqlx.NewDb(db, "pgx")
	first, err := createOrderSQLX(ctx, xdb, "sqlx-1", fp(t, "sqlx-a", 1), "sqlx-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	second, err := createOrderSQLX(ctx, xdb, "sqlx-1", fp(t, "sqlx-a", 1), "sqlx-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "sqlx-a")

	first, err = createOrderInSQLXTx(ctx, xdb, "sqlx-2", fp(t, "sqlx-b", 2), "sqlx-b", 2)
	if err != nil {
		t.Fatal(err)
	}
	second, err = createOrderInSQLXTx(ctx, xdb, "sqlx-2", fp(t, "sqlx-b", 2), "sqlx-b", 2)
	if err != nil {
		t.Fatal(err)
	}
	checkOnce(t, db, first, second, "sqlx-b")
}
