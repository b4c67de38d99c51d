package idemconnect

import (
	"context"
	"errors"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/callretry"
	"github.com/pgidem/idem/internal/keyhdr"
	"github.com/pgidem/idem/internal/rpcidem"
	"github.com/pgidem/idem/internal/rpcproto"
)

// NewClientInterceptor returns a client interceptor for calls to servers
// that deduplicate by idempotency key (NewInterceptor, idemgrpc's server,
// AIP-155's request_id practice). It sends each unary call with a key and
// retries it, with the same key, while another attempt may succeed, so that
// a lost reply costs a retry and never a second execution.
//
//	client := ordersv1connect.NewOrderServiceClient(http.DefaultClient, url,
//		connect.WithInterceptors(idemconnect.NewClientInterceptor(idem.RetryPolicy{})))
//	ctx := idem.WithCallKey(ctx, r.CallKey("order")) // r from idem.Reserve
//	resp, err := client.PlaceOrder(ctx, connect.NewRequest(msg)) // errors.Is(err, idem.ErrOutcomeUnknown): it may have happened
//
// Every attempt of one call carries the same Idempotency-Key header: the
// request's own (sent as it is); else the context's call key
// (idem.WithCallKey); else the request's AIP-155 field request_id, when it
// holds a key that idem accepts (so that a server that takes the key from
// that field, Options.KeyField, finds the same key in both places); else
// one minted for this call (idem.NewCallKey). A header the interceptor adds
// is removed from the request when the call returns, so a request sent
// again is a new call with a new key (or its request_id again). A key that
// idem would refuse (idem.ValidateKey; an empty context key, as
// Reservation.CallKey returns for an invalid step), or a policy with a
// negative field, fails the call before anything is sent, with an error
// wrapping idem.ErrInvalidKey or idem.ErrInvalidArgument.
//
// unavailable (the connection failed or broke, or the server could not
// serve) and aborted with a google.rpc.RetryInfo detail (the server's "a
// call with this key is in progress", as NewInterceptor sends it) are
// retried, after the wait the RetryInfo asks for, capped by p.MaxDelay, or
// else p's backoff. Every other code is returned at once: aborted without
// RetryInfo (another kind of conflict), and failed_precondition (the key
// was used for another request, or an outcome to reconcile) and
// invalid_argument, which are bugs or decisions, not accidents. The
// retries stop at p's bounds and when the call's context ends.
// p.AttemptTimeout bounds each attempt: one cut at it (a stalled connection
// or server) is retried with the same key, as a lost reply is, and counts
// as may-have-happened when it got a connection.
//
// When the call ends without an answer (unavailable after the last attempt,
// or deadline_exceeded or canceled while an attempt was under way) after an
// attempt that may have reached the server, the error is an
// *idem.CallError that wraps the last error (and the context's, when it
// ended during the wait before a retry): errors.Is(err,
// idem.ErrOutcomeUnknown) is true, connect.CodeOf(err) is the last error's
// code, its message says that the call may have been processed and to
// retry later with the same key, and its Key field holds that key. When no
// attempt can have reached the server, the last error is returned wrapped
// so that errors.Is(err, idem.ErrNotSent) is true (connect.CodeOf still
// reads it): no attempt got a connection (the dial or the TLS handshake failed,
// or the context ended before a connection was made), as the client trace
// of each attempt's context tells (net/http/httptrace: GetConn without
// GotConn; the interceptor adds its hooks to those the context already
// has). With an HTTP client that calls no trace hooks, only a failed dial
// or name lookup, a refused certificate or a server that does not speak
// TLS count as not sent. A call whose context ended before it started
// sends nothing either: its error wraps the context's, with the code
// connect-go gives it (canceled, deadline_exceeded), and matches
// idem.ErrNotSent. An answer is returned as it is (aborted too, when
// the retries run out on it).
//
// Streaming calls, and handlers, are not intercepted. Do not combine it
// with an idemhttp.Transport under the same client: each would retry the
// other's attempts. The interceptor is safe for concurrent use.
func NewClientInterceptor(p idem.RetryPolicy) connect.Interceptor {
	policy, err := callretry.New(p)
	return &clientInterceptor{policy: policy, err: err}
}

// clientInterceptor is NewClientInterceptor's interceptor.
type clientInterceptor struct {
	policy callretry.Policy
	err    error // of the policy
}

func (c *clientInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !req.Spec().IsClient {
			return next(ctx, req)
		}
		if c.err != nil {
			return nil, c.err
		}
		key, err := callretry.Own(req.Header().Values(HeaderKey), HeaderKey+" header")
		if err != nil {
			return nil, err
		}
		if key == "" {
			if key, err = callretry.Key(ctx, false); err != nil {
				return nil, err
			}
			if key == "" {
				if key = rpcproto.RequestID(req.Any()); key == "" {
					key = idem.NewCallKey()
				}
			}
			req.Header().Set(HeaderKey, keyhdr.Format(key)) // read back as key
			defer req.Header().Del(HeaderKey)
		}
		if err := ctx.Err(); err != nil { // as connect-go's own: canceled, deadline_exceeded
			code := connect.CodeCanceled
			if errors.Is(err, context.DeadlineExceeded) {
				code = connect.CodeDeadlineExceeded
			}
			return nil, callretry.NotSent(connect.NewError(code, err))
		}
		var conn *callretry.Conn // the last attempt's connection, as its client trace saw it
		timedOut := false        // the last attempt was cut at the policy's AttemptTimeout
		return callretry.Run(ctx, c.policy, key, func() (connect.AnyResponse, error) {
			var attemptCtx context.Context
			attemptCtx, conn = callretry.TraceConn(ctx)
			cancel := context.CancelFunc(func() {})
			if d := c.policy.AttemptTimeout(); d > 0 {
				attemptCtx, cancel = context.WithTimeout(attemptCtx, d)
			}
			defer cancel()
			resp, err := next(attemptCtx, req)
			// Cut at AttemptTimeout: the attempt's own deadline passed, or
			// the server, which got that deadline with the call
			// (Connect-Timeout-Ms, grpc-timeout) and whose clock ran it out
			// first, said so. An error the server sent (connect.IsWireError)
			// other than deadline_exceeded is an answer, even when the
			// deadline has passed by the time it is read.
			timedOut = err != nil && ctx.Err() == nil && c.policy.AttemptTimeout() > 0 &&
				(connect.CodeOf(err) == connect.CodeDeadlineExceeded || attemptCtx.Err() != nil && !connect.IsWireError(err))
			return resp, err
		}, func(_ connect.AnyResponse, err error) callretry.Verdict {
			return judgeError(err, conn, timedOut)
		}, func(connect.AnyResponse) {})
	}
}

func (c *clientInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (c *clientInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// judgeError says what one attempt's error means (see
// NewClientInterceptor); conn is the attempt's connection.
func judgeError(err error, conn *callretry.Conn, timedOut bool) callretry.Verdict {
	var info *errdetails.RetryInfo
	var ce *connect.Error
	if errors.As(err, &ce) {
		for _, d := range ce.Details() {
			if msg, err := d.Value(); err == nil {
				if i, ok := msg.(*errdetails.RetryInfo); ok {
					info = i
				}
			}
		}
	}
	return rpcidem.Judge(uint32(connect.CodeOf(err)), callretry.Network(err, conn), rpcproto.RetryInfo(info), timedOut)
}
