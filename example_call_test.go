package idem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// The call key of a reservation's outgoing call: the same for every attempt,
// worker and restart of the request, another for each step.
func ExampleReservation_CallKey() {
	r := idem.Reservation{Scope: idem.Scope{Actor: "alice", Operation: "payment.create"}, Key: "pay-0001"}
	fmt.Println(r.CallKey("charge"))
	again := r // a later attempt: another token, the same request
	again.Token = 7
	fmt.Println(again.CallKey("charge") == r.CallKey("charge"), r.CallKey("refund") != r.CallKey("charge"))
	fmt.Printf("%q\n", r.CallKey("charge\n")) // an invalid step: idem's clients refuse the empty key

	// Output:
	// bbf4bef9-8266-85bf-af4c-334c6e2545c2
	// true true
	// ""
}

// A reservation calls a card gateway through idemhttp.Transport with its
// call key. The gateway charges and its answer is lost; the transport's
// retry carries the same key, the gateway replays the charge, and the
// payment completes: one charge, nothing for an operator. When no answer
// comes at all, the error says the card may have been charged, and the
// reservation is marked unknown rather than charged again.
func Example_callingOtherServices() {
	ctx := context.Background()
	check := func(err error) {
		if err != nil {
			panic(err)
		}
	}
	pool, closeDB := examplePool() // the application's *pgxpool.Pool (example_test.go)
	defer closeDB()

	// The gateway deduplicates by Idempotency-Key, as Stripe does. It loses
	// its first answer to every key (the connection drops after the
	// charge), and never answers the key of a reservation of "never".
	var mu sync.Mutex
	charges := map[string]string{} // by key
	gateway := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		charge, replay := charges[key]
		if !replay {
			charge = fmt.Sprintf("ch_%d", len(charges)+1)
			charges[key] = charge
		}
		mu.Unlock()
		if !replay || key == (idem.Reservation{Scope: idem.Scope{Actor: "never", Operation: "payment.create"}, Key: "pay-2"}).CallKey("charge") {
			conn, _, _ := http.NewResponseController(w).Hijack()
			_ = conn.Close() // the answer is lost
			return
		}
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%q}`, charge)
	}))
	defer gateway.Close()

	client := &http.Client{Transport: &idemhttp.Transport{
		Policy: idem.RetryPolicy{MaxAttempts: 3, BaseDelay: 10 * time.Millisecond},
	}}
	pay := func(actor, key string) error {
		scope := idem.Scope{Actor: actor, Operation: "payment.create"}
		r, err := idem.Reserve(ctx, pool, scope, key, idem.FingerprintParts([]byte("12000 KRW")), 30*time.Second)
		if err != nil {
			return err
		}
		// Every attempt of this call, by this worker or another one after a
		// crash, carries the same key.
		callCtx := idem.WithCallKey(ctx, r.CallKey("charge"))
		req, err := http.NewRequestWithContext(callCtx, "POST", gateway.URL+"/v1/charges", bytes.NewReader([]byte(`{"amount":12000}`)))
		check(err)
		resp, err := client.Do(req)
		if err != nil {
			// errors.Is(err, idem.ErrOutcomeUnknown): the card may have been
			// charged. Never start over with a new key.
			if markErr := idem.MarkUnknown(ctx, pool, r, err.Error()); markErr != nil {
				return errors.Join(err, markErr)
			}
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		fmt.Printf("%s: %d %s, replayed by the gateway: %t\n", key, resp.StatusCode, body, idemhttp.Replayed(resp))
		return idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			return idem.Complete(ctx, tx, r, idem.Response{Status: resp.StatusCode, Body: body})
		})
	}

	check(pay("alice", "pay-1"))
	err := pay("never", "pay-2")
	fmt.Println("pay-2: the card may have been charged:", errors.Is(err, idem.ErrOutcomeUnknown))
	var callErr *idem.CallError
	if errors.As(err, &callErr) {
		fmt.Println("pay-2: attempts:", callErr.Attempts)
	}
	unknown, err := idem.ListUnknown(ctx, pool, 10, nil)
	check(err)
	mu.Lock()
	fmt.Printf("gateway: %d charges; unknown: %d (%s)\n", len(charges), len(unknown), unknown[0].Key)
	mu.Unlock()

	// Output:
	// pay-1: 201 {"id":"ch_1"}, replayed by the gateway: true
	// pay-2: the card may have been charged: true
	// pay-2: attempts: 3
	// gateway: 2 charges; unknown: 1 (pay-2)
}
