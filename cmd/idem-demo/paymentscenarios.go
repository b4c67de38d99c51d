package main

// The payment scenarios of `idem-demo run`. They share the demo's database
// and leave the draws alone.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// payments returns the demo's payment service (its reservations with a
// window), creating its tables and a gateway on first use. The payments
// give up on an attempt after half a second here, so the timeout scenarios
// are quick.
func (d *demo) payments(ctx context.Context) (*payments, error) {
	if d.pay == nil {
		if err := setupPayments(ctx, d.pool); err != nil {
			return nil, err
		}
		d.pay = newPayments(d.pool, newGateway(d.pool))
		d.pay.gatewayTimeout = 500 * time.Millisecond
	}
	return d.pay, nil
}

// withoutWindow returns a payment service like d.payments's, with the same
// gateway, whose reservations have no window (resumeWithin 0): a payment
// in doubt waits for an operator.
func (d *demo) withoutWindow(ctx context.Context) (*payments, error) {
	s, err := d.payments(ctx)
	if err != nil {
		return nil, err
	}
	if d.payNoWindow == nil {
		d.payNoWindow = newPayments(d.pool, s.gw)
		d.payNoWindow.gatewayTimeout, d.payNoWindow.resumeWithin = s.gatewayTimeout, 0
	}
	return d.payNoWindow, nil
}

var demoPayment = paymentRequest{CustomerID: "cus-1", AmountCents: 12000, Currency: "KRW"}

