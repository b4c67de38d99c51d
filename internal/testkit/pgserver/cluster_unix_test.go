//go:build unix

package pgserver

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// An immediate restart drops every connection and keeps what was committed
// with synchronous_commit on; the URL stays valid.
func TestRestartTempCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	if _, err := findServerBinaries(); err != nil {
		t.Skip(err)
	}
	srv, err := StartTempCluster(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	cfg, err := pgx.ParseConfig(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["synchronous_commit"] = "on"
	conn, err := pgx.ConnectConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(t.Context(), `CREATE TABLE t (v int); INSERT INTO t VALUES (1)`); err != nil {
		t.Fatal(err)
	}

	if err := srv.StopImmediate(); err != nil {
		t.Fatal(err)
	}
	if err := srv.StopImmediate(); err != nil {
		t.Fatalf("second StopImmediate: %v", err)
	}
	if err := Ping(t.Context(), srv.URL); err == nil {
		t.Fatal("server answers after StopImmediate")
	}
	if err := srv.Restart(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := conn.Ping(t.Context()); err == nil {
		t.Fatal("a connection from before the stop still works")
	}
	// Restart while running: stops immediately, then starts.
	if err := srv.Restart(t.Context()); err != nil {
		t.Fatal(err)
	}
	conn2, err := pgx.ConnectConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close(context.Background())
	var n int
	if err := conn2.QueryRow(t.Context(), `SELECT count(*) FROM t`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("after restarts: %d rows, %v", n, err)
	}

	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Restart(t.Context()); err == nil {
		t.Fatal("Restart after Close succeeded")
	}
	if err := (&Server{URL: srv.URL}).StopImmediate(); err == nil {
		t.Fatal("StopImmediate on a server that is not a temp cluster succeeded")
	}
}
