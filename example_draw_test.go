package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// The Goose Kuzi draw: one request debits points, takes stock from a box,
// picks prizes at random and writes a batch and a ledger debit (executeDraw
// below, the application's domain code). The draw endpoint
// runs it under idem.DoInTx, and this example puts it through the failure
// scenarios of the design, printing what the database holds after each one.
func Example_draw() {
	ctx := context.Background()
	check := func(err error) {
		if err != nil {
			panic(err)
		}
	}

	// The application's pool on its database (examplePool, in
	// example_test.go), and its tables: alice holds 1000 points; box 1 costs
	// 100 points a draw and holds 50 draws.
	pool, closeDB := examplePool()
	defer closeDB()
	_, err := pool.Exec(ctx, drawSchema)
	check(err)

	// drawOnce is the draw endpoint: parse the body, fingerprint it, and
	// draw once per key. An invalid body claims nothing.
	drawOnce := func(ctx context.Context, user, key string, body []byte) (idem.Result, error) {
		req, err := parseDrawRequest(body)
		if err != nil {
			return idem.Result{}, err
		}
		fp, err := idem.FingerprintJSON(body)
		if err != nil {
			return idem.Result{}, err
		}
		return idem.DoInTx(ctx, pool, idem.Scope{Actor: user, Operation: "draw"}, key, fp,
			func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				return executeDraw(ctx, tx, user, req)
			})
	}
	show := func() {
		s := readDrawState(ctx, pool, "alice")
		fmt.Printf("   points=%d stock=%d batches=%d debits=%d\n", s.Points, s.Stock, s.Batches, s.Debits)
	}
	batchID := func(res idem.Result) int64 {
		var out struct {
			BatchID int64 `json:"batch_id"`
		}
		check(json.Unmarshal(res.Body, &out))
		return out.BatchID
	}

	// 1. The draw commits, but the response is lost on the way to the app.
	// The app retries with the same key and the same body.
	twoDraws := []byte(`{"box_id":1,"quantity":2}`)
	first, err := drawOnce(ctx, "alice", "req-0001", twoDraws)
	check(err)
	retry, err := drawOnce(ctx, "alice", "req-0001", twoDraws)
	check(err)
	fmt.Println("1. retry after a lost response")
	fmt.Printf("   first: %d replayed=%t; retry: %d replayed=%t; same batch: %t; same bytes: %t\n",
		first.Status, first.Replayed, retry.Status, retry.Replayed,
		batchID(first) == batchID(retry), bytes.Equal(first.Body, retry.Body))
	show()

	// 2. A client bug sends a different body under the same key.
	_, err = drawOnce(ctx, "alice", "req-0001", []byte(`{"box_id":1,"quantity":5}`))
	fmt.Println("2. same key, different body")
	fmt.Println("   refused with ErrKeyReused:", errors.Is(err, idem.ErrKeyReused))
	show()

	// 3. A double tap and an eager retry library: 8 copies of one request
	// arrive at once, each on its own connection.
	results := make([]idem.Result, 8)
	errs := make([]error, 8)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			results[i], errs[i] = drawOnce(ctx, "alice", "req-0002", []byte(`{"box_id":1,"quantity":1}`))
		})
	}
	wg.Wait()
	executed, others := 0, 0
	batches := map[int64]bool{}
	for i := range 8 {
		switch {
		case errors.Is(errs[i], idem.ErrInProgress):
			others++ // told to retry later
		case errs[i] != nil:
			panic(errs[i])
		case results[i].Replayed:
			others++
			batches[batchID(results[i])] = true
		default:
			executed++
			batches[batchID(results[i])] = true
		}
	}
	fmt.Println("3. 8 concurrent duplicates")
	fmt.Printf("   executed: %d; replayed or in progress: %d; batch ids seen: %d\n", executed, others, len(batches))
	show()

	// 4. The draw runs inside the caller's transaction, which then fails
	// before COMMIT. The key, the debit, the stock and the batch all roll
	// back together, and the retry with the same key draws normally.
	oneDraw := []byte(`{"box_id":1,"quantity":1}`)
	fp, err := idem.FingerprintJSON(oneDraw)
	check(err)
	lost := errors.New("connection lost before COMMIT")
	err = idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		_, err := idem.Do(ctx, tx, idem.Scope{Actor: "alice", Operation: "draw"}, "req-0003", fp,
			func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				return executeDraw(ctx, tx, "alice", drawRequest{BoxID: 1, Quantity: 1})
			})
		if err != nil {
			return err
		}
		return lost
	})
	fmt.Println("4. failure before commit, then retry")
	fmt.Println("   rolled back:", errors.Is(err, lost))
	show()
	again, err := drawOnce(ctx, "alice", "req-0003", oneDraw)
	check(err)
	fmt.Printf("   retry: %d replayed=%t\n", again.Status, again.Replayed)
	show()

	// 5. Ten draws cost 1000 points; alice has 600 left. The refusal is
	// stored: the retry replays it instead of drawing again.
	tenDraws := []byte(`{"box_id":1,"quantity":10}`)
	poor, err := drawOnce(ctx, "alice", "req-0004", tenDraws)
	check(err)
	poorAgain, err := drawOnce(ctx, "alice", "req-0004", tenDraws)
	check(err)
	fmt.Println("5. insufficient points")
	fmt.Printf("   first: %d replayed=%t; retry: %d replayed=%t; same bytes: %t\n",
		poor.Status, poor.Replayed, poorAgain.Status, poorAgain.Replayed, bytes.Equal(poor.Body, poorAgain.Body))
	show()

	// Points and stock add up: nothing was charged or taken twice.
	s := readDrawState(ctx, pool, "alice")
	fmt.Printf("points %d + debited %d = %d; stock %d + taken %d = %d; invariants hold: %t\n",
		s.Points, s.Debited, s.Points+s.Debited, s.Stock, s.Taken, s.Stock+s.Taken,
		s.Check(startPoints, startStock) == nil)

	// Output:
	// 1. retry after a lost response
	//    first: 201 replayed=false; retry: 201 replayed=true; same batch: true; same bytes: true
	//    points=800 stock=48 batches=1 debits=1
	// 2. same key, different body
	//    refused with ErrKeyReused: true
	//    points=800 stock=48 batches=1 debits=1
	// 3. 8 concurrent duplicates
	//    executed: 1; replayed or in progress: 7; batch ids seen: 1
	//    points=700 stock=47 batches=2 debits=2
	// 4. failure before commit, then retry
	//    rolled back: true
	//    points=700 stock=47 batches=2 debits=2
	//    retry: 201 replayed=false
	//    points=600 stock=46 batches=3 debits=3
	// 5. insufficient points
	//    first: 402 replayed=false; retry: 402 replayed=true; same bytes: true
	//    points=600 stock=46 batches=3 debits=3
	// points 600 + debited 400 = 1000; stock 46 + taken 4 = 50; invariants hold: true
}

