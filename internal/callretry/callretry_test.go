package callretry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"math"
	"net"
	"net/http/httptrace"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
)

func TestNewDefaults(t *testing.T) {
	p, err := New(idem.RetryPolicy{})
	if err != nil {
		t.Fatal(err)
	}
	want := Policy{idem.DefaultRetryMaxAttempts, idem.DefaultRetryMaxElapsed, idem.DefaultRetryBaseDelay, idem.DefaultRetryMaxDelay, 0}
	if p != want {
		t.Fatalf("%+v, want %+v", p, want)
	}
	if _, err := New(idem.RetryPolicy{BaseDelay: -time.Second}); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("negative BaseDelay: %v", err)
	}
}

// The backoff's waits stay within full jitter's bounds; the receiver's
// wait is taken as it is, capped by MaxDelay; a receiver's request of no
// wait (0, or a past date: negative) is the backoff's.
func TestWait(t *testing.T) {
	p := Policy{maxAttempts: 100, maxElapsed: time.Hour, baseDelay: 10 * time.Millisecond, maxDelay: time.Second}
	for n := 1; n <= 80; n++ {
		bound := min(p.maxDelay, p.baseDelay<<min(n-1, 20))
		for range 50 {
			if w := p.wait(n, Verdict{}); w < 0 || w > bound {
				t.Fatalf("attempt %d: wait %s outside [0, %s]", n, w, bound)
			}
		}
	}
	for after, want := range map[time.Duration]time.Duration{
		300 * time.Millisecond: 300 * time.Millisecond, time.Hour: time.Second,
	} {
		if w := p.wait(1, Verdict{After: after, HasAfter: true}); w != want {
			t.Errorf("Retry-After %s: wait %s, want %s", after, w, want)
		}
	}
	for _, after := range []time.Duration{-time.Second, 0} {
		seen := map[time.Duration]bool{}
		for range 200 {
			w := p.wait(3, Verdict{After: after, HasAfter: true})
			if w < 0 || w > 4*p.baseDelay {
				t.Fatalf("Retry-After %s: wait %s, want the backoff's, within [0, %s]", after, w, 4*p.baseDelay)
			}
			seen[w] = true
		}
		if len(seen) < 10 {
			t.Errorf("Retry-After %s: %d distinct waits in 200, want the backoff's jitter", after, len(seen))
		}
	}
	zero := Policy{maxAttempts: 2, maxElapsed: time.Hour, maxDelay: time.Second}
	if w := zero.wait(3, Verdict{}); w != 0 {
		t.Errorf("zero base: %s", w)
	}
	// The largest policy Validate lets through: the bound is
	// math.MaxInt64, and the wait stays within it without overflowing.
	huge, err := New(idem.RetryPolicy{BaseDelay: math.MaxInt64, MaxDelay: math.MaxInt64})
	if err != nil {
		t.Fatal(err)
	}
	for n := 1; n <= 70; n++ {
		if w := huge.wait(n, Verdict{}); w < 0 {
			t.Fatalf("largest policy, attempt %d: wait %s", n, w)
		}
	}
	if w := huge.wait(1, Verdict{After: math.MaxInt64, HasAfter: true}); w != math.MaxInt64 {
		t.Errorf("largest policy, Retry-After: %s", w)
	}
}

// next stops at MaxAttempts, at MaxElapsed, before the context's deadline,
// after a verdict without Retry, and once the context ended.
func TestNext(t *testing.T) {
	ctx := context.Background()
	retry := Verdict{Retry: true, HasAfter: true, After: time.Second}
	p := Policy{maxAttempts: 3, maxElapsed: time.Minute, baseDelay: time.Millisecond, maxDelay: time.Minute}
	now := time.Now()
	if w, ok := p.next(ctx, now, 2, 2, retry); !ok || w != time.Second {
		t.Fatalf("attempt 2 of 3: %s %t", w, ok)
	}
	if _, ok := p.next(ctx, now, 3, 3, retry); ok {
		t.Fatal("retried past MaxAttempts")
	}
	if _, ok := p.next(ctx, now, 1, 1, Verdict{Answered: true}); ok {
		t.Fatal("retried a final answer")
	}
	if _, ok := p.next(ctx, now.Add(-59*time.Second-500*time.Millisecond), 1, 1, retry); ok {
		t.Fatal("retried past MaxElapsed")
	}
	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	if _, ok := p.next(short, now, 1, 1, retry); ok {
		t.Fatal("waited past the context's deadline")
	}
	done, cancel2 := context.WithCancel(ctx)
	cancel2()
	if _, ok := p.next(done, now, 1, 1, Verdict{Retry: true}); ok {
		t.Fatal("retried after the context ended")
	}
}

