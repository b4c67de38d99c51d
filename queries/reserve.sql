-- The reservation mode (reserve.go, reconcile.go). Every lease is decided by
-- the database clock: now(), the start of the statement's transaction.
-- Fencing tokens come from idem_keys_token_seq and never repeat.
--
-- A key reserved with a window (ReserveOptions.ResumeWithin) keeps its end
-- in resume_until (migration 6): while it lasts, an attempt whose lease ran
-- out, or that its worker marked unknown, is resumed by the next Reserve
-- rather than left for a person. "Needs a person" below is the complement:
-- no window (resume_until IS NULL), or one that has ended.

-- Reserves a free key: a 'processing' row with a lease and a new token, and
-- the window of the key's generation (none when resume_micros is 0). No row
-- means a row holds the key (ReserveLock reads it). While another transaction
-- holds an uncommitted claim on the key, the INSERT waits for it, at most the
-- lock_timeout that Reserve set for its transaction. It names unknown_at
-- (NULL, as the column's default would be) so that on a database below
-- migration 10 Reserve fails (ErrUnsupported) before its caller's work runs.
-- name: ReserveInsert :one
INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, token,
                       lease_expires_at, expires_at, resume_until, unknown_at)
VALUES (@actor, @operation, @idem_key, @fingerprint, 'processing',
        nextval('idem_keys_token_seq'),
        now() + (sqlc.arg(lease_micros)::bigint * interval '1 microsecond'),
        now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'),
        now() + (nullif(sqlc.arg(resume_micros)::bigint, 0) * interval '1 microsecond'),
        NULL)
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING token, lease_expires_at;

-- Locks and reads the row that holds a key, with what the database clock
-- says of its TTL, lease and window (the columns KeyGet reads, for judge,
-- and whether a window lasts).
-- name: ReserveLock :one
SELECT sqlc.embed(idem_keys),
       (expires_at <= now())::boolean AS expired,
       (lease_expires_at IS NOT NULL)::boolean AS leased,
       coalesce(ceil(extract(epoch FROM lease_expires_at - now()) * 1000)::bigint, 0)::bigint AS lease_left_ms,
       coalesce(resume_until > now(), false)::boolean AS in_window,
       ((status IN ('succeeded', 'rejected') AND response_status IS NOT NULL AND response_body IS NULL)
        OR coalesce(body_expires_at <= now(), false))::boolean AS body_gone
FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
FOR UPDATE;

-- Hands the row ReserveLock read (identified by its token) to a new owner: a
-- new request after the TTL (new_window: the new generation's window, none
-- when resume_micros is 0), a new attempt after a retryable failure, or a
-- resume of an attempt in doubt inside its window (resume: the lease ends
-- no later than the window). Only a new generation sets the window; the
-- other two keep it. The new attempt is not unknown (unknown_at cleared).
-- The new token is drawn in a CTE, not in SET: Citus
-- refuses a volatile function in an UPDATE of a distributed table, and runs
-- the CTE on the coordinator, whose sequence it is.
-- name: ReserveAcquire :one
WITH next AS (SELECT nextval('idem_keys_token_seq') AS token)
UPDATE idem_keys
SET fingerprint      = @fingerprint,
    status           = 'processing',
    response_status  = NULL,
    response_headers = NULL,
    response_body    = NULL,
    body_expires_at  = NULL,
    created_at       = now(),
    completed_at     = NULL,
    expires_at       = now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'),
    token            = (SELECT next.token FROM next),
    lease_expires_at = CASE WHEN sqlc.arg(resume)::boolean
                            THEN least(now() + (sqlc.arg(lease_micros)::bigint * interval '1 microsecond'), resume_until)
                            ELSE now() + (sqlc.arg(lease_micros)::bigint * interval '1 microsecond') END,
    resume_until     = CASE WHEN sqlc.arg(new_window)::boolean
                            THEN now() + (nullif(sqlc.arg(resume_micros)::bigint, 0) * interval '1 microsecond')
                            ELSE resume_until END,
    last_error       = NULL,
    resolve_reason   = NULL,
    unknown_at       = NULL
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND idem_keys.token = @token
RETURNING idem_keys.token, lease_expires_at;

