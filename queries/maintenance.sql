-- Deletes up to @batch_size finished rows past their TTL, oldest first.
-- Rows in flight are never touched: a claim not yet committed is invisible
-- here, a take-over in progress holds its row locked (SKIP LOCKED passes it
-- by, so several pruners never wait on each other either), and reservations
-- that are 'processing' or 'unknown' are not finished. Run through planned:
-- its plan is made for the table as it is, never a generic plan cached while
-- the table was small.
-- name: KeyPrune :execrows
DELETE FROM idem_keys AS k
USING (SELECT actor, operation, idem_key
       FROM idem_keys
       WHERE expires_at <= now()
         AND status IN ('succeeded', 'rejected', 'failed_retryable')
       ORDER BY expires_at
       LIMIT sqlc.arg(batch_size)::integer
       FOR UPDATE SKIP LOCKED) AS old
WHERE k.actor = old.actor AND k.operation = old.operation AND k.idem_key = old.idem_key;

-- KeyPrune for Citus, which refuses FOR UPDATE in a query over a
-- distributed table. Without SKIP LOCKED the conditions are checked again
-- on the row the DELETE locks: a row taken over (or pruned) by a
-- transaction that committed while this one waited for its lock is no
-- longer expired and finished (or gone), and stays. Concurrent pruners wait
-- for each other's batches instead of taking the next one: on PostgreSQL
-- that made two or four pruners no faster than one (issue 20), so
-- PostgreSQL keeps KeyPrune. Prune picks the statement per database
-- (citus.go).
-- name: KeyPruneCitus :execrows
DELETE FROM idem_keys AS k
USING (SELECT actor, operation, idem_key
       FROM idem_keys
       WHERE expires_at <= now()
         AND status IN ('succeeded', 'rejected', 'failed_retryable')
       ORDER BY expires_at
       LIMIT sqlc.arg(batch_size)::integer) AS old
WHERE k.actor = old.actor AND k.operation = old.operation AND k.idem_key = old.idem_key
  AND k.expires_at <= now()
  AND k.status IN ('succeeded', 'rejected', 'failed_retryable');

-- Drops the stored response body and headers of up to @batch_size finished
-- rows past their body_expires_at (Config.BodyTTL), oldest first, through
-- idem_keys_body_expires_idx (migration 00009); response_status and the
-- rest of the row stay until the key's TTL. body_expires_at becomes NULL
-- with the body, so the row leaves that index. Rows in flight are passed
-- by as in KeyPrune: a claim not yet committed is invisible, a completion
-- or take-over in progress holds its row locked (SKIP LOCKED), a row not
-- finished is not picked. Run through planned, as KeyPrune.
-- name: KeyDropBodies :execrows
UPDATE idem_keys AS k
SET response_body = NULL, response_headers = NULL, body_expires_at = NULL
FROM (SELECT actor, operation, idem_key
      FROM idem_keys
      WHERE body_expires_at <= now()
        AND status IN ('succeeded', 'rejected')
      ORDER BY body_expires_at
      LIMIT sqlc.arg(batch_size)::integer
      FOR UPDATE SKIP LOCKED) AS old
WHERE k.actor = old.actor AND k.operation = old.operation AND k.idem_key = old.idem_key;

-- KeyDropBodies for Citus, which refuses FOR UPDATE over a distributed
-- table: the conditions are checked again on the row the UPDATE locks (see
-- KeyPruneCitus).
-- name: KeyDropBodiesCitus :execrows
UPDATE idem_keys AS k
SET response_body = NULL, response_headers = NULL, body_expires_at = NULL
FROM (SELECT actor, operation, idem_key
      FROM idem_keys
      WHERE body_expires_at <= now()
        AND status IN ('succeeded', 'rejected')
      ORDER BY body_expires_at
      LIMIT sqlc.arg(batch_size)::integer) AS old
WHERE k.actor = old.actor AND k.operation = old.operation AND k.idem_key = old.idem_key
  AND k.body_expires_at <= now()
  AND k.status IN ('succeeded', 'rejected');

-- Counts the rows KeyPrune would delete now.
-- name: KeyCountPrunable :one
SELECT count(*) FROM idem_keys
WHERE expires_at <= now()
  AND status IN ('succeeded', 'rejected', 'failed_retryable');

-- Counts the keys in each status, with the oldest claim still processing.
-- name: KeyStats :many
SELECT status, count(*)::bigint AS keys, min(created_at)::timestamptz AS oldest
FROM idem_keys
GROUP BY status
ORDER BY status;

-- Sizes of idem_keys on disk: the table with its TOAST data, and its indexes.
-- name: KeyTableSize :one
SELECT pg_table_size('idem_keys')::bigint AS table_bytes,
       pg_indexes_size('idem_keys')::bigint AS index_bytes;
