-- Claims a key for the calling transaction, or reads the row that holds it.
--
-- The primary key picks a single winner: while another transaction holds an
-- uncommitted claim on the same key, the INSERT waits for it to finish, at
-- most @lock_timeout (set for the wait; the caller's value is saved first and
-- restored by the final SELECT). The statement returns one row: claimed when
-- this transaction now holds the key, otherwise the committed row that holds
-- it. It returns no row when the row it waited for committed during the wait
-- (invisible to this statement's snapshot); KeyGetAfterClaim then reads it
-- and restores lock_timeout.
-- name: KeyClaim :one
WITH claim AS (
    INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
    SELECT sqlc.arg(actor)::text, sqlc.arg(operation)::text, sqlc.arg(idem_key)::text,
           sqlc.arg(fingerprint)::bytea, 'processing',
           now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond')
    FROM (SELECT set_config('lock_timeout', sqlc.arg(lock_timeout)::text, true)
          FROM (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true)) AS saved
         ) AS bounded_wait
    ON CONFLICT (actor, operation, idem_key) DO NOTHING
    RETURNING true AS claimed
), outcome AS (
    SELECT claim.claimed, NULL::bytea AS fingerprint, NULL::text AS status,
           NULL::integer AS response_status, NULL::jsonb AS response_headers,
           NULL::bytea AS response_body, false AS expired
    FROM claim
    UNION ALL
    SELECT false, k.fingerprint, k.status, k.response_status, k.response_headers,
           k.response_body, k.expires_at <= now()
    FROM idem_keys AS k
    WHERE k.actor = sqlc.arg(actor)::text AND k.operation = sqlc.arg(operation)::text
      AND k.idem_key = sqlc.arg(idem_key)::text
      AND NOT EXISTS (SELECT FROM claim)
)
SELECT outcome.claimed::boolean AS claimed, outcome.fingerprint, outcome.status,
       outcome.response_status, outcome.response_headers, outcome.response_body,
       outcome.expired::boolean AS expired,
       set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true) AS restored
FROM outcome;

-- Restores the lock_timeout saved by KeyClaim or KeyTakeOver and reads the
-- row that holds a key. It always returns one row; found is false when no row
-- holds the key.
-- name: KeyGetAfterClaim :one
SELECT (k.idem_key IS NOT NULL)::boolean AS found,
       coalesce(k.fingerprint, '')::bytea AS fingerprint,
       coalesce(k.status, '')::text AS status,
       k.response_status, k.response_headers, k.response_body,
       coalesce(k.expires_at <= now(), false)::boolean AS expired
FROM (SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true)) AS restored
LEFT JOIN idem_keys AS k
  ON k.actor = @actor AND k.operation = @operation AND k.idem_key = @idem_key;

-- Claims a key whose row has expired: an expired key is a new request. Like
-- KeyClaim it waits at most @lock_timeout for a concurrent claim and leaves
-- the previous lock_timeout for KeyGetAfterClaim to restore. Returns no row
-- when the row is gone or no longer expired (another transaction took it over
-- first).
-- name: KeyTakeOver :one
UPDATE idem_keys
SET fingerprint      = @fingerprint,
    status           = 'processing',
    response_status  = NULL,
    response_headers = NULL,
    response_body    = NULL,
    created_at       = now(),
    completed_at     = NULL,
    expires_at       = now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond')
FROM (SELECT set_config('lock_timeout', sqlc.arg(lock_timeout)::text, true) AS lock_timeout
      FROM (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true)) AS saved
     ) AS bounded_wait
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND expires_at <= now()
RETURNING expires_at;

-- Stores the final outcome of a claimed key.
-- name: KeyComplete :execrows
UPDATE idem_keys
SET status           = @status,
    response_status  = @response_status,
    response_headers = @response_headers,
    response_body    = @response_body,
    completed_at     = now()
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND status = 'processing';

-- Gives up a claim that this transaction holds, after fn failed: the key is
-- free again once the transaction ends.
-- name: KeyRelease :exec
DELETE FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND status = 'processing';
