-- Claims a key for the calling transaction. The primary key picks a single
-- winner: while another transaction holds an uncommitted claim on the same
-- key, the INSERT waits for it to finish, at most @lock_timeout, which is set
-- while the row to insert is computed (before the insert can wait) after the
-- caller's value is saved. RETURNING restores the caller's value; it runs
-- only when the row was inserted. No row means a committed row holds the key:
-- KeyGetAfterClaim then reads it and restores lock_timeout.
-- name: KeyClaim :one
INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
SELECT sqlc.arg(actor)::text, sqlc.arg(operation)::text, sqlc.arg(idem_key)::text,
       sqlc.arg(fingerprint)::bytea, 'processing',
       now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond')
FROM (SELECT set_config('lock_timeout', sqlc.arg(lock_timeout)::text, true)
      FROM (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true)) AS saved
     ) AS bounded_wait
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING (set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true) IS NOT NULL)::boolean AS claimed;

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
-- KeyClaim it waits at most @lock_timeout for a concurrent claim and restores
-- the caller's lock_timeout when it returns a row. Returns no row when the row
-- is gone or no longer expired (another transaction took it over first).
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
RETURNING (set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true) IS NOT NULL)::boolean AS claimed;

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
