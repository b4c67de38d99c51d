// Package draw is the Goose Kuzi draw domain used by the idem example and the
// demo program: a user spends points to draw prizes from a box with finite
// stock.
//
// One draw debits the wallet, takes stock, picks prizes at random, and writes
// a batch, its inventory rows and one ledger debit. Execute does all of that
// in the caller's transaction; Service.Draw wraps it in idem.DoInTx so a
// retried request replays the first outcome instead of drawing again.
package draw

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// MaxQuantity is the largest number of draws one request may ask for.
const MaxQuantity = 10

// ErrInvalidRequest reports a request body that is not a valid draw request.
// Service.Draw returns it before claiming the key, so nothing is stored and
// the key stays free.
var ErrInvalidRequest = errors.New("draw: invalid request")

// Request is the body of a draw request.
type Request struct {
	BoxID    int64 `json:"box_id"`
	Quantity int   `json:"quantity"`
}

// RequestError is the error of ParseRequest and Request.Validate. It
// matches ErrInvalidRequest with errors.Is.
type RequestError struct {
	// Reason says what is wrong with the request, in a sentence meant for
	// the client (no decoder text).
	Reason string
}

func (e *RequestError) Error() string { return "draw: invalid request: " + e.Reason }

// Is reports whether target is ErrInvalidRequest.
func (e *RequestError) Is(target error) bool { return target == ErrInvalidRequest }

// The reasons of the RequestErrors about the fields.
var (
	reasonBoxID    = "box_id must be a positive integer."
	reasonQuantity = fmt.Sprintf("quantity must be an integer from 1 to %d.", MaxQuantity)
)

// exampleBody is the request quoted in RequestError reasons.
const exampleBody = `{"box_id":1,"quantity":2}`

// Validate reports whether r names a box and asks for 1 to MaxQuantity draws.
// The error is a *RequestError.
func (r Request) Validate() error {
	if r.BoxID <= 0 {
		return &RequestError{Reason: reasonBoxID}
	}
	if r.Quantity < 1 || r.Quantity > MaxQuantity {
		return &RequestError{Reason: reasonQuantity}
	}
	return nil
}

// ParseRequest decodes and validates a JSON draw request. Unknown fields and
// trailing data are refused. The error is a *RequestError.
func ParseRequest(body []byte) (Request, error) {
	var r Request
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return Request{}, &RequestError{Reason: decodeReason(err)}
	}
	if _, err := dec.Token(); err != io.EOF {
		return Request{}, &RequestError{Reason: "The body holds more than one JSON value; send one object, such as " + exampleBody + "."}
	}
	return r, r.Validate()
}

// decodeReason turns an error of encoding/json's Decode into a RequestError
// reason.
func decodeReason(err error) string {
	var typeErr *json.UnmarshalTypeError
	switch {
	case errors.Is(err, io.EOF):
		return "The body is empty; send a JSON object such as " + exampleBody + "."
	case errors.As(err, &typeErr) && typeErr.Field == "box_id":
		return reasonBoxID
	case errors.As(err, &typeErr) && typeErr.Field == "quantity":
		return reasonQuantity
	}
	// Decode reports an unknown field only by its message.
	if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok && len(name) <= 66 {
		return "Unknown field " + name + "; a draw request has box_id and quantity only."
	}
	return "The body is not a JSON object such as " + exampleBody + "."
}

// Outcome is the body of a successful draw (HTTP 201).
type Outcome struct {
	BatchID     int64    `json:"batch_id"`
	Prizes      []string `json:"prizes"`
	PointsSpent int64    `json:"points_spent"`
	PointsLeft  int64    `json:"points_left"`
}

// Problem codes of the refusals Execute stores.
const (
	CodeInvalidRequest     = "INVALID_REQUEST"
	CodeUnknownBox         = "UNKNOWN_BOX"
	CodeInsufficientPoints = "INSUFFICIENT_POINTS"
	CodeOutOfStock         = "OUT_OF_STOCK"
)

