package core

import (
	"bytes"
	"errors"
	"maps"
	"slices"
	"sync"

	"github.com/pgidem/idem/internal/driver"
)

// flights coalesces concurrent DoInTx calls of one Client on one pool that
// share a scope and key: the first (the leader) goes to the database; the
// others wait for its outcome instead of each waiting on the claim in a
// backend of its own. A committed outcome is exactly what the database would
// replay to them, so they get it as a replay without a round trip. When the
// leader's claim found the key held by a transaction elsewhere and gave up
// waiting, they give up too (ErrInProgress). When the leader fails otherwise,
// nothing was stored, and each of them goes to the database itself.
//
// This is an in-process shortcut only: duplicates in other processes meet at
// the primary key as always. (golang.org/x/sync/singleflight does not fit: it
// has no per-waiter deadline and runs a DoChan leader on another goroutine,
// re-raising its panics there.)
type flights struct {
	mu sync.Mutex
	m  map[flightKey]*flight
}

// flightKey names the calls that share a flight: the same key in the same
// scope on the same handle (a pool: the flight Driver.OwnSpan names). Keys
// on different pools (databases) are unrelated.
type flightKey struct {
	handle any
	k      driver.Key
}

// flight is one leader's call in progress.
type flight struct {
	done    chan struct{} // closed when res and err are set
	fp      Fingerprint
	waiters int    // callers that joined; guarded by flights.mu
	res     Result // the waiters' own copy of the leader's result
	err     error
}

// join returns the flight in progress for key, or starts one with the caller
// as its leader.
func (f *flights) join(key flightKey, fp Fingerprint) (fl *flight, leader bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if fl, ok := f.m[key]; ok {
		fl.waiters++
		return fl, false
	}
	if f.m == nil {
		f.m = make(map[flightKey]*flight)
	}
	fl = &flight{done: make(chan struct{}), fp: fp}
	f.m[key] = fl
	return fl, true
}

// finish records the leader's outcome and wakes the waiters. Once the key
// is out of the map no caller can join, so the count is final: only when
// someone waits is the result copied, because the leader's caller owns res
// and may change it while the waiters read theirs.
func (f *flights) finish(key flightKey, fl *flight, res Result, err error) {
	f.mu.Lock()
	delete(f.m, key)
	waiters := fl.waiters
	f.mu.Unlock()
	if waiters > 0 {
		fl.res, fl.err = cloneResult(res), err
	}
	close(fl.done)
}

// cloneResult returns res with its own copies of the body and headers; the
// body is never nil.
func cloneResult(res Result) Result {
	res.Body = bytes.Clone(res.Body)
	if res.Body == nil {
		res.Body = []byte{}
	}
	if res.Header != nil {
		h := maps.Clone(res.Header)
		for name, values := range h {
			h[name] = slices.Clone(values)
		}
		res.Header = h
	}
	return res
}

// errLeaderPanicked is the outcome waiters see when the leader's fn panicked.
var errLeaderPanicked = errors.New("idem: the concurrent call with this key panicked")

// heldElsewhere reports whether err is the in-progress error of a claim of
// k (and not, say, fn passing on a nested Do's).
func heldElsewhere(err error, k driver.Key) bool {
	var ipe *InProgressError
	return errors.As(err, &ipe) && ipe.held.Key != "" && ipe.held == k
}
