package draw_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/demo/draw"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// migrate installs idem's table and the draw tables and seeds; pgtest runs it
// once on a template database.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	return draw.Setup(ctx, pool)
}

// setup returns a pool (pgtest.PoolMaxConns connections, enough for every
// goroutine of a test to hold its own) on a fresh seeded database.
func setup(t *testing.T) *pgxpool.Pool {
	t.Helper()
	return pgtest.Pool(t, migrate)
}

func body(boxID int64, quantity int) []byte {
	return fmt.Appendf(nil, `{"box_id":%d,"quantity":%d}`, boxID, quantity)
}

func snapshot(t *testing.T, db draw.Querier, user string, boxID int64) draw.Snapshot {
	t.Helper()
	s, err := draw.Read(t.Context(), db, user, boxID)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func checkInvariants(t *testing.T, s draw.Snapshot, startPoints int64, startStock int) {
	t.Helper()
	if err := s.Check(startPoints, startStock); err != nil {
		t.Errorf("invariants broken: %v\n%+v", err, s)
	}
}

func outcome(t *testing.T, res idem.Result) draw.Outcome {
	t.Helper()
	if res.Status != http.StatusCreated {
		t.Fatalf("status %d, want 201: %s", res.Status, res.Body)
	}
	var out draw.Outcome
	if err := json.Unmarshal(res.Body, &out); err != nil {
		t.Fatalf("decode %s: %v", res.Body, err)
	}
	return out
}

// problemCode returns the "code" member of a problem+json refusal.
func problemCode(t *testing.T, res idem.Result) string {
	t.Helper()
	if ct := res.Header["Content-Type"]; !slices.Equal(ct, []string{"application/problem+json"}) {
		t.Errorf("Content-Type %q, want application/problem+json", ct)
	}
	var p struct {
		Status int    `json:"status"`
		Code   string `json:"code"`
	}
	if err := json.Unmarshal(res.Body, &p); err != nil {
		t.Fatalf("decode %s: %v", res.Body, err)
	}
	if p.Status != res.Status {
		t.Errorf("problem status %d, response status %d", p.Status, res.Status)
	}
	return p.Code
}

func TestDrawOnceThenReplay(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)

	first, err := svc.Draw(ctx, draw.SeedUser, "key-replay", body(draw.SeedBoxID, 3))
	if err != nil {
		t.Fatal(err)
	}
	if first.Replayed {
		t.Error("first call replayed")
	}
	out := outcome(t, first)
	if len(out.Prizes) != 3 || out.PointsSpent != 3*draw.SeedPrice || out.PointsLeft != draw.SeedPoints-3*draw.SeedPrice {
		t.Errorf("outcome %+v", out)
	}

	// The inventory holds exactly the prizes the response announced.
	rows, _ := pool.Query(ctx, `SELECT prize FROM inventory WHERE batch_id = $1 ORDER BY slot`, out.BatchID)
	stored, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(stored, out.Prizes) {
		t.Errorf("inventory %q, response %q", stored, out.Prizes)
	}

	// Retries (whitespace and key order do not matter) replay byte for byte.
	for _, b := range [][]byte{body(draw.SeedBoxID, 3), []byte(` { "quantity": 3, "box_id": 1 } `)} {
		again, err := svc.Draw(ctx, draw.SeedUser, "key-replay", b)
		if err != nil {
			t.Fatal(err)
		}
		if !again.Replayed || again.Status != first.Status || !bytes.Equal(again.Body, first.Body) {
			t.Errorf("retry: replayed=%v status=%d body=%s; first body=%s", again.Replayed, again.Status, again.Body, first.Body)
		}
	}

	s := snapshot(t, pool, draw.SeedUser, draw.SeedBoxID)
	if s.Batches != 1 || s.Debits != 1 || s.Stock != draw.SeedStock-3 {
		t.Errorf("after one draw and two retries: %+v", s)
	}
	checkInvariants(t, s, draw.SeedPoints, draw.SeedStock)
}

func TestKeyReusedChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)

	if _, err := svc.Draw(ctx, draw.SeedUser, "key-reused", body(draw.SeedBoxID, 1)); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, pool, draw.SeedUser, draw.SeedBoxID)
	_, err := svc.Draw(ctx, draw.SeedUser, "key-reused", body(draw.SeedBoxID, 2))
	if !errors.Is(err, idem.ErrKeyReused) {
		t.Fatalf("different body under the same key: err %v, want ErrKeyReused", err)
	}
	if after := snapshot(t, pool, draw.SeedUser, draw.SeedBoxID); after != before {
		t.Errorf("changed: before %+v, after %+v", before, after)
	}

	// The same key belongs to another user's scope independently.
	if err := draw.AddWallet(ctx, pool, "bob", 500); err != nil {
		t.Fatal(err)
	}
	res, err := svc.Draw(ctx, "bob", "key-reused", body(draw.SeedBoxID, 2))
	if err != nil || res.Replayed {
		t.Fatalf("bob with alice's key: replayed=%v err=%v", res.Replayed, err)
	}
	outcome(t, res)
}

func TestConcurrentDuplicatesDrawOnce(t *testing.T) {
	t.Parallel()
	const n = 16
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)

	results := make([]idem.Result, n)
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			results[i], errs[i] = svc.Draw(ctx, draw.SeedUser, "key-race", body(draw.SeedBoxID, 2))
		})
	}
	close(start)
	wg.Wait()

	executed := 0
	var first []byte
	for i := range n {
		if errors.Is(errs[i], idem.ErrInProgress) {
			continue
		}
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if !results[i].Replayed {
			executed++
		}
		if first == nil {
			first = results[i].Body
		} else if !bytes.Equal(first, results[i].Body) {
			t.Errorf("bodies differ:\n%s\n%s", first, results[i].Body)
		}
	}
	if executed != 1 {
		t.Errorf("%d calls executed, want 1", executed)
	}
	s := snapshot(t, pool, draw.SeedUser, draw.SeedBoxID)
	if s.Batches != 1 || s.Debits != 1 || s.Debited != 2*draw.SeedPrice {
		t.Errorf("after %d duplicates: %+v", n, s)
	}
	checkInvariants(t, s, draw.SeedPoints, draw.SeedStock)
}

// Distinct keys from one user race for the wallet: the guarded debit lets
// exactly as many through as the points pay for, and the rest are refused.
func TestConcurrentDrawsNeverOverdraw(t *testing.T) {
	t.Parallel()
	const n, points = 8, 350
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)
	if err := draw.AddWallet(ctx, pool, "carol", points); err != nil {
		t.Fatal(err)
	}

	results := make([]idem.Result, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			res, err := svc.Draw(ctx, "carol", fmt.Sprintf("key-wallet-%d", i), body(draw.SeedBoxID, 1))
			if err != nil {
				t.Error(err)
			}
			results[i] = res
		})
	}
	close(start)
	wg.Wait()

	created, refused := 0, 0
	for i, res := range results {
		switch {
		case res.Status == http.StatusCreated:
			created++
		case res.Status == http.StatusPaymentRequired && problemCode(t, res) == draw.CodeInsufficientPoints:
			refused++
		default:
			t.Errorf("call %d: status %d: %s", i, res.Status, res.Body)
		}
	}
	if created != points/draw.SeedPrice || refused != n-created {
		t.Errorf("created %d, refused %d; want %d and %d", created, refused, points/draw.SeedPrice, n-points/draw.SeedPrice)
	}
	s := snapshot(t, pool, "carol", draw.SeedBoxID)
	if s.Points != points%draw.SeedPrice {
		t.Errorf("points left %d, want %d", s.Points, points%draw.SeedPrice)
	}
	checkInvariants(t, s, points, draw.SeedStock)
}

