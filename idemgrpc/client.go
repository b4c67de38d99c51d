package idemgrpc

import (
	"context"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/callretry"
	"github.com/pgidem/idem/internal/keyhdr"
	"github.com/pgidem/idem/internal/rpcidem"
	"github.com/pgidem/idem/internal/rpcproto"
)

// UnaryClientInterceptor returns a client interceptor for calls to servers
// that deduplicate by idempotency key (UnaryServerInterceptor, AIP-155's
// request_id practice). It sends each unary call with a key and retries it,
// with the same key, while another attempt may succeed, so that a lost
// reply costs a retry and never a second execution.
//
//	conn, err := grpc.NewClient(target, grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor(idem.RetryPolicy{})), ...)
//	ctx := idem.WithCallKey(ctx, r.CallKey("transfer")) // r from idem.Reserve
//	reply, err := client.Transfer(ctx, req)            // errors.Is(err, idem.ErrOutcomeUnknown): it may have happened
//
// Every attempt of one call carries the same idempotency-key metadata: the
// call's own (in the outgoing metadata, sent as it is); else the context's
// call key (idem.WithCallKey); else the request's AIP-155 field
// request_id, when it holds a key that idem accepts (so that a server that
// takes the key from that field, Options.KeyField, finds the same key in
// both places); else one minted for this call (idem.NewCallKey). A key
// that idem would refuse (idem.ValidateKey; an empty context key, as
// Reservation.CallKey returns for an invalid step), or a policy with a
// negative field, fails the call before anything is sent, with an error
// wrapping idem.ErrInvalidKey or idem.ErrInvalidArgument.
//
// UNAVAILABLE (the connection failed or broke, or the server could not
// serve) and ABORTED with a google.rpc.RetryInfo detail (the server's "a
// call with this key is in progress", as UnaryServerInterceptor sends it)
// are retried, after the wait the status's RetryInfo asks for, capped by
// p.MaxDelay, or else p's backoff. Every other status is returned at once:
// ABORTED without RetryInfo (another kind of conflict), and
// FAILED_PRECONDITION (the key was used for another request, or an outcome
// to reconcile) and INVALID_ARGUMENT, which are bugs or decisions, not
// accidents. The retries stop at p's bounds and when the call's context
// ends. p.AttemptTimeout bounds each attempt: one cut at it (a stalled
// connection or server) is retried with the same key, as a lost reply is,
// and counts as may-have-happened when it reached a server.
//
// When the call ends without an answer (UNAVAILABLE after the last attempt,
// or DEADLINE_EXCEEDED or CANCELLED while an attempt was under way) after
// an attempt that reached a server (it got a stream on a connection, as
// grpc.Peer reports), the error is an *idem.CallError that wraps the last
// status (and the context's error, when it ended during the wait before a
// retry): errors.Is(err, idem.ErrOutcomeUnknown) is true, status.Code(err)
// is the last status's code, its message says that the call may have been
// processed and to retry later with the same key, and its Key field holds
// that key. When no attempt reached a server (the connection was refused
// or never became ready, no address could be picked, the context ended
// while the connection was being made), nothing was sent, and the last
// status is returned wrapped so that errors.Is(err, idem.ErrNotSent) is
// true (status.Code still reads it); so is a call whose context ended
// before it started, with the context's error and the status grpc-go gives
// it (CANCELLED, DEADLINE_EXCEEDED). An answer (ABORTED too, when the
// retries run out on it) is returned as it is.
//
// Streaming calls are not intercepted. Leave gRPC's own retries (a
// retryPolicy in the service config) off for the methods it intercepts:
// each would retry the other's attempts, and the interceptor sees only the
// last of gRPC's. The interceptor is safe for concurrent use.
func UnaryClientInterceptor(p idem.RetryPolicy) grpc.UnaryClientInterceptor {
	policy, policyErr := callretry.New(p)
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if policyErr != nil {
			return policyErr
		}
		md, _ := metadata.FromOutgoingContext(ctx)
		key, err := callretry.Own(md.Get(MetadataKey), MetadataKey+" metadata")
		if err != nil {
			return err
		}
		if key == "" {
			if key, err = callretry.Key(ctx, false); err != nil {
				return err
			}
			if key == "" {
				if key = rpcproto.RequestID(req); key == "" {
					key = idem.NewCallKey()
				}
			}
			ctx = metadata.AppendToOutgoingContext(ctx, MetadataKey, keyhdr.Format(key)) // read back as key
		}
		if err := ctx.Err(); err != nil {
			return callretry.NotSent(ctxError{err}) // as grpc-go's own: CANCELLED, DEADLINE_EXCEEDED
		}
		opts = opts[:len(opts):len(opts)] // each attempt appends its own grpc.Peer
		timedOut := false                 // the last attempt was cut at policy.AttemptTimeout
		_, err = callretry.Run(ctx, policy, key, func() (bool, error) {
			// grpc.Peer fills p only when the attempt got a stream on a
			// connection; without one, nothing of the call was sent.
			var p peer.Peer
			actx, cancel := ctx, context.CancelFunc(func() {})
			if d := policy.AttemptTimeout(); d > 0 {
				actx, cancel = context.WithTimeout(ctx, d)
			}
			defer cancel()
			err := invoker(actx, method, req, reply, cc, append(opts, grpc.Peer(&p))...)
			// Cut at AttemptTimeout: the attempt's own deadline passed, or
			// the server, which got that deadline with the call
			// (grpc-timeout) and whose clock ran it out first, said so. A
			// cut ends the attempt with DEADLINE_EXCEEDED (or CANCELLED);
			// any other status is an answer even when the deadline has
			// passed by the time it is read.
			code := status.Code(err)
			timedOut = err != nil && ctx.Err() == nil && policy.AttemptTimeout() > 0 &&
				(code == codes.DeadlineExceeded || code == codes.Canceled && actx.Err() != nil)
			return p.Addr != nil, err
		}, func(sent bool, err error) callretry.Verdict {
			return judgeStatus(sent, err, timedOut)
		}, func(bool) {})
		return err
	}
}

// ctxError is the error of a call whose context ended before its first
// attempt: the context's error, whose status is the one grpc-go gives it
// (CANCELLED, DEADLINE_EXCEEDED), so that status.Code reads it as it reads
// grpc-go's own.
type ctxError struct{ err error }

func (e ctxError) Error() string              { return e.err.Error() }
func (e ctxError) Unwrap() error              { return e.err }
func (e ctxError) GRPCStatus() *status.Status { return status.FromContextError(e.err) }

// judgeStatus says what one attempt's status means (see
// UnaryClientInterceptor); sent reports whether the attempt got a stream on
// a connection to a server.
func judgeStatus(sent bool, err error, timedOut bool) callretry.Verdict {
	if err == nil {
		return callretry.Verdict{Answered: true}
	}
	st := status.Convert(err)
	var info *errdetails.RetryInfo
	for _, d := range st.Details() {
		if i, ok := d.(*errdetails.RetryInfo); ok {
			info = i
		}
	}
	return rpcidem.Judge(uint32(st.Code()), callretry.Verdict{Retry: true, MaybeDone: sent}, rpcproto.RetryInfo(info), timedOut)
}
