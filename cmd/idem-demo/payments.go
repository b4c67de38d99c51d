package main

// Payments: seed 003's example of work outside the database. A card gateway
// cannot join the transaction, so POST /v1/payments uses idem's reservation
// mode instead of the idemhttp middleware:
//
//	ReserveWith (commits processing + lease + token, and a window of 23
//	   hours in which an attempt in doubt resumes: the gateway remembers
//	   keys 24)
//	-> keep the request (payment_requests), for a re-send after a crash
//	-> charge the card at the gateway (gateway.go, over HTTP through
//	   idemhttp.Transport), with the reservation's call key r.CallKey("charge"):
//	   a lost answer is retried with the same key, and the gateway replays it
//	-> Complete in the transaction that records the payment, or
//	   FailRetryable (the gateway certainly charged nothing), or
//	   MarkUnknown (it may have charged: no answer to any attempt)
//
// Inside the window a payment in doubt (marked unknown, or whose worker
// vanished and whose lease ran out) is resumed, by the client's retry or by
// the recovery worker (recoverPayments), which send the same request with
// the same call key again: the gateway answers with the charge it made.
// Past the window (or without one, resumeWithin 0) an unknown payment is
// never charged again by a retry; an operator reconciles it (POST
// /v1/admin/resolve) after looking at the gateway.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/demo/draw"
)

// paymentOperation is the operation of the payment keys' scope.
const paymentOperation = "payment.create"

// demoOperator is the bearer token of the operator routes; it is not a user.
const demoOperator = "operator"