// paymentRows counts the payments recorded under key.
func (d *demo) paymentRows(ctx context.Context, key string) (int, error) {
	var n int
	err := d.pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE actor = $1 AND idem_key = $2`, user, key).Scan(&n)
	return n, err
}

// chargesOf returns the latest charge the gateway made for the payment
// key and how many it made.
func chargesOf(ctx context.Context, gw *gateway, key string) (gatewayCharge, int, error) {
	charges, err := gw.charges(ctx, chargeKey(user, key))
	if err != nil || len(charges) == 0 {
		return gatewayCharge{}, 0, err
	}
	return charges[len(charges)-1], len(charges), nil
}

// outcome is what a payment left behind: the gateway's latest charge for
// it and how many it made, the payment's record, its rows in payments, and
// the records that need a person (all payments').
type outcome struct {
	charge  gatewayCharge
	charges int
	status  idem.Status
	rows    int
	waiting int
}

// outcomeOf reads what the payment key left behind, through the gateway gw.
func (d *demo) outcomeOf(ctx context.Context, gw *gateway, key string) (o outcome, err error) {
	if o.charge, o.charges, err = chargesOf(ctx, gw, key); err != nil {
		return o, err
	}
	rec, err := idem.Lookup(ctx, d.pool, idem.Scope{Actor: user, Operation: paymentOperation}, key)
	if err != nil {
		return o, err
	}
	o.status = rec.Status
	if o.rows, err = d.paymentRows(ctx, key); err != nil {
		return o, err
	}
	o.waiting, err = d.forAnOperator(ctx)
	return o, err
}

// forAnOperator counts the records that need a person (idem.ListUnknown).
func (d *demo) forAnOperator(ctx context.Context) (int, error) {
	recs, err := idem.ListUnknown(ctx, d.pool, 100, nil)
	return len(recs), err
}

// paymentRetried: a payment's response is lost and the client retries.
func (d *demo) paymentRetried(ctx context.Context) (string, bool, error) {
	s, err := d.payments(ctx)
	if err != nil {
		return "", false, err
	}
	first, _, err := s.pay(ctx, user, "demo-pay-1", demoPayment, "")
	if err != nil {
		return "", false, err
	}
	retry, replayed, err := s.pay(ctx, user, "demo-pay-1", demoPayment, "")
	if err != nil {
		return "", false, err
	}
	charge, _, err := chargesOf(ctx, s.gw, "demo-pay-1")
	if err != nil {
		return "", false, err
	}
	rows, err := d.paymentRows(ctx, "demo-pay-1")
	if err != nil {
		return "", false, err
	}
	same := bytes.Equal(first.Body, retry.Body)
	what := fmt.Sprintf("paid: %d; retry: %d replayed=%t, same bytes=%t; gateway: %d request, payments: %d",
		first.Status, retry.Status, replayed, same, charge.Requests, rows)
	return what, first.Status == http.StatusCreated && replayed && same && charge.Requests == 1 && rows == 1, nil
}

// paymentReplyLost: the gateway charges, and its answer to the first
// attempt is lost with the connection. The transport's retry carries the
// same call key; the gateway replays the charge; the payment succeeds, with
// one charge and nothing for an operator.
func (d *demo) paymentReplyLost(ctx context.Context) (string, bool, error) {
	s, err := d.payments(ctx)
	if err != nil {
		return "", false, err
	}
	const key = "demo-pay-5"
	paid, _, err := s.pay(ctx, user, key, demoPayment, modeReplyLost)
	if err != nil {
		return "", false, err
	}
	o, err := d.outcomeOf(ctx, s.gw, key)
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("gateway charged %s, answer lost; retried with the same key: replayed; paid %d (%s); gateway: %d charge for %d requests, payments: %d",
		o.charge.ID, paid.Status, o.status, o.charges, o.charge.Requests, o.rows)
	ok := paid.Status == http.StatusCreated && bytes.Contains(paid.Body, []byte(o.charge.ID)) &&
		o.status == idem.StatusSucceeded && o.charges == 1 && o.charge.Requests == 2 && o.rows == 1
	return what, ok, nil
}

// paymentTimedOut: without a window, the gateway charges, then answers
// none of the attempts. The payment is unknown; retries are refused and
// never reach the gateway.
func (d *demo) paymentTimedOut(ctx context.Context) (string, bool, error) {
	s, err := d.withoutWindow(ctx)
	if err != nil {
		return "", false, err
	}
	_, _, err = s.pay(ctx, user, "demo-pay-2", demoPayment, modeTimeoutAfterCharge)
	if !errors.Is(err, errOutcomeUnknown) || errors.Is(err, errResumable) {
		return fmt.Sprintf("want a gateway timeout, got %v", err), false, nil
	}
	refused := 0
	for range 2 {
		if _, _, err := s.pay(ctx, user, "demo-pay-2", demoPayment, ""); errors.Is(err, idem.ErrOutcomeUnknown) {
			refused++
		}
	}
	charge, _, err := chargesOf(ctx, s.gw, "demo-pay-2")
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("no window: gateway charged %s, no answer to %d attempts: 504; %d retries: 409 outcome unknown; gateway: %d requests",
		charge.ID, s.gatewayPolicy.MaxAttempts, refused, charge.Requests)
	return what, refused == 2 && charge.Requests == s.gatewayPolicy.MaxAttempts, nil
}

// paymentResolved: an operator finds the unknown payment's charge at the
// gateway and records it; the retry replays it.
func (d *demo) paymentResolved(ctx context.Context) (string, bool, error) {
	s, err := d.withoutWindow(ctx)
	if err != nil {
		return "", false, err
	}
	unknown, err := d.forAnOperator(ctx)
	if err != nil {
		return "", false, err
	}
	charge, found, err := s.resolve(ctx, user, "demo-pay-2")
	if err != nil {
		return "", false, err
	}
	retry, replayed, err := s.pay(ctx, user, "demo-pay-2", demoPayment, "")
	if err != nil {
		return "", false, err
	}
	rows, err := d.paymentRows(ctx, "demo-pay-2")
	if err != nil {
		return "", false, err
	}
	after, _, err := chargesOf(ctx, s.gw, "demo-pay-2")
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("%d unknown listed; resolved with %s; retry: %d replayed=%t; gateway: %d requests, payments: %d",
		unknown, charge.ID, retry.Status, replayed, after.Requests, rows)
	ok := unknown == 1 && found && retry.Status == http.StatusCreated && replayed &&
		bytes.Contains(retry.Body, []byte(charge.ID)) && after.Requests == s.gatewayPolicy.MaxAttempts && rows == 1
	return what, ok, nil
}

// paymentStaleWorker: a worker pauses past its lease before it reaches the
// gateway. The key turns unknown; the operator finds no charge and allows a
// retry, which charges; the stale worker wakes, and its Complete is fenced.
func (d *demo) paymentStaleWorker(ctx context.Context) (string, bool, error) {
	s, err := d.payments(ctx)
	if err != nil {
		return "", false, err
	}
	const key = "demo-pay-3"
	fp, err := idem.FingerprintJSON(demoPayment)
	if err != nil {
		return "", false, err
	}
	scope := idem.Scope{Actor: user, Operation: paymentOperation}
	stale, err := idem.Reserve(ctx, d.pool, scope, key, fp, 50*time.Millisecond)
	if err != nil {
		return "", false, err
	}
	for { // the pause: until the database clock has passed the lease
		var past bool
		if err := d.pool.QueryRow(ctx, `SELECT now() > $1`, stale.LeaseExpiresAt).Scan(&past); err != nil {
			return "", false, err
		}
		if past {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	expired, err := idem.ExpireLeases(ctx, d.pool, 100)
	if err != nil {
		return "", false, err
	}
	if _, found, err := s.resolve(ctx, user, key); err != nil || found {
		return fmt.Sprintf("resolve: found=%t, %v", found, err), false, nil
	}
	paid, _, err := s.pay(ctx, user, key, demoPayment, "")
	if err != nil {
		return "", false, err
	}
	// The stale worker wakes up and carries on.
	charge, err := s.charge(ctx, stale, demoPayment, "")
	if err != nil {
		return "", false, err
	}
	err = idem.InTx(ctx, d.pool, func(ctx context.Context, tx pgx.Tx) error {
		if err := idem.Complete(ctx, tx, stale, paymentResponse(charge)); err != nil {
			return err
		}
		return insertPayment(ctx, tx, user, key, charge)
	})
	fenced := errors.Is(err, idem.ErrFenced)
	rows, err := d.paymentRows(ctx, key)
	if err != nil {
		return "", false, err
	}
	after, _, err := chargesOf(ctx, s.gw, key)
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("lease ran out: %d expired; resolved retryable; retry paid %d; stale Complete fenced=%t; gateway: %s for %d requests, payments: %d",
		expired, paid.Status, fenced, after.ID, after.Requests, rows)
	ok := expired == 1 && paid.Status == http.StatusCreated && fenced && after.Requests == 2 && rows == 1
	return what, ok, nil
}

// paymentUnavailable: the gateway refuses before charging anything: the
// key may run again, and the retry charges once.
func (d *demo) paymentUnavailable(ctx context.Context) (string, bool, error) {
	s, err := d.payments(ctx)
	if err != nil {
		return "", false, err
	}
	_, _, err = s.pay(ctx, user, "demo-pay-4", demoPayment, modeUnavailable)
	if !errors.Is(err, errNotCharged) {
		return fmt.Sprintf("want the gateway to refuse, got %v", err), false, nil
	}
	retry, replayed, err := s.pay(ctx, user, "demo-pay-4", demoPayment, "")
	if err != nil {
		return "", false, err
	}
	charge, _, err := chargesOf(ctx, s.gw, "demo-pay-4")
	if err != nil {
		return "", false, err
	}
	rows, err := d.paymentRows(ctx, "demo-pay-4")
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("gateway refused %d attempts, nothing charged: 503; retry: %d replayed=%t; gateway: %s for %d requests, payments: %d",
		s.gatewayPolicy.MaxAttempts, retry.Status, replayed, charge.ID, charge.Requests, rows)
	return what, retry.Status == http.StatusCreated && !replayed && charge.ID != "" &&
		charge.Requests == s.gatewayPolicy.MaxAttempts+1 && rows == 1, nil
}

// paymentResumedByRetry: with a window, the gateway charges and answers
// none of the attempts; the payment is in doubt, but not an operator's.
// The client's retry resumes it: the same request with the same call key,
// which the gateway answers with the first charge. One charge.
func (d *demo) paymentResumedByRetry(ctx context.Context) (string, bool, error) {
	s, err := d.payments(ctx)
	if err != nil {
		return "", false, err
	}
	const key = "demo-pay-6"
	_, _, err = s.pay(ctx, user, key, demoPayment, modeTimeoutAfterCharge)
	if !errors.Is(err, errResumable) {
		return fmt.Sprintf("want a gateway timeout inside the window, got %v", err), false, nil
	}
	waiting, err := d.forAnOperator(ctx)
	if err != nil {
		return "", false, err
	}
	paid, replayed, err := s.pay(ctx, user, key, demoPayment, "")
	if err != nil {
		return "", false, err
	}
	o, err := d.outcomeOf(ctx, s.gw, key)
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("gateway charged %s, no answer to %d attempts: 504, for an operator: %d; retry resumed: paid %d with %s; gateway: %d charge for %d requests, payments: %d, for an operator: %d",
		o.charge.ID, s.gatewayPolicy.MaxAttempts, waiting, paid.Status, o.charge.ID, o.charges, o.charge.Requests, o.rows, o.waiting)
	ok := waiting == 0 && paid.Status == http.StatusCreated && !replayed && bytes.Contains(paid.Body, []byte(o.charge.ID)) &&
		o.status == idem.StatusSucceeded && o.charges == 1 && o.charge.Requests == s.gatewayPolicy.MaxAttempts+1 && o.rows == 1 && o.waiting == 0
	return what, ok, nil
}

// paymentRecovered: the payment service stops dead after the gateway
// charged and before Complete, as a crash does; nobody retries. A new
// service starts (with a gateway of its own, which remembers in the same
// tables, as a provider outlives its caller); once the lease has run out
// its recovery worker resumes the payment and sends its request again with
// the same call key; the gateway answers with the first charge; the
// payment succeeds. One charge, nothing for an operator.
func (d *demo) paymentRecovered(ctx context.Context) (string, bool, error) {
	s, err := d.payments(ctx)
	if err != nil {
		return "", false, err
	}
	const key = "demo-pay-7"
	crashing := newPayments(d.pool, s.gw)
	crashing.lease, crashing.gatewayTimeout, crashing.stop = 100*time.Millisecond, s.gatewayTimeout, func() {}
	if _, _, err := crashing.pay(withCrash(ctx), user, key, demoPayment, ""); !errors.Is(err, errStopped) {
		return fmt.Sprintf("want the service to stop after the charge, got %v", err), false, nil
	}
	first, _, err := chargesOf(ctx, s.gw, key)
	if err != nil {
		return "", false, err
	}

	restartedGW := newGateway(d.pool)
	defer restartedGW.close()
	restarted := newPayments(d.pool, restartedGW)
	restarted.gatewayTimeout = s.gatewayTimeout
	resumed := 0
	for deadline := time.Now().Add(10 * time.Second); resumed == 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		n, err := restarted.recoverPayments(ctx)
		if err != nil {
			return "", false, err
		}
		resumed += n
	}
	o, err := d.outcomeOf(ctx, restartedGW, key)
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("gateway charged %s, the service stopped before Complete; after the restart the recovery worker resumed %d: replayed %s, %s; gateway: %d charge for %d requests, payments: %d, for an operator: %d",
		first.ID, resumed, o.charge.ID, o.status, o.charges, o.charge.Requests, o.rows, o.waiting)
	ok := resumed == 1 && first.ID != "" && o.charge.ID == first.ID && o.status == idem.StatusSucceeded &&
		o.charges == 1 && o.charge.Requests == 2 && o.rows == 1 && o.waiting == 0
	return what, ok, nil
}
