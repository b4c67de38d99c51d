package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// A reservation made with a window (ReserveOptions.ResumeWithin): its worker
// charges the card and vanishes before Complete. Nobody retries; a recovery
// worker finds the attempt with ListResumable, resumes it, and charges again
// with the same call key, which the gateway answers with the first charge.
// One charge, and nothing for a person.
func Example_resume() {
	ctx := context.Background()
	check := func(err error) {
		if err != nil {
			panic(err)
		}
	}
	pool, closeDB := examplePool() // the application's *pgxpool.Pool (example_test.go)
	defer closeDB()

	// The gateway remembers each Idempotency-Key (a day, say) and answers
	// a repeat with the charge it made.
	var mu sync.Mutex
	charges, requests := map[string]string{}, 0
	gateway := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		defer mu.Unlock()
		requests++
		if charges[key] == "" {
			charges[key] = fmt.Sprintf("ch_%d", len(charges)+1)
		}
		fmt.Fprint(w, charges[key])
	}))
	defer gateway.Close()
	charge := func(r idem.Reservation) string {
		req, err := http.NewRequestWithContext(ctx, "POST", gateway.URL, nil)
		check(err)
		req.Header.Set("Idempotency-Key", r.CallKey("charge")) // the same for every attempt
		resp, err := http.DefaultClient.Do(req)
		check(err)
		defer resp.Body.Close()
		var id string
		_, err = fmt.Fscan(resp.Body, &id)
		check(err)
		return id
	}
	opts := idem.ReserveOptions{Lease: 100 * time.Millisecond, ResumeWithin: 23 * time.Hour}
	scope, fp := idem.Scope{Actor: "cus-1", Operation: "payment.create"}, idem.FingerprintParts([]byte("12000 KRW"))

	// The first worker charges, then vanishes before Complete.
	r, err := idem.ReserveWith(ctx, pool, scope, "pay-1", fp, opts)
	check(err)
	fmt.Println("first attempt charged", charge(r))

	// The recovery worker, once the lease has run out.
	var resumable []idem.Record
	for len(resumable) == 0 {
		time.Sleep(20 * time.Millisecond)
		resumable, err = idem.ListResumable(ctx, pool, 100, nil)
		check(err)
	}
	for _, rec := range resumable {
		r, err := idem.ReserveWith(ctx, pool, rec.Scope, rec.Key, rec.Fingerprint, opts)
		check(err)
		id := charge(r)
		fmt.Printf("resumed %s: %t, the gateway answered %s\n", rec.Key, r.Resumed, id)
		check(idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			return idem.Complete(ctx, tx, r, idem.Response{Status: 201, Body: []byte(id)})
		}))
	}

	unknown, err := idem.ListUnknown(ctx, pool, 100, nil)
	check(err)
	again, err := idem.ReserveWith(ctx, pool, scope, "pay-1", fp, opts)
	check(err)
	fmt.Printf("charges: %d for %d requests; for a person: %d; the client's retry: %d %s\n",
		len(charges), requests, len(unknown), again.Status, again.Body)

	// Output:
	// first attempt charged ch_1
	// resumed pay-1: true, the gateway answered ch_1
	// charges: 1 for 2 requests; for a person: 0; the client's retry: 201 ch_1
}
