package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// The storage run (-storage) measures what a retained key costs at rest:
// calls at a fixed rate with a TTL of -storage-keys / -storage-rate, Prune
// deleting the expired keys beside them, and VACUUM whenever autovacuum
// would (vacuumDue: dead rows, or rows inserted since the last VACUUM),
// until the table has held its steady state for one TTL. Then it reports the bytes per retained key of the heap, each index and TOAST
// (the working size), the same after VACUUM FULL (the compact size), the
// share of completions that were HOT updates, and the WAL bytes a fresh
// call writes against the floor's (the bare transaction plus one INSERT of
// a finished key row), read from pg_walinspect and counted for the
// benchmark database only.

// vacuumDue says whether autovacuum would VACUUM idem_keys now, as
// PostgreSQL 15 decides (relation_needs_vacanalyze): its dead rows past
// autovacuum_vacuum_threshold plus autovacuum_vacuum_scale_factor times the
// rows the last VACUUM counted, or its rows inserted since that VACUUM past
// autovacuum_vacuum_insert_threshold (-1: never) plus
// autovacuum_vacuum_insert_scale_factor times those rows; each the table's
// own setting (migration 00011) or else the server's. It reads the
// statistics autovacuum reads, which each backend sends at most about once
// a second. autovacuum_naptime (how often autovacuum looks at a database,
// a minute by default) is left out: against a production TTL (a day) it is
// nothing, against a run's TTL of a minute or two it would be everything.
const vacuumDue = `
SELECT s.n_dead_tup > threshold + scale * tuples
       OR (insert_threshold <> -1 AND s.n_ins_since_vacuum > insert_threshold + insert_scale * tuples)
FROM pg_class c
JOIN pg_stat_user_tables s ON s.relid = c.oid
CROSS JOIN LATERAL (
    SELECT greatest(c.reltuples, 0) AS tuples,
           coalesce((max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_threshold'))::float8,
                    current_setting('autovacuum_vacuum_threshold')::float8) AS threshold,
           coalesce((max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_scale_factor'))::float8,
                    current_setting('autovacuum_vacuum_scale_factor')::float8) AS scale,
           coalesce((max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_insert_threshold'))::float8,
                    current_setting('autovacuum_vacuum_insert_threshold')::float8) AS insert_threshold,
           coalesce((max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_insert_scale_factor'))::float8,
                    current_setting('autovacuum_vacuum_insert_scale_factor')::float8) AS insert_scale
    FROM pg_options_to_table(c.reloptions)) o
WHERE c.oid = 'idem_keys'::regclass`

// storageLimit is the most bytes per retained key the layout may take
// compact (after VACUUM FULL: heap, indexes and TOAST, less each
// relation's first two pages); beyond it the run fails. It asserts the layout, which the run's speed does not move.
// storageGoal is issue 34's goal for the working size in steady state,
// reported as MISS only: the working size depends on how far the run got
// to its steady state, which a loaded machine decides.
const (
	storageLimit = 600
	storageGoal  = 300
)

// storageRequest is the workload of issue 34: a draw (internal/demo/draw) whose
// stored response is a JSON body of about 50 bytes with Content-Type and
// Location.
func storageRequest(user string, box int64) request {
	r := drawRequest(user, box)
	run := r.run
	r.run = func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
		resp, err := run(ctx, tx)
		if err == nil {
			resp.Header = map[string][]string{
				"Content-Type": {"application/json"},
				"Location":     {"/v1/draws/" + strconv.FormatInt(rand.Int64N(1e9), 10)},
			}
		}
		return resp, err
	}
	return r
}

// relSize is one relation of idem_keys and its size.
type relSize struct {
	name  string
	bytes int64
}

// storageStats are the sizes of idem_keys and its rows.
type storageStats struct {
	rels []relSize // heap, each index, TOAST (with its index), free space and visibility maps
	rows int64
}

func (s storageStats) total() int64 {
	var t int64
	for _, r := range s.rels {
		if r.name != "fsm+vm" {
			t += r.bytes
		}
	}
	return t
}

func (s storageStats) perKey(b int64) float64 { return float64(b) / float64(max(s.rows, 1)) }