// The draw application: its tables, alice's wallet and box 1.
const drawSchema = `
	CREATE TABLE wallets (user_id text PRIMARY KEY, points bigint NOT NULL CHECK (points >= 0));
	CREATE TABLE boxes (id bigint PRIMARY KEY, price bigint NOT NULL, stock int NOT NULL CHECK (stock >= 0));
	CREATE TABLE draw_batches (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		user_id text NOT NULL REFERENCES wallets, box_id bigint NOT NULL REFERENCES boxes,
		quantity int NOT NULL, prizes text[] NOT NULL);
	CREATE TABLE point_ledger (
		batch_id bigint PRIMARY KEY REFERENCES draw_batches, -- one debit per batch
		user_id text NOT NULL REFERENCES wallets, amount bigint NOT NULL);
	INSERT INTO wallets VALUES ('alice', 1000);
	INSERT INTO boxes VALUES (1, 100, 50)`

// startPoints and startStock are alice's points and box 1's draws in
// drawSchema.
const (
	startPoints = 1000
	startStock  = 50
)

// drawRequest is the body of a draw request: {"box_id":1,"quantity":2}.
type drawRequest struct {
	BoxID    int64 `json:"box_id"`
	Quantity int   `json:"quantity"`
}

// parseDrawRequest decodes and validates a draw request body.
func parseDrawRequest(body []byte) (drawRequest, error) {
	var req drawRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return drawRequest{}, fmt.Errorf("invalid draw request: %w", err)
	}
	if req.BoxID <= 0 || req.Quantity < 1 || req.Quantity > 10 {
		return drawRequest{}, errors.New("invalid draw request: box_id must be positive, quantity 1 to 10")
	}
	return req, nil
}

