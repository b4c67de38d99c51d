package idem_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// statementCounter is a pgx tracer that counts the round trips and the
// statements a connection sends while it is on.
type statementCounter struct {
	mu         sync.Mutex
	on         bool
	roundTrips int
	statements []string
}

func (s *statementCounter) count(roundTrips int, sql string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.on {
		s.roundTrips += roundTrips
		if sql != "" {
			s.statements = append(s.statements, strings.Join(strings.Fields(sql), " "))
		}
	}
}

func (s *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	s.count(1, data.SQL)
	return ctx
}
func (s *statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (s *statementCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	s.count(1, "")
	return ctx
}
func (s *statementCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	s.count(0, data.SQL)
}
func (s *statementCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
func (s *statementCounter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	s.count(1, "")
	return ctx
}
func (s *statementCounter) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

// measure runs call with the counter on and returns what it counted.
func (s *statementCounter) measure(t *testing.T, call func() error) (roundTrips int, statements []string) {
	t.Helper()
	s.mu.Lock()
	s.on, s.roundTrips, s.statements = true, 0, nil
	s.mu.Unlock()
	err := call()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.on = false
	if err != nil {
		t.Fatal(err)
	}
	return s.roundTrips, s.statements
}

// A regression guard: the round trips and statements of idem's own on each
// call (fn sends none here), on a connection whose prepared statements are
// cached (the steady state):
//   - fresh DoInTx and fresh Do: 2 round trips, at most 4 statements;
//   - replays: 2 round trips, DoInTx at most 5 statements, Do at most 6;
//   - a fresh Reserve and a Reserve that replays: 3 round trips (BEGIN; its
//     settings, the insert and the locking read in one; COMMIT), at most 6
//     statements.
func TestStatementsPerCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	counter := &statementCounter{}
	cfg := pool.Config().ConnConfig.Copy()
	cfg.Tracer = counter
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	ok := func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Status: 201, Body: []byte(`{"id":1}`)}, nil
	}
	doInTx := func(key string) func() error {
		return func() error {
			res, err := idem.DoInTx(ctx, conn, scope, key, fpA, ok)
			if err == nil && res.Status != 201 {
				err = fmt.Errorf("status %d", res.Status)
			}
			return err
		}
	}
	do := func(key string) func() error {
		return func() error {
			tx, err := conn.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			var res idem.Result
			_, _ = counter.measure(t, func() error {
				res, err = idem.Do(ctx, tx, scope, key, fpA, ok)
				return err
			})
			if err == nil && res.Status != 201 {
				err = fmt.Errorf("status %d", res.Status)
			}
			if err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	}
	// Warm the statement cache: every statement of every path once.
	for _, call := range []func() error{doInTx("warm"), doInTx("warm"), do("warm-do"), do("warm-do")} {
		if err := call(); err != nil {
			t.Fatal(err)
		}
	}

	check := func(name string, wantRoundTrips, maxStatements int, rt int, stmts []string) {
		t.Helper()
		if rt > wantRoundTrips || len(stmts) > maxStatements {
			t.Errorf("%s: %d round trips, %d statements; want at most %d and %d:\n%s",
				name, rt, len(stmts), wantRoundTrips, maxStatements, strings.Join(stmts, "\n"))
		}
		t.Logf("%s: %d round trips, %d statements", name, rt, len(stmts))
	}
	rt, stmts := counter.measure(t, doInTx("fresh"))
	check("fresh DoInTx", 2, 4, rt, stmts)
	rt, stmts = counter.measure(t, doInTx("fresh"))
	check("DoInTx replay", 2, 5, rt, stmts)

	// Do: only what Do itself sends counts, not the caller's BEGIN and
	// COMMIT (do measures inside them).
	measureDo := func(key string) (int, []string) {
		if err := do(key)(); err != nil {
			t.Fatal(err)
		}
		counter.mu.Lock()
		defer counter.mu.Unlock()
		return counter.roundTrips, counter.statements
	}
	rt, stmts = measureDo("fresh-do")
	check("fresh Do", 2, 4, rt, stmts)
	rt, stmts = measureDo("fresh-do")
	check("Do replay", 2, 6, rt, stmts)

	reserve := func(key string, replayed bool) func() error {
		return func() error {
			r, err := idem.Reserve(ctx, conn, scope, key, fpA, time.Minute)
			if err == nil && r.Replayed != replayed {
				err = fmt.Errorf("replayed %t", r.Replayed)
			}
			if err == nil && !replayed {
				err = idem.InTx(ctx, conn, func(ctx context.Context, tx pgx.Tx) error {
					return idem.Complete(ctx, tx, r, idem.Response{Status: 201, Body: []byte(`{"id":1}`)})
				})
			}
			return err
		}
	}
	for _, call := range []func() error{reserve("warm-r", false), reserve("warm-r", true)} {
		if err := call(); err != nil {
			t.Fatal(err)
		}
	}
	counter.mu.Lock()
	counter.on, counter.roundTrips, counter.statements = true, 0, nil
	counter.mu.Unlock()
	r, err := idem.Reserve(ctx, conn, scope, "fresh-r", fpA, time.Minute)
	counter.mu.Lock()
	counter.on, rt, stmts = false, counter.roundTrips, counter.statements
	counter.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	check("fresh Reserve", 3, 6, rt, stmts)
	if err := idem.InTx(ctx, conn, func(ctx context.Context, tx pgx.Tx) error {
		return idem.Complete(ctx, tx, r, idem.Response{Status: 201, Body: []byte(`{"id":1}`)})
	}); err != nil {
		t.Fatal(err)
	}
	rt, stmts = counter.measure(t, reserve("fresh-r", true))
	check("Reserve replay", 3, 6, rt, stmts)
}
