package core

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/loghash"
)

// Metrics, logs and spans: the instruments of a Client. Every call of Do,
// DoInTx, Reserve and the reservation and maintenance calls ends in one
// place (a call's end method, or count for the maintenance calls, below),
// which turns its result into one
// counter, the histograms, one log record and the span's outcome.
//
// Metric names follow seed 003's: idem.<step>.<outcome>, one counter per
// outcome, each with the attributes "operation" (the scope's Operation) and
// "call" (do, do_in_tx, reserve, ...). Keys and actors never become
// attributes. The histograms idem.duplicate.wait and idem.overhead carry
// "outcome" as well.

// Outcomes of a call, as counted (idem.reserve.<outcome>) and logged.
const (
	outcomeCreated    = "created"     // fn ran (or a reservation was granted) and its outcome was stored
	outcomeRejected   = "rejected"    // fn refused with Reject; the refusal was stored
	outcomeReplay     = "replay"      // a stored outcome was replayed
	outcomeInProgress = "in_progress" // a twin or a live lease holds the key
	outcomeKeyMisuse  = "key_misuse"  // same key, different fingerprint
	outcomeUnknown    = "unknown"     // the key's outcome is unknown (ErrOutcomeUnknown)
	outcomeFailed     = "failed"      // fn or its response failed; nothing was stored
	outcomeStoreError = "store_error" // the database failed (Unavailable); also counted as idem.store.error
	outcomeFenced     = "fenced"      // a reservation that no longer owns its key (ErrFenced)
)

// observer holds a client's instruments. The zero cost path: with no
// Logger, no TracerProvider and the global MeterProvider left as the
// OpenTelemetry no-op, a call costs one map lookup (under a read lock) and a
// few no-op calls.
type observer struct {
	log    *slog.Logger // nil: silent
	hash   *loghash.Hasher
	tracer trace.Tracer // nil: no spans
	// interpret is the driver's Interpret, for outcomes of calls that
	// failed with a database's error (nil: none read).
	interpret func(error) error
	counters  map[string]metric.Int64Counter
	wait      metric.Float64Histogram
	overhead  metric.Float64Histogram

	mu    sync.RWMutex
	cache map[measureKey]measures // per call, operation and outcome, built once
}

type measureKey struct{ call, operation, outcome string }

// unavailable reports whether err means the database could not serve:
// ErrUnavailable, or a database's error that the driver says is one.
func (o *observer) unavailable(err error) bool {
	return errors.Is(err, ErrUnavailable) || o.interpret != nil && errors.Is(o.interpret(err), driver.ErrUnavailable)
}

// counterNames lists every counter, by the name a call's count uses.
var counterNames = map[string]string{
	outcomeCreated:    "idem.reserve.created",
	outcomeRejected:   "idem.reserve.rejected",
	outcomeReplay:     "idem.reserve.replay",
	outcomeInProgress: "idem.reserve.in_progress",
	outcomeKeyMisuse:  "idem.reserve.key_misuse",
	outcomeUnknown:    "idem.reserve.unknown",
	outcomeFailed:     "idem.reserve.failed",
	outcomeFenced:     "idem.reserve.fenced",
	outcomeStoreError: "idem.store.error",
	// Counted by the reservation and maintenance calls.
	"failed_retry":       "idem.reserve.failed_retry",
	"zombie_key":         "idem.zombie_key",
	"resumed":            "idem.reserve.resumed",
	"reconcile_resolved": "idem.reconcile.resolved",
	"reconcile_failed":   "idem.reconcile.failed",
	"ttl_pruned":         "idem.ttl_pruned",
	"bodies_dropped":     "idem.bodies_dropped",
}

var counterHelp = map[string]string{
	outcomeCreated:       "Calls that ran fn (or were granted a reservation) and stored the outcome.",
	outcomeRejected:      "Calls whose fn refused the request with Reject; the refusal was stored.",
	outcomeReplay:        "Calls answered with a stored outcome; fn did not run.",
	outcomeInProgress:    "Calls refused because a concurrent call or a live lease holds the key.",
	outcomeKeyMisuse:     "Calls refused because the key was used for a different request.",
	outcomeUnknown:       "Calls refused because the key's outcome is unknown and must be reconciled.",
	outcomeFailed:        "Calls whose fn or response failed; nothing was stored.",
	outcomeFenced:        "Reservation calls refused because the reservation no longer owns its key.",
	outcomeStoreError:    "Calls that failed because the database could not serve them.",
	"failed_retry":       "Reservations given up as certainly not executed (FailRetryable).",
	"zombie_key":         "Reservations whose lease ran out before they completed (turned unknown).",
	"resumed":            "Reservations that took over an attempt in doubt inside its window (ReserveOptions.ResumeWithin).",
	"reconcile_resolved": "Unknown outcomes resolved by reconciliation (Resolve).",
	"reconcile_failed":   "Reconciliation attempts (Resolve) that failed.",
	"ttl_pruned":         "Expired keys deleted by Prune.",
	"bodies_dropped":     "Stored response bodies dropped by Prune past Config.BodyTTL (the keys stay).",
}

