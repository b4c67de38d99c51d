package idem_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// What the first Do on a connection costs in every exec mode of pgx, and
// the second: on a connection whose statements pgx has not cached yet, Do
// sends its SAVEPOINT alone first (so that nothing pgx prepares or
// describes can fail outside it), then the claim; once the claim's
// statements are cached, SAVEPOINT and the claim go in one round trip again
// (describe_exec caches nothing: every Do pays the extra round trip). The
// round trips counted are those pgx traces: not the ones in which it
// prepares or describes a batch's statements before sending it.
func TestStatementsOnAFreshConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	ok := func(context.Context, pgx.Tx) (idem.Response, error) { return idem.Response{Status: 201}, nil }
	for _, mode := range execModes {
		name := strings.ReplaceAll(mode.String(), " ", "_")
		counter := &statementCounter{}
		cfg := pool.Config().ConnConfig.Copy()
		cfg.Tracer = counter
		cfg.DefaultQueryExecMode = mode
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		// A Client that has run on the pool already, as in a service's
		// steady state.
		client, err := idem.New(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.DoInTx(ctx, pool, scope, "warm-"+name, fpA, ok); err != nil {
			t.Fatal(err)
		}
		var trips [2]int
		for i := range trips {
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			trips[i], _ = counter.measure(t, func() error {
				_, err := client.Do(ctx, tx, scope, name+"-"+string(rune('a'+i)), fpA, ok)
				return err
			})
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("%s: first Do on the connection %d round trips, second %d", mode, trips[0], trips[1])
		want := 2
		if mode == pgx.QueryExecModeDescribeExec {
			want = 5 // the savepoint, then a describe before each batch
		}
		if trips[1] > want {
			t.Errorf("%s: the second Do on a connection costs %d round trips, want at most %d", mode, trips[1], want)
		}
		_ = conn.Close(ctx)
	}
}
