-- Reads the committed record of a key, with whether its response's body
-- is gone (as KeyGet says it). Run through planned.
-- name: KeyLookup :one
SELECT sqlc.embed(idem_keys),
       ((status IN ('succeeded', 'rejected') AND response_status IS NOT NULL AND response_body IS NULL)
        OR coalesce(body_expires_at <= now(), false))::boolean AS body_gone
FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key;

-- Locks the committed record of a key for Forget, without waiting for a
-- transaction that holds it (55P03), with whether a reservation's lease ran
-- out (by the database clock). Run through planned.
-- name: KeyLockForForget :one
SELECT status,
       (lease_expires_at IS NOT NULL AND lease_expires_at <= now())::boolean AS lease_ran_out
FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
FOR UPDATE NOWAIT;

-- Deletes the record of a key that KeyLockForForget locked. Run through
-- planned.
-- name: KeyForget :execrows
DELETE FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key;