func newObserver(cfg Config) *observer {
	o := &observer{log: cfg.Logger, hash: loghash.New(cfg.LogHashKey), cache: make(map[measureKey]measures)}
	if cfg.TracerProvider != nil {
		o.tracer = cfg.TracerProvider.Tracer(instrumentationName)
	}
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(instrumentationName)
	o.counters = make(map[string]metric.Int64Counter, len(counterNames))
	for outcome, name := range counterNames {
		// A meter refuses nothing valid; on error it still returns a no-op.
		o.counters[outcome], _ = meter.Int64Counter(name, metric.WithDescription(counterHelp[outcome]))
	}
	o.wait, _ = meter.Float64Histogram("idem.duplicate.wait", metric.WithUnit("s"),
		metric.WithDescription("How long calls that did not run fn (replays, in-progress refusals) took to get their answer."))
	o.overhead, _ = meter.Float64Histogram("idem.overhead", metric.WithUnit("s"),
		metric.WithDescription("Time a call spent outside fn: idem's own statements and the transaction's round trips."))
	return o
}

const instrumentationName = "github.com/pgidem/idem"

// measures is what a call's end needs for one call name, operation and
// outcome: the outcome's counter with the options of the attribute set
// (call, operation), and the options of the set (call, operation, outcome)
// for the histograms. Built once, so that a call allocates none.
type measures struct {
	counter metric.Int64Counter
	add     []metric.AddOption    // for counter: call, operation
	record  []metric.RecordOption // for the histograms: call, operation, outcome
}

// measuresOf returns the measures of a call name, an operation and an
// outcome (or a counted event), built once for each combination.
func (o *observer) measuresOf(callName, operation, outcome string) measures {
	k := measureKey{callName, operation, outcome}
	o.mu.RLock()
	m, ok := o.cache[k]
	o.mu.RUnlock()
	if ok {
		return m
	}
	call, op := attribute.String("call", callName), attribute.String("operation", operation)
	counterSet := metric.WithAttributeSet(attribute.NewSet(call, op))
	histSet := metric.WithAttributeSet(attribute.NewSet(call, op, attribute.String("outcome", outcome)))
	m = measures{
		counter: o.counters[outcome],
		add:     []metric.AddOption{counterSet},
		record:  []metric.RecordOption{histSet},
	}
	o.mu.Lock()
	if len(o.cache) < maxAttrSets {
		o.cache[k] = m
	}
	o.mu.Unlock()
	return m
}

// maxAttrSets bounds the cache of attribute sets: operations come from the
// application's code, but a service that builds them from input must not
// grow memory without bound.
const maxAttrSets = 4096

// How a call is observed: it begins with its clock and span (Client.begin
// and the call it returns, in call.go); end turns its result into a
// counter, the histograms, a log record and the span's outcome.

// api names the public call observed: Do, or DoInTx (which runs Do on a
// caller's transaction).
func (cl *call) api() string {
	if cl.name == "do_in_tx" {
		return "DoInTx"
	}
	return "Do"
}

// outcomeOf names the outcome of a call that returned res and err.
func (o *observer) outcomeOf(res Result, err error, rejected bool) string {
	switch {
	case err == nil && res.Replayed, errors.Is(err, ErrResponseGone):
		return outcomeReplay // the stored outcome answered, fn did not run
	case err == nil && rejected:
		return outcomeRejected
	case err == nil:
		return outcomeCreated
	case errors.Is(err, ErrInProgress):
		return outcomeInProgress
	case errors.Is(err, ErrKeyReused):
		return outcomeKeyMisuse
	case errors.Is(err, ErrOutcomeUnknown):
		return outcomeUnknown
	case errors.Is(err, ErrFenced):
		return outcomeFenced
	case o.unavailable(err):
		return outcomeStoreError
	default:
		return outcomeFailed
	}
}

