package idem_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

// counts returns the sum of every counter the reader holds, by metric name
// and then by the "operation" attribute.
func counts(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					for _, kv := range p.Attributes.ToSlice() {
						if kv.Key == "key" || kv.Key == "actor" {
							t.Errorf("%s carries attribute %s", m.Name, kv.Key)
						}
					}
					op, _ := p.Attributes.Value("operation")
					out[m.Name+"/"+op.AsString()] += p.Value
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					outcome, _ := p.Attributes.Value("outcome")
					out[m.Name+"/"+outcome.AsString()] += int64(p.Count)
				}
			}
		}
	}
	return out
}

func TestMetricsLogsAndSpans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	reader := sdkmetric.NewManualReader()
	spans := tracetest.NewSpanRecorder()
	var logs testlog.Buffer
	client, err := idem.New(idem.Config{
		MeterProvider:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
		Logger:         slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		LogHashKey:     []byte("secret"),
	})
	if err != nil {
		t.Fatal(err)
	}
	const key = "raw-key-that-must-not-be-logged"
	var calls atomic.Int64
	op := idem.Scope{Actor: "actor-that-must-not-be-logged", Operation: "draw"}

	if _, err := client.DoInTx(ctx, pool, op, key, fpA, recordEffect(&calls, key)); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := client.DoInTx(ctx, pool, op, key, fpA, recordEffect(&calls, key)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := client.DoInTx(ctx, pool, op, key, fpB, recordEffect(&calls, key)); !errors.Is(err, idem.ErrKeyReused) {
		t.Fatal(err)
	}
	refuse := func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{}, idem.Reject(idem.Response{Status: 402})
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := client.Do(ctx, tx, op, "refused", fpA, refuse)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	if _, err := client.DoInTx(ctx, pool, op, "fails", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{}, boom
	}); !errors.Is(err, boom) {
		t.Fatal(err)
	}

	got := counts(t, reader)
	for name, want := range map[string]int64{
		"idem.reserve.created/draw":    1,
		"idem.reserve.replay/draw":     2,
		"idem.reserve.key_misuse/draw": 1,
		"idem.reserve.rejected/draw":   1,
		"idem.reserve.failed/draw":     1,
		"idem.duplicate.wait/replay":   2,
		"idem.overhead/created":        1,
		"idem.overhead/replay":         2,
	} {
		if got[name] != want {
			t.Errorf("%s = %d, want %d (all: %v)", name, got[name], want, got)
		}
	}

	var names []string
	for _, s := range spans.Ended() {
		names = append(names, s.Name())
	}
	if len(names) != 6 || names[0] != "idem.DoInTx" || names[4] != "idem.Do" {
		t.Errorf("spans: %v", names)
	}

	out := logs.String()
	if strings.Contains(out, key) || strings.Contains(out, op.Actor) {
		t.Fatalf("the logs hold a raw key or actor:\n%s", out)
	}
	for _, want := range []string{`"outcome":"replay"`, `"outcome":"key_misuse"`, `"key_hash":"`, `"actor_hash":"`} {
		if !strings.Contains(out, want) {
			t.Errorf("logs lack %s:\n%s", want, out)
		}
	}
	// The hash is keyed: the same key hashes the same under the same secret,
	// and differently under another.
	if n := strings.Count(out, `"key_hash":"`); n < 4 {
		t.Errorf("%d log records with a key hash", n)
	}
}

// Without a Logger, a MeterProvider or a TracerProvider a client records
// nothing and works as before.
func TestObservabilityOffByDefault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	for range 2 {
		if _, err := idem.DoInTx(ctx, pool, scope, "quiet", fpA, recordEffect(&calls, "quiet")); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := idem.Prune(ctx, pool, idem.PruneOptions{}); err != nil || n != 0 {
		t.Fatal(n, err)
	}
}

// A call whose fn panics is recorded as failed, and its span ends.
func TestPanicIsObserved(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	reader := sdkmetric.NewManualReader()
	spans := tracetest.NewSpanRecorder()
	client, err := idem.New(idem.Config{
		MeterProvider:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
	})
	if err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() { _ = recover() }()
		_, _ = client.DoInTx(ctx, pool, scope, "panics", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
			panic("boom")
		})
	}()
	if got := counts(t, reader)["idem.reserve.failed/"+scope.Operation]; got != 1 {
		t.Fatalf("failed counter %d, want 1", got)
	}
	if n := len(spans.Ended()); n != 1 {
		t.Fatalf("%d spans ended, want 1", n)
	}
}

