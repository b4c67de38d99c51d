package rpctest

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem/internal/testkit/citustest"
	"github.com/pgidem/idem/internal/testkit/testlog"
)

// RunCitus runs on tr, with each database/sql driver, what Options.Citus
// promises on the coordinator of a Citus cluster (internal/testkit/citustest's,
// named by IDEM_CITUS_URL; without it the test is skipped): with Citus, a
// call runs once and replays, its write on the actor's worker; without it,
// a call with a key is answered INTERNAL, idem.ErrUnsupported is logged
// and nothing is written.
func RunCitus(t *testing.T, tr Transport) {
	if os.Getenv(citustest.EnvURL) == "" {
		t.Skip(citustest.EnvURL + " is not set: no Citus cluster (.ci/citus starts one and prints its URL)")
	}
	for _, d := range Drivers {
		if d.sql == "" {
			continue // the pgx form finds out by itself; Citus is for *sql.DB
		}
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			cdb := citustest.New(t, citusTemplate)
			db := d.Open(t, cdb.URL)
			check := d.pool(t, cdb.URL)
			count := func(query string) int {
				t.Helper()
				var n int
				if err := check.QueryRow(ctx, query).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			var runs atomic.Int64
			h := func(ctx context.Context, tx Tx, req *dynamicpb.Message) Outcome {
				n := runs.Add(1)
				if err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO transfers (actor, note, amount) VALUES ('alice', '%s', %d)`,
					Note(req), Amount(req))); err != nil {
					return Fail(codeInternal, err.Error())
				}
				return Outcome{Reply: Reply(n, Note(req))}
			}

			citus := tr.Serve(t, db, Options{Citus: true}, h)
			first := citus.Call(ctx, "alice", []string{"citus-1"}, Request("citus", 1))
			if first.Err != nil || first.Replayed() {
				t.Fatalf("with Citus, first call: %s", first)
			}
			again := citus.Call(ctx, "alice", []string{"citus-1"}, Request("citus", 1))
			if again.Err != nil || !again.Replayed() || !bytes.Equal(again.Body, first.Body) {
				t.Fatalf("with Citus, replay: %s; first %x", again, first.Body)
			}
			if runs.Load() != 1 || count(`SELECT count(*) FROM transfers WHERE actor = 'alice'`) != 1 ||
				count(`SELECT count(*) FROM idem_keys`) != 1 {
				t.Fatalf("with Citus: %d runs, %d transfers, %d keys; want 1, 1, 1", runs.Load(),
					count(`SELECT count(*) FROM transfers`), count(`SELECT count(*) FROM idem_keys`))
			}

			var logs testlog.Buffer
			plain := tr.Serve(t, db, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))}, h)
			for i := range 2 {
				if a := plain.Call(ctx, "alice", []string{"plain-1"}, Request("plain", 2)); a.Code() != codeInternal || a.Replayed() {
					t.Errorf("without Citus, call %d: %s", i, a)
				}
			}
			if runs.Load() != 1 || count(`SELECT count(*) FROM transfers`) != 1 || count(`SELECT count(*) FROM idem_keys`) != 1 {
				t.Errorf("without Citus: %d runs, %d transfers, %d keys; want 1, 1, 1", runs.Load(),
					count(`SELECT count(*) FROM transfers`), count(`SELECT count(*) FROM idem_keys`))
			}
			if out := logs.String(); strings.Count(out, "not supported by this database") != 2 {
				t.Errorf("without Citus, logs (want idem.ErrUnsupported twice):\n%s", out)
			}
		})
	}
}

// citusTemplate is the database RunCitus's tests copy: idem's tables and
// citusTransfers. (Without citustest.Main in these test processes, the
// template itself stays on the cluster, which .ci/citus throws away.)
var citusTemplate = &citustest.Template{Schema: citusTransfers}

// citusTransfers is the transfers table of RunCitus's handler: distributed
// by actor and co-located with idem_keys, so a call's key and its write
// live on one worker.
func citusTransfers(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `
		CREATE TABLE transfers (
			actor  text NOT NULL,
			id     bigserial,
			note   text NOT NULL,
			amount bigint NOT NULL,
			PRIMARY KEY (actor, id));
		SELECT create_distributed_table('transfers', 'actor', colocate_with => 'idem_keys')`)
	return err
}
