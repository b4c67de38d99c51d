// Package rpcidem is what idemgrpc and idemconnect share without protobuf,
// grpc or connect: the fingerprint of a call, the stored form of its
// outcome, the reasons of their ErrorInfo details, and Core, the part of an
// interceptor that depends on no transport and no message format (options,
// the rules of the key, the scope and the stored names, the run of the
// handler in the store's DoInTx, the status of idem's errors and their
// logs). The protobuf half (the request's key field, deterministic
// marshalling, reply types, google.rpc.Status) is internal/rpcproto, a module
// of its own so that the library's module needs no protobuf; each of
// idemgrpc and idemconnect keeps only its transport's glue. Both store a
// call's outcome alike, so a key used through one and retried through the
// other (the same procedure served by grpc-go and by connect-go) replays.
//
//	idemgrpc, idemconnect   transport glue (metadata, status errors)
//	internal/rpcproto        protobuf: key field, reply types, google.rpc.Status
//	internal/rpcidem         this package: keys, scope, outcome, stored form
//	internal/front           the public fronts: idem (pgx) or idemsql (database/sql)
//
// The stored form, in an idem.Response:
//   - a reply: Status 200, Body the reply message, marshalled by
//     protobuf's deterministic marshal, and the entry ReplyType (the
//     message's full name) among the headers;
//   - a refusal (a status the handler returned that the interceptor's
//     refusal codes hold): Status the HTTP status of the code (HTTPStatus),
//     Body a google.rpc.Status (code, message, details), marshalled the same
//     way;
//   - Header: the chosen response headers under their lower-case names, the
//     chosen trailers under TrailerPrefix and their name. Values of binary
//     ("-bin") entries are stored base64-encoded, as they travel. Stored
//     names never hold '~' (HeaderName refuses it), which marks idem's own
//     entries: TrailerPrefix and ReplyType.
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
// can carry it: HeaderName refuses '~' (as gRPC refuses it in metadata
// keys).
const TrailerPrefix = "trailer~"

// ReplyType is the stored entry that holds the full name of a stored
// reply's message type ("google.rpc.ResourceInfo"), so that a replay
// decodes it without the procedure's schema. A record stored without it
// (by an earlier version) is decoded as the procedure's reply type.
const ReplyType = "reply~type"

// Entries splits stored, the Header of a stored outcome, into the headers
// and the trailers to send again (names as stored, lower case; nil for
// none) and the reply's type ("" for none).
func Entries(stored map[string][]string) (header, trailer map[string][]string, replyType string) {
	add := func(m *map[string][]string, name string, values []string) {
		if *m == nil {
			*m = make(map[string][]string, len(stored))
		}
		(*m)[name] = values
	}
	for name, values := range stored {
		switch n, isTrailer := strings.CutPrefix(name, TrailerPrefix); {
		case name == ReplyType:
			if len(values) == 1 {
				replyType = values[0]
			}
		case isTrailer:
			add(&trailer, n, values)
		default:
			add(&header, name, values)
		}
	}
	return header, trailer, replyType
}

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
	ReasonResponseExpired  = "IDEMPOTENCY_RESPONSE_EXPIRED"
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"
)