// setupPayments creates the tables payments are recorded in (payments)
// and their requests kept in until they are done (payment_requests), and
// the gateway's (setupGateway), unless they exist.
func setupPayments(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS payments (
		id           text      PRIMARY KEY,
		actor        text      NOT NULL,
		idem_key     text      NOT NULL,
		charge_id    text      NOT NULL UNIQUE,
		customer_id  text      NOT NULL,
		amount_cents bigint    NOT NULL,
		currency     text      NOT NULL,
		UNIQUE (actor, idem_key));
		CREATE TABLE IF NOT EXISTS payment_requests (
			actor    text  NOT NULL,
			idem_key text  NOT NULL,
			request  jsonb NOT NULL,
			PRIMARY KEY (actor, idem_key))`)
	if err != nil {
		return fmt.Errorf("create payments: %w", err)
	}
	return setupGateway(ctx, pool)
}

// paymentRequest is the body of POST /v1/payments.
type paymentRequest struct {
	CustomerID  string `json:"customerId"`
	AmountCents int64  `json:"amountCents"`
	Currency    string `json:"currency"`
}

// parsePayment reads and checks a payment request.
func parsePayment(body []byte) (paymentRequest, error) {
	var p paymentRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return p, errors.New("the body must be a JSON object with customerId, amountCents and currency")
	}
	if dec.More() {
		return p, errors.New("the body must hold one JSON object")
	}
	switch {
	case strings.TrimSpace(p.CustomerID) == "" || len(p.CustomerID) > 64:
		return p, errors.New("customerId must be 1 to 64 characters")
	case p.AmountCents <= 0:
		return p, errors.New("amountCents must be a positive integer")
	case p.Currency != "KRW" && p.Currency != "USD":
		return p, errors.New("currency must be KRW or USD")
	}
	return p, nil
}

// chargeStep names the payment's one call to the gateway: its call key is
// the reservation's CallKey(chargeStep).
const chargeStep = "charge"

// chargeKey is the idempotency key the gateway knows the charge of the
// payment (actor, key) by.
func chargeKey(actor, key string) string {
	return idem.Reservation{Scope: idem.Scope{Actor: actor, Operation: paymentOperation}, Key: key}.CallKey(chargeStep)
}

var (
	// errGatewayUnavailable: the gateway refused the request before acting.
	errGatewayUnavailable = errors.New("gateway unavailable: nothing was charged")
	// errDeclined: the gateway declined the card; nothing was charged.
	errDeclined = errors.New("card declined")
)

// payments runs payments through the reservation mode.
type payments struct {
	pool  *pgxpool.Pool
	gw    *gateway
	lease time.Duration // how long a payment may take before it counts as stuck
	// resumeWithin is the window of a payment's reservation: the gateway
	// remembers keys 24 hours, and an hour is left for clocks and delays.
	// 0: none (a payment in doubt waits for an operator).
	resumeWithin time.Duration
	// stop, when set, is called after the gateway charged a payment whose
	// request asked to crash there (X-Demo-Crash: after-charge), before
	// Complete: serve exits the process; if it returns, pay returns
	// errStopped and leaves the payment as a crash would.
	stop func()
	// gatewayTimeout bounds one attempt of a charge (the wait for the
	// gateway's answer); gatewayPolicy bounds the attempts.
	gatewayTimeout time.Duration
	gatewayPolicy  idem.RetryPolicy
	// gatewayURL, when set, is where the gateway is reached (a relay in
	// front of it, in tests); default: the gateway's own URL.
	gatewayURL string

	clientOnce sync.Once
	client     *http.Client
}

// Defaults of the payments.
const (
	defaultPaymentLease = 30 * time.Second
	defaultResumeWithin = gatewayKeyTTL - time.Hour
)

func newPayments(pool *pgxpool.Pool, gw *gateway) *payments {
	return &payments{pool: pool, gw: gw, lease: defaultPaymentLease, resumeWithin: defaultResumeWithin,
		gatewayTimeout: 2 * time.Second,
		gatewayPolicy:  idem.RetryPolicy{MaxAttempts: 3, BaseDelay: 20 * time.Millisecond, MaxDelay: 200 * time.Millisecond}}
}

// gatewayClient is the payments' HTTP client for the gateway: every
// attempt of a charge carries the same Idempotency-Key, and a lost answer
// or a refusal is retried (idemhttp.Transport).
func (s *payments) gatewayClient() *http.Client {
	s.clientOnce.Do(func() {
		s.client = &http.Client{Transport: &idemhttp.Transport{
			Base:   &http.Transport{ResponseHeaderTimeout: s.gatewayTimeout},
			Policy: s.gatewayPolicy,
		}}
	})
	return s.client
}

// charge asks the gateway to charge p for the reservation r, with r's call
// key. Its errors: errDeclined (a decision of the gateway),
// errGatewayUnavailable (the gateway refused every attempt, or could not be
// reached: certainly nothing charged), or any other error when the card may
// have been charged (no answer after an attempt that may have reached the
// gateway, or an answer that does not say).
func (s *payments) charge(ctx context.Context, r idem.Reservation, p paymentRequest, mode string) (gatewayCharge, error) {
	url, err := s.gw.baseURL()
	if s.gatewayURL != "" {
		url = s.gatewayURL
	}
	if err != nil {
		return gatewayCharge{}, fmt.Errorf("%w: %w", errGatewayUnavailable, err)
	}
	body, _ := json.Marshal(p)
	ctx = idem.WithCallKey(ctx, r.CallKey(chargeStep))
	req, err := http.NewRequestWithContext(ctx, "POST", url+"/v1/charges", bytes.NewReader(body))
	if err != nil {
		return gatewayCharge{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if mode != "" {
		req.Header.Set(headerGatewayMode, mode)
	}
	resp, err := s.gatewayClient().Do(req)
	var callErr *idem.CallError
	switch {
	case errors.As(err, &callErr):
		return gatewayCharge{}, fmt.Errorf("gateway: no answer to %d attempts, the card may have been charged: %w", callErr.Attempts, callErr.Err)
	case err != nil: // nothing reached the gateway
		return gatewayCharge{}, fmt.Errorf("%w: %w", errGatewayUnavailable, err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var c gatewayCharge
	switch {
	case err != nil:
		return c, fmt.Errorf("gateway: the answer was cut, the card may have been charged: %w", err)
	case resp.StatusCode == http.StatusCreated && json.Unmarshal(answer, &c) == nil && c.ID != "":
		return c, nil
	case resp.StatusCode == http.StatusPaymentRequired:
		return c, errDeclined
	case resp.StatusCode == http.StatusServiceUnavailable:
		return c, errGatewayUnavailable
	}
	return c, fmt.Errorf("gateway: answered %d %s; the card may have been charged", resp.StatusCode, answer)
}

var (
	// errOutcomeUnknown: the gateway may have charged; the payment is held
	// for reconciliation.
	errOutcomeUnknown = errors.New("the gateway did not answer: the card may have been charged")
	// errResumable: the gateway may have charged; the payment is in doubt
	// inside its window, and a retry with the same key resumes it.
	errResumable = fmt.Errorf("%w; a retry with the same key resumes the payment", errOutcomeUnknown)
	// errNotCharged: the gateway certainly charged nothing; a retry runs.
	errNotCharged = errors.New("the gateway charged nothing")
	// errStopped: the payment stopped after the charge, before Complete, as
	// asked (X-Demo-Crash: after-charge).
	errStopped = errors.New("stopped after the charge, before Complete, as a crash would")
)

// crashCtx marks the context of a payment that asks to stop after the
// charge (withCrash).
type crashCtx struct{}

// withCrash returns ctx for a payment that stops after the charge, before
// Complete (X-Demo-Crash: after-charge): see payments.stop.
func withCrash(ctx context.Context) context.Context { return context.WithValue(ctx, crashCtx{}, true) }

// headerCrash asks the payments to stop after the gateway charged: its
// value is "after-charge".
const headerCrash = "X-Demo-Crash"

// options are the reservation options of a payment.
func (s *payments) options() idem.ReserveOptions {
	return idem.ReserveOptions{Lease: s.lease, ResumeWithin: s.resumeWithin}
}

// pay charges p at most once per (user, key): a replay returns the stored
// response with replayed true. Errors: idem's (ErrKeyReused, ErrInProgress,
// ErrOutcomeUnknown, store failures), errOutcomeUnknown after a gateway
// timeout (the record is unknown; errResumable when a retry resumes it),
// errNotCharged after a refusal of the gateway (the record is
// failed_retryable). A payment in doubt inside its window is resumed: the
// same request is sent again with the same call key.
func (s *payments) pay(ctx context.Context, user, key string, p paymentRequest, mode string) (resp idem.Response, replayed bool, err error) {
	fp, err := idem.FingerprintJSON(p)
	if err != nil {
		return idem.Response{}, false, err
	}
	r, err := idem.ReserveWith(ctx, s.pool, idem.Scope{Actor: user, Operation: paymentOperation}, key, fp, s.options())
	if err != nil {
		return idem.Response{}, false, err
	}
	if r.Replayed {
		return r.Response, true, nil
	}
	// Kept before the gateway is called: a recovery worker sends the same
	// request again after a crash (the gateway refuses another one under
	// the same key).
	if err := keepRequest(ctx, s.pool, user, key, p); err != nil {
		_ = s.notCharged(context.WithoutCancel(ctx), r, "nothing sent: "+err.Error())
		return idem.Response{}, false, err
	}
	resp, err = s.execute(ctx, r, p, mode)
	return resp, false, err
}

// keepRequest stores p as the request of the payment (user, key).
func keepRequest(ctx context.Context, pool *pgxpool.Pool, user, key string, p paymentRequest) error {
	// Encoded here, not by pgx: behind a pooler in exec or simple-protocol
	// mode pgx does not know the column's type and cannot encode a struct.
	request, err := json.Marshal(p)
	if err != nil {
		return fmt.Errorf("keep the payment's request: %w", err)
	}
	_, err = pool.Exec(ctx, `INSERT INTO payment_requests (actor, idem_key, request) VALUES ($1, $2, $3::jsonb)
		ON CONFLICT (actor, idem_key) DO UPDATE SET request = excluded.request`, user, key, string(request))
	if err != nil {
		return fmt.Errorf("keep the payment's request: %w", err)
	}
	return nil
}

// keptRequest reads the request of the payment (user, key); found is false
// when none was kept (the payment's attempt stopped before it sent one).
func keptRequest(ctx context.Context, pool *pgxpool.Pool, user, key string) (p paymentRequest, found bool, err error) {
	err = pool.QueryRow(ctx, `SELECT request FROM payment_requests WHERE actor = $1 AND idem_key = $2`, user, key).Scan(&p)
	if errors.Is(err, pgx.ErrNoRows) {
		return p, false, nil
	}
	return p, err == nil, err
}

// execute charges p for the reservation r, which executes (or resumes), and
// records the outcome: the payment's response, or errOutcomeUnknown
// (errResumable), errNotCharged, errStopped, or a store failure.
func (s *payments) execute(ctx context.Context, r idem.Reservation, p paymentRequest, mode string) (resp idem.Response, err error) {
	user, key := r.Scope.Actor, r.Key
	charge, err := s.charge(ctx, r, p, mode)
	if err == nil && s.stop != nil && ctx.Value(crashCtx{}) != nil {
		s.stop()
		return idem.Response{}, errStopped
	}
	switch {
	case errors.Is(err, errDeclined):
		// A decision of the gateway: stored and replayed like a success.
		resp = draw.Problem(http.StatusPaymentRequired, "CARD_DECLINED", "The card was declined; nothing was charged.")
		err := idem.InTx(ctx, s.pool, func(ctx context.Context, tx pgx.Tx) error {
			return idem.Complete(ctx, tx, r, resp)
		})
		return resp, err
	case errors.Is(err, errGatewayUnavailable):
		return idem.Response{}, s.notCharged(ctx, r, err.Error())
	case err != nil:
		return idem.Response{}, s.inDoubt(ctx, r, err.Error())
	}

	resp = paymentResponse(charge)
	err = idem.InTx(ctx, s.pool, func(ctx context.Context, tx pgx.Tx) error {
		// ErrFenced: the payment is no longer ours to record; roll back.
		if err := idem.Complete(ctx, tx, r, resp); err != nil {
			return err
		}
		return insertPayment(ctx, tx, user, key, charge)
	})
	if err != nil && !errors.Is(err, idem.ErrFenced) {
		// The card was charged but the payment is not recorded: never
		// charge again. (If the store is down this fails too; then the
		// lease runs out and the record turns unknown all the same.)
		_ = idem.MarkUnknown(context.WithoutCancel(ctx), s.pool, r, "charged, but recording the payment failed: "+err.Error())
	}
	return resp, err
}

// notCharged records that this attempt of the payment charged nothing: the
// record becomes failed_retryable and a retry runs (errNotCharged). A
// resumed payment is in doubt all the same (inDoubt): an earlier attempt
// may have charged under the same call key, which this one never sent.
func (s *payments) notCharged(ctx context.Context, r idem.Reservation, reason string) error {
	if r.Resumed {
		return s.inDoubt(ctx, r, reason)
	}
	if err := idem.FailRetryable(ctx, s.pool, r, reason); err != nil {
		return err
	}
	return errNotCharged
}

// inDoubt records that the payment may have been charged: the record
// becomes unknown, resumable inside its window (errResumable), an
// operator's case past it (errOutcomeUnknown).
func (s *payments) inDoubt(ctx context.Context, r idem.Reservation, reason string) error {
	if err := idem.MarkUnknown(ctx, s.pool, r, reason); err != nil {
		return err
	}
	rec, err := idem.Lookup(ctx, s.pool, r.Scope, r.Key)
	if err == nil && rec.ResumeUntil.After(time.Now()) {
		return errResumable
	}
	return errOutcomeUnknown
}

// recoverEvery is how often serve's recovery worker looks for payments to
// resume.
const recoverEvery = time.Second

// recoverPayments is the recovery worker's round: it resumes the payments
// in doubt inside their window (idem.ListResumable), oldest first, and
// sends each one's request again with its call key; the gateway answers
// with the charge it made, if it made one, and the payment completes. It
// leaves a payment whose worker marked it unknown to the client until the
// attempt's lease would have run out (the client's retry, if it comes,
// gets its answer first-hand), and one resumed by someone else meanwhile
// (ErrInProgress, a replay). It returns how many payments it resumed.
func (s *payments) recoverPayments(ctx context.Context) (resumed int, err error) {
	now := time.Now()
	var after *idem.Record
	for {
		recs, err := idem.ListResumable(ctx, s.pool, 100, after)
		if err != nil || len(recs) == 0 {
			return resumed, err
		}
		after = &recs[len(recs)-1]
		for _, rec := range recs {
			if rec.Scope.Operation != paymentOperation || rec.LeaseExpiresAt.After(now) {
				continue
			}
			r, err := idem.ReserveWith(ctx, s.pool, rec.Scope, rec.Key, rec.Fingerprint, s.options())
			switch {
			case errors.Is(err, idem.ErrInProgress), errors.Is(err, idem.ErrOutcomeUnknown):
				continue // another worker or the client's retry has it; or its window just ended
			case err != nil:
				return resumed, err
			case r.Replayed:
				continue
			}
			p, found, err := keptRequest(ctx, s.pool, rec.Scope.Actor, rec.Key)
			switch {
			case err != nil:
				_ = idem.MarkUnknown(context.WithoutCancel(ctx), s.pool, r, "the payment's request could not be read: "+err.Error())
				return resumed, err
			case !found: // it stopped before it sent anything
				if err := idem.FailRetryable(ctx, s.pool, r, "never sent: no request was kept"); err != nil {
					return resumed, err
				}
				continue
			}
			_, err = s.execute(ctx, r, p, "")
			if err != nil && !errors.Is(err, errOutcomeUnknown) && !errors.Is(err, errNotCharged) {
				return resumed, err
			}
			resumed++
		}
	}
}

// recoverLoop runs the recovery worker every recoverEvery until ctx ends,
// logging what it resumed and what failed.
func (s *payments) recoverLoop(ctx context.Context, log *slog.Logger) {
	t := time.NewTicker(recoverEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := s.recoverPayments(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			log.Error("recovery worker", "error", err)
		case n > 0:
			log.Info("recovery worker resumed payments", "payments", n)
		}
	}
}

// paymentID names the payment of a charge.
func paymentID(c gatewayCharge) string { return "pay_" + strings.TrimPrefix(c.ID, "ch_") }

// paymentResponse is the response that answers a charged payment.
func paymentResponse(c gatewayCharge) idem.Response {
	body, _ := json.Marshal(map[string]any{
		"paymentId": paymentID(c), "chargeId": c.ID, "customerId": c.CustomerID,
		"amountCents": c.AmountCents, "currency": c.Currency, "status": "succeeded",
	})
	return idem.Response{
		Status: http.StatusCreated,
		Header: map[string][]string{"Content-Type": {"application/json"}, "Location": {"/v1/payments/" + paymentID(c)}},
		Body:   body,
	}
}

// insertPayment writes the payment row of a charge and publishes its
// payment.succeeded event (webhooks.go), in the same transaction.
func insertPayment(ctx context.Context, tx pgx.Tx, user, key string, c gatewayCharge) error {
	_, err := tx.Exec(ctx, `INSERT INTO payments (id, actor, idem_key, charge_id, customer_id, amount_cents, currency)
		VALUES ($1, $2, $3, $4, $5, $6, $7)`, paymentID(c), user, key, c.ID, c.CustomerID, c.AmountCents, c.Currency)
	if err != nil {
		return fmt.Errorf("record payment: %w", err)
	}
	return publishPaymentSucceeded(ctx, tx, user, key, c)
}

// resolve reconciles the unknown payment of (actor, key) against the
// gateway: a charge found there is recorded and becomes the payment's
// response; no charge makes the key retryable.
func (s *payments) resolve(ctx context.Context, actor, key string) (charge gatewayCharge, found bool, err error) {
	scope := idem.Scope{Actor: actor, Operation: paymentOperation}
	// The verdict is about the attempt the record holds now, before the
	// gateway is asked: should another attempt take the key meanwhile,
	// Resolve refuses with ErrFenced.
	rec, err := idem.Lookup(ctx, s.pool, scope, key)
	if err != nil {
		return charge, false, err
	}
	charge, found, err = s.gw.lookup(ctx, chargeKey(actor, key))
	if err != nil {
		return charge, false, err
	}
	if !found {
		err = idem.Resolve(ctx, s.pool, scope, key, idem.Resolution{Token: rec.Token, Retryable: true, Reason: "operator: no charge at the gateway"})
		return charge, false, err
	}
	resp := paymentResponse(charge)
	err = idem.InTx(ctx, s.pool, func(ctx context.Context, tx pgx.Tx) error {
		err := idem.Resolve(ctx, tx, scope, key, idem.Resolution{
			Token: rec.Token, Succeeded: &resp, Reason: "operator: charge " + charge.ID + " found at the gateway",
		})
		if err != nil {
			return err
		}
		return insertPayment(ctx, tx, actor, key, charge)
	})
	return charge, true, err
}

// registerPayments adds the payment routes to mux:
//
//	POST /v1/payments        {"customerId":"cus-1","amountCents":12000,"currency":"KRW"}, with Idempotency-Key
//	GET  /v1/admin/unknown   payments whose outcome is unknown (operator)
//	POST /v1/admin/resolve   {"actor":"alice","key":"..."}: reconcile one against the gateway (operator)
//	GET  /v1/admin/charges   the gateway's charges, by idempotency key (operator)
//
// The operator's bearer token is "operator".
func registerPayments(mux *http.ServeMux, s *payments, log *slog.Logger) {
	mux.HandleFunc("POST /v1/payments", func(w http.ResponseWriter, r *http.Request) {
		user, err := bearerUser(r)
		if err != nil {
			writeResponse(w, draw.Problem(http.StatusUnauthorized, idemhttp.CodeUnauthenticated, "Send Authorization: Bearer <user>."))
			return
		}
		key, err := paymentKey(r)
		if err != nil {
			writeResponse(w, draw.Problem(http.StatusBadRequest, idemhttp.CodeKeyInvalid, err.Error()))
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 64<<10))
		if err != nil {
			writeResponse(w, draw.Problem(http.StatusRequestEntityTooLarge, idemhttp.CodeBodyTooLarge, "The body is over 64 KiB."))
			return
		}
		p, err := parsePayment(body)
		if err != nil {
			// Refused before the key is reserved: a corrected retry runs.
			writeResponse(w, draw.Problem(http.StatusUnprocessableEntity, "INVALID_PAYMENT", err.Error()))
			return
		}
		ctx := r.Context()
		if r.Header.Get(headerCrash) == "after-charge" {
			ctx = withCrash(ctx)
		}
		resp, replayed, err := s.pay(ctx, user, key, p, r.Header.Get(headerGatewayMode))
		if replayed {
			w.Header().Set(idemhttp.HeaderReplayed, "true")
		}
		if err == nil {
			writeResponse(w, resp)
			return
		}
		resp, retryAfter := paymentProblem(err)
		if resp.Status >= 500 {
			log.Error("payment failed", "error", err)
		}
		if retryAfter > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(int((retryAfter+time.Second-1)/time.Second)))
		}
		writeResponse(w, resp)
	})

	operator := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != "Bearer "+demoOperator {
				writeResponse(w, draw.Problem(http.StatusForbidden, "FORBIDDEN", "Operator routes need Authorization: Bearer operator."))
				return
			}
			h(w, r)
		}
	}
	mux.HandleFunc("GET /v1/admin/unknown", operator(func(w http.ResponseWriter, r *http.Request) {
		type item struct {
			Actor     string    `json:"actor"`
			Operation string    `json:"operation"`
			Key       string    `json:"key"`
			LastError string    `json:"lastError"`
			CreatedAt time.Time `json:"createdAt"`
		}
		items := []item{}
		var after *idem.Record
		for {
			recs, err := idem.ListUnknown(r.Context(), s.pool, 100, after)
			if err != nil {
				log.Error("list unknown failed", "error", err)
				writeResponse(w, draw.Problem(http.StatusServiceUnavailable, idemhttp.CodeStoreUnavailable, "The records could not be read."))
				return
			}
			if len(recs) == 0 {
				break
			}
			for _, rec := range recs {
				items = append(items, item{rec.Scope.Actor, rec.Scope.Operation, rec.Key, rec.LastError, rec.CreatedAt.UTC()})
			}
			after = &recs[len(recs)-1]
		}
		writeJSON(w, http.StatusOK, map[string]any{"unknown": items})
	}))
	mux.HandleFunc("POST /v1/admin/resolve", operator(func(w http.ResponseWriter, r *http.Request) {
		var in struct{ Actor, Key string }
		if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&in); err != nil || in.Actor == "" || in.Key == "" {
			writeResponse(w, draw.Problem(http.StatusBadRequest, "BAD_REQUEST", `Send {"actor":"...","key":"..."}.`))
			return
		}
		charge, found, err := s.resolve(r.Context(), in.Actor, in.Key)
		switch {
		case errors.Is(err, idem.ErrNotFound):
			writeResponse(w, draw.Problem(http.StatusNotFound, "NOT_FOUND", "No payment holds this key."))
		case errors.Is(err, idem.ErrFenced):
			writeResponse(w, draw.Problem(http.StatusConflict, "NOT_RESOLVABLE", "Another attempt or operator changed the payment while it was resolved; look again."))
		case errors.Is(err, idem.ErrNotResolvable):
			writeResponse(w, draw.Problem(http.StatusConflict, "NOT_RESOLVABLE", "The payment's outcome is not in doubt: "+strings.TrimPrefix(err.Error(), "idem: ")))
		case errors.Is(err, idem.ErrInvalidKey), errors.Is(err, idem.ErrInvalidScope):
			writeResponse(w, draw.Problem(http.StatusBadRequest, "BAD_REQUEST", strings.TrimPrefix(err.Error(), "idem: ")))
		case err != nil:
			log.Error("resolve failed", "error", err)
			writeResponse(w, draw.Problem(http.StatusInternalServerError, "INTERNAL_ERROR", "The payment could not be resolved."))
		case found:
			writeJSON(w, http.StatusOK, map[string]any{"key": in.Key, "resolution": "succeeded", "chargeId": charge.ID})
		default:
			writeJSON(w, http.StatusOK, map[string]any{"key": in.Key, "resolution": "retryable"})
		}
	}))
	mux.HandleFunc("GET /v1/admin/charges", operator(func(w http.ResponseWriter, r *http.Request) {
		charges, err := s.gw.list(r.Context())
		if err != nil {
			log.Error("list charges failed", "error", err)
			writeResponse(w, draw.Problem(http.StatusServiceUnavailable, idemhttp.CodeStoreUnavailable, "The gateway's charges could not be read."))
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"charges": charges})
	}))
}

// paymentKey reads the Idempotency-Key header as the middleware does (a bare
// key or an RFC 8941 string), valid for idem; its error, without the
// package's prefix, is the answer's detail.
func paymentKey(r *http.Request) (string, error) {
	key, err := idemhttp.ParseKey(r.Header)
	if err == nil {
		err = idem.ValidateKey(key)
	}
	if err != nil {
		detail := strings.TrimPrefix(strings.TrimPrefix(err.Error(), "idemhttp: "), "idem: ")
		return "", errors.New(strings.ToUpper(detail[:1]) + detail[1:] + ".")
	}
	return key, nil
}

// paymentProblem answers a payment that did not complete.
func paymentProblem(err error) (resp idem.Response, retryAfter time.Duration) {
	var inProgress *idem.InProgressError
	switch {
	case errors.Is(err, idem.ErrKeyReused):
		return draw.Problem(http.StatusUnprocessableEntity, idemhttp.CodeKeyReused,
			"This Idempotency-Key was used for a different payment."), 0
	case errors.As(err, &inProgress):
		return draw.Problem(http.StatusConflict, idemhttp.CodeInProgress,
			"A payment with this Idempotency-Key is in progress; retry later with the same key."), inProgress.RetryAfter
	case errors.Is(err, idem.ErrOutcomeUnknown):
		return draw.Problem(http.StatusConflict, idemhttp.CodeOutcomeUnknown,
			"The outcome of the payment with this Idempotency-Key is unknown; it will not be charged again until it is reconciled."), 0
	case errors.Is(err, errResumable):
		return draw.Problem(http.StatusGatewayTimeout, "GATEWAY_TIMEOUT",
			"The card gateway did not answer; the card may have been charged. Retry with the same key: the payment resumes, "+
				"and the gateway, which remembers the charge's key, cannot charge twice."), 0
	case errors.Is(err, errOutcomeUnknown):
		return draw.Problem(http.StatusGatewayTimeout, "GATEWAY_TIMEOUT",
			"The card gateway did not answer; the card may have been charged. The payment is held for reconciliation."), 0
	case errors.Is(err, errNotCharged):
		return draw.Problem(http.StatusServiceUnavailable, "GATEWAY_UNAVAILABLE",
			"The card gateway is unavailable; nothing was charged. Retry with the same key."), time.Second
	case idem.Unavailable(err):
		return draw.Problem(http.StatusServiceUnavailable, idemhttp.CodeStoreUnavailable,
			"The payment store is unavailable; retry later with the same key."), time.Second
	}
	return draw.Problem(http.StatusInternalServerError, idemhttp.CodeInternal, "The payment failed."), 0
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, _ := json.MarshalIndent(v, "", "  ")
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}
