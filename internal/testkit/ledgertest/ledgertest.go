// Package ledgertest is the ledger domain of the fault tests (package idem's
// and idemhttp's): accounts with a balance, one ledger entry per executed
// transfer, and the invariant checked at the end of a faulty run.
//
// The invariant ([Check]): every key took effect exactly once, every answer a
// client got equals the response of the execution that committed, a final
// retry replays that response, and the ledger balances.
package ledgertest

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/pgtest"
	"github.com/pgidem/idem/internal/testkit/relay"
)

const (
	// Accounts is the number of accounts, with ids 1 to Accounts.
	Accounts = 8
	// Opening is every account's opening balance.
	Opening = 1_000_000
)

// Migrate installs idem's table and the ledger domain: Accounts accounts
// holding Opening each, and a ledger of one entry per executed transfer.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, fmt.Sprintf(`
		CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO accounts SELECT g, %d FROM generate_series(1, %d) g;
		CREATE TABLE ledger (
			id bigserial PRIMARY KEY,
			idem_key text NOT NULL,
			from_account int NOT NULL REFERENCES accounts,
			to_account int NOT NULL REFERENCES accounts,
			amount bigint NOT NULL)`, Opening, Accounts))
	return err
}

// BehindRelay makes a fresh ledger database (see [Migrate]) and starts a
// relay in front of it that cuts the connection right after the server
// acknowledged a COMMIT whenever dropAfterCommit says so. It returns the
// database's own URL (to check the invariant directly), the URL through the
// relay (for the instances) and the relay. The relay is closed and the
// database dropped when the test ends; failures fail the test.
func BehindRelay(t testing.TB, dropAfterCommit func() bool) (direct, relayed string, r *relay.Relay) {
	t.Helper()
	direct = pgtest.URL(t, Migrate)
	target, err := relay.Target(direct)
	if err != nil {
		t.Fatal(err)
	}
	r, err = relay.Start(target, relay.Options{DropAfterCommit: dropAfterCommit})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	relayed, err = r.ConnString(direct)
	if err != nil {
		t.Fatal(err)
	}
	return direct, relayed, r
}

// Transfer is one client intent: move Amount from one account to another.
// Its JSON form (without the key) is the request body and the fingerprint.
type Transfer struct {
	Key    string `json:"-"`
	From   int    `json:"from"`
	To     int    `json:"to"`
	Amount int64  `json:"amount"`
}

// Transfers returns n random transfers between distinct accounts, with keys
// prefix-0000, prefix-0001, ….
func Transfers(n int, prefix string) []Transfer {
	out := make([]Transfer, n)
	for i := range out {
		from := 1 + rand.N(Accounts)
		to := 1 + (from+rand.N(Accounts-1))%Accounts // never from
		out[i] = Transfer{Key: fmt.Sprintf("%s-%04d", prefix, i), From: from, To: to, Amount: 1 + rand.Int64N(500)}
	}
	return out
}

// Schedule returns the requests to send for trs: each key twice in a row
// (concurrent duplicates), then each key copies-2 more times in a shuffled
// order (later duplicates, some while the first is still running).
func Schedule(trs []Transfer, copies int) []Transfer {
	var jobs []Transfer
	for _, tr := range trs {
		jobs = append(jobs, tr, tr)
	}
	var later []Transfer
	for range copies - 2 {
		later = append(later, trs...)
	}
	rand.Shuffle(len(later), func(i, j int) { later[i], later[j] = later[j], later[i] })
	return append(jobs, later...)
}

// Body is the response body of the execution of tr that wrote ledger entry
// entry.
func Body(tr Transfer, entry int64) []byte {
	return fmt.Appendf(nil, `{"key":%q,"entry":%d,"from":%d,"to":%d,"amount":%d}`,
		tr.Key, entry, tr.From, tr.To, tr.Amount)
}

// Write debits, credits (in the transfer's own order: concurrent transfers
// may deadlock unless the caller locked the accounts first) and writes the
// ledger entry in tx, and returns the entry's id.
func Write(ctx context.Context, tx pgx.Tx, tr Transfer) (entry int64, err error) {
	if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance - $2 WHERE id = $1`, tr.From, tr.Amount); err != nil {
		return 0, err
	}
	if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1`, tr.To, tr.Amount); err != nil {
		return 0, err
	}
	err = tx.QueryRow(ctx, `INSERT INTO ledger (idem_key, from_account, to_account, amount)
		VALUES ($1, $2, $3, $4) RETURNING id`, tr.Key, tr.From, tr.To, tr.Amount).Scan(&entry)
	return entry, err
}

// Answer is a successful response a client read in full.
type Answer struct {
	Body     []byte
	Replayed bool
}

// Check verifies the invariant on the database behind pool for trs, all of
// which must have been answered (answers holds every answer by key):
//   - each key has exactly one ledger entry, matching its transfer, and the
//     ledger holds no other entry;
//   - every answer for a key is Body of that entry, and at most one of them
//     is not a replay;
//   - replay(tr, committed), the caller's final retry of tr, which reports
//     its own failures (it should replay committed and run nothing);
//   - every account's balance is its opening balance plus its ledger
//     entries, and the total is unchanged.
func Check(t testing.TB, ctx context.Context, pool *pgxpool.Pool, trs []Transfer, answers map[string][]Answer,
	replay func(tr Transfer, committed []byte)) {
	t.Helper()
	entries := map[string][]int64{}
	want := map[int]int64{}
	for i := 1; i <= Accounts; i++ {
		want[i] = Opening
	}
	byKey := map[string]Transfer{}
	for _, tr := range trs {
		byKey[tr.Key] = tr
	}
	rows, err := pool.Query(ctx, `SELECT id, idem_key, from_account, to_account, amount FROM ledger`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, amount int64
		var key string
		var from, to int
		if err := rows.Scan(&id, &key, &from, &to, &amount); err != nil {
			t.Fatal(err)
		}
		tr, ok := byKey[key]
		if !ok || tr.From != from || tr.To != to || tr.Amount != amount {
			t.Errorf("ledger entry %d (%s %d->%d %d) matches no transfer", id, key, from, to, amount)
		}
		entries[key] = append(entries[key], id)
		want[from] -= amount
		want[to] += amount
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	for _, tr := range trs {
		ids := entries[tr.Key]
		if len(ids) != 1 {
			t.Errorf("key %s: %d ledger entries, want exactly 1", tr.Key, len(ids))
			continue
		}
		committed := Body(tr, ids[0])
		fresh := 0
		for _, a := range answers[tr.Key] {
			if !bytes.Equal(a.Body, committed) {
				t.Errorf("key %s: answered %s, committed %s", tr.Key, a.Body, committed)
			}
			if !a.Replayed {
				fresh++
			}
		}
		if len(answers[tr.Key]) == 0 {
			t.Errorf("key %s: never answered", tr.Key)
		}
		if fresh > 1 {
			t.Errorf("key %s: %d answers were not replays", tr.Key, fresh)
		}
		replay(tr, committed)
	}

	var total int64
	rows, err = pool.Query(ctx, `SELECT id, balance FROM accounts`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int
		var balance int64
		if err := rows.Scan(&id, &balance); err != nil {
			t.Fatal(err)
		}
		if balance != want[id] {
			t.Errorf("account %d: balance %d, ledger says %d", id, balance, want[id])
		}
		total += balance
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if total != Accounts*Opening {
		t.Errorf("total balance %d, want %d", total, Accounts*Opening)
	}
}
