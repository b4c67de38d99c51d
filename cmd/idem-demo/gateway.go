package main

// The demo's card gateway: an HTTP server of its own on 127.0.0.1, which
// the payments reach over the network through idemhttp.Transport, as a
// service reaches its payment provider.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// headerGatewayMode tells the demo's gateway how to misbehave for one
// request. It is not part of the payment's fingerprint.
const headerGatewayMode = "X-Demo-Gateway"

// Gateway modes, sent with every attempt of a charge.
const (
	// modeTimeoutAfterCharge: the gateway charges, then never answers
	// (nor answers any retry of the charge).
	modeTimeoutAfterCharge = "timeout-after-charge"
	// modeReplyLost: the gateway charges, then its answer to the first
	// attempt is lost with the connection; a retry gets it.
	modeReplyLost = "reply-lost"
	// modeUnavailable: the gateway refuses the request (503) and charges
	// nothing.
	modeUnavailable = "unavailable"
)

// declineAboveCents is the amount above which the gateway declines a card.
const declineAboveCents = 1_000_000

// gatewayKeyTTL is how long the gateway remembers an idempotency key, as
// Stripe does: a key sent again within it gets the first answer back.
const gatewayKeyTTL = 24 * time.Hour

// gateway is the demo's card gateway. Like providers that take an
// idempotency key (Stripe, and the IETF draft), POST /v1/charges requires
// an Idempotency-Key, runs once per key, and remembers the key with a hash
// of the request and the answer for gatewayKeyTTL: a retry with the same
// key and body gets the same answer with Idempotent-Replayed: true; the
// same key with another body gets 422; a retry while the first still runs
// waits for it and gets its answer. A refusal before anything ran (503) is
// not remembered. A card over declineAboveCents is declined (402), and the
// decline is remembered like a charge.
//
// Its memory (the keys, the charges, the requests counted per key) lives
// in tables of the demo's own database (setupGateway), not in the demo's
// process: like a real provider's, it outlives the calling service, so a
// payment service that crashed and restarts (serve -keep) finds the charges
// it made and the keys it sent. One process to run, and the demo already
// owns that database.
type gateway struct {
	pool *pgxpool.Pool
	now  func() time.Time // the gateway's clock, for its 24 hours

	start sync.Once // of the listener, on first use
	url   string
	err   error
	srv   *http.Server
}

// gatewayKey is what the gateway remembers of a key: the request's hash,
// when it first came, and the answer.
type gatewayKey struct {
	fingerprint []byte
	at          time.Time
	status      int
	body        []byte
}

type gatewayCharge struct {
	ID          string `json:"chargeId"`
	Key         string `json:"key"`
	CustomerID  string `json:"customerId"`
	AmountCents int64  `json:"amountCents"`
	Currency    string `json:"currency"`
	Requests    int    `json:"requests"`
}