// The maintenance calls count a database that cannot serve them in
// idem.store.error, Prune as ExpireLeases does.
func TestMaintenanceStoreErrorCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	client, err := idem.New(idem.Config{MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	if err != nil {
		t.Fatal(err)
	}
	// Nothing listens on port 1.
	dead, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/idem?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer dead.Close()
	if _, err := client.ExpireLeases(ctx, dead, 10); !idem.Unavailable(err) {
		t.Fatalf("ExpireLeases on a dead database: %v", err)
	}
	if got := counts(t, reader)["idem.store.error/"]; got != 1 {
		t.Fatalf("after ExpireLeases: idem.store.error = %d, want 1", got)
	}
	if _, err := client.PruneReport(ctx, dead, idem.PruneOptions{}); !idem.Unavailable(err) {
		t.Fatalf("Prune on a dead database: %v", err)
	}
	if got := counts(t, reader)["idem.store.error/"]; got != 2 {
		t.Fatalf("after Prune: idem.store.error = %d, want 2", got)
	}
}

// A store error of a reservation or maintenance call is logged (Error),
// as Config.Logger promises for every store error, with the key's and the
// actor's hashes when the call has a key, never their values.
func TestStoreErrorsOfOtherCallsLogged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var logs testlog.Buffer
	client, err := idem.New(idem.Config{
		Logger:     slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		LogHashKey: []byte("secret"),
	})
	if err != nil {
		t.Fatal(err)
	}
	op := idem.Scope{Actor: "actor-that-must-not-be-logged", Operation: "pay"}
	const key = "raw-key-that-must-not-be-logged"
	r, err := client.Reserve(ctx, pool, op, key, fpA, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	dead, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/idem?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer dead.Close()
	if err := client.FailRetryable(ctx, dead, r, "declined"); !idem.Unavailable(err) {
		t.Fatalf("FailRetryable on a dead database: %v", err)
	}
	if _, err := client.ExpireLeases(ctx, dead, 10); !idem.Unavailable(err) {
		t.Fatalf("ExpireLeases on a dead database: %v", err)
	}
	if _, err := client.Prune(ctx, dead, idem.PruneOptions{}); !idem.Unavailable(err) {
		t.Fatalf("Prune on a dead database: %v", err)
	}
	out := logs.String()
	if strings.Contains(out, key) || strings.Contains(out, op.Actor) {
		t.Fatalf("the logs hold a raw key or actor:\n%s", out)
	}
	for _, call := range []string{"fail_retryable", "expire_leases", "prune"} {
		if !strings.Contains(out, `"call":"`+call+`"`) {
			t.Errorf("no log record of %s's store error:\n%s", call, out)
		}
	}
	if !strings.Contains(out, `"level":"ERROR"`) || !strings.Contains(out, `"outcome":"store_error"`) || !strings.Contains(out, `"key_hash":"`) {
		t.Errorf("store errors not logged as such:\n%s", out)
	}
}

// A maintenance call cut by its own context (a pruner given a deadline) is
// the caller's doing: not counted in idem.store.error, not logged as the
// store being unavailable.
func TestMaintenanceCutByItsContextNotAStoreError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	reader := sdkmetric.NewManualReader()
	var logs testlog.Buffer
	client, err := idem.New(idem.Config{
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		Logger:        slog.New(slog.NewJSONHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	// Another transaction holds the table: Prune waits until its deadline.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	cut, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := client.Prune(cut, pool, idem.PruneOptions{}); err == nil || cut.Err() == nil {
		t.Fatalf("Prune behind a lock: %v (context: %v); want its deadline", err, cut.Err())
	}
	if got := counts(t, reader)["idem.store.error/"]; got != 0 {
		t.Errorf("idem.store.error = %d after a Prune cut by its deadline, want 0", got)
	}
	if logs.String() != "" {
		t.Errorf("logged: %s", logs.String())
	}
}
