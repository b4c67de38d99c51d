package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/internal/pgadvice"
	"github.com/pgidem/idem/internal/demo/draw"
)

// duplicates is how many copies of one request the concurrent scenario sends
// at once, each on its own connection.
const duplicates = 8

// The demo user and box are the ones draw.Setup seeds.
const (
	user  = draw.SeedUser
	boxID = draw.SeedBoxID
)

// scenario is one row of the table.
type scenario struct {
	name string
	// run plays the scenario and says what happened and whether the
	// responses were the expected ones.
	run func(d *demo, ctx context.Context) (what string, ok bool, err error)
	// drawn and batches are what the database must hold afterwards, in
	// total since the start: draws taken (so points and stock follow) and
	// batches written (one debit each).
	drawn, batches int
}

var scenarios = []scenario{
	{"retry after a lost response", (*demo).lostResponse, 2, 1},
	{"same key, different body", (*demo).keyReused, 2, 1},
	{fmt.Sprintf("%d concurrent duplicates", duplicates), (*demo).concurrentDuplicates, 3, 2},
	{"failure before commit", (*demo).failureBeforeCommit, 4, 3},
	{"insufficient points", (*demo).insufficientPoints, 4, 3},
	// Payments through a card gateway (payments.go): the draws stay as they are.
	{"payment, then its retry", (*demo).paymentRetried, 4, 3},
	{"gateway's answer lost, the client retries", (*demo).paymentReplyLost, 4, 3},
	{"gateway times out after charging, no window", (*demo).paymentTimedOut, 4, 3},
	{"operator resolves the unknown payment", (*demo).paymentResolved, 4, 3},
	{"worker paused past its lease", (*demo).paymentStaleWorker, 4, 3},
	{"gateway unavailable, nothing charged", (*demo).paymentUnavailable, 4, 3},
	// With a window (ReserveOptions.ResumeWithin): in doubt, but not an
	// operator's.
	{"gateway times out after charging, the retry resumes", (*demo).paymentResumedByRetry, 4, 3},
	{"service stops after the charge, recovered after restart", (*demo).paymentRecovered, 4, 3},
	// The payments' events (webhooks.go), delivered as webhooks.
	{"payment.succeeded webhooks: answers lost, relay restarted", (*demo).paymentEvents, 4, 3},
}

type demo struct {
	pool *pgxpool.Pool
	svc  *draw.Service
	pay  *payments // created by the first payment scenario
	// payNoWindow shares pay's gateway; its reservations have no window.
	payNoWindow *payments
}

// runScenarios plays every scenario in order, prints the table and returns
// how many rows failed.
func runScenarios(ctx context.Context, out io.Writer, pool *pgxpool.Pool) (failed int) {
	d := &demo{pool: pool, svc: draw.NewService(pool)}
	defer func() {
		if d.pay != nil {
			d.pay.gw.close() // payNoWindow shares it
		}
	}()
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "scenario\twhat happened\tpoints\tstock\tbatches\tdebits\tcheck")
	fmt.Fprintln(tw, "--------\t-------------\t------\t-----\t-------\t------\t-----")
	row := func(name, what string, s draw.Snapshot, ok bool) {
		verdict := "ok"
		if !ok {
			verdict = "FAIL"
			failed++
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%s\n", name, what, s.Points, s.Stock, s.Batches, s.Debits, verdict)
	}

	start, err := d.read(ctx)
	if err != nil {
		fmt.Fprintln(out, "read back:", err)
		return 1
	}
	row("start", "seeded: alice's wallet and box 1", start, start.Check(draw.SeedPoints, draw.SeedStock) == nil)

	var pooled error // a scenario's error that a setting fixes: said after the table
	for i, sc := range scenarios {
		what, ok, err := sc.run(d, ctx)
		if err != nil {
			what, ok = "error: "+err.Error(), false
			if explained := pgadvice.Explain(err, setting); explained != err && pooled == nil {
				pooled = explained
			}
		}
		s, err := d.read(ctx)
		if err != nil {
			what, ok = what+"; read back: "+err.Error(), false
		}
		want := draw.Snapshot{
			Points:  draw.SeedPoints - int64(sc.drawn)*draw.SeedPrice,
			Stock:   draw.SeedStock - sc.drawn,
			Batches: sc.batches,
			Debits:  sc.batches,
		}
		if s.Points != want.Points || s.Stock != want.Stock || s.Batches != want.Batches || s.Debits != want.Debits {
			what += fmt.Sprintf(" [want points=%d stock=%d batches=%d debits=%d]", want.Points, want.Stock, want.Batches, want.Debits)
			ok = false
		}
		if err := s.Check(draw.SeedPoints, draw.SeedStock); err != nil {
			what += " [invariant broken: " + err.Error() + "]"
			ok = false
		}
		row(fmt.Sprintf("%d. %s", i+1, sc.name), what, s, ok)
	}

	s, err := d.read(ctx)
	if err == nil {
		err = s.Check(draw.SeedPoints, draw.SeedStock)
	}
	row("points and stock add up",
		fmt.Sprintf("%d + %d debited = %d points; %d + %d taken = %d stock",
			s.Points, s.Debited, s.Points+s.Debited, s.Stock, s.Taken, s.Stock+s.Taken),
		s, err == nil)
	tw.Flush()
	if err != nil {
		fmt.Fprintln(out, "invariants:", err)
	}
	if pooled != nil {
		fmt.Fprintln(out, "\n"+pooled.Error())
	}
	return failed
}