// setupGateway creates the tables the gateway remembers in, unless they
// exist: a key's request (its hash) and answer, the requests counted per
// key (refused ones too), the charges in the order they were made.
func setupGateway(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS gateway_keys (
			idem_key    text        PRIMARY KEY,
			fingerprint bytea       NOT NULL,
			first_at    timestamptz NOT NULL,
			status      integer     NOT NULL,
			body        bytea       NOT NULL);
		CREATE TABLE IF NOT EXISTS gateway_requests (
			idem_key text    PRIMARY KEY,
			n        integer NOT NULL);
		CREATE TABLE IF NOT EXISTS gateway_charges (
			n            bigserial PRIMARY KEY,
			idem_key     text      NOT NULL,
			customer_id  text      NOT NULL,
			amount_cents bigint    NOT NULL,
			currency     text      NOT NULL)`)
	if err != nil {
		return fmt.Errorf("create the gateway's tables: %w", err)
	}
	return nil
}

// newGateway returns a gateway that remembers in pool's database (its
// tables made by setupGateway); it starts listening on first use.
func newGateway(pool *pgxpool.Pool) *gateway {
	return &gateway{pool: pool, now: time.Now}
}

// baseURL returns the gateway's URL, starting its server on 127.0.0.1 the
// first time.
func (g *gateway) baseURL() (string, error) {
	g.start.Do(func() {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			g.err = fmt.Errorf("gateway: listen: %w", err)
			return
		}
		g.srv = &http.Server{Handler: g, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = g.srv.Serve(ln) }()
		g.url = "http://" + ln.Addr().String()
	})
	return g.url, g.err
}

// close stops the gateway's server, if it started.
func (g *gateway) close() {
	g.start.Do(func() {}) // not started: never will be
	if g.srv != nil {
		_ = g.srv.Close()
	}
}

// ServeHTTP serves POST /v1/charges.
func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/charges" {
		gatewayError(w, http.StatusNotFound, "no such route")
		return
	}
	key, err := idemhttp.ParseKey(r.Header)
	if err == nil {
		err = idem.ValidateKey(key)
	}
	if err != nil {
		gatewayError(w, http.StatusBadRequest, "send one valid Idempotency-Key")
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	var p paymentRequest
	if err == nil {
		err = json.Unmarshal(body, &p)
	}
	if err != nil {
		gatewayError(w, http.StatusBadRequest, "the body must be a charge")
		return
	}
	mode := r.Header.Get(headerGatewayMode)

	// Like a provider, the gateway finishes what it started when the
	// client hangs up.
	fp := sha256.Sum256(body)
	fate, k, attempt, err := g.handle(context.WithoutCancel(r.Context()), key, fp[:], p, mode)
	if err != nil {
		// Nothing the gateway could record: nothing was charged.
		gatewayError(w, http.StatusServiceUnavailable, "unavailable; nothing was charged")
		return
	}
	switch fate {
	case refused:
		gatewayError(w, http.StatusServiceUnavailable, "unavailable; nothing was charged")
		return
	case reused:
		gatewayError(w, http.StatusUnprocessableEntity, "this Idempotency-Key was used for another request")
		return
	case replay:
		w.Header().Set(idemhttp.HeaderReplayed, "true")
	}

	switch {
	case mode == modeTimeoutAfterCharge:
		<-r.Context().Done() // never answers
		return
	case mode == modeReplyLost && attempt == 1:
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close() // the answer is lost with the connection
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(k.body)))
	w.WriteHeader(k.status)
	_, _ = w.Write(k.body)
}

// The fates of a request, as handle decides them.
const (
	execute = iota // a new key: charged (or declined) now
	replay         // the key's answer is there: send it again
	reused         // the key holds another request
	refused        // the gateway refuses (modeUnavailable), remembering nothing
)

// handle counts a request with key, decides its fate and, for a new key,
// charges p (or declines it), all in one transaction: k is the key's
// answer, attempt the request's number among the key's. The count's row
// lock orders the requests of one key: a second one waits for the first to
// commit and gets its answer.
func (g *gateway) handle(ctx context.Context, key string, fp []byte, p paymentRequest, mode string) (fate int, k gatewayKey, attempt int, err error) {
	err = pgx.BeginFunc(ctx, g.pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `INSERT INTO gateway_requests AS r (idem_key, n) VALUES ($1, 1)
			ON CONFLICT (idem_key) DO UPDATE SET n = r.n + 1 RETURNING n`, key).Scan(&attempt); err != nil {
			return err
		}
		err := tx.QueryRow(ctx, `SELECT fingerprint, first_at, status, body FROM gateway_keys WHERE idem_key = $1`,
			key).Scan(&k.fingerprint, &k.at, &k.status, &k.body)
		known := err == nil && g.now().Sub(k.at) <= gatewayKeyTTL // past it: forgotten, a new request
		switch {
		case err != nil && !errors.Is(err, pgx.ErrNoRows):
			return err
		case known && !bytes.Equal(k.fingerprint, fp):
			fate = reused
		case known:
			fate = replay
		case mode == modeUnavailable:
			fate = refused
		default:
			fate = execute
			k, err = g.execute(ctx, tx, key, fp, p)
			return err
		}
		return nil
	})
	return fate, k, attempt, err
}

// execute charges p (or declines it) under key in tx and remembers the
// answer, which it returns.
func (g *gateway) execute(ctx context.Context, tx pgx.Tx, key string, fp []byte, p paymentRequest) (gatewayKey, error) {
	k := gatewayKey{fingerprint: fp, at: g.now()}
	if p.AmountCents > declineAboveCents {
		k.status, k.body = http.StatusPaymentRequired, []byte(`{"error":"card_declined"}`)
	} else {
		c := gatewayCharge{Key: key, CustomerID: p.CustomerID, AmountCents: p.AmountCents, Currency: p.Currency}
		var n int64
		if err := tx.QueryRow(ctx, `INSERT INTO gateway_charges (idem_key, customer_id, amount_cents, currency)
			VALUES ($1, $2, $3, $4) RETURNING n`, key, c.CustomerID, c.AmountCents, c.Currency).Scan(&n); err != nil {
			return k, err
		}
		c.ID = fmt.Sprintf("ch_%d", n)
		k.status = http.StatusCreated
		k.body, _ = json.Marshal(c)
	}
	_, err := tx.Exec(ctx, `INSERT INTO gateway_keys (idem_key, fingerprint, first_at, status, body) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT (idem_key) DO UPDATE SET fingerprint = excluded.fingerprint, first_at = excluded.first_at,
			status = excluded.status, body = excluded.body`, key, fp, k.at, k.status, k.body)
	return k, err
}

// gatewayError writes the gateway's error answer.
func gatewayError(w http.ResponseWriter, status int, msg string) {
	body, _ := json.Marshal(map[string]string{"error": msg})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// lookup returns the latest charge made under key, as an operator finds it
// in the gateway's dashboard, and whether there is one.
func (g *gateway) lookup(ctx context.Context, key string) (gatewayCharge, bool, error) {
	charges, err := g.charges(ctx, key)
	if err != nil || len(charges) == 0 {
		return gatewayCharge{}, false, err
	}
	return charges[len(charges)-1], true, nil
}

// list returns every charge, oldest first.
func (g *gateway) list(ctx context.Context) ([]gatewayCharge, error) { return g.charges(ctx, "") }

// charges returns the charges made under key ("": all of them), oldest
// first, each with the requests its key has had.
func (g *gateway) charges(ctx context.Context, key string) ([]gatewayCharge, error) {
	rows, err := g.pool.Query(ctx, `SELECT 'ch_' || c.n, c.idem_key, c.customer_id, c.amount_cents, c.currency, coalesce(r.n, 0)
		FROM gateway_charges c LEFT JOIN gateway_requests r USING (idem_key)
		WHERE $1 = '' OR c.idem_key = $1 ORDER BY c.n`, key)
	if err != nil {
		return nil, err
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (gatewayCharge, error) {
		var c gatewayCharge
		err := row.Scan(&c.ID, &c.Key, &c.CustomerID, &c.AmountCents, &c.Currency, &c.Requests)
		return c, err
	})
	if out == nil {
		out = []gatewayCharge{}
	}
	return out, err
}