func readStorage(ctx context.Context, pool *pgxpool.Pool) (storageStats, error) {
	var s storageStats
	rows, err := pool.Query(ctx, `
		SELECT 'heap', pg_relation_size('idem_keys'::regclass), 0
		UNION ALL
		SELECT x.indexrelid::regclass::text, pg_relation_size(x.indexrelid), 1
		FROM pg_index x WHERE x.indrelid = 'idem_keys'::regclass
		UNION ALL
		SELECT 'toast', coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0), 2
		FROM pg_class c WHERE c.oid = 'idem_keys'::regclass
		UNION ALL
		SELECT 'fsm+vm', pg_relation_size('idem_keys'::regclass, 'fsm') + pg_relation_size('idem_keys'::regclass, 'vm'), 3
		ORDER BY 3, 1`)
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var r relSize
		var ord int
		if err := rows.Scan(&r.name, &r.bytes, &ord); err != nil {
			return s, err
		}
		s.rels = append(s.rels, r)
	}
	if err := rows.Err(); err != nil {
		return s, err
	}
	return s, pool.QueryRow(ctx, `SELECT count(*) FROM idem_keys`).Scan(&s.rows)
}

// runStorage is the storage run; it returns how many checks failed.
func (b *bench) runStorage(ctx context.Context, out io.Writer) (int, error) {
	o := b.o
	ttl := time.Duration(float64(o.storageKeys) / o.storageRate * float64(time.Second))
	client, err := idem.New(idem.Config{TTL: ttl, BodyTTL: o.storageBodyTTL})
	if err != nil {
		return 0, err
	}
	pool, err := b.open(ctx, int32(o.workers+2), "")
	if err != nil {
		return 0, err
	}
	fmt.Fprintf(out, "\nstorage: %.0f calls/s for %s, TTL %s (steady state: %d keys), Prune every %s, VACUUM when autovacuum would\n",
		o.storageRate, (2 * ttl).Round(time.Second), ttl.Round(time.Millisecond), o.storageKeys, (ttl / 20).Round(time.Millisecond))
	// Only the storage run's keys: -smoke's workloads ran before it on
	// the same table.
	if err := execSQL(ctx, pool, `TRUNCATE idem_keys`); err != nil {
		return 0, err
	}
	if o.storageFillfactor != 0 {
		if err := execSQL(ctx, pool, fmt.Sprintf(`ALTER TABLE idem_keys SET (fillfactor = %d)`, o.storageFillfactor)); err != nil {
			return 0, err
		}
	}
	if o.storageVacuumScale != 0 {
		if err := execSQL(ctx, pool, fmt.Sprintf(`ALTER TABLE idem_keys SET (autovacuum_vacuum_scale_factor = %g)`, o.storageVacuumScale)); err != nil {
			return 0, err
		}
	}
	var layout string
	if err := pool.QueryRow(ctx, `SELECT coalesce(array_to_string(reloptions, ', '), 'defaults')
		|| format(' (server: autovacuum_vacuum_threshold %s, autovacuum_vacuum_scale_factor %s, '
			|| 'autovacuum_vacuum_insert_threshold %s, autovacuum_vacuum_insert_scale_factor %s)',
			current_setting('autovacuum_vacuum_threshold'), current_setting('autovacuum_vacuum_scale_factor'),
			current_setting('autovacuum_vacuum_insert_threshold'), current_setting('autovacuum_vacuum_insert_scale_factor'))
		FROM pg_class WHERE oid = 'idem_keys'::regclass`).Scan(&layout); err != nil {
		return 0, err
	}
	fmt.Fprintf(out, "idem_keys storage: %s\n", layout)
	if o.storageBodyTTL > 0 {
		fmt.Fprintf(out, "bodies kept %s (Config.BodyTTL), then dropped by Prune\n", o.storageBodyTTL)
	}
	if o.storageFloor {
		fmt.Fprintln(out, "calls: the floor's business transaction and one INSERT of a finished row, not DoInTx (-storage-floor)")
	}
	if err := execSQL(ctx, pool, `SELECT pg_stat_reset_single_table_counters('idem_keys'::regclass)`); err != nil {
		return 0, err
	}

	runCtx, stop := context.WithTimeout(ctx, 2*ttl)
	defer stop()
	tokens := make(chan struct{}, o.workers)
	var calls, behind atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, o.workers+2)
	wg.Add(1)
	go func() { // the fixed rate
		defer wg.Done()
		defer close(tokens)
		start, period := time.Now(), time.Duration(float64(time.Second)/o.storageRate)
		for i := int64(0); ; i++ {
			next := start.Add(time.Duration(i) * period)
			if d := time.Until(next); d > 0 {
				select {
				case <-runCtx.Done():
					return
				case <-time.After(d):
				}
			}
			select {
			case <-runCtx.Done():
				return
			case tokens <- struct{}{}:
			default:
				behind.Add(1) // every worker busy: the call is dropped, not queued
			}
		}
	}()
	for id := range o.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := &worker{rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(id)))}
			for range tokens {
				r := storageRequest("u"+strconv.Itoa(1+w.rng.IntN(o.users)), int64(1000+1+w.rng.IntN(o.boxes)))
				var err error
				if o.storageFloor {
					err = floorTx(runCtx, pool, r, w.newKey(), ttl.Microseconds())
				} else {
					_, err = client.DoInTx(runCtx, pool, r.scope, w.newKey(), r.fp, r.run)
				}
				if err != nil {
					if runCtx.Err() != nil {
						return
					}
					errs <- err
					return
				}
				calls.Add(1)
			}
		}()
	}
	var pruned, vacuums atomic.Int64
	// every runs f every period until the run ends or f fails.
	every := func(period time.Duration, name string, f func() error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(period)
			defer t.Stop()
			for {
				select {
				case <-runCtx.Done():
					return
				case <-t.C:
				}
				if err := f(); err != nil {
					if runCtx.Err() == nil {
						errs <- fmt.Errorf("%s: %w", name, err)
					}
					return
				}
			}
		}()
	}
	every(ttl/20, "prune", func() error {
		n, err := idem.Prune(runCtx, pool, idem.PruneOptions{})
		pruned.Add(n)
		return err
	})
	// VACUUM as autovacuum would, looked at ten times as often as Prune
	// runs (at most every 50 ms), so that a threshold below Prune's share
	// shows.
	every(max(ttl/200, 50*time.Millisecond), "vacuum", func() error {
		var due bool
		if err := pool.QueryRow(runCtx, vacuumDue).Scan(&due); err != nil || !due {
			return err
		}
		if _, err := pool.Exec(runCtx, `VACUUM idem_keys`); err != nil {
			return err
		}
		vacuums.Add(1)
		return nil
	})
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	// The end of the run as autovacuum would leave it: expired keys pruned,
	// then VACUUM.
	if _, err := idem.Prune(ctx, pool, idem.PruneOptions{}); err != nil {
		return 0, err
	}
	if err := execSQL(ctx, pool, `VACUUM idem_keys`); err != nil {
		return 0, err
	}
	working, err := readStorage(ctx, pool)
	if err != nil {
		return 0, err
	}
	pool.Close() // its sessions' statistics reach the server as they end
	sp, err := openPool(ctx, b.url, 2, "", "")
	if err != nil {
		return 0, err
	}
	defer sp.Close()
	var upd, hot int64
	completions := calls.Load() // one update each, HOT when it fits its page
	if o.storageFloor {
		completions = 0 // a key is written once
	}
	for range 50 { // the last sessions' counters may take a moment
		if err := sp.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'idem_keys'::regclass`).Scan(&upd, &hot); err != nil {
			return 0, err
		}
		if upd >= completions {
			break
		}
		time.Sleep(100 * time.Millisecond)
		_, _ = sp.Exec(ctx, `SELECT pg_stat_clear_snapshot()`)
	}
	if err := execSQL(ctx, sp, `VACUUM FULL idem_keys`); err != nil {
		return 0, err
	}
	compact, err := readStorage(ctx, sp)
	if err != nil {
		return 0, err
	}
	fmt.Fprintf(out, "calls %d (%.0f/s; %d dropped: every worker busy), pruned %d, VACUUMs %d; retained keys %d\n",
		calls.Load(), float64(calls.Load())/(2*ttl).Seconds(), behind.Load(), pruned.Load(), vacuums.Load(), working.rows)
	fmt.Fprintf(out, "%-32s %14s %10s %14s %10s\n", "bytes per retained key", "working", "per key", "compact", "per key")
	for i, r := range working.rels {
		c := compact.rels[i]
		fmt.Fprintf(out, "%-32s %14d %10.1f %14d %10.1f\n", r.name, r.bytes, working.perKey(r.bytes), c.bytes, compact.perKey(c.bytes))
	}
	wt, ct := working.total(), compact.total()
	fmt.Fprintf(out, "%-32s %14d %10.1f %14d %10.1f\n", "total (heap, indexes, TOAST)", wt, working.perKey(wt), ct, compact.perKey(ct))
	share := float64(hot) / float64(max(upd, 1))
	fmt.Fprintf(out, "HOT updates: %d of %d (%.1f%%); completions: %d calls\n", hot, upd, 100*share, completions)
	if o.storageFloor {
		share = 1 // no completion to be HOT
	}
	if o.storageBodyTTL > 0 {
		// Prune's body drops are updates too, never HOT (they leave the
		// index of body_expires_at): the share is the completions'.
		share = float64(hot) / float64(max(calls.Load(), 1))
		fmt.Fprintf(out, "HOT completions: %.1f%% (the %d other updates dropped bodies)\n", 100*share, max(upd-calls.Load(), 0))
	}
	wal, err := b.walPerCall(ctx, sp, client)
	if err != nil {
		return 0, err
	}
	wal.print(out)

	failures := 0
	perKey := working.perKey(wt)
	// The check leaves out each relation's first two pages (an index's
	// metapage and root, a heap's first page): a fixed cost that a small
	// run, or a loaded machine that retained fewer keys, would otherwise
	// spread over too few keys to read the layout from.
	var layoutBytes int64
	for _, r := range compact.rels {
		layoutBytes += max(0, r.bytes-2*8192)
	}
	if c := compact.perKey(layoutBytes); c > storageLimit {
		fmt.Fprintf(out, "FAIL  %.0f bytes per retained key compact beyond each relation's first two pages, more than the layout allows (%d)\n", c, storageLimit)
		failures++
	}
	switch {
	case working.rows == 0:
		fmt.Fprintln(out, "FAIL  no key retained")
		failures++
	case perKey > storageGoal:
		fmt.Fprintf(out, "MISS  %.0f bytes per retained key (goal: at most %d)\n", perKey, storageGoal)
	default:
		fmt.Fprintf(out, "ok    %.0f bytes per retained key (goal: at most %d)\n", perKey, storageGoal)
	}
	// A completion that is not HOT because its page was full depends on when
	// pruning and VACUUM ran (the machine's load), so below 99% is a MISS;
	// a layout that stops completions from being HOT at all (an index on a
	// column the completion writes) falls far below 90%, and fails.
	switch {
	case share < 0.90:
		fmt.Fprintf(out, "FAIL  %.1f%% of the updates were HOT (every completion should be)\n", 100*share)
		failures++
	case share < 0.99:
		fmt.Fprintf(out, "MISS  %.1f%% of the updates were HOT (goal: every completion; full pages depend on when VACUUM ran)\n", 100*share)
	}
	return failures, nil
}

// walStats are the WAL bytes per call of the workloads walPerCall runs.
type walStats struct {
	source string
	calls  int
	rows   []walRow
}

type walRow struct {
	name       string
	bytes, fpi float64 // per call: every record, and the full-page images among them
}

func (w walStats) print(out io.Writer) {
	fmt.Fprintf(out, "WAL per call (%d calls each, one connection, %s):\n", w.calls, w.source)
	fmt.Fprintf(out, "%-10s %12s %16s %22s\n", "workload", "bytes", "of them FPI", "without FPI vs floor")
	var floor float64
	for _, r := range w.rows {
		if r.name == "floor" {
			floor = r.bytes - r.fpi
		}
	}
	for _, r := range w.rows {
		fmt.Fprintf(out, "%-10s %12.0f %16.0f %21.2fx\n", r.name, r.bytes, r.fpi, (r.bytes-r.fpi)/max(floor, 1))
	}
}

// walPerCall runs, one after the other on one connection, calls of the
// bare transaction, the floor and DoInTx with fresh keys, and counts the WAL
// each wrote: through pg_walinspect, the records that touch the benchmark
// database or belong to a transaction that did (its commit), so other
// databases on the server count for nothing; without pg_walinspect, the
// server's whole WAL.
func (b *bench) walPerCall(ctx context.Context, sp *pgxpool.Pool, client *idem.Client) (walStats, error) {
	n := b.o.storageWALCalls
	w := walStats{source: "pg_walinspect, this database only", calls: n}
	inspect := true
	if _, err := sp.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_walinspect`); err != nil {
		inspect, w.source = false, "the server's whole WAL (no pg_walinspect)"
	}
	conn, err := pgx.Connect(ctx, b.url)
	if err != nil {
		return w, err
	}
	defer conn.Close(ctx)
	wk := &worker{db: conn, rng: rand.New(rand.NewPCG(1, 2))}
	req := func() request {
		return storageRequest("u"+strconv.Itoa(1+wk.rng.IntN(b.o.users)), int64(1000+1+wk.rng.IntN(b.o.boxes)))
	}
	workloads := []struct {
		name string
		call func() error
	}{
		{"bare", func() error {
			r := req()
			return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { _, err := r.run(ctx, tx); return err })
		}},
		{"floor", func() error {
			wk.biz = &business{request: func(*worker) request { return req() }}
			return opFloor(ctx, wk)
		}},
		{"doInTx", func() error {
			r := req()
			_, err := client.DoInTx(ctx, conn, r.scope, wk.newKey(), r.fp, r.run)
			return err
		}},
	}
	for _, wl := range workloads {
		for range 20 { // warm the connection's statement cache
			if err := wl.call(); err != nil {
				return w, fmt.Errorf("%s: %w", wl.name, err)
			}
		}
		// In chunks, each read at once: on a busy server the segments of
		// a long stretch are recycled before they can be read.
		var bytes, fpi int64
		for done := 0; done < n; {
			chunk := min(50, n-done)
			b, f, err := walOf(ctx, conn, inspect, func() error {
				for range chunk {
					if err := wl.call(); err != nil {
						return fmt.Errorf("%s: %w", wl.name, err)
					}
				}
				return nil
			})
			if err != nil {
				return w, err
			}
			bytes, fpi, done = bytes+b, fpi+f, done+chunk
		}
		w.rows = append(w.rows, walRow{name: wl.name, bytes: float64(bytes) / float64(n), fpi: float64(fpi) / float64(n)})
	}
	return w, nil
}