func (d *demo) read(ctx context.Context) (draw.Snapshot, error) {
	return draw.Read(ctx, d.pool, user, boxID)
}

func (d *demo) draw(ctx context.Context, key string, quantity int) (idem.Result, error) {
	return d.svc.Draw(ctx, user, key, body(quantity))
}

func body(quantity int) []byte {
	return fmt.Appendf(nil, `{"box_id":%d,"quantity":%d}`, boxID, quantity)
}

func batchID(res idem.Result) int64 {
	var out draw.Outcome
	if json.Unmarshal(res.Body, &out) != nil {
		return 0
	}
	return out.BatchID
}

// lostResponse: the draw commits but the response never reaches the app,
// which retries with the same key and body.
func (d *demo) lostResponse(ctx context.Context) (string, bool, error) {
	first, err := d.draw(ctx, "demo-0001", 2)
	if err != nil {
		return "", false, err
	}
	retry, err := d.draw(ctx, "demo-0001", 2)
	if err != nil {
		return "", false, err
	}
	sameBatch := batchID(first) != 0 && batchID(first) == batchID(retry)
	sameBytes := bytes.Equal(first.Body, retry.Body)
	what := fmt.Sprintf("drew 2: %d; retry: %d replayed=%t, same batch=%t, same bytes=%t",
		first.Status, retry.Status, retry.Replayed, sameBatch, sameBytes)
	ok := first.Status == http.StatusCreated && !first.Replayed && retry.Replayed && sameBatch && sameBytes
	return what, ok, nil
}

// keyReused: a client bug sends a different body under a used key.
func (d *demo) keyReused(ctx context.Context) (string, bool, error) {
	_, err := d.draw(ctx, "demo-0001", 5)
	if !errors.Is(err, idem.ErrKeyReused) {
		return fmt.Sprintf("want ErrKeyReused, got %v", err), false, nil
	}
	return "quantity 5 under the same key: ErrKeyReused (422), nothing ran", true, nil
}

// concurrentDuplicates: copies of one request arrive at once.
func (d *demo) concurrentDuplicates(ctx context.Context) (string, bool, error) {
	results := make([]idem.Result, duplicates)
	errs := make([]error, duplicates)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range duplicates {
		wg.Go(func() {
			<-start
			results[i], errs[i] = d.draw(ctx, "demo-0002", 1)
		})
	}
	close(start)
	wg.Wait()

	executed, replayed, inProgress := 0, 0, 0
	batches := map[int64]bool{}
	for i := range duplicates {
		switch {
		case errors.Is(errs[i], idem.ErrInProgress):
			inProgress++
		case errs[i] != nil:
			return "", false, errs[i]
		case results[i].Replayed:
			replayed++
			batches[batchID(results[i])] = true
		default:
			executed++
			batches[batchID(results[i])] = true
		}
	}
	what := fmt.Sprintf("%d executed, %d replayed, %d in progress; %d batch id seen",
		executed, replayed, inProgress, len(batches))
	return what, executed == 1 && len(batches) == 1, nil
}

// failureBeforeCommit: the draw runs with idem.Do in the caller's
// transaction, which then fails before COMMIT; the retry draws normally.
func (d *demo) failureBeforeCommit(ctx context.Context) (string, bool, error) {
	before, err := d.read(ctx)
	if err != nil {
		return "", false, err
	}
	fp, err := idem.FingerprintJSON(body(1))
	if err != nil {
		return "", false, err
	}
	lost := errors.New("connection lost before COMMIT")
	err = idem.InTx(ctx, d.pool, func(ctx context.Context, tx pgx.Tx) error {
		_, err := idem.Do(ctx, tx, idem.Scope{Actor: user, Operation: draw.Operation}, "demo-0003", fp,
			func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
				return draw.Execute(ctx, tx, user, draw.Request{BoxID: boxID, Quantity: 1})
			})
		if err != nil {
			return err
		}
		return lost
	})
	if !errors.Is(err, lost) {
		return fmt.Sprintf("want the transaction to fail, got %v", err), false, nil
	}
	after, err := d.read(ctx)
	if err != nil {
		return "", false, err
	}
	untouched := after == before

	retry, err := d.draw(ctx, "demo-0003", 1)
	if err != nil {
		return "", false, err
	}
	what := fmt.Sprintf("drew 1, rolled back: no trace=%t; retry: %d replayed=%t",
		untouched, retry.Status, retry.Replayed)
	return what, untouched && retry.Status == http.StatusCreated && !retry.Replayed, nil
}

// insufficientPoints: a draw the wallet cannot pay for is refused, and the
// refusal is what the key replays.
func (d *demo) insufficientPoints(ctx context.Context) (string, bool, error) {
	first, err := d.draw(ctx, "demo-0004", draw.MaxQuantity)
	if err != nil {
		return "", false, err
	}
	retry, err := d.draw(ctx, "demo-0004", draw.MaxQuantity)
	if err != nil {
		return "", false, err
	}
	same := bytes.Equal(first.Body, retry.Body)
	what := fmt.Sprintf("%d draws cost %d: %d; retry: %d replayed=%t, same bytes=%t",
		draw.MaxQuantity, draw.MaxQuantity*draw.SeedPrice, first.Status, retry.Status, retry.Replayed, same)
	ok := first.Status == http.StatusPaymentRequired && !first.Replayed &&
		retry.Replayed && retry.Status == first.Status && same
	return what, ok, nil
}
