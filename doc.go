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
// Run Migrate (or apply Migrations with goose) once before use. Config and
// New give a configurable Client with the same methods as the package-level
// functions.
package idem
