package idemui_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemui"
	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// scaleKeys is how many keys the plan checks run on.
const scaleKeys = 3_000_000

// buildScale fills idem_keys of the database at url with scaleKeys rows: two
// days of a service at about 17 keys a second, a key living 24 hours, so
// half of them are expired; 1 in 1000 an unknown outcome and 1 in 1000 a
// reservation whose lease ran out (a few of the newest still in flight),
// 2% failed_retryable, 5% rejected, the rest succeeded; 1000 actors, three
// operations. It builds fast: the table unlogged and its indexes dropped
// while the rows go in, then built again from their own definitions, then
// ANALYZE (autovacuum may be off).
func buildScale(t *testing.T, url string) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var defs []string
	rows, err := conn.Query(ctx, `SELECT indexdef FROM pg_indexes WHERE tablename = 'idem_keys' AND indexname <> 'idem_keys_pkey'
		UNION ALL SELECT 'ALTER TABLE idem_keys ADD CONSTRAINT ' || conname || ' ' || pg_get_constraintdef(oid)
		FROM pg_constraint WHERE conrelid = 'idem_keys'::regclass AND contype = 'p'`)
	if err != nil {
		t.Fatal(err)
	}
	defs, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(defs) < 4 {
		t.Fatalf("index definitions: %v, %v", defs, err)
	}
	start := time.Now()
	for _, sql := range []string{
		`ALTER TABLE idem_keys SET UNLOGGED`,
		`ALTER TABLE idem_keys DROP CONSTRAINT idem_keys_pkey`,
		`DO $$ DECLARE i text; BEGIN
			FOR i IN SELECT indexname FROM pg_indexes WHERE tablename = 'idem_keys' LOOP EXECUTE 'DROP INDEX ' || i; END LOOP;
		END $$`,
		fmt.Sprintf(`INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_body,
			created_at, completed_at, expires_at, token, lease_expires_at, last_error)
		SELECT 'actor-' || (i %% 1000), CASE i %% 3 WHEN 0 THEN 'charge' WHEN 1 THEN 'refund' ELSE 'payout' END, 'key-' || i,
			'\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f'::bytea,
			st, CASE WHEN st IN ('succeeded', 'rejected') THEN 200 END,
			CASE WHEN st IN ('succeeded', 'rejected') THEN '\x7b226f6b223a747275657d'::bytea END,
			c, CASE WHEN st IN ('succeeded', 'rejected', 'failed_retryable') THEN c + interval '50 ms' END,
			c + interval '24 hours',
			CASE WHEN st = 'rejected' OR (st = 'succeeded' AND i %% 2 = 0) THEN 0 ELSE i END,
			CASE WHEN st = 'rejected' OR (st = 'succeeded' AND i %% 2 = 0) THEN NULL ELSE c + interval '5 minutes' END,
			CASE st WHEN 'unknown' THEN 'gateway timeout after 30s' WHEN 'failed_retryable' THEN 'card declined' END
		FROM (SELECT i, now() - (%[1]d - i) * interval '57.6 ms' AS c,
		             CASE WHEN i %% 1000 = 1 THEN 'unknown' WHEN i %% 1000 = 3 THEN 'processing'
		                  WHEN i %% 50 = 4 THEN 'failed_retryable' WHEN i %% 20 = 5 THEN 'rejected'
		                  ELSE 'succeeded' END AS st
		      FROM generate_series(1, %[1]d) AS i) AS g`, scaleKeys),
		fmt.Sprintf(`SELECT setval('idem_keys_token_seq', %d)`, scaleKeys+1),
		`INSERT INTO idem_audit (actor, operator, action, operation, idem_key, token_before, token_after,
			status_before, status_after, verdict, reason, changed, acted_at)
		SELECT 'actor-' || (i % 1000), 'operator-' || (i % 7), 'resolve', 'charge', 'key-' || (i * 1000 + 1), i, i + 1,
			'unknown', 'succeeded', 'succeeded', 'checked at the provider', 1, now() - i * interval '1 minute'
		FROM generate_series(1, 20000) AS i`,
		`SET maintenance_work_mem = '256MB'`,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%.80s: %v", sql, err)
		}
	}
	for _, def := range defs {
		if _, err := conn.Exec(ctx, def); err != nil {
			t.Fatalf("%s: %v", def, err)
		}
	}
	if _, err := conn.Exec(ctx, `ANALYZE idem_keys; ANALYZE idem_audit`); err != nil {
		t.Fatal(err)
	}
	t.Logf("built %d keys in %s", scaleKeys, time.Since(start).Round(100*time.Millisecond))
}

