package idemhttp_test

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// A handler that calls idem itself (idem.DoInTx, idem.Reserve) reads the
// Idempotency-Key header as the middleware does: ParseKey, then
// idem.ValidateKey. Each error is a 400.
func ExampleParseKey() {
	for _, h := range []http.Header{
		{"Idempotency-Key": {"8e03978e-40d5"}},   // a bare key, as clients send
		{"Idempotency-Key": {`"8e03978e-40d5"`}}, // a structured-field string
		{},                                       // no header
		{"Idempotency-Key": {"a", "b"}},          // two headers
		{"Idempotency-Key": {"a, b"}},            // two values joined by a proxy
		{"Idempotency-Key": {`"8e03978e`}},       // an unterminated string
		{"Idempotency-Key": {`"has space"`}},     // read, but not a valid key
	} {
		key, err := idemhttp.ParseKey(h)
		if err == nil {
			err = idem.ValidateKey(key)
		}
		switch {
		case errors.Is(err, idemhttp.ErrMissingKey):
			fmt.Println("400: missing key")
		case errors.Is(err, idemhttp.ErrMultipleKeys):
			fmt.Println("400: more than one key")
		case errors.Is(err, idemhttp.ErrMalformedKey):
			fmt.Println("400: malformed header")
		case errors.Is(err, idem.ErrInvalidKey):
			fmt.Println("400: invalid key")
		default:
			fmt.Println("key:", key)
		}
	}
	// Output:
	// key: 8e03978e-40d5
	// key: 8e03978e-40d5
	// 400: missing key
	// 400: more than one key
	// 400: more than one key
	// 400: malformed header
	// 400: invalid key
}
