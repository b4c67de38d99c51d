package rpcidem

import (
	"testing"
	"time"

	"github.com/pgidem/idem/internal/callretry"
)

func TestJudge(t *testing.T) {
	sent := callretry.Verdict{Retry: true, MaybeDone: true}
	unsent := callretry.Verdict{Retry: true}
	refused := callretry.Verdict{} // a certificate the client refuses
	wait := &RetryInfo{Delay: 3 * time.Second, HasDelay: true}
	answered := callretry.Verdict{Answered: true}
	for _, tc := range []struct {
		name    string
		code    uint32
		network callretry.Verdict
		info    *RetryInfo
		want    callretry.Verdict
	}{
		{"ok", 0, sent, nil, answered},
		{"other code", CodeFailedPrecondition, sent, wait, answered},
		{"unavailable, sent", CodeUnavailable, sent, nil, sent},
		{"unavailable, unsent", CodeUnavailable, unsent, nil, unsent},
		{"unavailable, delay", CodeUnavailable, sent, wait, callretry.Verdict{Retry: true, MaybeDone: true, After: 3 * time.Second, HasAfter: true}},
		{"unavailable, not retried", CodeUnavailable, refused, wait, refused},
		{"unavailable, RetryInfo without delay", CodeUnavailable, unsent, &RetryInfo{}, unsent},
		{"aborted", CodeAborted, sent, nil, answered},
		{"aborted, in progress", CodeAborted, unsent, &RetryInfo{}, callretry.Verdict{Retry: true, Answered: true, MaybeDone: true}},
		{"aborted, in progress, delay", CodeAborted, unsent, wait, callretry.Verdict{Retry: true, Answered: true, MaybeDone: true, After: 3 * time.Second, HasAfter: true}},
		{"deadline, sent", CodeDeadlineExceeded, sent, wait, callretry.Verdict{MaybeDone: true}},
		{"deadline, unsent", CodeDeadlineExceeded, unsent, nil, callretry.Verdict{}},
		{"cancelled, sent", CodeCanceled, sent, nil, callretry.Verdict{MaybeDone: true}},
		{"cancelled, unsent", CodeCanceled, unsent, wait, callretry.Verdict{}},
	} {
		if got := Judge(tc.code, tc.network, tc.info); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}
