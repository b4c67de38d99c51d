// Package idem makes retried requests safe by doing idempotency inside the
// application's own PostgreSQL transaction.
//
// A service runs its business logic inside Do. Claiming the key, the
// business writes and the stored response commit or roll back together in the
// caller's pgx transaction:
//
//	fp, err := idem.FingerprintJSON(body)
//	res, err := idem.DoInTx(ctx, pool, idem.Scope{Actor: user, Operation: "draw"}, key, fp,
//		func(ctx context.Context, tx pgx.Tx) (idem.Response, error) {
//			// debit, take stock, write inventory with tx ...
//			return idem.Response{Status: 201, Body: out}, nil
//		})
//
// A retry with the same key replays the first response byte for byte
// (Result.Replayed); the same key with a different request is refused
// (ErrKeyReused); concurrent duplicates run fn once; a failure before commit
// leaves nothing behind and the key free.
//
// fn may run more than once (serialization retries, lost connections); only
// one run commits. Work outside the database (a card gateway, an e-mail)
// never belongs in fn: Reserve, Complete, FailRetryable and MarkUnknown
// give it a lease and a fencing token, and an outcome that may have happened
// becomes unknown, to be reconciled with ListUnknown and Resolve, never run
// again blindly; unless the call carried the reservation's call key to a
// receiver that remembers it (ReserveWith with ReserveOptions.ResumeWithin):
// then, inside that window, the next Reserve or a recovery worker fed by
// ListResumable resumes it with the same key. DoJSON returns typed values instead of bytes; Inbox applies
// the same discipline to messages and webhook deliveries, EventID to an
// outbox.
//
// Run Migrate (or apply Migrations with goose) before use (on Citus, then
// Distribute, which shards idem_keys and the audit trail by actor), and Prune
// (and ExpireLeases, with reservations) periodically. Lookup, Forget and
// ReadStats serve operators, as does the idem command (cmd/idem).
// Unavailable tells a store failure from everything else: fail closed. Config
// and New give a configurable Client with the same methods as the
// package-level functions, and with metrics (OpenTelemetry), logs (slog,
// with keyed hashes of keys and actors) and spans when configured.
//
// # Layers
//
// This package is a front: its functions adapt pgx's types to idem's
// protocol, which is written once, for pgx and for database/sql (package
// idemsql) alike, in internal/core, and reaches the database through a
// driver. A call walks down the layers and back up once; no layer imports
// one above it:
//
//	fronts    idem (pgx): this package        idemsql (database/sql)
//	core      internal/core: the call loop, reservations, reconciliation,
//	          lookups, pruning, statistics, observation
//	drivers   internal/driver/pgxdriver        internal/driver/sqldriver
//	          (pipelined round trips)          (one statement at a time)
//	queries   internal/db                      internal/dbsql
//	          (sqlc, generated twice from queries/)
//
// Following its ctx, a call of DoInTx or Do passes through three files:
// idem.go, internal/core/call.go (the call loop and its retries) and
// internal/driver/pgxdriver/span.go (each round trip, its statements queued
// and read there); Reserve and ReserveWith through internal/core/reserve.go
// and pgxdriver/executor.go. On the way, DoInTx calls helpers that take no
// ctx: in internal/core, validate.go (the key and the scope), observe.go
// (the call's metrics, log record and span's outcome, at its end),
// flight.go (concurrent duplicates coalesced) and response.go (a response
// as it is stored); Do also pgxdriver's driver.go (its nil check of the
// transaction). A failing call also reads
// internal/core/errors.go and fnended.go, and convert.go here
// (docs/development.md walks a call file by file). The statements are sqlc's,
// generated in internal/db. The public types (Scope, Response, Result,
// Record, Reservation, Config, the errors, ...) are defined here, with the
// fields of internal/core's own, and convert.go carries values across at no
// cost per call; InTx and Beginner live in tx.go.
package idem