// prizes are what a draw may win, the common ones more often.
var prizes = []string{"Golden Goose", "Silver Goose", "Goose Plush", "Goose Plush", "Goose Sticker", "Goose Sticker"}

// executeDraw performs one draw for user in tx: 201 with the batch on
// success, or a refusal made with idem.Reject (402 insufficient points or
// unknown box, 409 out of stock), which undoes the debit and is stored.
func executeDraw(ctx context.Context, tx pgx.Tx, user string, req drawRequest) (idem.Response, error) {
	var cost, pointsLeft int64
	err := tx.QueryRow(ctx, `
		UPDATE wallets AS w SET points = w.points - b.price * $3
		FROM boxes AS b
		WHERE w.user_id = $1 AND b.id = $2 AND w.points >= b.price * $3
		RETURNING b.price * $3, w.points`, user, req.BoxID, req.Quantity).Scan(&cost, &pointsLeft)
	if errors.Is(err, pgx.ErrNoRows) {
		return idem.Response{}, idem.Reject(idem.Response{Status: 402, Body: []byte(`{"error":"insufficient points"}`)})
	}
	if err != nil {
		return idem.Response{}, err
	}
	tag, err := tx.Exec(ctx, `UPDATE boxes SET stock = stock - $2 WHERE id = $1 AND stock >= $2`, req.BoxID, req.Quantity)
	if err != nil {
		return idem.Response{}, err
	}
	if tag.RowsAffected() == 0 {
		return idem.Response{}, idem.Reject(idem.Response{Status: 409, Body: []byte(`{"error":"out of stock"}`)})
	}
	won := make([]string, req.Quantity)
	for i := range won {
		won[i] = prizes[rand.IntN(len(prizes))] // a replay returns these, never draws again
	}
	var batchID int64
	err = tx.QueryRow(ctx, `
		WITH batch AS (
			INSERT INTO draw_batches (user_id, box_id, quantity, prizes) VALUES ($1, $2, $3, $4) RETURNING id
		), debit AS (
			INSERT INTO point_ledger (batch_id, user_id, amount) SELECT id, $1, $5 FROM batch
		)
		SELECT id FROM batch`, user, req.BoxID, req.Quantity, won, cost).Scan(&batchID)
	if err != nil {
		return idem.Response{}, err
	}
	body, err := json.Marshal(map[string]any{"batch_id": batchID, "prizes": won, "points_left": pointsLeft})
	if err != nil {
		return idem.Response{}, err
	}
	return idem.Response{Status: 201, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: body}, nil
}

// drawState is what the database holds for one user and box 1.
type drawState struct {
	Points, Debited int64 // points left; points debited by the ledger
	Stock, Taken    int   // draws left in box 1; draws taken by the batches
	Batches, Debits int   // the user's batches and ledger debits
}

// Check reports whether nothing was charged or taken twice: points and
// stock add up to what they started from, and every batch has one debit.
func (s drawState) Check(startPoints int64, startStock int) error {
	if s.Points+s.Debited != startPoints || s.Stock+s.Taken != startStock || s.Debits != s.Batches {
		return fmt.Errorf("invariants broken: %+v", s)
	}
	return nil
}

// readDrawState reads user's points, batches and ledger debits and box 1's
// stock in one statement.
func readDrawState(ctx context.Context, pool *pgxpool.Pool, user string) drawState {
	var s drawState
	err := pool.QueryRow(ctx, `SELECT
		(SELECT points FROM wallets WHERE user_id = $1),
		(SELECT coalesce(sum(amount), 0)::bigint FROM point_ledger WHERE user_id = $1),
		(SELECT stock FROM boxes WHERE id = 1),
		(SELECT coalesce(sum(quantity), 0)::int FROM draw_batches WHERE box_id = 1),
		(SELECT count(*) FROM draw_batches WHERE user_id = $1),
		(SELECT count(*) FROM point_ledger WHERE user_id = $1)`, user).
		Scan(&s.Points, &s.Debited, &s.Stock, &s.Taken, &s.Batches, &s.Debits)
	if err != nil {
		panic(err)
	}
	return s
}
