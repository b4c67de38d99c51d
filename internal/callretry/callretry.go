// Package callretry is the retry loop that idem's clients share
// (idemhttp.Transport and the client interceptors of idemgrpc and
// idemconnect): the key of a call, an idem.RetryPolicy with its defaults,
// the wait between attempts, and the error of a call given up without an
// answer. Each client judges its own attempts (Verdict); Run decides
// whether and when another one follows.
package callretry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http/httptrace"
	"sync/atomic"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/keyhdr"
)

// Policy is an idem.RetryPolicy with its defaults in place.
type Policy struct {
	maxAttempts int
	maxElapsed  time.Duration
	baseDelay   time.Duration
	maxDelay    time.Duration
	attempt     time.Duration // each attempt's bound, 0 for none
}

// New returns p with its zero fields replaced by their defaults, or p's
// Validate error.
func New(p idem.RetryPolicy) (Policy, error) {
	if err := p.Validate(); err != nil {
		return Policy{}, err
	}
	or := func(v, def time.Duration) time.Duration {
		if v == 0 {
			return def
		}
		return v
	}
	out := Policy{
		maxAttempts: p.MaxAttempts,
		maxElapsed:  or(p.MaxElapsed, idem.DefaultRetryMaxElapsed),
		baseDelay:   or(p.BaseDelay, idem.DefaultRetryBaseDelay),
		maxDelay:    or(p.MaxDelay, idem.DefaultRetryMaxDelay),
		attempt:     p.AttemptTimeout,
	}
	if out.maxAttempts == 0 {
		out.maxAttempts = idem.DefaultRetryMaxAttempts
	}
	return out, nil
}

// AttemptTimeout is the bound on each attempt (idem.RetryPolicy's), 0 for
// none.
func (p Policy) AttemptTimeout() time.Duration { return p.attempt }

// Once is p with a single attempt.
func (p Policy) Once() Policy {
	p.maxAttempts = 1
	return p
}

// Key returns the key of a call without a key of its own: the context's
// call key (idem.WithCallKey), checked; else, when mint is true, a new one
// (idem.NewCallKey); else "". An invalid context key is refused with an
// error wrapping idem.ErrInvalidKey.
func Key(ctx context.Context, mint bool) (string, error) {
	if key, ok := idem.CallKeyFrom(ctx); ok {
		if err := idem.ValidateKey(key); err != nil {
			return "", fmt.Errorf("%w (the context's call key, from idem.WithCallKey; Reservation.CallKey returns \"\" for an invalid step)", err)
		}
		return key, nil
	}
	if mint {
		return idem.NewCallKey(), nil
	}
	return "", nil
}

// Own returns the key a request carries itself, in values (the entries of
// its Idempotency-Key header or idempotency-key metadata, where names
// them), read as idem's servers read it (a bare key or an RFC 8941 string)
// and checked by idem.ValidateKey. It returns "" for no entry. A key that
// cannot be read or is invalid is refused with an error wrapping
// idem.ErrInvalidKey.
func Own(values []string, where string) (string, error) {
	if len(values) == 0 {
		return "", nil
	}
	key, err := keyhdr.Parse(values)
	if err == nil {
		err = idem.ValidateKey(key)
	} else {
		err = fmt.Errorf("%w: %v", idem.ErrInvalidKey, err)
	}
	if err != nil {
		return "", fmt.Errorf("%w (the request's own %s)", err, where)
	}
	return key, nil
}

// Verdict is what a client makes of one attempt.
type Verdict struct {
	// Retry: another attempt with the same key may succeed where this one
	// failed.
	Retry bool
	// Answered: the receiver answered. When no attempt follows, the answer
	// is returned as it is; otherwise the call ends with an error.
	Answered bool
	// MaybeDone: the attempt may have taken effect at the receiver (it was
	// sent and not answered, it was answered with a server error, or it
	// found the request in progress).
	MaybeDone bool
	// After, when HasAfter, is the wait the receiver asked for before the
	// next attempt (Retry-After, RetryInfo).
	After    time.Duration
	HasAfter bool
	// InProgress: the receiver answered that a request with this key is
	// in progress (HTTP 409, ABORTED with RetryInfo). Such an attempt does
	// not count toward MaxAttempts (unless it is 1): the call waits it out
	// within MaxElapsed and its context.
	InProgress bool
}

