package idem_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// Do runs inside the application's own transaction: here a transfer
// handler that also writes an audit row. The key, the transfer and the
// stored response commit or roll back with that transaction, so a failure
// before COMMIT leaves nothing behind and the retry with the same key runs.
func ExampleDo() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO accounts VALUES ('alice', 100), ('bob', 0);
		CREATE TABLE audit (id bigserial PRIMARY KEY, entry text NOT NULL)`); err != nil {
		panic(err)
	}

	// transfer is the business function: Do runs it once per key.
	transfer := func(ctx context.Context, tx pgx.Tx, from, to string, amount int64) (idem.Response, error) {
		for _, move := range []struct {
			account string
			delta   int64
		}{{from, -amount}, {to, amount}} {
			if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1`,
				move.account, move.delta); err != nil {
				return idem.Response{}, err // undone, nothing stored: a retry runs again
			}
		}
		body := fmt.Appendf(nil, `{"from":%q,"to":%q,"amount":%d}`, from, to, amount)
		return idem.Response{Status: 201, Body: body}, nil
	}

	// handle is the application's request handler: its own transaction,
	// its own audit row, and the transfer under Do.
	handle := func(user, key, to string, amount int64, lose error) {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			scope := idem.Scope{Actor: user, Operation: "transfer"}
			fp := idem.FingerprintParts([]byte(to), []byte(strconv.FormatInt(amount, 10)))
			res, err := idem.Do(ctx, tx, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				return transfer(ctx, tx, user, to, amount)
			})
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO audit (entry) VALUES ($1)`,
				fmt.Sprintf("%s: transfer, replayed=%t", user, res.Replayed)); err != nil {
				return err
			}
			if lose != nil {
				return lose // pgx.BeginFunc rolls back
			}
			fmt.Printf("%d %s replayed=%t\n", res.Status, res.Body, res.Replayed)
			return nil
		})
		if err != nil {
			fmt.Println("rolled back:", err)
		}
	}

	handle("alice", "tr-1", "bob", 30, errors.New("connection lost before COMMIT"))
	handle("alice", "tr-1", "bob", 30, nil) // the retry runs: the failed attempt left nothing
	handle("alice", "tr-1", "bob", 30, nil) // the response was lost; the next retry replays

	var alice, bob, audit int
	if err := pool.QueryRow(ctx, `SELECT
		(SELECT balance FROM accounts WHERE id = 'alice'), (SELECT balance FROM accounts WHERE id = 'bob'),
		(SELECT count(*) FROM audit)`).Scan(&alice, &bob, &audit); err != nil {
		panic(err)
	}
	fmt.Printf("alice %d, bob %d, audit rows %d\n", alice, bob, audit)
	// Output:
	// rolled back: connection lost before COMMIT
	// 201 {"from":"alice","to":"bob","amount":30} replayed=false
	// 201 {"from":"alice","to":"bob","amount":30} replayed=true
	// alice 70, bob 30, audit rows 2
}

// DoInTx opens and commits the transaction itself: a deposit the app may
// send again and again with the same key moves the money once. A replay
// returns the first response as it was (the balance then), never one
// computed again.
func ExampleDoInTx() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO accounts VALUES ('alice', 0)`); err != nil {
		panic(err)
	}

	// deposit is the business function, run once per key.
	deposit := func(ctx context.Context, user, key string, amount int64) (idem.Result, error) {
		scope := idem.Scope{Actor: user, Operation: "deposit"}
		fp := idem.FingerprintParts([]byte(strconv.FormatInt(amount, 10)))
		return idem.DoInTx(ctx, pool, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			var balance int64
			err := tx.QueryRow(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance`,
				user, amount).Scan(&balance)
			if err != nil {
				return idem.Response{}, err // rolled back, nothing stored: a retry runs again
			}
			return idem.Response{Status: 200, Body: fmt.Appendf(nil, `{"balance":%d}`, balance)}, nil
		})
	}
	show := func(res idem.Result, err error) {
		switch {
		case errors.Is(err, idem.ErrKeyReused):
			fmt.Println("refused: the key was used for another deposit")
		case err != nil:
			panic(err)
		default:
			fmt.Printf("%d %s replayed=%t\n", res.Status, res.Body, res.Replayed)
		}
	}

	show(deposit(ctx, "alice", "dep-1", 100))
	show(deposit(ctx, "alice", "dep-1", 100)) // the response was lost; the app retries
	show(deposit(ctx, "alice", "dep-2", 50))  // a new deposit, a new key
	show(deposit(ctx, "alice", "dep-1", 999)) // a bug sends another amount with an old key

	var balance int64
	if err := pool.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = 'alice'`).Scan(&balance); err != nil {
		panic(err)
	}
	fmt.Println("balance:", balance)
	// Output:
	// 200 {"balance":100} replayed=false
	// 200 {"balance":100} replayed=true
	// 200 {"balance":150} replayed=false
	// refused: the key was used for another deposit
	// balance: 150
}

// Reject makes a refusal the final outcome of its key: the withdrawal's
// debit is undone, the 402 is stored, and every retry with that key gets
// the same 402, even after the account was topped up. A new attempt is a
// new intent with a new key.
func ExampleReject() {
	ctx := context.Background()
	pool, closeDB := examplePool() // the application's *pgxpool.Pool
	defer closeDB()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO accounts VALUES ('alice', 50)`); err != nil {
		panic(err)
	}

	// withdraw is the business function, run once per key.
	withdraw := func(ctx context.Context, user, key string, amount int64) {
		scope := idem.Scope{Actor: user, Operation: "withdraw"}
		fp := idem.FingerprintParts([]byte(strconv.FormatInt(amount, 10)))
		res, err := idem.DoInTx(ctx, pool, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			var balance int64
			err := tx.QueryRow(ctx, `UPDATE accounts SET balance = balance - $2 WHERE id = $1 RETURNING balance`,
				user, amount).Scan(&balance)
			if err != nil {
				return idem.Response{}, err // rolled back, nothing stored: a retry runs again
			}
			if balance < 0 {
				// The debit above is undone; the refusal is stored.
				return idem.Response{}, idem.Reject(idem.Response{Status: 402, Body: []byte(`{"error":"insufficient funds"}`)})
			}
			return idem.Response{Status: 200, Body: fmt.Appendf(nil, `{"balance":%d}`, balance)}, nil
		})
		if err != nil {
			panic(err)
		}
		fmt.Printf("%s: %d %s replayed=%t\n", key, res.Status, res.Body, res.Replayed)
	}
	balance := func() int64 {
		var b int64
		if err := pool.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = 'alice'`).Scan(&b); err != nil {
			panic(err)
		}
		return b
	}

	withdraw(ctx, "alice", "wd-1", 80)
	withdraw(ctx, "alice", "wd-1", 80) // a retry replays the refusal
	fmt.Println("balance:", balance())
	if _, err := pool.Exec(ctx, `UPDATE accounts SET balance = balance + 100 WHERE id = 'alice'`); err != nil {
		panic(err)
	}
	withdraw(ctx, "alice", "wd-1", 80) // still refused: that key's outcome is decided
	withdraw(ctx, "alice", "wd-2", 80) // a new attempt, a new key
	fmt.Println("balance:", balance())
	// Output:
	// wd-1: 402 {"error":"insufficient funds"} replayed=false
	// wd-1: 402 {"error":"insufficient funds"} replayed=true
	// balance: 50
	// wd-1: 402 {"error":"insufficient funds"} replayed=true
	// wd-2: 200 {"balance":70} replayed=false
	// balance: 70
}

// examplePool connects the way a service does: to DATABASE_URL (here with
// a default for a local PostgreSQL), through a pgxpool, with idem.Migrate at
// start-up. In a service that is all:
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	...
//	err = idem.Migrate(ctx, pool)
//
// Only so that the examples never see each other's rows or those of an
// earlier run, each one gets a schema of its own, first on the pool's
// search_path: idem's table and the example's tables live there, and the
// function returned drops it and closes the pool.
func examplePool() (*pgxpool.Pool, func()) {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@localhost:5432/postgres"
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		panic(err)
	}
	cfg.MaxConns = 10
	schema := fmt.Sprintf("example_%x", rand.Uint64())
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		_, err = pool.Exec(ctx, "CREATE SCHEMA "+schema)
		if err == nil {
			err = idem.Migrate(ctx, pool)
		}
	}
	if err != nil {
		panic(err)
	}
	return pool, func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	}
}
