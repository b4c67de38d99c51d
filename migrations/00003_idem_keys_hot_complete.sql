-- +goose NO TRANSACTION
-- +goose Up
-- Version 3 of idem_keys: the completion of a key claimed by Do or DoInTx is
-- a HOT update (heap-only tuple: no new index entries, no dead ones left in
-- the indexes).
--
-- PostgreSQL makes an update HOT only when it changes no indexed column and
-- no column that an index predicate reads. The two partial indexes of 00002
-- read status, which every completion changes. They are replaced by indexes
-- of the same columns over the open reservations: a lease, and no outcome
-- recorded yet (lease_expires_at IS NOT NULL AND completed_at IS NULL), which
-- are the 'processing' and 'unknown' reservations. Do never sets
-- lease_expires_at, and its claim writes completed_at with the claim (the
-- value its completion would write: now() of the same transaction), so
-- KeyComplete changes only status and the response columns, none of them
-- indexed.
--
-- The indexes are built CONCURRENTLY (this migration runs outside a
-- transaction): a populated table keeps taking writes while they are built.
-- Each one is dropped first if it exists, so a run that was interrupted
-- (which may leave an invalid index behind) can simply be run again.

-- ExpireLeases walks the leases of open reservations in expiry order.
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_open_lease_idx;
CREATE INDEX CONCURRENTLY idem_keys_open_lease_idx ON idem_keys (lease_expires_at)
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL;

-- ListUnknown pages through open reservations, oldest first, and keeps the
-- 'unknown' ones.
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_open_created_idx;
CREATE INDEX CONCURRENTLY idem_keys_open_created_idx ON idem_keys (created_at, actor, operation, idem_key)
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL;

DROP INDEX CONCURRENTLY IF EXISTS idem_keys_lease_idx;
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_unknown_idx;

-- +goose Down
-- Back to the indexes of 00002. No row is changed or deleted: a Do row's
-- completed_at keeps the value version 2 would have written.
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_lease_idx;
CREATE INDEX CONCURRENTLY idem_keys_lease_idx ON idem_keys (lease_expires_at)
    WHERE status = 'processing' AND lease_expires_at IS NOT NULL;

DROP INDEX CONCURRENTLY IF EXISTS idem_keys_unknown_idx;
CREATE INDEX CONCURRENTLY idem_keys_unknown_idx ON idem_keys (created_at, actor, operation, idem_key)
    WHERE status = 'unknown';

DROP INDEX CONCURRENTLY IF EXISTS idem_keys_open_lease_idx;
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_open_created_idx;