// Execute performs one draw for user inside tx and returns the response to
// store: 201 with an Outcome on success.
//
// Deterministic refusals are returned as idem.Reject, so idem.Do undoes the
// writes Execute made and stores the refusal for replay:
//   - 422 INVALID_REQUEST: req fails Validate;
//   - 404 UNKNOWN_BOX: the box does not exist;
//   - 402 INSUFFICIENT_POINTS: the wallet holds less than price × quantity;
//   - 409 OUT_OF_STOCK: the box has fewer than quantity draws left.
//
// Any other error (a database failure, a box without prizes) is returned as
// is; the caller's transaction must roll back and nothing is stored.
//
// The wallet and the box are changed with guarded UPDATEs (points >= cost,
// stock >= quantity), so concurrent draws never overdraw either; the wallet
// row is locked before the box row in every draw.
func Execute(ctx context.Context, tx pgx.Tx, user string, req Request) (idem.Response, error) {
	resp, err := attempt(ctx, tx, user, req, rand.IntN)
	var r *refusal
	if errors.As(err, &r) {
		return idem.Response{}, idem.Reject(r.resp)
	}
	return resp, err
}

// Attempt performs one draw like Execute, for callers that keep or undo the
// writes by the response status, as idemhttp does: a refusal comes back as
// its 4xx response with a nil error, and the writes Attempt made before it
// (the debit, when the box turns out to be out of stock) are still in tx,
// so the caller must roll them back. intn picks the prizes: it returns a
// uniform integer in [0, n) (nil means math/rand/v2's IntN).
func Attempt(ctx context.Context, tx pgx.Tx, user string, req Request, intn func(n int) int) (idem.Response, error) {
	if intn == nil {
		intn = rand.IntN
	}
	resp, err := attempt(ctx, tx, user, req, intn)
	var r *refusal
	if errors.As(err, &r) {
		return r.resp, nil
	}
	return resp, err
}

// refusal is a deterministic refusal: its response is the outcome.
type refusal struct{ resp idem.Response }

func (r *refusal) Error() string { return fmt.Sprintf("draw: refused with status %d", r.resp.Status) }

func refuse(resp idem.Response) error { return &refusal{resp: resp} }

func attempt(ctx context.Context, tx pgx.Tx, user string, req Request, intn func(int) int) (idem.Response, error) {
	if err := req.Validate(); err != nil {
		return idem.Response{}, refuse(Problem(http.StatusUnprocessableEntity, CodeInvalidRequest, err.(*RequestError).Reason))
	}

	// Debit the wallet, pricing the draw from the box in the same statement.
	var cost, pointsLeft int64
	err := tx.QueryRow(ctx, `
		UPDATE wallets AS w
		SET points = w.points - b.price * $3
		FROM boxes AS b
		WHERE w.user_id = $1 AND b.id = $2 AND w.points >= b.price * $3
		RETURNING b.price * $3, w.points`,
		user, req.BoxID, req.Quantity).Scan(&cost, &pointsLeft)
	if errors.Is(err, pgx.ErrNoRows) {
		return idem.Response{}, refuseDebit(ctx, tx, user, req)
	}
	if err != nil {
		return idem.Response{}, fmt.Errorf("draw: debit points: %w", err)
	}

	// Pick the prizes. The picks are random; a replay returns the stored
	// response and never rolls again.
	table, err := loadPrizes(ctx, tx, req.BoxID)
	if err != nil {
		return idem.Response{}, err
	}
	won := pick(table, req.Quantity, intn)

	// Take stock. Every draw from the box contends on this row, so it is
	// locked last and held only until commit.
	tag, err := tx.Exec(ctx,
		`UPDATE boxes SET stock = stock - $2 WHERE id = $1 AND stock >= $2`,
		req.BoxID, req.Quantity)
	if err != nil {
		return idem.Response{}, fmt.Errorf("draw: take stock: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return idem.Response{}, refuse(Problem(http.StatusConflict, CodeOutOfStock,
			fmt.Sprintf("box %d has fewer than %d draws left", req.BoxID, req.Quantity)))
	}

	// Record the batch, its inventory rows and its single ledger debit.
	out := Outcome{Prizes: won, PointsSpent: cost, PointsLeft: pointsLeft}
	err = tx.QueryRow(ctx, `
		WITH batch AS (
			INSERT INTO draw_batches (user_id, box_id, quantity)
			VALUES ($1, $2, $3)
			RETURNING id
		), items AS (
			INSERT INTO inventory (batch_id, slot, user_id, prize)
			SELECT batch.id, won.slot, $1, won.prize
			FROM batch, unnest($4::text[]) WITH ORDINALITY AS won (prize, slot)
		), debit AS (
			INSERT INTO point_ledger (user_id, batch_id, amount)
			SELECT $1, batch.id, $5 FROM batch
		)
		SELECT id FROM batch`,
		user, req.BoxID, req.Quantity, won, cost).Scan(&out.BatchID)
	if err != nil {
		return idem.Response{}, fmt.Errorf("draw: record batch: %w", err)
	}

	body, err := json.Marshal(out)
	if err != nil {
		return idem.Response{}, fmt.Errorf("draw: encode outcome: %w", err)
	}
	return idem.Response{
		Status: http.StatusCreated,
		Header: map[string][]string{"Content-Type": {"application/json"}},
		Body:   body,
	}, nil
}

