package draw

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed schema.sql
var schema string

// The data Setup seeds: one user and one box. Callers that print or check
// the invariants start from these numbers.
const (
	SeedUser   = "alice"
	SeedPoints = 1000
	SeedBoxID  = 1
	SeedPrice  = 100
	SeedStock  = 50
)

// Prize is one entry of a box's prize table. A prize's chance is its weight
// divided by the box's total weight.
type Prize struct {
	Name   string
	Weight int
}

// Box is a box users draw from.
type Box struct {
	ID     int64
	Name   string
	Price  int64 // points per draw
	Stock  int   // draws left
	Prizes []Prize
}

// SeedBox is the box Setup creates.
var SeedBox = Box{
	ID:    SeedBoxID,
	Name:  "Starter Box",
	Price: SeedPrice,
	Stock: SeedStock,
	Prizes: []Prize{
		{Name: "Golden Goose", Weight: 1},
		{Name: "Silver Goose", Weight: 9},
		{Name: "Goose Plush", Weight: 30},
		{Name: "Goose Sticker", Weight: 60},
	},
}

// Setup creates the draw tables if they do not exist and seeds SeedUser with
// SeedPoints points and SeedBox. Running it again changes nothing: existing
// wallets and boxes are left as they are.
func Setup(ctx context.Context, pool *pgxpool.Pool) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, schema); err != nil {
			return fmt.Errorf("draw: create tables: %w", err)
		}
		if err := AddWallet(ctx, tx, SeedUser, SeedPoints); err != nil {
			return err
		}
		return AddBox(ctx, tx, SeedBox)
	})
}

// Execer is the part of a pool, connection or transaction the seeding
// helpers use.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// AddWallet creates a wallet holding points for user. An existing wallet is
// left unchanged.
func AddWallet(ctx context.Context, db Execer, user string, points int64) error {
	_, err := db.Exec(ctx,
		`INSERT INTO wallets (user_id, points) VALUES ($1, $2) ON CONFLICT (user_id) DO NOTHING`,
		user, points)
	if err != nil {
		return fmt.Errorf("draw: add wallet %q: %w", user, err)
	}
	return nil
}

// AddBox creates box and its prize table. An existing box, or an existing
// prize of the box, is left unchanged.
func AddBox(ctx context.Context, db Execer, box Box) error {
	_, err := db.Exec(ctx,
		`INSERT INTO boxes (id, name, price, stock) VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO NOTHING`,
		box.ID, box.Name, box.Price, box.Stock)
	if err != nil {
		return fmt.Errorf("draw: add box %d: %w", box.ID, err)
	}
	for _, p := range box.Prizes {
		_, err := db.Exec(ctx,
			`INSERT INTO prizes (box_id, name, weight) VALUES ($1, $2, $3) ON CONFLICT (box_id, name) DO NOTHING`,
			box.ID, p.Name, p.Weight)
		if err != nil {
			return fmt.Errorf("draw: add prize %q to box %d: %w", p.Name, box.ID, err)
		}
	}
	return nil
}
