package idem_test

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/draw"
	"github.com/pgidem/idem/internal/pgtest"
)

// The draw application of Example_draw. Its domain (debit the points, take
// stock, pick prizes, write the batch, the inventory and the ledger) lives
// in internal/draw, shared with cmd/idem-demo and the benchmark; these
// names stand for the application's own code in the example.

// drawRequest is the body of a draw request: {"box_id":1,"quantity":2}.
type drawRequest = draw.Request

// drawState is what the database holds for one user and box 1.
type drawState = draw.Snapshot

// startPoints and startStock are alice's points and box 1's draws when
// drawPool hands the database out.
const (
	startPoints = draw.SeedPoints
	startStock  = draw.SeedStock
)

// drawPool stands in for the application's pool (10 connections) on its
// database: idem's table and the draw tables, where alice holds 1000
// points and box 1 costs 100 points a draw and holds 50 draws. The function
// returned closes the pool and drops the database.
func drawPool() (*pgxpool.Pool, func()) {
	return pgtest.ExamplePool(func(ctx context.Context, pool *pgxpool.Pool) error {
		if err := idem.Migrate(ctx, pool); err != nil {
			return err
		}
		return draw.Setup(ctx, pool)
	}, 10)
}

// parseDrawRequest decodes and validates a draw request body.
func parseDrawRequest(body []byte) (drawRequest, error) { return draw.ParseRequest(body) }

// executeDraw performs one draw for user in tx: 201 with the batch on
// success, or a refusal made with idem.Reject (402 insufficient points,
// 409 out of stock, 404 unknown box).
func executeDraw(ctx context.Context, tx pgx.Tx, user string, req drawRequest) (idem.Response, error) {
	return draw.Execute(ctx, tx, user, req)
}

// readDrawState reads user's points, batches and ledger debits and box 1's
// stock in one statement.
func readDrawState(ctx context.Context, pool *pgxpool.Pool, user string) drawState {
	s, err := draw.Read(ctx, pool, user, 1)
	if err != nil {
		panic(err)
	}
	return s
}