// Run: a call given up without an answer after an attempt that may have
// reached the receiver is an idem.CallError; one that certainly did not is
// the plain error; an answer is returned as it is; an ended context sends
// nothing.
func TestRun(t *testing.T) {
	ctx := context.Background()
	p := Policy{maxAttempts: 3, maxElapsed: time.Minute, baseDelay: time.Millisecond, maxDelay: time.Millisecond}
	lost := errors.New("connection reset")
	n := 0
	_, err := Run(ctx, p, "k1", func() (int, error) { n++; return 0, lost }, func(int, error) Verdict {
		return Verdict{Retry: true, MaybeDone: true}
	}, func(int) {})
	var ce *idem.CallError
	if !errors.As(err, &ce) || ce.Key != "k1" || ce.Attempts != 3 || !errors.Is(err, lost) || n != 3 {
		t.Fatalf("lost replies: %v (%d attempts)", err, n)
	}
	refused := &net.OpError{Op: "dial", Err: errors.New("connection refused")}
	_, err = Run(ctx, p, "k2", func() (int, error) { return 0, refused }, func(_ int, err error) Verdict { return Network(err, nil) }, func(int) {})
	if !errors.Is(err, idem.ErrNotSent) || errors.Is(err, idem.ErrOutcomeUnknown) || !errors.Is(err, refused) {
		t.Fatalf("refused dials: %v", err)
	}
	discarded := 0
	res, err := Run(ctx, p, "k3", func() (int, error) { return 503, nil }, func(int, error) Verdict {
		return Verdict{Retry: true, Answered: true, MaybeDone: true}
	}, func(int) { discarded++ })
	if res != 503 || err != nil || discarded != 2 {
		t.Fatalf("answers: %d %v, %d discarded", res, err, discarded)
	}
	// The context ends during a wait: both its error and the last
	// attempt's stay reachable.
	waiting, cancelWait := context.WithCancel(ctx)
	slow := Policy{maxAttempts: 3, maxElapsed: time.Hour, baseDelay: time.Hour, maxDelay: time.Hour}
	_, err = Run(waiting, slow, "k5", func() (int, error) {
		time.AfterFunc(20*time.Millisecond, cancelWait)
		return 0, lost
	}, func(int, error) Verdict {
		return Verdict{Retry: true, HasAfter: true, After: time.Minute, MaybeDone: true}
	}, func(int) {})
	if !errors.As(err, &ce) || ce.Attempts != 1 || !errors.Is(err, context.Canceled) || !errors.Is(err, lost) ||
		!strings.Contains(err.Error(), "connection reset") {
		t.Fatalf("ended during a wait: %v", err)
	}
	waiting, cancelWait = context.WithCancel(ctx)
	_, err = Run(waiting, slow, "k6", func() (int, error) {
		time.AfterFunc(20*time.Millisecond, cancelWait)
		return 0, refused
	}, func(_ int, err error) Verdict { return Network(err, nil) }, func(int) {})
	if errors.As(err, &ce) || !errors.Is(err, context.Canceled) || !errors.Is(err, refused) {
		t.Fatalf("ended during a wait after a refused dial: %v", err)
	}
	done, cancel := context.WithCancel(ctx)
	cancel()
	sent := false
	if _, err := Run(done, p, "k4", func() (int, error) { sent = true; return 0, nil }, func(int, error) Verdict { return Verdict{} }, func(int) {}); !errors.Is(err, context.Canceled) || sent {
		t.Fatalf("ended context: %v, sent %t", err, sent)
	}
}

func TestKey(t *testing.T) {
	ctx := context.Background()
	if k, err := Key(ctx, false); k != "" || err != nil {
		t.Fatalf("no key: %q %v", k, err)
	}
	if k, err := Key(ctx, true); idem.ValidateKey(k) != nil || err != nil {
		t.Fatalf("minted: %q %v", k, err)
	}
	if k, err := Key(idem.WithCallKey(ctx, "ck-1"), true); k != "ck-1" || err != nil {
		t.Fatalf("context: %q %v", k, err)
	}
	for _, bad := range []string{"", "a b", "é"} {
		if _, err := Key(idem.WithCallKey(ctx, bad), true); !errors.Is(err, idem.ErrInvalidKey) {
			t.Errorf("context key %q: %v", bad, err)
		}
	}
	if k, err := Own([]string{`"quoted-1"`}, "header"); k != "quoted-1" || err != nil {
		t.Fatalf("own quoted: %q %v", k, err)
	}
	for _, bad := range [][]string{{"a b"}, {"a", "b"}, {`"open`}, {"a,b"}} {
		if _, err := Own(bad, "header"); !errors.Is(err, idem.ErrInvalidKey) {
			t.Errorf("own %q: %v", bad, err)
		}
	}
}

