-- +goose NO TRANSACTION
-- +goose Up
-- One index of open reservations instead of two. idem_keys_open_lease_idx
-- (lease_expires_at, migration 00003) and idem_keys_open_created_idx
-- (created_at, actor, operation, idem_key) hold the same rows, the open
-- reservations (a lease, no outcome yet), and every INSERT opens every index
-- of the table whether it inserts or not: the lease index cost each claim of
-- Do and DoInTx, fresh or replayed, and each completion, its setup. Without
-- it a fresh DoInTx runs about 12,000 fewer instructions of the server's, a
-- replay about 3,600 (docs/benchmarks.md, issue 30's sixth look).
-- ExpireLeases now walks idem_keys_open_created_idx, oldest attempt first,
-- and reads the open reservations whose lease has not run out to pass them
-- (as many as are in flight; at 50,000 of them a batch reads them all, about
-- 30 ms); the unknown ones it read already (their lease ran out long ago, so
-- the lease order put them first).
--
-- Dropped CONCURRENTLY (this migration runs outside a transaction), so that
-- no call waits for it; IF EXISTS: an interrupted run can simply be run
-- again.
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_open_lease_idx;

-- +goose Down
-- Version 11's index, built CONCURRENTLY (calls keep running while it is
-- built on a populated table), dropped first should an interrupted run have
-- left an invalid one. No row changes.
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_open_lease_idx;
CREATE INDEX CONCURRENTLY idem_keys_open_lease_idx ON idem_keys (lease_expires_at)
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL;