// walOf runs calls and returns the WAL bytes they wrote, and the
// full-page images among them (see walPerCall).
func walOf(ctx context.Context, conn *pgx.Conn, inspect bool, calls func() error) (bytes, fpi int64, err error) {
	var start, end string
	if err := conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&start); err != nil {
		return 0, 0, err
	}
	if err := calls(); err != nil {
		return 0, 0, err
	}
	if err := conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&end); err != nil {
		return 0, 0, err
	}
	if !inspect {
		err = conn.QueryRow(ctx, `SELECT ($2::pg_lsn - $1::pg_lsn)::bigint`, start, end).Scan(&bytes)
		return bytes, 0, err
	}
	for range 100 { // pg_walinspect reads only flushed WAL
		var flushed bool
		if err := conn.QueryRow(ctx, `SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn`, end).Scan(&flushed); err != nil || flushed {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	err = conn.QueryRow(ctx, `
				WITH r AS (
					SELECT * FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)
				), mine AS (
					SELECT * FROM r
					WHERE block_ref LIKE '%/' || (SELECT oid FROM pg_database WHERE datname = current_database()) || '/%'
				)
				SELECT coalesce(sum(record_length), 0)::bigint, coalesce(sum(fpi_length), 0)::bigint
				FROM r
				WHERE start_lsn IN (SELECT start_lsn FROM mine)
				   OR (xid <> 0 AND xid IN (SELECT xid FROM mine))`, start, end).Scan(&bytes, &fpi)
	if err != nil {
		return 0, 0, fmt.Errorf("WAL count: %w", err)
	}
	return bytes, fpi, nil
}

// storageCheck checks the storage flags.
func (o *options) storageCheck() error {
	if o.storageKeys < 1 || o.storageRate <= 0 || o.storageWALCalls < 1 {
		return errors.New("-storage-keys, -storage-rate and -storage-wal-calls must be positive")
	}
	if o.storageFillfactor != 0 && (o.storageFillfactor < 10 || o.storageFillfactor > 100) {
		return errors.New("-storage-fillfactor must be between 10 and 100 (0: the migrations')")
	}
	if o.storageVacuumScale < 0 || o.storageVacuumScale > 100 {
		return errors.New("-storage-vacuum-scale must be between 0 and 100 (0: the migrations')")
	}
	if o.storageFloor && o.storageBodyTTL != 0 {
		return errors.New("-storage-floor writes no body's time: it does not go with -storage-body-ttl")
	}
	return nil
}
