package core

import (
	"context"
	"encoding/json"
	"fmt"
)

// Typed replay: DoJSON and DoInTxJSON store a value as its JSON and return
// it decoded, and RejectJSON stores a refusal that comes back as a
// *RejectedError (see idem.DoJSON).

// RejectedError is the refusal of a request made with RejectJSON (or Reject),
// as DoJSON and DoInTxJSON return it: on the call whose fn refused, and on
// every replay of the refusal. Check for it with errors.As.
type RejectedError struct {
	// Status is the status given to RejectJSON (100 to 999).
	Status int
	// Body is the JSON of the value given to RejectJSON, exactly as stored.
	Body []byte
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("idem: request rejected with status %d", e.Status)
}

// Decode decodes the refusal's value into v (a pointer), with encoding/json.
// A body that does not decode into v gives an error wrapping ErrStoredValue;
// a v that is not a non-nil pointer, one wrapping ErrInvalidArgument.
func (e *RejectedError) Decode(v any) error {
	if err := json.Unmarshal(e.Body, v); err != nil {
		if _, notPointer := err.(*json.InvalidUnmarshalError); notPointer {
			return errorf("idem: %w: Decode needs a non-nil pointer, not %T", ErrInvalidArgument, v)
		}
		return errorf("idem: %w: refusal (%T): %w", ErrStoredValue, v, err)
	}
	return nil
}

// RejectJSON is Reject with v marshalled as the body (see idem.RejectJSON).
func RejectJSON(status int, v any) error {
	if status < 100 || status > 999 {
		return errorf("idem: %w: rejection status %d is not 100 to 999", ErrInvalidResponse, status)
	}
	body, err := json.Marshal(v)
	if err != nil {
		return errorf("idem: %w: rejection value %T does not marshal to JSON: %w", ErrInvalidResponse, v, err)
	}
	return Reject(Response{Status: status, Body: body})
}

// DoJSON is Do for code that deals in values (see idem.DoJSON). It is a
// function because Go methods cannot have type parameters.
func DoJSON[T, TTx, TDB any](ctx context.Context, c *Client[TTx, TDB], tx TTx, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (T, error)) (T, bool, error) {
	var zero T
	if err := checkJSONCall(c, fn == nil); err != nil {
		return zero, false, err
	}
	res, err := c.Do(ctx, tx, scope, key, fp, jsonFn(fn))
	return decodeResult[T](res, err)
}

// DoInTxJSON is DoInTx for code that deals in values (see idem.DoInTxJSON).
func DoInTxJSON[T, TTx, TDB any](ctx context.Context, c *Client[TTx, TDB], db TDB, scope Scope, key string, fp Fingerprint,
	fn func(ctx context.Context, tx TTx) (T, error)) (T, bool, error) {
	var zero T
	if err := checkJSONCall(c, fn == nil); err != nil {
		return zero, false, err
	}
	res, err := c.DoInTx(ctx, db, scope, key, fp, jsonFn(fn))
	return decodeResult[T](res, err)
}

func checkJSONCall[TTx, TDB any](c *Client[TTx, TDB], nilFn bool) error {
	if c == nil {
		return errorf("idem: %w: nil client", ErrInvalidArgument)
	}
	if nilFn {
		return errNilFn
	}
	return nil
}

// jsonFn adapts fn to Do: its value is stored as Response{Body: JSON}, once
// it is known to decode back into a T, so that a replay cannot fail on a
// value the first call accepted.
func jsonFn[T, TTx any](fn func(ctx context.Context, tx TTx) (T, error)) func(ctx context.Context, tx TTx) (Response, error) {
	return func(ctx context.Context, tx TTx) (Response, error) {
		v, err := fn(ctx, tx)
		return jsonResponse(v, err, new(T))
	}
}

// jsonResponse is the Response that stores v, fn's value under DoJSON, or
// fn's error err; back points to a zero value of v's type, which v's JSON
// must decode into.
func jsonResponse(v any, err error, back any) (Response, error) {
	if err != nil {
		if refusal, ok := RejectedResponse(err); ok && refusal.Status == 0 {
			return Response{}, errorf("idem: %w: a rejection under DoJSON needs a status of 100 to 999", ErrInvalidResponse)
		}
		return Response{}, err
	}
	body, err := json.Marshal(v)
	if err != nil {
		return Response{}, errorf("idem: %w: %T does not marshal to JSON: %w", ErrInvalidResponse, v, err)
	}
	if err := json.Unmarshal(body, back); err != nil {
		return Response{}, errorf("idem: %w: the JSON of %T does not decode back into it: %w", ErrInvalidResponse, v, err)
	}
	return Response{Body: body}, nil
}

// decodeResult turns Do's outcome into DoJSON's: the decoded value, or the
// refusal as a *RejectedError.
func decodeResult[T any](res Result, err error) (T, bool, error) {
	var v T
	if err != nil {
		return v, res.Replayed, err // a replay whose body is gone (ErrResponseGone)
	}
	if res.Status != 0 {
		return v, res.Replayed, &RejectedError{Status: res.Status, Body: res.Body}
	}
	if err := json.Unmarshal(res.Body, &v); err != nil {
		var zero T
		return zero, false, errorf("idem: %w: %T: %w", ErrStoredValue, zero, err)
	}
	return v, res.Replayed, nil
}