// Users race for the last units of a box: the guarded stock update sells
// exactly the stock, and the refused users keep their points.
func TestConcurrentDrawsNeverOversell(t *testing.T) {
	t.Parallel()
	const n, stock = 10, 3
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)
	box := draw.Box{ID: 2, Name: "Limited Box", Price: 10, Stock: stock, Prizes: []draw.Prize{{Name: "Crystal Goose", Weight: 1}}}
	if err := draw.AddBox(ctx, pool, box); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if err := draw.AddWallet(ctx, pool, fmt.Sprintf("user-%d", i), 100); err != nil {
			t.Fatal(err)
		}
	}

	results := make([]idem.Result, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			res, err := svc.Draw(ctx, fmt.Sprintf("user-%d", i), "key-stock", body(box.ID, 1))
			if err != nil {
				t.Error(err)
			}
			results[i] = res
		})
	}
	close(start)
	wg.Wait()

	created := 0
	for i, res := range results {
		user := fmt.Sprintf("user-%d", i)
		s := snapshot(t, pool, user, box.ID)
		switch res.Status {
		case http.StatusCreated:
			created++
			checkInvariants(t, s, 100, stock)
			if s.Points != 90 || s.Batches != 1 {
				t.Errorf("%s drew: %+v", user, s)
			}
		case http.StatusConflict:
			if code := problemCode(t, res); code != draw.CodeOutOfStock {
				t.Errorf("%s: code %q", user, code)
			}
			if s.Points != 100 || s.Batches != 0 || s.Debits != 0 {
				t.Errorf("%s was refused but charged: %+v", user, s)
			}
		default:
			t.Errorf("%s: status %d: %s", user, res.Status, res.Body)
		}
	}
	s := snapshot(t, pool, "nobody", box.ID)
	if created != stock || s.Stock != 0 || s.Taken != stock {
		t.Errorf("created %d, stock left %d, taken %d; want %d, 0, %d", created, s.Stock, s.Taken, stock, stock)
	}
}

// A refusal is the stored outcome of its key: topping up the wallet does not
// change what the same key replays, and a new key draws normally.
func TestInsufficientPointsIsStoredAndReplayed(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)
	if err := draw.AddWallet(ctx, pool, "bob", 150); err != nil {
		t.Fatal(err)
	}

	first, err := svc.Draw(ctx, "bob", "key-poor", body(draw.SeedBoxID, 2))
	if err != nil {
		t.Fatal(err)
	}
	if first.Status != http.StatusPaymentRequired || first.Replayed || problemCode(t, first) != draw.CodeInsufficientPoints {
		t.Fatalf("first: status %d replayed %v body %s", first.Status, first.Replayed, first.Body)
	}
	if s := snapshot(t, pool, "bob", draw.SeedBoxID); s.Points != 150 || s.Batches != 0 || s.Stock != draw.SeedStock {
		t.Errorf("refusal changed something: %+v", s)
	}

	if _, err := pool.Exec(ctx, `UPDATE wallets SET points = 1000 WHERE user_id = 'bob'`); err != nil {
		t.Fatal(err)
	}
	again, err := svc.Draw(ctx, "bob", "key-poor", body(draw.SeedBoxID, 2))
	if err != nil {
		t.Fatal(err)
	}
	if !again.Replayed || again.Status != first.Status || !bytes.Equal(again.Body, first.Body) {
		t.Errorf("retry after top-up: replayed=%v status=%d body=%s", again.Replayed, again.Status, again.Body)
	}

	fresh, err := svc.Draw(ctx, "bob", "key-rich", body(draw.SeedBoxID, 2))
	if err != nil {
		t.Fatal(err)
	}
	if out := outcome(t, fresh); out.PointsLeft != 800 {
		t.Errorf("new key after top-up: %+v", out)
	}
}

// Execute debits the wallet before it takes stock; an out-of-stock refusal
// must undo that debit.
func TestRefusalsUndoEarlierWrites(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)
	box := draw.Box{ID: 3, Name: "Last One", Price: 50, Stock: 1, Prizes: []draw.Prize{{Name: "Goose Egg", Weight: 1}}}
	if err := draw.AddBox(ctx, pool, box); err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		key    string
		body   []byte
		status int
		code   string
	}{
		{"key-sold-out", body(box.ID, 2), http.StatusConflict, draw.CodeOutOfStock},
		{"key-no-box", body(99, 1), http.StatusNotFound, draw.CodeUnknownBox},
	}
	for _, c := range cases {
		res, err := svc.Draw(ctx, draw.SeedUser, c.key, c.body)
		if err != nil {
			t.Fatal(err)
		}
		if res.Status != c.status || problemCode(t, res) != c.code {
			t.Errorf("%s: status %d body %s", c.key, res.Status, res.Body)
		}
	}
	s := snapshot(t, pool, draw.SeedUser, box.ID)
	if s.Points != draw.SeedPoints || s.Stock != 1 || s.Batches != 0 || s.Debits != 0 || s.Items != 0 {
		t.Errorf("refusals left writes behind: %+v", s)
	}
}

