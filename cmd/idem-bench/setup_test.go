package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/testkit/pgtest"
)

// recreate drops only a database idem-bench created, that no session uses:
// another database of the name is refused and keeps its data.
func TestRecreateDropsOnlyItsOwnDatabase(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	srv := pgtest.Server(t)
	admin, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	name := fmt.Sprintf("idembenchtest_%d", time.Now().UnixNano())
	ident := pgx.Identifier{name}.Sanitize()
	t.Cleanup(func() { _, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)") })
	connectTo := func() *pgx.Conn {
		t.Helper()
		cfg, err := pgx.ParseConfig(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Database = name
		c, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}

	// Someone else's database of that name: refused, its table kept.
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+ident); err != nil {
		t.Fatal(err)
	}
	c := connectTo()
	if _, err := c.Exec(ctx, "CREATE TABLE theirs (id int)"); err != nil {
		t.Fatal(err)
	}
	c.Close(ctx)
	if err := recreate(ctx, srv, name); err == nil || !strings.Contains(err.Error(), "not idem-bench's") {
		t.Fatalf("recreate over another database: %v", err)
	}
	c = connectTo()
	if _, err := c.Exec(ctx, "SELECT FROM theirs"); err != nil {
		t.Fatalf("the other database lost its table: %v", err)
	}
	c.Close(ctx)

	// idem-bench's own: recreated, and refused while a session uses it.
	if _, err := admin.Exec(ctx, "DROP DATABASE "+ident); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := recreate(ctx, srv, name); err != nil {
			t.Fatalf("recreate: %v", err)
		}
	}
	c = connectTo()
	defer c.Close(ctx)
	if err := recreate(ctx, srv, name); err == nil || !strings.Contains(err.Error(), "session(s) use it") {
		t.Fatalf("recreate of a database in use: %v", err)
	}
}

// The storage run's flags are checked before anything runs.
func TestStorageFlagsChecked(t *testing.T) {
	t.Parallel()
	good := options{workers: 1, rounds: 1, round: time.Second, storm: 2, users: 1, boxes: 1, replayKeys: 1, allocs: 1,
		storageKeys: 1, storageRate: 1, storageWALCalls: 1,
		relayRounds: 1, relayEvents: 1, relayLatencyEvents: 1, relayPending: 1}
	if err := good.check(); err != nil {
		t.Fatalf("good options refused: %v", err)
	}
	for name, bad := range map[string]func(*options){
		"no keys":         func(o *options) { o.storageKeys = 0 },
		"no rate":         func(o *options) { o.storageRate = 0 },
		"negative rate":   func(o *options) { o.storageRate = -1 },
		"no WAL calls":    func(o *options) { o.storageWALCalls = 0 },
		"fillfactor 5":    func(o *options) { o.storageFillfactor = 5 },
		"fillfactor 101":  func(o *options) { o.storageFillfactor = 101 },
		"vacuum scale -1": func(o *options) { o.storageVacuumScale = -1 },
		"floor with bodies' time": func(o *options) {
			o.storageFloor, o.storageBodyTTL = true, time.Second
		},
	} {
		o := good
		bad(&o)
		if err := o.check(); err == nil || !strings.Contains(err.Error(), "-storage") {
			t.Errorf("%s: got %v, want an error naming the -storage flag", name, err)
		}
	}
}
