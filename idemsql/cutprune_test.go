package idemsql_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

// A Prune cut by its own deadline is the caller's doing, on either driver
// (lib/pq answers the cancel with the server's 57014, not the context's
// error): not logged as the store being unavailable.
func TestPruneCutByItsContextNotAStoreError(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, pool := migrated(t, driver)
		var logs testlog.Buffer
		client, err := idemsql.New(idem.Config{Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		tx, err := pool.Begin(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(context.Background(), `LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		if _, err := client.Prune(ctx, db, idem.PruneOptions{}); err == nil {
			t.Fatal("Prune behind a lock: no error")
		}
		if logs.String() != "" {
			t.Errorf("logged: %s", logs.String())
		}
	})
}