// An invalid body is refused before the key is claimed, so the key stays
// free for the corrected request.
func TestInvalidBodyClaimsNothing(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)

	for _, b := range []string{
		`{"box_id":1,"quantity":0}`,
		`{"box_id":1,"quantity":11}`,
		`{"box_id":0,"quantity":1}`,
		`{"box_id":1,"quantity":1,"user_id":"mallory"}`,
		`{"box_id":1,"quantity":1} {}`,
		`{"box_id":1,`,
		``,
	} {
		if _, err := svc.Draw(ctx, draw.SeedUser, "key-fixed", []byte(b)); !errors.Is(err, draw.ErrInvalidRequest) {
			t.Errorf("%q: err %v, want ErrInvalidRequest", b, err)
		}
	}
	res, err := svc.Draw(ctx, draw.SeedUser, "key-fixed", body(draw.SeedBoxID, 1))
	if err != nil || res.Replayed {
		t.Fatalf("valid body after invalid ones: replayed=%v err=%v", res.Replayed, err)
	}
	outcome(t, res)

	// Execute called directly refuses an invalid request as a stored 422.
	res, err = idem.DoInTx(ctx, pool, idem.Scope{Actor: draw.SeedUser, Operation: draw.Operation}, "key-direct", idem.Fingerprint{},
		func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			return draw.Execute(ctx, tx, draw.SeedUser, draw.Request{BoxID: 1, Quantity: 0})
		})
	if err != nil || res.Status != http.StatusUnprocessableEntity || problemCode(t, res) != draw.CodeInvalidRequest {
		t.Errorf("Execute with quantity 0: status %d err %v", res.Status, err)
	}
}

// A failure after the draw's writes but before commit leaves no trace: not
// the debit, not the stock, not the stored response. The same key then draws.
func TestFailureBeforeCommitLeavesNoTrace(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := setup(t)
	svc := draw.NewService(pool)
	scope := idem.Scope{Actor: draw.SeedUser, Operation: draw.Operation}
	b := body(draw.SeedBoxID, 2)
	fp, err := idem.FingerprintJSON(b)
	if err != nil {
		t.Fatal(err)
	}
	crash := errors.New("crash after the writes")

	// fn itself fails after Execute wrote everything.
	_, err = idem.DoInTx(ctx, pool, scope, "key-crash", fp, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		if _, err := draw.Execute(ctx, tx, draw.SeedUser, draw.Request{BoxID: draw.SeedBoxID, Quantity: 2}); err != nil {
			return idem.Response{}, err
		}
		return idem.Response{}, crash
	})
	if !errors.Is(err, crash) {
		t.Fatalf("err %v, want %v", err, crash)
	}

	// Do completed, then the caller's transaction failed and rolled back.
	err = idem.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		res, err := idem.Do(ctx, tx, scope, "key-crash", fp, func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
			return draw.Execute(ctx, tx, draw.SeedUser, draw.Request{BoxID: draw.SeedBoxID, Quantity: 2})
		})
		if err != nil {
			return err
		}
		outcome(t, res)
		return crash
	})
	if !errors.Is(err, crash) {
		t.Fatalf("err %v, want %v", err, crash)
	}

	s := snapshot(t, pool, draw.SeedUser, draw.SeedBoxID)
	if s.Points != draw.SeedPoints || s.Stock != draw.SeedStock || s.Batches != 0 || s.Debits != 0 || s.Items != 0 {
		t.Errorf("rolled-back draws left a trace: %+v", s)
	}

	// Nothing was stored under the key either: the retry executes.
	res, err := svc.Draw(ctx, draw.SeedUser, "key-crash", b)
	if err != nil || res.Replayed {
		t.Fatalf("retry after rollback: replayed=%v err=%v", res.Replayed, err)
	}
	outcome(t, res)
	s = snapshot(t, pool, draw.SeedUser, draw.SeedBoxID)
	if s.Batches != 1 || s.Debits != 1 {
		t.Errorf("after the retry: %+v", s)
	}
	checkInvariants(t, s, draw.SeedPoints, draw.SeedStock)
}

func TestSetupIsRepeatable(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := setup(t)
	if _, err := draw.NewService(pool).Draw(ctx, draw.SeedUser, "key-setup", body(draw.SeedBoxID, 1)); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, pool, draw.SeedUser, draw.SeedBoxID)
	if err := draw.Setup(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(t, pool, draw.SeedUser, draw.SeedBoxID); after != before {
		t.Errorf("second Setup changed data: before %+v, after %+v", before, after)
	}
}
