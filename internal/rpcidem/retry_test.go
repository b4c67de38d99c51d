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
		timed   bool
	}{
		{"attempt timed out, sent", CodeDeadlineExceeded, sent, nil, sent, true},
		{"attempt timed out, unsent", CodeCanceled, unsent, wait, unsent, true},
		{"ok", 0, sent, nil, answered, false},
		{"other code", CodeFailedPrecondition, sent, wait, answered, false},
		{"unavailable, sent", CodeUnavailable, sent, nil, sent, false},
		{"unavailable, unsent", CodeUnavailable, unsent, nil, unsent, false},
		{"unavailable, delay", CodeUnavailable, sent, wait, callretry.Verdict{Retry: true, MaybeDone: true, After: 3 * time.Second, HasAfter: true}, false},
		{"unavailable, not retried", CodeUnavailable, refused, wait, refused, false},
		{"unavailable, RetryInfo without delay", CodeUnavailable, unsent, &RetryInfo{}, unsent, false},
		{"aborted", CodeAborted, sent, nil, answered, false},
		{"aborted, in progress", CodeAborted, unsent, &RetryInfo{}, callretry.Verdict{Retry: true, Answered: true, MaybeDone: true, InProgress: true}, false},
		{"aborted, in progress, delay", CodeAborted, unsent, wait, callretry.Verdict{Retry: true, Answered: true, MaybeDone: true, InProgress: true, After: 3 * time.Second, HasAfter: true}, false},
		{"deadline, sent", CodeDeadlineExceeded, sent, wait, callretry.Verdict{MaybeDone: true}, false},
		{"deadline, unsent", CodeDeadlineExceeded, unsent, nil, callretry.Verdict{}, false},
		{"cancelled, sent", CodeCanceled, sent, nil, callretry.Verdict{MaybeDone: true}, false},
		{"cancelled, unsent", CodeCanceled, unsent, wait, callretry.Verdict{}, false},
	} {
		if got := Judge(tc.code, tc.network, tc.info, tc.timed); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}