-- Stores the outcome of a reservation, in the caller's transaction. Like
-- every statement that finishes a record (FailRetryable, Resolve), it keeps
-- the outcome for a TTL from now: a record finished after its TTL (a long
-- lease, a late reconciliation) must still be replayed, never run again.
-- name: ReserveComplete :execrows
UPDATE idem_keys
SET status           = 'succeeded',
    response_status  = sqlc.arg(response_status)::integer,
    response_headers = sqlc.narg(response_headers)::text::jsonb,
    response_body    = @response_body,
    expires_at       = greatest(expires_at, now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond')),
    completed_at     = now()
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND token = @token AND status = 'processing';

-- Records that a reservation certainly did not execute: the key may run again.
-- name: ReserveFailRetryable :execrows
UPDATE idem_keys
SET status       = 'failed_retryable',
    last_error   = sqlc.arg(reason)::text,
    expires_at   = greatest(expires_at, now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond')),
    completed_at = now()
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND token = @token AND status = 'processing';

-- Records that a reservation may have executed. The same token may mark its
-- record unknown again (a repeated call, or the lease ran out first): the
-- record keeps the time it first became unknown (least ignores the NULL of
-- a record that was not; Citus refuses now() inside coalesce or CASE in a
-- distributed UPDATE, not inside least).
-- name: ReserveMarkUnknown :execrows
UPDATE idem_keys
SET status     = 'unknown',
    last_error = sqlc.arg(reason)::text,
    unknown_at = least(unknown_at, now())
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND token = @token AND status IN ('processing', 'unknown');

-- Extends a live lease; never shortens it. A resumed attempt's lease
-- (resumed) never passes the window (least ignores the NULL of the others).
-- name: ReserveHeartbeat :one
UPDATE idem_keys
SET lease_expires_at = greatest(lease_expires_at,
                                least(now() + (sqlc.arg(extend_micros)::bigint * interval '1 microsecond'),
                                      CASE WHEN sqlc.arg(resumed)::boolean THEN resume_until END))
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND token = @token AND status = 'processing' AND lease_expires_at > now()
RETURNING lease_expires_at;

-- Turns at most @max_rows reservations whose lease ran out, and that need a
-- person (no window, or one that ended), into 'unknown', oldest attempt
-- first: inside its window a lapsed attempt stays 'processing' for a
-- recovery worker (ReserveListResumable) or the next Reserve. Rows another
-- worker has locked are skipped, so several workers can run it at once. It
-- walks idem_keys_open_created_idx in its order (its WHERE repeats the index
-- predicate: open reservations, a lease and no outcome), passing the leases
-- that have not run out: the table has no index of leases, which every
-- claim of Do would pay for (migration 00012).
-- name: ReserveExpireLeases :execrows
UPDATE idem_keys AS k
SET status     = 'unknown',
    last_error = sqlc.arg(reason)::text,
    unknown_at = now()
FROM (SELECT actor, operation, idem_key
      FROM idem_keys
      WHERE status = 'processing' AND lease_expires_at IS NOT NULL AND completed_at IS NULL
        AND lease_expires_at <= now()
        AND (resume_until IS NULL OR resume_until <= now())
      ORDER BY created_at, actor, operation, idem_key
      LIMIT @max_rows
      FOR UPDATE SKIP LOCKED) AS expired
WHERE k.actor = expired.actor AND k.operation = expired.operation AND k.idem_key = expired.idem_key
  AND k.status = 'processing';

-- ReserveExpireLeases for Citus, which refuses FOR UPDATE in a query over a
-- distributed table (see KeyPruneCitus). Without SKIP LOCKED the
-- conditions are checked again on the row the UPDATE locks: a lease
-- extended, or a record completed, by a transaction that committed while
-- this one waited for its lock stays as it is. Concurrent workers wait for
-- each other's batches.
-- name: ReserveExpireLeasesCitus :execrows
UPDATE idem_keys AS k
SET status     = 'unknown',
    last_error = sqlc.arg(reason)::text,
    unknown_at = now()
FROM (SELECT actor, operation, idem_key
      FROM idem_keys
      WHERE status = 'processing' AND lease_expires_at IS NOT NULL AND completed_at IS NULL
        AND lease_expires_at <= now()
        AND (resume_until IS NULL OR resume_until <= now())
      ORDER BY created_at, actor, operation, idem_key
      LIMIT @max_rows) AS expired
WHERE k.actor = expired.actor AND k.operation = expired.operation AND k.idem_key = expired.idem_key
  AND k.status = 'processing' AND k.lease_expires_at <= now()
  AND (k.resume_until IS NULL OR k.resume_until <= now());

-- Pages through the records in doubt that need a person (no window, or one
-- that ended): 'unknown', and 'processing' whose lease ran out (a crashed
-- worker's, which ExpireLeases would mark unknown: listed without waiting
-- for it), oldest first, after the given position ('-infinity' and the
-- empty names for the first page). It walks idem_keys_open_created_idx: its
-- WHERE repeats the index predicate (open reservations: a lease, no
-- outcome).
-- name: ReserveListUnknown :many
SELECT *
FROM idem_keys
WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
  AND (status = 'unknown' OR (status = 'processing' AND lease_expires_at <= now()))
  AND (resume_until IS NULL OR resume_until <= now())
  AND (created_at, actor, operation, idem_key)
      > (sqlc.arg(after_created_at)::timestamptz, sqlc.arg(after_actor)::text,
         sqlc.arg(after_operation)::text, sqlc.arg(after_key)::text)
ORDER BY created_at, actor, operation, idem_key
LIMIT @max_rows;

-- Pages through the attempts a recovery worker re-drives: in doubt (the
-- lease ran out, or the worker marked it unknown) inside their window,
-- oldest first, after the given position (as ReserveListUnknown). It walks
-- idem_keys_open_created_idx, as ReserveListUnknown does.
-- name: ReserveListResumable :many
SELECT *
FROM idem_keys
WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
  AND resume_until > now()
  AND (status = 'unknown' OR (status = 'processing' AND lease_expires_at <= now()))
  AND (created_at, actor, operation, idem_key)
      > (sqlc.arg(after_created_at)::timestamptz, sqlc.arg(after_actor)::text,
         sqlc.arg(after_operation)::text, sqlc.arg(after_key)::text)
ORDER BY created_at, actor, operation, idem_key
LIMIT @max_rows;

-- Reconciles the row ReserveLock read (identified by its token, the one the
-- operator named): 'succeeded' with the response found at the provider, or
-- 'failed_retryable'. The token advances, so the reservation that held the
-- key is fenced. last_error keeps why the record failed or became unknown;
-- the operator's reason goes beside it. The response found lives as long
-- as the key, as a reservation's does: body_expires_at is cleared (a
-- record that a claim of Do or DoInTx left without an outcome was marked
-- unknown with its claim's body time until 2026-12-06, and a response
-- resolved there was gone at once). (The new token is drawn in a CTE: see
-- ReserveAcquire.)
-- name: ReserveResolve :execrows
WITH next AS (SELECT nextval('idem_keys_token_seq') AS token)
UPDATE idem_keys
SET status           = @status,
    response_status  = sqlc.narg(response_status),
    response_headers = sqlc.narg(response_headers)::text::jsonb,
    response_body    = sqlc.narg(response_body),
    body_expires_at  = NULL,
    completed_at     = now(),
    expires_at       = greatest(expires_at, now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond')),
    token            = (SELECT next.token FROM next),
    resolve_reason   = sqlc.arg(reason)::text
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND idem_keys.token = @token;
