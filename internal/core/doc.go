// Package core is idem's protocol, written once for every database package:
// the call loop of Do and DoInTx (claim with a bounded wait, fn, complete;
// read and judge; take over; a refusal stored by a claim of its own), the
// reservations and their fencing, the resume of an attempt in doubt inside
// its window (ReserveOptions.ResumeWithin, ListResumable), reconciliation,
// lookups, pruning, statistics, the inbox, typed replay, the checks of a
// response, the retry policy and the observer (metrics, spans, logs with
// hashed keys).
//
// It is generic over the transaction type of a driver (pgx.Tx, *sql.Tx) and
// the handle transactions are begun on, and reaches the database only
// through package driver's interface, so it never names a database package
// nor asserts a transaction back to one:
//
//	fronts    idem (pgx)            idemsql (database/sql)     public API, thin
//	             │                      │
//	core      core.Client[pgx.Tx, …]   core.Client[*sql.Tx, …]   this package
//	             │                      │
//	drivers   pgxdriver (pipelined)    sqldriver (one at a time)
//	             │                      │
//	queries   internal/db              internal/dbsql             sqlc, from queries/
//
// Files, by concern: call.go (Do and DoInTx: the call in progress, its
// clock and span begun; the call loop, its retries, judge), fnended.go (fn that ends its own transaction), intx.go (InTx),
// reserve.go (the reservation mode: Reserve and ReserveWith, which judge
// decides for like Do and which resumes inside a window, Complete,
// FailRetryable, MarkUnknown, Heartbeat), observe.go (how a call is
// recorded at its end: metrics, log record, the span's outcome), operate.go (the operators'
// calls: ExpireLeases, ListUnknown and ListResumable, Resolve, Lookup,
// Forget, Prune, ReadStats), callkey.go, inbox.go, json.go (typed replay),
// response.go (what can be stored, and replayed), validate.go, flight.go
// (coalescing DoInTx in a process), errors.go (and what the core tells
// apart in a database's errors, in the driver's terms), types.go (the
// public types, which package idem names), client.go (Config, New).
package core