// notSent is the error of a call none of whose attempts reached the
// receiver: it matches idem.ErrNotSent and wraps the last attempt's error.
type notSent struct{ err error }

func (e *notSent) Error() string {
	return idem.ErrNotSent.Error() + ": " + e.err.Error()
}
func (e *notSent) Unwrap() error        { return e.err }
func (e *notSent) Is(target error) bool { return target == idem.ErrNotSent }

// NotSent wraps err, the error of a call of which nothing was sent, so
// that it matches idem.ErrNotSent (nil stays nil).
func NotSent(err error) error {
	if err == nil {
		return nil
	}
	return &notSent{err}
}

// Run makes the attempts of one call whose attempts all carry key ("" for
// none), and returns the last answer, or the error of a call that ended
// without one. After each attempt, judge says what it means; Run stops when
// it is not worth retrying, at the policy's bounds, or when ctx ends, and
// otherwise discards the attempt's result and waits before the next one.
//
// A call that ends without an answer, after an attempt that may have taken
// effect, returns an *idem.CallError (idem.ErrOutcomeUnknown) wrapping the
// last error; one none of whose attempts reached the receiver (no answer,
// nothing that may have taken effect) returns the last error wrapped so
// that it matches idem.ErrNotSent. When ctx ends during a wait, the last error is ctx's joined with
// the last attempt's, so that errors.Is finds ctx's error and errors.As
// (gRPC's status.Code, connect.CodeOf) the attempt's. A ctx that ended
// before the first attempt returns its error (matching idem.ErrNotSent)
// and sends nothing.
func Run[T any](ctx context.Context, p Policy, key string, attempt func() (T, error), judge func(T, error) Verdict, discard func(T)) (T, error) {
	var zero T
	if err := ctx.Err(); err != nil {
		return zero, NotSent(err)
	}
	start := time.Now()
	maybeDone, answered := false, false
	giveUp := func(n int, err error) error {
		switch {
		case maybeDone:
			return &idem.CallError{Key: key, Attempts: n, Err: err}
		case !answered:
			return NotSent(err)
		}
		return err
	}
	counted := 0 // the attempts that count toward maxAttempts
	for n := 1; ; n++ {
		res, err := attempt()
		v := judge(res, err)
		maybeDone = maybeDone || v.MaybeDone
		if !v.InProgress || p.maxAttempts == 1 {
			counted++
		}
		wait, again := p.next(ctx, start, counted, n, v)
		answered = answered || v.Answered
		if !again {
			if v.Answered {
				return res, err
			}
			return zero, giveUp(n, err)
		}
		if v.Answered {
			discard(res)
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return zero, giveUp(n, waitEnded(ctx.Err(), err))
		}
	}
}

// waitEnded is the error of a call whose context ended (with ctxErr) during
// the wait after an attempt that failed with last (nil for an answer).
func waitEnded(ctxErr, last error) error {
	if last == nil {
		return ctxErr
	}
	return &endedError{ctx: ctxErr, last: last}
}

// endedError keeps both errors of a wait that the context ended: the
// context's first, then the last attempt's. Unlike errors.Join, its
// message is one line.
type endedError struct{ ctx, last error }

func (e *endedError) Error() string {
	return e.ctx.Error() + " while waiting to retry, after: " + e.last.Error()
}

func (e *endedError) Unwrap() []error { return []error{e.ctx, e.last} }

// next reports whether attempt n+1 follows attempt n, judged v, and after
// what wait; counted of the n count toward maxAttempts.
func (p Policy) next(ctx context.Context, start time.Time, counted, n int, v Verdict) (time.Duration, bool) {
	if !v.Retry || counted >= p.maxAttempts || ctx.Err() != nil {
		return 0, false
	}
	wait := p.wait(n, v)
	at := time.Now().Add(wait)
	if at.Sub(start) > p.maxElapsed {
		return 0, false
	}
	if deadline, ok := ctx.Deadline(); ok && at.After(deadline) {
		return 0, false
	}
	return wait, true
}

