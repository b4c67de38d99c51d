package draw

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Querier is the part of a pool, connection or transaction Read uses.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Snapshot is what the database holds for one user and one box, read in a
// single statement so the numbers are consistent with each other.
type Snapshot struct {
	Points  int64 // points left in the user's wallet
	Batches int   // the user's draw batches
	Draws   int   // draws in those batches (sum of quantities)
	Items   int   // the user's inventory rows
	Debits  int   // the user's ledger debits
	Debited int64 // points debited from the user, in total
	Stock   int   // draws left in the box
	Taken   int   // draws taken from the box by every user's batches
}

// Read returns the Snapshot of user and box boxID. A missing wallet or box
// reads as zero.
func Read(ctx context.Context, db Querier, user string, boxID int64) (Snapshot, error) {
	var s Snapshot
	err := db.QueryRow(ctx, `
		SELECT
			coalesce((SELECT points FROM wallets WHERE user_id = $1), 0),
			(SELECT count(*) FROM draw_batches WHERE user_id = $1),
			(SELECT coalesce(sum(quantity), 0) FROM draw_batches WHERE user_id = $1),
			(SELECT count(*) FROM inventory WHERE user_id = $1),
			(SELECT count(*) FROM point_ledger WHERE user_id = $1),
			(SELECT coalesce(sum(amount), 0)::bigint FROM point_ledger WHERE user_id = $1),
			coalesce((SELECT stock FROM boxes WHERE id = $2), 0),
			(SELECT coalesce(sum(quantity), 0) FROM draw_batches WHERE box_id = $2)`,
		user, boxID).Scan(&s.Points, &s.Batches, &s.Draws, &s.Items,
		&s.Debits, &s.Debited, &s.Stock, &s.Taken)
	if err != nil {
		return Snapshot{}, fmt.Errorf("draw: read snapshot: %w", err)
	}
	return s, nil
}

// Check reports every way s breaks the draw invariants, given the points the
// user started with (and was never credited since) and the stock the box
// started with:
//   - points left + points debited = starting points;
//   - stock left + draws taken = starting stock;
//   - one ledger debit per batch;
//   - one inventory row per draw.
func (s Snapshot) Check(startPoints int64, startStock int) error {
	var errs []error
	if s.Points+s.Debited != startPoints {
		errs = append(errs, fmt.Errorf("points %d + debited %d != %d", s.Points, s.Debited, startPoints))
	}
	if s.Stock+s.Taken != startStock {
		errs = append(errs, fmt.Errorf("stock %d + taken %d != %d", s.Stock, s.Taken, startStock))
	}
	if s.Debits != s.Batches {
		errs = append(errs, fmt.Errorf("%d debits for %d batches", s.Debits, s.Batches))
	}
	if s.Items != s.Draws {
		errs = append(errs, fmt.Errorf("%d inventory rows for %d draws", s.Items, s.Draws))
	}
	return errors.Join(errs...)
}

// Wallet is what a user holds: points left and prizes won.
type Wallet struct {
	User   string         `json:"user"`
	Points int64          `json:"points"`
	Draws  int            `json:"draws"`  // draws in the user's batches
	Prizes map[string]int `json:"prizes"` // prize name -> count in the inventory
}

// ErrNoWallet is returned by ReadWallet for a user without a wallet.
var ErrNoWallet = errors.New("draw: no such wallet")

// ReadWallet returns user's Wallet, read in a single statement.
func ReadWallet(ctx context.Context, db Querier, user string) (Wallet, error) {
	w := Wallet{User: user, Prizes: map[string]int{}}
	var prizes []byte
	err := db.QueryRow(ctx, `
		SELECT w.points,
			(SELECT coalesce(sum(quantity), 0) FROM draw_batches WHERE user_id = $1),
			(SELECT coalesce(jsonb_object_agg(prize, n), '{}')
			 FROM (SELECT prize, count(*) AS n FROM inventory WHERE user_id = $1 GROUP BY prize) AS p)
		FROM wallets AS w WHERE w.user_id = $1`,
		user).Scan(&w.Points, &w.Draws, &prizes)
	if errors.Is(err, pgx.ErrNoRows) {
		return Wallet{}, fmt.Errorf("%w: %q", ErrNoWallet, user)
	}
	if err == nil {
		err = json.Unmarshal(prizes, &w.Prizes)
	}
	if err != nil {
		return Wallet{}, fmt.Errorf("draw: read wallet: %w", err)
	}
	return w, nil
}