// Network: what the client trace says about the connection decides when it
// tells; the error alone when it does not.
func TestNetwork(t *testing.T) {
	traced := func(asked, got bool) *Conn {
		c := &Conn{}
		c.asked.Store(asked)
		c.got.Store(got)
		return c
	}
	var (
		unknown = (*Conn)(nil)
		silent  = traced(false, false) // a transport that calls no hook
		none    = traced(true, false)  // asked for a connection, got none
		got     = traced(true, true)
	)
	server, client := net.Pipe()
	defer server.Close()
	defer client.Close()
	dial := &net.OpError{Op: "dial", Err: errors.New("connection refused")}
	reset := &net.OpError{Op: "read", Err: errors.New("connection reset by peer")}
	cert := x509.UnknownAuthorityError{}
	notTLS := tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake", Conn: client}
	badRecord := tls.RecordHeaderError{Msg: "oversized record received"} // after the handshake: Conn is nil
	for _, c := range []struct {
		name string
		err  error
		conn *Conn
		want Verdict
	}{
		{"refused dial, no trace", dial, unknown, Verdict{Retry: true}},
		{"refused dial, silent transport", dial, silent, Verdict{Retry: true}},
		{"name lookup", &net.DNSError{Err: "no such host"}, unknown, Verdict{Retry: true}},
		{"reset, no trace", reset, unknown, Verdict{Retry: true, MaybeDone: true}},
		{"context, no trace", context.DeadlineExceeded, unknown, Verdict{Retry: true, MaybeDone: true}},
		{"context, no connection", context.DeadlineExceeded, none, Verdict{Retry: true}},
		{"context, connected", context.Canceled, got, Verdict{Retry: true, MaybeDone: true}},
		{"handshake timeout, no connection", errors.New("net/http: TLS handshake timeout"), none, Verdict{Retry: true}},
		{"dial after a connection (net/http's own retry)", dial, got, Verdict{Retry: true, MaybeDone: true}},
		{"certificate", cert, unknown, Verdict{}},
		{"certificate, no connection", cert, none, Verdict{}},
		{"certificate after a connection", cert, got, Verdict{MaybeDone: true}},
		{"not TLS, no trace", notTLS, unknown, Verdict{}},
		{"not TLS, no connection", notTLS, none, Verdict{}},
		{"bad record mid-connection, no trace", badRecord, unknown, Verdict{Retry: true, MaybeDone: true}},
		{"bad record, connected", badRecord, got, Verdict{Retry: true, MaybeDone: true}},
		{"bad record, no connection", badRecord, none, Verdict{Retry: true}},
	} {
		if v := Network(c.err, c.conn); v != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, v, c.want)
		}
	}
}

// TraceConn's hooks run with those the context already had.
func TestTraceConn(t *testing.T) {
	var theirs []string
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		GetConn: func(string) { theirs = append(theirs, "get") },
		GotConn: func(httptrace.GotConnInfo) { theirs = append(theirs, "got") },
	})
	ctx, c := TraceConn(ctx)
	trace := httptrace.ContextClientTrace(ctx)
	trace.GetConn("127.0.0.1:1")
	if !c.asked.Load() || c.got.Load() || Network(context.Canceled, c).MaybeDone {
		t.Fatalf("after GetConn: %+v", Network(context.Canceled, c))
	}
	trace.GotConn(httptrace.GotConnInfo{})
	if !c.got.Load() || !Network(context.Canceled, c).MaybeDone || strings.Join(theirs, ",") != "get,got" {
		t.Fatalf("after GotConn: %+v, the caller's hooks saw %q", Network(context.Canceled, c), theirs)
	}
}

// In-progress answers do not count toward MaxAttempts: a call that finds
// its request in progress three times, with MaxAttempts 2, still gets the
// final answer; with MaxAttempts 1 it gets the first in-progress answer.
func TestRunInProgress(t *testing.T) {
	ctx := context.Background()
	p := Policy{maxAttempts: 2, maxElapsed: time.Minute, baseDelay: time.Millisecond, maxDelay: time.Millisecond}
	n := 0
	judge := func(code int, _ error) Verdict {
		if code == 409 {
			return Verdict{Retry: true, Answered: true, MaybeDone: true, InProgress: true}
		}
		return Verdict{Answered: true}
	}
	res, err := Run(ctx, p, "k", func() (int, error) {
		if n++; n <= 3 {
			return 409, nil
		}
		return 201, nil
	}, judge, func(int) {})
	if err != nil || res != 201 || n != 4 {
		t.Fatalf("%d %v after %d attempts", res, err, n)
	}
	n = 0
	res, err = Run(ctx, p.Once(), "k", func() (int, error) { n++; return 409, nil }, judge, func(int) {})
	if err != nil || res != 409 || n != 1 {
		t.Fatalf("Once: %d %v after %d attempts", res, err, n)
	}
}

// A context that ended before the first attempt: nothing sent, ErrNotSent.
func TestRunEndedContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p, _ := New(idem.RetryPolicy{})
	_, err := Run(ctx, p, "k", func() (int, error) { t.Fatal("sent"); return 0, nil }, func(int, error) Verdict { return Verdict{} }, func(int) {})
	if !errors.Is(err, idem.ErrNotSent) || !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("%v", err)
	}
}