// statement is one statement a page ran, with the connection it ran on.
type statement struct {
	conn *pgx.Conn
	sql  string
	args []any
}

// recorder is a pgx tracer that keeps every statement.
type recorder struct {
	mu    sync.Mutex
	stmts []statement
}

func (r *recorder) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stmts = append(r.stmts, statement{conn, d.SQL, d.Args})
	return ctx
}

func (*recorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *recorder) take() []statement {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.stmts
	r.stmts = nil
	return s
}

// Every page answers at 3 million keys without reading idem_keys whole:
// the plan of every statement a page runs (with the settings its
// transaction ran it with) has no sequential scan of idem_keys. The time
// of each page is logged, not asserted: first (what the build left in the
// caches) and the median of five more.
func TestPagesAtScale(t *testing.T) {
	if testing.Short() {
		t.Skip("builds 3 million keys")
	}
	t.Parallel()
	ctx := context.Background()
	dbURL := pgtest.URL(t, idem.Migrate)
	buildScale(t, dbURL)
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	cfg.ConnConfig.Tracer = rec
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	h, err := idemui.New(idemui.Options{DB: pool, Prefix: "/idem",
		Authorize: func(*http.Request, idemui.Action) (string, error) { return "scale", nil }})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/idem/", h)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

	// A record that needs a person, and the second page of the list.
	var first struct {
		Records []struct{ Actor, Operation, Key string }
		Next    string
	}
	res, err := client.Get(srv.URL + "/idem/api/unknown?limit=50")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.NewDecoder(res.Body).Decode(&first); err != nil || len(first.Records) == 0 || first.Next == "" {
		t.Fatalf("the list at scale: %v %+v", err, first)
	}
	res.Body.Close()
	// The check finds a sequential scan where there is one.
	if plan := explain(t, ctx, pool, nil, statement{sql: `SELECT count(*) FROM idem_keys WHERE last_error = 'x'`}); !seqScanOf(plan, "idem_keys") {
		t.Fatalf("the plan check misses the sequential scan of\n%s", plan)
	}
	var failed struct {
		Keys []struct{ Status string }
		Next string
	}
	res, err = client.Get(srv.URL + "/idem/api/status?status=failed_retryable&limit=50")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.NewDecoder(res.Body).Decode(&failed); err != nil || len(failed.Keys) != 50 || failed.Next == "" ||
		failed.Keys[0].Status != "failed_retryable" {
		t.Fatalf("the failed records at scale: %v %+v", err, failed)
	}
	res.Body.Close()
	failedNext := failed.Next
	// The partial index of failed records: its size per key of the table.
	var failedIdx, pkIdx, keys int64
	if err := pool.QueryRow(ctx, `SELECT pg_relation_size('idem_keys_failed_idx'), pg_relation_size('idem_keys_pkey'),
		(SELECT count(*) FROM idem_keys)`).Scan(&failedIdx, &pkIdx, &keys); err != nil {
		t.Fatal(err)
	}
	t.Logf("idem_keys_failed_idx: %d bytes, %.1f bytes a key (the primary key: %.1f), at %d keys, 2%% of them failed",
		failedIdx, float64(failedIdx)/float64(keys), float64(pkIdx)/float64(keys), keys)
	r0 := first.Records[0]
	one := keyPath(idem.Scope{Actor: r0.Actor, Operation: r0.Operation}, r0.Key)
	rec.take()

	pages := []struct{ name, method, path, body string }{
		{"overview", "GET", "/idem/", ""},
		{"overview (JSON)", "GET", "/idem/api/overview", ""},
		{"needs a person", "GET", "/idem/unknown", ""},
		{"needs a person, page 2", "GET", "/idem/unknown?after=" + first.Next, ""},
		{"needs a person, filtered", "GET", "/idem/unknown?actor=actor-1&older_than=1h&error=timeout", ""},
		{"needs a person, no match", "GET", "/idem/unknown?error=no+such+error", ""},
		{"needs a person, leases that ran out", "GET", "/idem/unknown?state=lapsed", ""},
		{"needs a person, newest first", "GET", "/idem/unknown?order=newest", ""},
		{"one verdict on all: the count", "GET", "/idem/bulk-resolve?all=yes&actor=actor-3", ""},
		{"expire leases: count", "GET", "/idem/expire-leases", ""},
		{"expire leases: count, filtered", "GET", "/idem/expire-leases?operation=charge&older_than=24h", ""},
		{"record", "GET", one, ""},
		{"record, named in the query", "GET", "/idem/key?" + url.Values{"actor": {r0.Actor}, "operation": {r0.Operation}, "key": {r0.Key}}.Encode(), ""},
		{"search: an actor's keys", "GET", "/idem/search?actor=actor-42", ""},
		{"search: an actor's keys of one operation", "GET", "/idem/search?actor=actor-42&operation=refund", ""},
		{"search: a key", "GET", "/idem/search?actor=actor-42&operation=charge&key=key-42042", ""},
		{"search: actors by prefix", "GET", "/idem/search?actor_prefix=actor-4", ""},
		{"keys by status: failed", "GET", "/idem/status?status=failed_retryable", ""},
		{"keys by status: failed (JSON), page 2", "GET", "/idem/api/status?status=failed_retryable&after=" + failedNext, ""},
		{"keys by status: succeeded", "GET", "/idem/status?status=succeeded", ""},
		{"keys by status: rejected", "GET", "/idem/status?status=rejected", ""},
		{"keys by status: processing (rare)", "GET", "/idem/status?status=processing", ""},
		{"audit trail", "GET", "/idem/audit", ""},
		{"audit trail, by operator", "GET", "/idem/audit?operator=operator-3", ""},
		{"audit trail, of a key", "GET", "/idem/audit?actor=actor-1&operation=charge&key=key-1001", ""},
		{"audit trail, a day by operator prefix", "GET", "/idem/audit?operator=operator-&from=" + time.Now().UTC().AddDate(0, 0, -3).Format("2006-01-02") +
			"&to=" + time.Now().UTC().AddDate(0, 0, -2).Format("2006-01-02"), ""},
		{"audit trail, CSV export of 20,000 rows", "GET", "/idem/audit.csv?operator=operator-", ""},
	}
	var report strings.Builder
	fmt.Fprintf(&report, "%-36s %9s %9s\n", "page at 3M keys", "first", "median")
	for _, p := range pages {
		var times []time.Duration
		for i := range 6 {
			start := time.Now()
			res := do(t, client, p.method, srv.URL+p.path, p.body)
			times = append(times, time.Since(start))
			if res != http.StatusOK && res != http.StatusSeeOther {
				t.Fatalf("%s: status %d", p.name, res)
			}
			stmts := rec.take()
			if i == 0 {
				checkPlans(t, pool, p.name, stmts)
			}
		}
		rest := slices.Clone(times[1:])
		slices.Sort(rest)
		fmt.Fprintf(&report, "%-36s %9s %9s\n", p.name, times[0].Round(100*time.Microsecond), rest[len(rest)/2].Round(100*time.Microsecond))
	}
	t.Logf("\n%s", report.String())

	// The search by actor prefix reads the visibility map: each hop of a
	// table never vacuumed (autovacuum may be off here) also reads a heap
	// page. Against the single actor's keys, once the table is vacuumed.
	if _, err := pool.Exec(ctx, `VACUUM idem_keys`); err != nil {
		t.Fatal(err)
	}
	rec.take()
	report.Reset()
	fmt.Fprintf(&report, "%-36s %9s\n", "after VACUUM, interleaved", "median")
	vacuumed := map[string][]time.Duration{}
	paths := []struct{ name, path string }{{"search: actors by prefix", "/idem/search?actor_prefix=actor-4"},
		{"search: an actor's keys", "/idem/search?actor=actor-42"}}
	for range 6 {
		for _, p := range paths {
			start := time.Now()
			if res := do(t, client, "GET", srv.URL+p.path, ""); res != http.StatusOK {
				t.Fatalf("%s: status %d", p.name, res)
			}
			vacuumed[p.name] = append(vacuumed[p.name], time.Since(start))
		}
	}
	for _, p := range paths {
		times := vacuumed[p.name]
		slices.Sort(times)
		fmt.Fprintf(&report, "%-36s %9s\n", p.name, times[len(times)/2].Round(100*time.Microsecond))
	}
	checkPlans(t, pool, "search: actors by prefix, vacuumed", rec.take())
	t.Logf("\n%s", report.String())

	// The actions, once each: their statements' plans and their times.
	var rec0 idem.Record
	if rec0, err = idem.Lookup(ctx, pool, idem.Scope{Actor: r0.Actor, Operation: r0.Operation}, r0.Key); err != nil {
		t.Fatal(err)
	}
	actions := []struct{ name, path, body string }{
		{"resolve", one + "/resolve", url.Values{"token": {fmt.Sprint(rec0.Token)}, "verdict": {"retryable"}, "reason": {"scale"}}.Encode()},
		{"expire leases, filtered", "/idem/expire-leases", url.Values{"actor": {"actor-3"}, "cutoff": {time.Now().UTC().Format(time.RFC3339Nano)}}.Encode()},
		{"prune, 10 batches of 1000", "/idem/prune", "confirm=yes&reason=scale"},
	}
	report.Reset()
	fmt.Fprintf(&report, "%-36s %9s\n", "action at 3M keys", "time")
	for _, a := range actions {
		rec.take()
		start := time.Now()
		if res := do(t, client, "POST", srv.URL+a.path, a.body); res != http.StatusSeeOther {
			t.Fatalf("%s: status %d", a.name, res)
		}
		fmt.Fprintf(&report, "%-36s %9s\n", a.name, time.Since(start).Round(100*time.Microsecond))
		checkPlans(t, pool, a.name, rec.take())
	}
	t.Logf("\n%s", report.String())
}

