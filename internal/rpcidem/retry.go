package rpcidem

import (
	"time"

	"github.com/pgidem/idem/internal/callretry"
)

// RetryInfo is what a client reads of a status's google.rpc.RetryInfo
// detail: the delay it asks for, when it sets one (HasDelay).
type RetryInfo struct {
	Delay    time.Duration
	HasDelay bool
}

// Judge says what one attempt of a client interceptor (idemgrpc's,
// idemconnect's) means, from its status code (any other code, success
// included, is an answer), network (the transport's judgement of the
// attempt's connection: whether a failed attempt is worth retrying and may
// have reached the server) and the status's RetryInfo (nil: none):
//   - UNAVAILABLE is retried as network says;
//   - ABORTED with RetryInfo (the interceptor's "in progress") is retried,
//     and may have taken effect; without it, it is another conflict, the
//     server's answer;
//   - DEADLINE_EXCEEDED and CANCELLED are not retried, and may have taken
//     effect when network says the attempt was sent;
//   - an attempt cut at idem.RetryPolicy.AttemptTimeout (timedOut: its own
//     deadline passed, not the call's) is retried as network says, whatever
//     its code, like a lost reply;
//   - a retried attempt waits RetryInfo's delay, when it sets one.
func Judge(code uint32, network callretry.Verdict, info *RetryInfo, timedOut bool) callretry.Verdict {
	if timedOut {
		return network
	}
	var v callretry.Verdict
	switch code {
	case CodeUnavailable:
		if v = network; !v.Retry {
			return v
		}
	case CodeAborted:
		if info == nil {
			return callretry.Verdict{Answered: true}
		}
		// In progress: waited out, not counted toward MaxAttempts (as
		// HTTP's 409; idem.RetryPolicy).
		v = callretry.Verdict{Retry: true, Answered: true, MaybeDone: true, InProgress: true}
	case CodeDeadlineExceeded, CodeCanceled:
		return callretry.Verdict{MaybeDone: network.MaybeDone}
	default:
		return callretry.Verdict{Answered: true}
	}
	if info != nil && info.HasDelay {
		v.After, v.HasAfter = info.Delay, true
	}
	return v
}