// end records the call's outcome: its counter, the histograms, a log
// record and the span.
func (cl *call) end(ctx context.Context, res Result, err error) {
	cl.ended = true
	o := cl.o
	outcome := o.outcomeOf(res, err, cl.rejected)
	elapsed := time.Since(cl.start)
	m := o.measuresOf(cl.name, cl.scope.Operation, outcome)
	m.counter.Add(ctx, 1, m.add...)
	withOutcome := m.record
	switch outcome {
	case outcomeReplay, outcomeInProgress:
		o.wait.Record(ctx, elapsed.Seconds(), withOutcome...)
	}
	o.overhead.Record(ctx, (elapsed - cl.fnTime).Seconds(), withOutcome...)
	if cl.span != nil {
		cl.span.SetAttributes(attribute.String("idem.outcome", outcome))
		if outcome == outcomeStoreError || outcome == outcomeFailed {
			cl.span.RecordError(err)
			cl.span.SetStatus(codes.Error, outcome)
		}
		cl.span.End()
	}
	if o.log == nil {
		return
	}
	level, msg := slog.LevelDebug, ""
	switch outcome {
	case outcomeReplay:
		level, msg = slog.LevelInfo, "idem: replayed a stored outcome"
	case outcomeInProgress:
		level, msg = slog.LevelInfo, "idem: refused, the key is in progress"
	case outcomeKeyMisuse:
		level, msg = slog.LevelWarn, "idem: refused, the key was used for a different request"
	case outcomeUnknown:
		level, msg = slog.LevelWarn, "idem: refused, the key's outcome is unknown; reconcile it"
	case outcomeFenced:
		level, msg = slog.LevelWarn, "idem: refused, the reservation no longer owns its key"
	case outcomeStoreError:
		level, msg = slog.LevelError, "idem: the store is unavailable"
	case outcomeFailed:
		level, msg = slog.LevelDebug, "idem: the call failed; nothing was stored"
	default:
		level, msg = slog.LevelDebug, "idem: stored a new outcome"
	}
	if !o.log.Enabled(ctx, level) {
		return
	}
	attrs := []slog.Attr{
		slog.String("call", cl.name),
		slog.String("operation", cl.scope.Operation),
		slog.String("key_hash", o.hash.Sum(cl.key)),
		slog.String("actor_hash", o.hash.Sum(cl.scope.Actor)),
		slog.String("outcome", outcome),
		slog.Duration("duration", elapsed),
	}
	if err != nil && (outcome == outcomeStoreError || outcome == outcomeFailed) {
		attrs = append(attrs, slog.String("error", err.Error()))
	}
	o.log.LogAttrs(ctx, level, msg, attrs...)
}

// endIfPanicking records a call that did not end as failed: deferred, it
// runs when fn panicked, and the panic goes on.
func (cl *call) endIfPanicking(ctx context.Context) {
	if !cl.ended {
		err := cl.panicErr
		if err == nil {
			err = errPanicked
		}
		cl.end(ctx, Result{}, err)
	}
}

var errPanicked = errors.New("idem: fn panicked")

// logStoreError logs the store error of a reservation, reconciliation or
// maintenance call (countEnd), as end logs Do's: with the hashes of the key
// and the actor when the call has a key.
func (o *observer) logStoreError(ctx context.Context, callName string, scope Scope, key string, err error) {
	if o.log == nil || !o.log.Enabled(ctx, slog.LevelError) {
		return
	}
	attrs := []slog.Attr{slog.String("call", callName)}
	if scope.Operation != "" { // the maintenance calls have none
		attrs = append(attrs, slog.String("operation", scope.Operation))
	}
	if key != "" {
		attrs = append(attrs, slog.String("key_hash", o.hash.Sum(key)), slog.String("actor_hash", o.hash.Sum(scope.Actor)))
	}
	attrs = append(attrs, slog.String("outcome", outcomeStoreError), slog.String("error", err.Error()))
	o.log.LogAttrs(ctx, slog.LevelError, "idem: the store is unavailable", attrs...)
}

// count adds n to the counter of a maintenance or reservation event.
func (o *observer) count(ctx context.Context, event, callName, operation string, n int64) {
	if n != 0 {
		m := o.measuresOf(callName, operation, event)
		m.counter.Add(ctx, n, m.add...)
	}
}
