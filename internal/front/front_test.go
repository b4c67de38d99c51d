package front

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// Each adapter's Txs holds its own transactions: another adapter's
// accessors, and the other type's, read nothing.
func TestTxsApart(t *testing.T) {
	var a, b Txs
	tx := &sql.Tx{}
	ctx := a.sqlTx.With(context.Background(), tx)
	if a.SQLTx(ctx) != tx {
		t.Error("SQLTx does not return the transaction put there")
	}
	if b.SQLTx(ctx) != nil || a.PgxTx(ctx) != nil || b.PgxTx(ctx) != nil {
		t.Error("another Txs, or the other type, returned a transaction")
	}
	var none pgx.Tx
	if a.PgxTx(a.pgxTx.With(context.Background(), none)) != nil {
		t.Error("a nil pgx.Tx read back as not nil")
	}
}

// A nil handle, a typed nil pointer too, is refused when the store opens.
func TestNilHandle(t *testing.T) {
	var txs Txs
	c, err := idem.New(idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for name, open := range map[string]Open{
		"nil Beginner":       txs.Pgx(nil),
		"nil *pgxpool":       txs.Pgx((*pgxpool.Pool)(nil)),
		"nil *sql.DB":        txs.SQL(nil, false),
		"nil *sql.DB, Citus": txs.SQL(nil, true),
		"valid *pgxpool":     txs.Pgx(&pgxpool.Pool{}),
	} {
		s, err := open(c)
		if want := name != "valid *pgxpool"; want != errors.Is(err, ErrNilHandle) || want != (s == nil) {
			t.Errorf("%s: %v, %v", name, s, err)
		}
	}
}
