// Package idemsql is idem for services that talk to PostgreSQL through
// database/sql: pgx's stdlib driver (github.com/jackc/pgx/v5/stdlib) or
// lib/pq, directly or under an ORM that hands out a *sql.Tx (GORM, Bun,
// sqlx, ent; the examples module shows each).
//
// It offers package idem's calls with *sql.DB and *sql.Tx in place of pgx's
// handles: Do, DoInTx, InTx, Migrate, the reservation calls (Reserve,
// ReserveWith, Complete, FailRetryable, MarkUnknown, Heartbeat), the
// operator calls (Lookup, Forget, Resolve, ListUnknown, ListResumable,
// ExpireLeases, Prune, ReadStats),
// the inbox (Inbox, InboxInTx, InboxKey), the typed-replay forms (DoJSON,
// DoInTxJSON and their With forms), and a Client from New(idem.Config)
// with every method of idem.Client. idem.MigrateDown is not ported: run it
// (or the idem command) on a pgx pool. On a Citus coordinator (idem_keys
// distributed with idem.Distribute), use a Client of NewCitus: a *sql.Tx
// does not say which database it is on, so idemsql does not ask; the
// setting picks Citus's statement forms, at no statement per call.
//
// Everything else is package idem's: the same table and migrations (a
// database migrated by idem.Migrate or idemsql.Migrate serves both, and
// both kinds of service can share keys), the same protocol (one core,
// internal/core, runs both packages' calls; only its driver differs), the
// same errors (idem's sentinels; idem.Unavailable recognizes both drivers'
// connection failures and server errors), the same retries of
// serialization failures and deadlocks, the same metrics, spans and logs.
//
// # Layers
//
//	fronts    idem (pgx)                   idemsql (database/sql): this package
//	core      internal/core: the protocol, generic over the transaction type
//	drivers   internal/driver/pgxdriver    internal/driver/sqldriver
//	queries   internal/db                  internal/dbsql (sqlc, from queries/)
//
// DoInTx and Do read do.go, then internal/core/call.go, then
// internal/driver/sqldriver/span.go.
//
//	db, _ := sql.Open("pgx", url) // or "postgres" with lib/pq
//	_ = idemsql.Migrate(ctx, db)
//	res, err := idemsql.DoInTx(ctx, db, scope, key, fp,
//		func(ctx context.Context, tx *sql.Tx) (idem.Response, error) {
//			// the service's writes, in tx
//			return idem.Response{Status: 201, Body: body}, nil
//		})
//
// # Round trips
//
// database/sql sends one statement per round trip: it cannot pipeline, as
// package idem does with pgx's batches. A first DoInTx costs four round
// trips (BEGIN, the claim, which bounds its own wait, the stored response,
// COMMIT) where idem.DoInTx costs two; a replay five (BEGIN, the claim, the
// planner setting and the read of the stored row, ROLLBACK); Do in a
// caller's transaction four (its savepoint, the claim, the stored response,
// the release) where idem.Do costs two. lib/pq adds a round trip to every
// statement with arguments unless the connection sets
// binary_parameters=yes. BenchmarkRoundTrips measures them; docs/sql.md has
// the figures.
//
// Concurrent DoInTx calls with the same key in one process are not
// coalesced (idem.DoInTx coalesces them on one pgx pool); they meet at the
// primary key, like calls from different processes.
package idemsql
