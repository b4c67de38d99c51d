-- Claims a key for the calling transaction. The primary key picks a single
-- winner: while another transaction holds an uncommitted claim on the same key
-- this statement waits (bounded by lock_timeout) for it to finish. It returns
-- no row when a committed row already holds the key.
-- name: KeyClaim :one
INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, expires_at)
VALUES (@actor, @operation, @idem_key, @fingerprint, 'processing',
        now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'))
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING expires_at;

-- Reads the row that holds a key, and whether it has expired.
-- name: KeyGet :one
SELECT fingerprint, status, response_status, response_headers, response_body,
       expires_at <= now() AS expired
FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key;

-- Claims a key whose row has expired: an expired key is a new request. Returns
-- no row when the row is gone or no longer expired (another transaction took it
-- over first).
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