// wait is the wait after attempt n: the receiver's request capped by
// maxDelay, or a random wait between zero and min(maxDelay,
// baseDelay × 2^(n-1)) (full jitter). A request of no wait (Retry-After: 0,
// or a date already past by this clock) is taken as none: the backoff
// decides, so that answers that do not count toward maxAttempts (in
// progress) cannot loop without a pause.
func (p Policy) wait(n int, v Verdict) time.Duration {
	if v.HasAfter && v.After > 0 {
		return min(v.After, p.maxDelay)
	}
	bound := p.maxDelay
	if n-1 < 62 && p.baseDelay <= p.maxDelay>>(n-1) {
		bound = p.baseDelay << (n - 1)
	}
	if bound <= 0 {
		return 0
	}
	// In [0, bound]; bound+1 as a uint64 cannot overflow, even at
	// math.MaxInt64.
	return time.Duration(rand.Uint64N(uint64(bound) + 1))
}

// Conn follows one attempt of an HTTP call through the client trace of its
// request's context (net/http/httptrace): whether the attempt asked its
// transport for a connection (GetConn) and whether it got one (GotConn).
// net/http's Transport, HTTP/2 included, writes a request only on a
// connection it reported with GotConn, so an attempt that asked and got
// none sent nothing. A transport that calls neither hook tells nothing.
type Conn struct{ asked, got atomic.Bool }

// TraceConn returns ctx with client trace hooks that fill a new Conn,
// composed with the hooks ctx already has (httptrace.WithClientTrace: those
// run too).
func TraceConn(ctx context.Context) (context.Context, *Conn) {
	c := &Conn{}
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GetConn: func(string) { c.asked.Store(true) },
		GotConn: func(httptrace.GotConnInfo) { c.got.Store(true) },
	}), c
}

// Network judges an attempt that failed with err before an answer came
// back: whether to retry it and whether it may have reached the receiver.
// c is the attempt's Conn, nil for none.
//
// When c tells (the transport asked for a connection), an attempt that got
// no connection sent nothing: it is retried (within the context: Run stops
// once it ended), unless the TLS handshake failed for good (a certificate
// the client refuses, a server that does not speak TLS). An attempt that got one may have
// reached the receiver, whatever err says (net/http may send a request and
// then fail to dial for its own retry of it): it is retried unless the
// certificate was refused.
//
// When c does not tell, err alone decides: a refused certificate, or a
// server whose first answer is not TLS, did not reach it and is not
// retried; a failed dial or name lookup did not reach it and is retried;
// anything else (a connection closed or reset, a TLS record that breaks a
// connection, a timeout, the context's end, an error of the transport) is
// retried and may have reached it.
func Network(err error, c *Conn) Verdict {
	var (
		certErr   *tls.CertificateVerificationError
		authErr   x509.UnknownAuthorityError
		hostErr   x509.HostnameError
		invalid   x509.CertificateInvalidError
		recordErr tls.RecordHeaderError
		dnsErr    *net.DNSError
		opErr     *net.OpError
	)
	refused := errors.As(err, &certErr) || errors.As(err, &authErr) || errors.As(err, &hostErr) || errors.As(err, &invalid)
	// Only a record read before the handshake's first one carries Conn.
	notTLS := errors.As(err, &recordErr) && recordErr.Conn != nil
	switch {
	case c != nil && c.asked.Load() && !c.got.Load():
		return Verdict{Retry: !refused && !notTLS}
	case c != nil && c.asked.Load():
		return Verdict{Retry: !refused, MaybeDone: true}
	case refused, notTLS:
		return Verdict{}
	case errors.As(err, &dnsErr), errors.As(err, &opErr) && opErr.Op == "dial":
		return Verdict{Retry: true}
	}
	return Verdict{Retry: true, MaybeDone: true}
}
