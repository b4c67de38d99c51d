package core

import (
	"context"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

// BenchmarkObserve measures what observing one call costs (begin, the fn
// clock, end): off (the defaults), and with an SDK MeterProvider and an
// Info-level JSON logger on, for a fresh call (counted, not logged) and a
// replay (counted and logged). Compare with BenchmarkDoFresh/DoInTx.
func BenchmarkObserve(b *testing.B) {
	ctx := context.Background()
	on := Config{
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader())),
		Logger:        slog.New(slog.NewJSONHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelInfo})),
	}
	scope := Scope{Actor: "alice", Operation: "draw"}
	for _, tc := range []struct {
		name string
		cfg  Config
		res  Result
	}{
		{"off", Config{}, Result{}},
		{"on/fresh", on, Result{}},
		{"on/replay", on, Result{Replayed: true}},
	} {
		c := &Client[struct{}, struct{}]{obs: newObserver(tc.cfg)}
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				ctx, cl := c.begin(ctx, "do_in_tx", "idem.DoInTx", scope, "dcb654ad-1908-4cf4-93d0-b10e4895ebce")
				cl.fnTime += time.Since(cl.start)
				cl.end(ctx, tc.res, nil)
			}
		})
	}
}

// Every counter a client registers is listed in docs/operations.md's
// Observability section, so that an operator can find the metrics to
// alert on.
func TestCountersDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range counterNames {
		if !strings.Contains(string(doc), "`"+name+"`") {
			t.Errorf("docs/operations.md does not list the counter %s", name)
		}
	}
}