func do(t *testing.T, client *http.Client, method, u, body string) int {
	t.Helper()
	req, err := http.NewRequest(method, u, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" || method == "POST" {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	return res.StatusCode
}

// checkPlans explains every statement of stmts that reads or writes a
// table, in a transaction with the settings its own transaction had set
// before it (replayed in order per connection), and fails on a sequential
// scan of idem_keys.
func checkPlans(t *testing.T, pool *pgxpool.Pool, what string, stmts []statement) {
	t.Helper()
	ctx := context.Background()
	settings := map[*pgx.Conn][]statement{}
	explained := 0
	for _, s := range stmts {
		sql := strings.TrimSpace(s.sql)
		lower := strings.ToLower(sql)
		switch {
		case lower == "begin" || strings.HasPrefix(lower, "begin ") || lower == "commit" || lower == "rollback":
			delete(settings, s.conn)
			continue
		case strings.HasPrefix(lower, "select set_config") || strings.HasPrefix(lower, "set local"):
			settings[s.conn] = append(settings[s.conn], s)
			continue
		case strings.HasPrefix(lower, "savepoint") || strings.HasPrefix(lower, "release") || strings.HasPrefix(lower, "rollback to"):
			continue
		}
		plan := explain(t, ctx, pool, settings[s.conn], s)
		explained++
		if strings.Contains(plan, `"Node Type": "Seq Scan"`) && seqScanOf(plan, "idem_keys") {
			t.Errorf("%s: a sequential scan of idem_keys in the plan of\n%s\n%s", what, sql, plan)
		}
	}
	if explained == 0 {
		t.Errorf("%s: no statement recorded", what)
	}
}

// explain returns the JSON plan of s, run after the settings.
func explain(t *testing.T, ctx context.Context, pool *pgxpool.Pool, settings []statement, s statement) string {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for _, set := range settings {
		if _, err := tx.Exec(ctx, set.sql, set.args...); err != nil {
			t.Fatal(err)
		}
	}
	var plan string
	if err := tx.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+s.sql, s.args...).Scan(&plan); err != nil {
		t.Fatalf("EXPLAIN %s: %v", s.sql, err)
	}
	return plan
}

// seqScanOf reports whether the JSON plan has a Seq Scan node on table.
func seqScanOf(plan, table string) bool {
	var nodes []map[string]any
	if err := json.Unmarshal([]byte(plan), &nodes); err != nil {
		return true
	}
	var walk func(n map[string]any) bool
	walk = func(n map[string]any) bool {
		if n["Node Type"] == "Seq Scan" && n["Relation Name"] == table {
			return true
		}
		kids, _ := n["Plans"].([]any)
		for _, k := range kids {
			if m, ok := k.(map[string]any); ok && walk(m) {
				return true
			}
		}
		return false
	}
	for _, n := range nodes {
		if p, ok := n["Plan"].(map[string]any); ok && walk(p) {
			return true
		}
	}
	return false
}
