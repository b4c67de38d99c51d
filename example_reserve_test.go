package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// payment is a payment request (seed 003): the body a client sends with
// its Idempotency-Key.
type payment struct {
	CustomerID  string `json:"customerId"`
	AmountCents int64  `json:"amountCents"`
	Currency    string `json:"currency"`
}

// chargeCard is the outside work: a card gateway that cannot join the
// database transaction. The idempotency key goes along, as providers that
// take one dedupe on it.
func chargeCard(ctx context.Context, gatewayURL, key string, p payment) (chargeID string, err error) {
	body, _ := json.Marshal(p)
	req, err := http.NewRequestWithContext(ctx, "POST", gatewayURL+"/charges", strings.NewReader(string(body)))
	if err != nil {
		return "", err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var out struct{ ID string }
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return "", err
	}
	return out.ID, nil
}

// pay runs a payment at most once per key: reserve the key, charge the
// card, and record the charge and the response in one transaction.
func pay(ctx context.Context, pool *pgxpool.Pool, gatewayURL, key string, p payment) (idem.Response, error) {
	fp, err := idem.FingerprintJSON(p)
	if err != nil {
		return idem.Response{}, err
	}
	scope := idem.Scope{Actor: p.CustomerID, Operation: "payment.create"}
	r, err := idem.Reserve(ctx, pool, scope, key, fp, 30*time.Second)
	if err != nil {
		// ErrInProgress, ErrKeyReused, ErrOutcomeUnknown, or the store is
		// down: do not charge.
		return idem.Response{}, err
	}
	if r.Replayed {
		return r.Response, nil
	}

	chargeCtx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	charge, err := chargeCard(chargeCtx, gatewayURL, key, p)
	if err != nil {
		// The request left the process: the card may have been charged.
		// (Had it certainly not left, FailRetryable would let a retry run.)
		if markErr := idem.MarkUnknown(ctx, pool, r, "gateway: "+err.Error()); markErr != nil {
			return idem.Response{}, errors.Join(err, markErr)
		}
		return idem.Response{}, err
	}
	resp := idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"paymentId":%q,"status":"created"}`, charge)}
	err = idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO payments (idem_key, charge_id, amount_cents) VALUES ($1, $2, $3)`,
			key, charge, p.AmountCents); err != nil {
			return err
		}
		return idem.Complete(ctx, tx, r, resp) // ErrFenced: no longer ours, roll back
	})
	return resp, err
}

// A card gateway behind the reservation mode: a payment, its retry, a
// gateway that times out after charging, and an operator who reconciles.
func Example_reserve() {
	ctx := context.Background()
	check := func(err error) {
		if err != nil {
			panic(err)
		}
	}
	pool, closeDB := examplePool() // the application's *pgxpool.Pool (example_test.go)
	defer closeDB()
	_, err := pool.Exec(ctx, `CREATE TABLE payments (idem_key text PRIMARY KEY, charge_id text NOT NULL, amount_cents bigint NOT NULL)`)
	check(err)

	// The gateway: one charge per idempotency key. For the key "slow-1"
	// it charges and then never answers.
	var mu sync.Mutex
	charges := map[string]string{}
	gateway := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // read in full: then a client that hangs up ends r.Context()
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		if charges[key] == "" {
			charges[key] = fmt.Sprintf("ch_%d", len(charges)+1)
		}
		id := charges[key]
		mu.Unlock()
		if strings.HasPrefix(key, "slow-") {
			<-r.Context().Done()
			return
		}
		fmt.Fprintf(w, `{"id":%q}`, id)
	}))
	defer gateway.Close()

	p := payment{CustomerID: "cus-1", AmountCents: 12000, Currency: "KRW"}

	// 1. A payment, and its retry after a lost response.
	first, err := pay(ctx, pool, gateway.URL, "pay-1", p)
	check(err)
	again, err := pay(ctx, pool, gateway.URL, "pay-1", p)
	check(err)
	fmt.Printf("1. %d %s; retry: %d %s\n", first.Status, first.Body, again.Status, again.Body)

	// 2. The gateway charges but its answer never comes: the outcome is
	// unknown, and retries do not charge again.
	_, err = pay(ctx, pool, gateway.URL, "slow-1", p)
	fmt.Println("2. timeout:", err != nil)
	_, err = pay(ctx, pool, gateway.URL, "slow-1", p)
	fmt.Println("   retry refused with ErrOutcomeUnknown:", errors.Is(err, idem.ErrOutcomeUnknown))

	// 3. An operator lists the unknown records, finds the charge at the
	// gateway and resolves the record with the response it should have had.
	unknown, err := idem.ListUnknown(ctx, pool, 100, nil)
	check(err)
	for _, rec := range unknown {
		mu.Lock()
		charge := charges[rec.Key]
		mu.Unlock()
		source, _, _ := strings.Cut(rec.LastError, ":")
		fmt.Printf("3. unknown: %s %s (%s); the gateway has %s\n", rec.Scope.Actor, rec.Key, source, charge)
		check(idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO payments (idem_key, charge_id, amount_cents) VALUES ($1, $2, $3)`,
				rec.Key, charge, p.AmountCents); err != nil {
				return err
			}
			return idem.Resolve(ctx, tx, rec.Scope, rec.Key, idem.Resolution{
				Token:     rec.Token, // the attempt this verdict is about
				Succeeded: &idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"paymentId":%q,"status":"created"}`, charge)},
				Reason:    "charge found at the gateway",
			})
		}))
	}

	// 4. The retry now replays the resolved outcome.
	resolved, err := pay(ctx, pool, gateway.URL, "slow-1", p)
	check(err)
	fmt.Printf("4. retry: %d %s\n", resolved.Status, resolved.Body)

	var payments int
	check(pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&payments))
	fmt.Printf("   charges at the gateway: %d; payments recorded: %d\n", len(charges), payments)

	// Output:
	// 1. 201 {"paymentId":"ch_1","status":"created"}; retry: 201 {"paymentId":"ch_1","status":"created"}
	// 2. timeout: true
	//    retry refused with ErrOutcomeUnknown: true
	// 3. unknown: cus-1 slow-1 (gateway); the gateway has ch_2
	// 4. retry: 201 {"paymentId":"ch_2","status":"created"}
	//    charges at the gateway: 2; payments recorded: 2
}
