package draw_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/pgidem/idem/internal/demo/draw"
)

// Every malformed body gets a *RequestError whose reason is a sentence of
// the draw's own, never encoding/json's text.
func TestParseRequestReasons(t *testing.T) {
	t.Parallel()
	for body, want := range map[string]string{
		``:                                   "The body is empty",
		`   `:                                "The body is empty",
		`{"box_id":1,`:                       "The body is not a JSON object",
		`not json`:                           "The body is not a JSON object",
		`[1,2]`:                              "The body is not a JSON object",
		`"draw"`:                             "The body is not a JSON object",
		`{"box_id":"1","quantity":2}`:        "box_id must be a positive integer.",
		`{"box_id":1.5,"quantity":2}`:        "box_id must be a positive integer.",
		`{"box_id":0,"quantity":2}`:          "box_id must be a positive integer.",
		`{"box_id":1,"quantity":"two"}`:      "quantity must be an integer from 1 to 10.",
		`{"box_id":1,"quantity":1e100}`:      "quantity must be an integer from 1 to 10.",
		`{"box_id":1,"quantity":11}`:         "quantity must be an integer from 1 to 10.",
		`{"box_id":1,"quantity":0}`:          "quantity must be an integer from 1 to 10.",
		`{"box_id":1,"quantity":1,"user":1}`: `Unknown field "user"; a draw request has box_id and quantity only.`,
		`{"box_id":1,"quantity":1} {}`:       "The body holds more than one JSON value",
	} {
		_, err := draw.ParseRequest([]byte(body))
		var reqErr *draw.RequestError
		if !errors.As(err, &reqErr) || !errors.Is(err, draw.ErrInvalidRequest) {
			t.Errorf("%q: %v, want a *RequestError matching ErrInvalidRequest", body, err)
			continue
		}
		if !strings.HasPrefix(reqErr.Reason, want) {
			t.Errorf("%q: reason %q, want it to start with %q", body, reqErr.Reason, want)
		}
		if strings.Contains(reqErr.Reason, "json:") || strings.Contains(reqErr.Reason, "Go ") {
			t.Errorf("%q: reason %q holds decoder text", body, reqErr.Reason)
		}
	}
	if r, err := draw.ParseRequest([]byte(`{"quantity":2,"box_id":1}`)); err != nil || r != (draw.Request{BoxID: 1, Quantity: 2}) {
		t.Errorf("valid body: %+v, %v", r, err)
	}
}
