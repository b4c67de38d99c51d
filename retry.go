package idem

import (
	"errors"
	"fmt"
	"time"
)

// ErrNotSent means no attempt of an outgoing call made by one of idem's
// clients (idemhttp.Transport, the gRPC and Connect client interceptors)
// reached the receiver: the connection was refused, the name did not
// resolve, the certificate was refused, or the context ended before a
// connection was made. The request certainly had no effect: it may be
// sent again, also with a new key. An error that matches ErrNotSent never
// matches ErrOutcomeUnknown; the chain holds the last attempt's error.
var ErrNotSent = errors.New("idem: the call was not sent (no attempt reached the receiver)")

// RetryPolicy bounds the retries of an outgoing call made through one of
// idem's clients: idemhttp.Transport, idemgrpc.UnaryClientInterceptor and
// idemconnect.NewClientInterceptor. Every attempt of one call carries the
// same idempotency key. The zero value of every field means its default; a
// negative field is refused (Validate) and the call is not sent.
//
// Between attempts a client waits what the receiver asked for (HTTP
// Retry-After, gRPC's RetryInfo), capped by MaxDelay, or else an exponential
// backoff with full jitter: a random delay between zero and
// min(MaxDelay, BaseDelay × 2^(n-1)) after the nth attempt. It stops at
// MaxAttempts attempts, when the next attempt would start more than
// MaxElapsed after the first one, or when the call's context ends (also when
// the context's deadline would pass during the wait). MaxElapsed does not
// cut an attempt short: AttemptTimeout does. An answer that says the
// request is in progress (HTTP 409, gRPC and Connect ABORTED with RetryInfo)
// does not count toward MaxAttempts, unless it is 1: such a call is waited
// out within MaxElapsed and the context.
type RetryPolicy struct {
	// MaxAttempts is the most attempts of one call, the first included.
	// 1 means no retry. Default DefaultRetryMaxAttempts.
	MaxAttempts int
	// MaxElapsed is the longest time from the start of the first attempt to
	// the start of the last one. Default DefaultRetryMaxElapsed.
	MaxElapsed time.Duration
	// BaseDelay is the backoff's first bound. Default DefaultRetryBaseDelay.
	BaseDelay time.Duration
	// MaxDelay caps every wait, the receiver's requests included.
	// Default DefaultRetryMaxDelay.
	MaxDelay time.Duration
	// AttemptTimeout bounds each attempt: an attempt still unanswered after
	// it is cut and, like a lost reply, retried with the same key (and
	// counts as may-have-happened when it was sent; as the last attempt,
	// the call ends with a CallError). idemhttp.Transport bounds the wait
	// for the answer's headers (the body is read after); the gRPC and
	// Connect client interceptors the whole unary call. Default 0: no bound
	// but the context's. Make it longer than the receiver's usual work, or
	// every attempt is cut and the receiver's in-progress answers are
	// waited out instead.
	AttemptTimeout time.Duration
}

// Defaults of RetryPolicy.
const (
	DefaultRetryMaxAttempts = 4
	DefaultRetryMaxElapsed  = 30 * time.Second
	DefaultRetryBaseDelay   = 100 * time.Millisecond
	DefaultRetryMaxDelay    = 5 * time.Second
)

// Validate reports whether p can be used: no field may be negative. The
// error wraps ErrInvalidArgument and names the field.
func (p RetryPolicy) Validate() error {
	for _, f := range [...]struct {
		name string
		neg  bool
		v    any
	}{
		{"MaxAttempts", p.MaxAttempts < 0, p.MaxAttempts},
		{"MaxElapsed", p.MaxElapsed < 0, p.MaxElapsed},
		{"BaseDelay", p.BaseDelay < 0, p.BaseDelay},
		{"MaxDelay", p.MaxDelay < 0, p.MaxDelay},
		{"AttemptTimeout", p.AttemptTimeout < 0, p.AttemptTimeout},
	} {
		if f.neg {
			return fmt.Errorf("%w: RetryPolicy.%s is %v; it must not be negative (0 means the default)", ErrInvalidArgument, f.name, f.v)
		}
	}
	return nil
}

// CallError is the error of an outgoing call that one of idem's clients
// gave up on without an answer after an attempt that may have reached the
// receiver: the reply was lost, the connection broke, the call timed out or
// its context ended while an attempt was under way. The request may have
// been processed. errors.Is(err, ErrOutcomeUnknown) is true, and the chain
// holds the last attempt's error (Err).
//
// Do not start over with a new key: retry later with the same key (Key),
// which the receiver deduplicates for as long as it remembers keys (Stripe:
// 24 hours), or reconcile with the receiver first. The message says so; it
// does not hold the key, because error messages end up in logs, where idem
// writes keys only as keyed hashes: read the key from the field.
type CallError struct {
	// Key is the idempotency key every attempt carried, "" when the call
	// carried none.
	Key string
	// Attempts is the number of attempts made.
	Attempts int
	// Err is the last attempt's error. When the context ended during the
	// wait before a retry, Err wraps both the context's error and the last
	// attempt's (the context's alone after an answer), so that
	// errors.Is(err, context.Canceled) holds and gRPC's status.Code and
	// connect.CodeOf still read the last status.
	Err error
}

func (e *CallError) Error() string {
	retry := "retry later with the same idempotency key"
	if e.Key == "" {
		retry = "check with the receiver before sending it again"
	}
	return fmt.Sprintf("%s: no answer to %d attempt(s); the request may have been processed: %s (last error: %v)",
		ErrOutcomeUnknown.Error(), e.Attempts, retry, e.Err)
}

// Unwrap returns the last attempt's error.
func (e *CallError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrOutcomeUnknown) true.
func (e *CallError) Is(target error) bool { return target == ErrOutcomeUnknown }
