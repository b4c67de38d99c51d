// Package rpcidem is what idemgrpc and idemconnect share, without protobuf,
// grpc or connect: the fingerprint of a call, the stored form of its
// outcome, the reasons of their ErrorInfo details, and Core, the part of an
// interceptor that does not depend on its transport (options, the rules of
// the key and the scope, the run of the handler in idem.DoInTx, the status
// of idem's errors and their logs). Each module keeps its transport's glue:
// reading the key, running the handler, protobuf (un)marshalling, and
// turning a Failure into its own error. Both store a call's outcome alike,
// so a key used through one and retried through the other (the same
// procedure served by grpc-go and by connect-go) replays.
//
// The stored form, in an idem.Response:
//   - a reply: Status 200, Body the reply message, marshalled by
//     protobuf's deterministic marshal;
//   - a refusal (a status the handler returned that the interceptor's
//     refusal codes hold): Status the HTTP status of the code (HTTPStatus),
//     Body a google.rpc.Status (code, message, details), marshalled the same
//     way;
//   - Header: the chosen response headers under their lower-case names, the
//     chosen trailers under TrailerPrefix and their name. Values of binary
//     ("-bin") entries are stored base64-encoded, as they travel.
package rpcidem

import (
	"encoding/base64"
	"strings"

	"github.com/pgidem/idem"
)

// FingerprintVersion is the first part of every fingerprint. A change of
// what the fingerprint covers gets a new version.
const FingerprintVersion = "idemrpc/1"

// Fingerprint is the fingerprint of a call of procedure ("/pkg.Service/Method",
// gRPC's full method and Connect's procedure alike) with request, the
// request message marshalled deterministically.
func Fingerprint(procedure string, request []byte) idem.Fingerprint {
	return idem.FingerprintParts([]byte(FingerprintVersion), []byte(procedure), request)
}

// StatusReply is the stored Status of a reply.
const StatusReply = 200

// TrailerPrefix is put before the name of a stored trailer. The stored
// name stays an HTTP token (idem refuses other header names), and no header
// can carry it: '~' is not allowed in gRPC metadata keys.
const TrailerPrefix = "trailer~"

// HTTPStatus is the stored Status of a refusal with the gRPC status code
// code: the HTTP status that google.rpc.Code documents for it (400 for
// INVALID_ARGUMENT, FAILED_PRECONDITION and OUT_OF_RANGE, 404 for NOT_FOUND,
// ...). It is for people reading the record (idem inspect); the code itself
// is in the stored google.rpc.Status. Never StatusReply.
func HTTPStatus(code uint32) int {
	switch code {
	case 1: // CANCELLED
		return 499
	case 3, 9, 11: // INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE
		return 400
	case 4: // DEADLINE_EXCEEDED
		return 504
	case 5: // NOT_FOUND
		return 404
	case 6, 10: // ALREADY_EXISTS, ABORTED
		return 409
	case 7: // PERMISSION_DENIED
		return 403
	case 8: // RESOURCE_EXHAUSTED
		return 429
	case 12: // UNIMPLEMENTED
		return 501
	case 14: // UNAVAILABLE
		return 503
	case 16: // UNAUTHENTICATED
		return 401
	}
	return 500 // UNKNOWN, INTERNAL, DATA_LOSS, and codes outside the list (OK is never stored as a refusal)
}

// IsBinary reports whether the metadata entry name holds binary values
// (its name ends in "-bin").
func IsBinary(name string) bool { return strings.HasSuffix(strings.ToLower(name), "-bin") }

// EncodeBinary is the stored form of a raw binary metadata value.
func EncodeBinary(v string) string { return base64.StdEncoding.EncodeToString([]byte(v)) }

// DecodeBinary is the raw value of a stored binary metadata value, padded
// or not.
func DecodeBinary(v string) (string, error) {
	if len(v)%4 == 0 {
		b, err := base64.StdEncoding.DecodeString(v)
		return string(b), err
	}
	b, err := base64.RawStdEncoding.DecodeString(v)
	return string(b), err
}

// ErrorDomain is the domain of the ErrorInfo details of idemgrpc's and
// idemconnect's own errors.
const ErrorDomain = "github.com/pgidem/idem"

// The reasons of the ErrorInfo details, the same words as idemhttp's problem
// codes.
const (
	ReasonKeyMissing       = "IDEMPOTENCY_KEY_MISSING"
	ReasonKeyInvalid       = "IDEMPOTENCY_KEY_INVALID"
	ReasonKeyReused        = "IDEMPOTENCY_KEY_REUSED"
	ReasonInProgress       = "REQUEST_IN_PROGRESS"
	ReasonOutcomeUnknown   = "IDEMPOTENCY_OUTCOME_UNKNOWN"
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"
)