// refuseDebit explains why the guarded debit matched no row and returns the
// refusal to store.
func refuseDebit(ctx context.Context, tx pgx.Tx, user string, req Request) error {
	var price, points *int64
	err := tx.QueryRow(ctx, `
		SELECT (SELECT price FROM boxes WHERE id = $2),
		       (SELECT points FROM wallets WHERE user_id = $1)`,
		user, req.BoxID).Scan(&price, &points)
	if err != nil {
		return fmt.Errorf("draw: read wallet and box: %w", err)
	}
	if price == nil {
		return refuse(Problem(http.StatusNotFound, CodeUnknownBox,
			fmt.Sprintf("box %d does not exist", req.BoxID)))
	}
	var have int64
	if points != nil {
		have = *points
	}
	return refuse(Problem(http.StatusPaymentRequired, CodeInsufficientPoints,
		fmt.Sprintf("%d draws from box %d cost %d points; the wallet holds %d",
			req.Quantity, req.BoxID, *price*int64(req.Quantity), have)))
}

func loadPrizes(ctx context.Context, tx pgx.Tx, boxID int64) ([]Prize, error) {
	rows, _ := tx.Query(ctx,
		`SELECT name, weight FROM prizes WHERE box_id = $1 ORDER BY name`, boxID)
	table, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Prize, error) {
		var p Prize
		err := row.Scan(&p.Name, &p.Weight)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("draw: load prizes of box %d: %w", boxID, err)
	}
	if len(table) == 0 {
		return nil, fmt.Errorf("draw: box %d has no prizes", boxID)
	}
	return table, nil
}

// pick draws n prizes from table, each with probability weight/total.
// intn returns a uniform integer in [0, n).
func pick(table []Prize, n int, intn func(int) int) []string {
	total := 0
	for _, p := range table {
		total += p.Weight
	}
	won := make([]string, n)
	for i := range won {
		r := intn(total)
		for _, p := range table {
			if r < p.Weight {
				won[i] = p.Name
				break
			}
			r -= p.Weight
		}
	}
	return won
}

// Problem returns an application/problem+json response (RFC 9457) with the
// extension member "code" naming the problem for programs.
func Problem(status int, code, detail string) idem.Response {
	body, _ := json.Marshal(struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Code   string `json:"code"`
		Detail string `json:"detail"`
	}{"about:blank", http.StatusText(status), status, code, detail})
	return idem.Response{
		Status: status,
		Header: map[string][]string{"Content-Type": {"application/problem+json"}},
		Body:   body,
	}
}
