-- The operator's console (package idemui) and the audit trail
-- (internal/audit). Every page's statement walks an index or a sample of
-- idem_keys, never the whole table: the open reservations through
-- idem_keys_open_created_idx (their WHERE repeats the index's predicate: a
-- lease, no outcome), one scope through
-- the primary key, the statuses and the last 24 hours through a
-- TABLESAMPLE of a bounded number of pages. The console runs them with
-- enable_seqscan off for its transaction and plans each with its values
-- (no generic plan).
--
-- "Needs a person": an 'unknown' record, or a 'processing' reservation
-- whose lease ran out before it recorded an outcome (not yet turned
-- unknown), without a window or past it (resume_until IS NULL OR
-- resume_until <= now(), where the statements below say "needs a
-- person"; ConsoleExpireLeases evaluates it at its cutoff instead). The
-- same attempts inside their window (ReserveOptions.
-- ResumeWithin) are "resuming": a recovery worker's or the next Reserve's,
-- not a person's.

-- Pages through the records that need a person, oldest first (by
-- created_at, then scope and key), after the given position ('-infinity'
-- and empty names for the first page), filtered: an empty actor,
-- operation or error text matches every record; min_age_micros 0 every
-- age. The error text is matched as a substring of last_error, ignoring
-- case (no pattern characters).
-- name: ConsoleNeedsPerson :many
SELECT actor, operation, idem_key, status, token, created_at, lease_expires_at, last_error,
       (status = 'processing')::boolean AS lease_ran_out
FROM idem_keys
WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
  -- needs a person
  AND (status = 'unknown' OR (status = 'processing' AND lease_expires_at <= now()))
  AND (resume_until IS NULL OR resume_until <= now())
  AND (sqlc.arg(actor)::text = '' OR actor = sqlc.arg(actor)::text)
  AND (sqlc.arg(operation)::text = '' OR operation = sqlc.arg(operation)::text)
  AND created_at <= now() - (sqlc.arg(min_age_micros)::bigint * interval '1 microsecond')
  AND (sqlc.arg(error_text)::text = ''
       OR strpos(lower(coalesce(last_error, '')), lower(sqlc.arg(error_text)::text)) > 0)
  -- the state: '' any, 'unknown' the unknown outcomes, 'lapsed' the leases that ran out
  AND (sqlc.arg(state)::text = '' OR (sqlc.arg(state)::text = 'unknown') = (status = 'unknown'))
  AND (created_at, actor, operation, idem_key)
      > (sqlc.arg(after_created_at)::timestamptz, sqlc.arg(after_actor)::text,
         sqlc.arg(after_operation)::text, sqlc.arg(after_key)::text)
ORDER BY created_at, actor, operation, idem_key
LIMIT sqlc.arg(max_rows)::integer;

-- The same list, newest first, before the given position ('infinity' and
-- empty names for the first page): the index walked backwards.
-- name: ConsoleNeedsPersonNewest :many
SELECT actor, operation, idem_key, status, token, created_at, lease_expires_at, last_error,
       (status = 'processing')::boolean AS lease_ran_out
FROM idem_keys
WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
  -- needs a person
  AND (status = 'unknown' OR (status = 'processing' AND lease_expires_at <= now()))
  AND (resume_until IS NULL OR resume_until <= now())
  AND (sqlc.arg(actor)::text = '' OR actor = sqlc.arg(actor)::text)
  AND (sqlc.arg(operation)::text = '' OR operation = sqlc.arg(operation)::text)
  AND created_at <= now() - (sqlc.arg(min_age_micros)::bigint * interval '1 microsecond')
  AND (sqlc.arg(error_text)::text = ''
       OR strpos(lower(coalesce(last_error, '')), lower(sqlc.arg(error_text)::text)) > 0)
  -- the state: '' any, 'unknown' the unknown outcomes, 'lapsed' the leases that ran out
  AND (sqlc.arg(state)::text = '' OR (sqlc.arg(state)::text = 'unknown') = (status = 'unknown'))
  AND (created_at, actor, operation, idem_key)
      < (sqlc.arg(before_created_at)::timestamptz, sqlc.arg(before_actor)::text,
         sqlc.arg(before_operation)::text, sqlc.arg(before_key)::text)
ORDER BY created_at DESC, actor DESC, operation DESC, idem_key DESC
LIMIT sqlc.arg(max_rows)::integer;

-- Counts the records that need a person under the same filter, up to
-- @cap_rows (a count of @cap_rows means at least that many).
-- name: ConsoleNeedsPersonCount :one
SELECT count(*)::bigint FROM (
    SELECT 1
    FROM idem_keys
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
      -- needs a person
      AND (status = 'unknown' OR (status = 'processing' AND lease_expires_at <= now()))
      AND (resume_until IS NULL OR resume_until <= now())
      AND (sqlc.arg(actor)::text = '' OR actor = sqlc.arg(actor)::text)
      AND (sqlc.arg(operation)::text = '' OR operation = sqlc.arg(operation)::text)
      AND created_at <= now() - (sqlc.arg(min_age_micros)::bigint * interval '1 microsecond')
      AND (sqlc.arg(error_text)::text = ''
           OR strpos(lower(coalesce(last_error, '')), lower(sqlc.arg(error_text)::text)) > 0)
      -- the state: '' any, 'unknown' the unknown outcomes, 'lapsed' the leases that ran out
      AND (sqlc.arg(state)::text = '' OR (sqlc.arg(state)::text = 'unknown') = (status = 'unknown'))
    LIMIT sqlc.arg(cap_rows)::integer) AS matched;

-- Counts the reservations whose lease ran out (still 'processing') that
-- the filter matches, exactly, and returns the database time of the count,
-- against which every condition on time is evaluated (the lease, the
-- window, the age): ConsoleExpireLeases with that cutoff evaluates them
-- against the same instant, so it acts on these and no others.
-- name: ConsoleExpirableCount :one
SELECT count(*)::bigint AS leases, now()::timestamptz AS cutoff
FROM idem_keys
WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
  AND status = 'processing' AND lease_expires_at <= now()
  -- needs a person
  AND (resume_until IS NULL OR resume_until <= now())
  AND (sqlc.arg(actor)::text = '' OR actor = sqlc.arg(actor)::text)
  AND (sqlc.arg(operation)::text = '' OR operation = sqlc.arg(operation)::text)
  AND created_at <= now() - (sqlc.arg(min_age_micros)::bigint * interval '1 microsecond')
  AND (sqlc.arg(error_text)::text = ''
       OR strpos(lower(coalesce(last_error, '')), lower(sqlc.arg(error_text)::text)) > 0);

-- Turns the reservations that the filter matched at the instant
-- least(@cutoff, now()) into 'unknown': the transition of
-- ReserveExpireLeases (the same SET, the token kept, so the worker that
-- held the lease is fenced). Every condition on time is evaluated against
-- that instant, not against now: the lease ran out by then, the window (if
-- any) had ended by then, the attempt was at least min_age old by then.
-- Rows locked by another transaction are waited for, and the conditions are
-- checked again on the row as it is then: a record completed, or a lease
-- extended, meanwhile stays as it is. With the cutoff of
-- ConsoleExpirableCount it acts on at most the rows counted (a lease that
-- runs out, a window that ends or an attempt that ages past the filter
-- after the count is past the cutoff; a lease that ran out cannot be
-- extended). Returns each record it changed, for its own audit row.
-- name: ConsoleExpireLeases :many
UPDATE idem_keys
SET status     = 'unknown',
    last_error = sqlc.arg(reason)::text,
    unknown_at = now()
WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
  AND status = 'processing'
  AND lease_expires_at <= least(sqlc.arg(cutoff)::timestamptz, now())
  -- needs a person, at the cutoff
  AND (resume_until IS NULL OR resume_until <= least(sqlc.arg(cutoff)::timestamptz, now()))
  AND (sqlc.arg(actor)::text = '' OR actor = sqlc.arg(actor)::text)
  AND (sqlc.arg(operation)::text = '' OR operation = sqlc.arg(operation)::text)
  AND created_at <= least(sqlc.arg(cutoff)::timestamptz, now())
                    - (sqlc.arg(min_age_micros)::bigint * interval '1 microsecond')
  AND (sqlc.arg(error_text)::text = ''
       OR strpos(lower(coalesce(last_error, '')), lower(sqlc.arg(error_text)::text)) > 0)
RETURNING actor, operation, idem_key, token, lease_expires_at;

-- The open reservations, oldest first, up to @cap_rows of them: counts by
-- kind and the oldest of each. The oldest are exact whatever the cap (the
-- walk starts with them); the counts are exact below the cap. lease_ran_out
-- and unknown count what needs a person; resuming what is in doubt inside
-- its window (resuming_unknown: those marked unknown).
-- name: ConsoleOpen :one
SELECT count(*)::bigint AS scanned,
       count(*) FILTER (WHERE status = 'processing' AND lease_expires_at > now())::bigint AS in_flight,
       count(*) FILTER (WHERE status = 'processing' AND lease_expires_at <= now() AND NOT in_window)::bigint AS lease_ran_out,
       count(*) FILTER (WHERE status = 'unknown' AND NOT in_window)::bigint AS unknown,
       count(*) FILTER (WHERE (status = 'unknown' OR (status = 'processing' AND lease_expires_at <= now()))
                        AND in_window)::bigint AS resuming,
       count(*) FILTER (WHERE status = 'unknown' AND in_window)::bigint AS resuming_unknown,
       min(created_at) FILTER (WHERE status = 'processing' AND lease_expires_at > now())::timestamptz AS oldest_in_flight,
       min(created_at) FILTER (WHERE (status = 'unknown' OR (status = 'processing' AND lease_expires_at <= now()))
                               AND NOT in_window)::timestamptz AS oldest_needs_person,
       now()::timestamptz AS now
FROM (SELECT status, lease_expires_at, created_at, coalesce(resume_until > now(), false) AS in_window
      FROM idem_keys
      WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
      ORDER BY created_at
      LIMIT sqlc.arg(cap_rows)::integer) AS open;

-- The size of idem_keys on disk (the table with its TOAST data, and its
-- indexes) and its pages now.
-- name: ConsoleTableSize :one
SELECT pg_table_size('idem_keys')::bigint AS table_bytes,
       pg_indexes_size('idem_keys')::bigint AS index_bytes,
       (pg_relation_size('idem_keys') / current_setting('block_size')::bigint)::bigint AS pages;

-- Counts the rows of a sample of idem_keys (SYSTEM: whole pages, each with
-- probability @percent / 100; REPEATABLE: the same pages each time while the
-- table keeps them, so that the page stays in the cache and the counts do not
-- jump between two views) by status and by the hour, counted back from
-- now, of their outcome (completed_at; for an unknown outcome the time it
-- became unknown, or created_at when that was not recorded, before
-- migration 10): hours_ago 0 to 23, or -1 for older ones and records in
-- flight.
-- name: ConsoleSample :many
SELECT status,
       (CASE WHEN status <> 'processing'
                  AND coalesce(completed_at, unknown_at, created_at) > now() - interval '24 hours'
                  AND coalesce(completed_at, unknown_at, created_at) <= now()
             THEN floor(date_part('epoch', now() - coalesce(completed_at, unknown_at, created_at)) / 3600)
             ELSE -1 END)::integer AS hours_ago,
       count(*)::bigint AS keys
FROM idem_keys TABLESAMPLE SYSTEM (sqlc.arg(percent)::float8) REPEATABLE (0)
GROUP BY 1, 2;

-- Pages through the keys of one actor (and one operation when given), in
-- key order, after the given position: a walk of the primary key.
-- name: ConsoleScopeKeys :many
SELECT actor, operation, idem_key, status, token, created_at, completed_at, expires_at,
       lease_expires_at, last_error
FROM idem_keys
WHERE actor = sqlc.arg(actor)::text
  AND (sqlc.arg(operation)::text = '' OR operation = sqlc.arg(operation)::text)
  AND (operation, idem_key) > (sqlc.arg(after_operation)::text, sqlc.arg(after_key)::text)
ORDER BY actor, operation, idem_key
LIMIT sqlc.arg(max_rows)::integer;

-- Locks the record of a key and reads its status and token, waiting for a
-- transaction that holds it (at most the lock_timeout of the change's
-- transaction), for a verdict or a forget.
-- name: AuditLockKey :one
SELECT status, token, created_at
FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
FOR UPDATE;

-- Writes a row of the trail in the transaction of the change it records.
-- name: AuditInsert :one
INSERT INTO idem_audit (actor, operator, action, operation, idem_key, token_before, token_after,
                        status_before, status_after, verdict, reason, changed, detail)
VALUES (@actor, @operator, @action, @operation, @idem_key, sqlc.narg(token_before), sqlc.narg(token_after),
        sqlc.narg(status_before), sqlc.narg(status_after), sqlc.narg(verdict), @reason, @changed,
        sqlc.narg(detail)::text::jsonb)
RETURNING id, acted_at;

-- Writes one row of the trail for each record a bulk action changed, in
-- the transaction of the change: @records is a JSON array of objects
-- {actor, operation, idem_key, token, detail}, one a record.
-- name: AuditInsertEach :execrows
INSERT INTO idem_audit (actor, operator, action, operation, idem_key, token_before, token_after,
                        status_before, status_after, reason, changed, detail)
SELECT r.actor, @operator, @action, r.operation, r.idem_key, r.token, r.token,
       @status_before::text, @status_after::text, @reason, 1, r.detail
FROM jsonb_to_recordset(sqlc.arg(records)::text::jsonb)
     AS r(actor text, operation text, idem_key text, token bigint, detail jsonb);

-- Pages through the trail, newest first, before the given position
-- ('infinity' for the first page), filtered: an empty value matches every
-- row; operator_prefix keeps the operators whose name starts with it;
-- from_at and to_at keep the rows acted at from_at (included) to to_at
-- (excluded), '-infinity' and 'infinity' for no bound.
-- name: AuditList :many
SELECT id, acted_at, operator, action, actor, operation, idem_key, token_before, token_after,
       status_before, status_after, verdict, reason, changed, coalesce(detail::text, '')::text AS detail
FROM idem_audit
WHERE (sqlc.arg(operator)::text = '' OR operator = sqlc.arg(operator)::text)
  AND (sqlc.arg(action)::text = '' OR action = sqlc.arg(action)::text)
  AND (sqlc.arg(actor)::text = '' OR actor = sqlc.arg(actor)::text)
  AND (sqlc.arg(operation)::text = '' OR operation = sqlc.arg(operation)::text)
  AND (sqlc.arg(idem_key)::text = '' OR idem_key = sqlc.arg(idem_key)::text)
  AND (sqlc.arg(operator_prefix)::text = '' OR starts_with(operator, sqlc.arg(operator_prefix)::text))
  AND acted_at >= sqlc.arg(from_at)::timestamptz AND acted_at < sqlc.arg(to_at)::timestamptz
  AND (acted_at, id) < (sqlc.arg(before_acted_at)::timestamptz, sqlc.arg(before_id)::bigint)
ORDER BY acted_at DESC, id DESC
LIMIT sqlc.arg(max_rows)::integer;

-- The shape of an answer of one operation: the status and content type of
-- a succeeded record among the first 200 keys of the scope (a walk of the
-- primary key), which a verdict's form offers as its default.
-- name: ConsoleScopeShape :many
SELECT response_status::integer AS status,
       coalesce(response_headers->'Content-Type'->>0, '')::text AS content_type
FROM (SELECT status, response_status, response_headers
      FROM idem_keys
      WHERE actor = sqlc.arg(actor)::text AND operation = sqlc.arg(operation)::text
      ORDER BY actor, operation, idem_key
      LIMIT 200) AS first_keys
WHERE status = 'succeeded' AND response_status BETWEEN 200 AND 599
LIMIT 1;

-- The records that needed a person at the instant least(@cutoff, now())
-- and that the filter matches, oldest first, up to @max_rows: what a bulk
-- verdict "over the filter" acts on, each with its token now. Every
-- condition on time is evaluated at that instant, as ConsoleExpireLeases
-- does: a record whose attempt started after the count, or whose lease ran
-- out or window ended after it, is not the count's. Nor is one that became
-- unknown after the count (unknown_at) while its lease still ran then: a
-- record whose lease had run out by then was the count's, however it became
-- unknown since; one that became unknown before migration 10 (no
-- unknown_at) did before any count made since.
-- name: ConsoleNeedsPersonAt :many
SELECT actor, operation, idem_key, token
FROM idem_keys
WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL
  -- needs a person, at the cutoff
  AND ((status = 'unknown' AND (unknown_at IS NULL OR unknown_at <= least(sqlc.arg(cutoff)::timestamptz, now())
                                OR lease_expires_at <= least(sqlc.arg(cutoff)::timestamptz, now())))
       OR (status = 'processing' AND lease_expires_at <= least(sqlc.arg(cutoff)::timestamptz, now())))
  AND (resume_until IS NULL OR resume_until <= least(sqlc.arg(cutoff)::timestamptz, now()))
  AND (sqlc.arg(actor)::text = '' OR actor = sqlc.arg(actor)::text)
  AND (sqlc.arg(operation)::text = '' OR operation = sqlc.arg(operation)::text)
  AND created_at <= least(sqlc.arg(cutoff)::timestamptz, now())
                    - (sqlc.arg(min_age_micros)::bigint * interval '1 microsecond')
  AND (sqlc.arg(error_text)::text = ''
       OR strpos(lower(coalesce(last_error, '')), lower(sqlc.arg(error_text)::text)) > 0)
  -- the state: '' any, 'unknown' the unknown outcomes, 'lapsed' the leases that ran out
  AND (sqlc.arg(state)::text = '' OR (sqlc.arg(state)::text = 'unknown') = (status = 'unknown'))
ORDER BY created_at, actor, operation, idem_key
LIMIT sqlc.arg(max_rows)::integer;

-- The database time now: the instant of a count made in the same
-- transaction.
-- name: ConsoleNow :one
SELECT now()::timestamptz AS now;

-- Pages through the records of one status across actors, the latest
-- expiry first (about the newest keys first), before the given position
-- ('infinity' and empty names for the first page): a walk of
-- idem_keys_expires_at_idx backwards (ties on expires_at in key order, an
-- incremental sort of each tie) that reads at most @scan_rows rows, so that a
-- page of a rare status costs no more than one of a common one. The walk
-- follows the order rows were written, so its heap reads are close together.
-- Returns, in walk order, up to @max_rows records of the status (match) and
-- the last row read (edge, with walked_rows, how many were read: fewer than
-- @scan_rows when the walk reached the end of the table); a row can be both.
-- The windows follow the walk's order, so nothing is sorted again (a Sort,
-- which the console turns off, would cost a JIT compilation).
-- name: ConsoleStatusKeys :many
SELECT actor, operation, idem_key, status, token, created_at, completed_at, expires_at,
       lease_expires_at, last_error,
       (status = sqlc.arg(status)::text AND matched <= sqlc.arg(max_rows)::integer)::boolean AS match,
       (n = walked_rows)::boolean AS edge, walked_rows::bigint AS walked_rows
FROM (SELECT w.*, count(*) FILTER (WHERE status = sqlc.arg(status)::text) OVER walk AS matched,
             row_number() OVER walk AS n, count(*) OVER () AS walked_rows
      FROM (SELECT actor, operation, idem_key, status, token, created_at, completed_at, expires_at,
                   lease_expires_at, last_error
            FROM idem_keys
            WHERE expires_at <= sqlc.arg(before_expires_at)::timestamptz
              AND (expires_at < sqlc.arg(before_expires_at)::timestamptz
                   OR (actor, operation, idem_key) < (sqlc.arg(before_actor)::text, sqlc.arg(before_operation)::text,
                                                      sqlc.arg(before_key)::text))
            ORDER BY expires_at DESC, actor DESC, operation DESC, idem_key DESC
            LIMIT sqlc.arg(scan_rows)::integer) AS w
      WINDOW walk AS (ORDER BY expires_at DESC, actor DESC, operation DESC, idem_key DESC
                      ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)) AS walked
WHERE (status = sqlc.arg(status)::text AND matched <= sqlc.arg(max_rows)::integer) OR n = walked_rows
ORDER BY expires_at DESC, actor DESC, operation DESC, idem_key DESC;

-- Pages through the failed_retryable records across actors, newest outcome
-- first, before the given position ('infinity' and empty names for the
-- first page): a walk of idem_keys_failed_idx backwards (its WHERE repeats
-- the index predicate).
-- name: ConsoleFailedKeys :many
SELECT actor, operation, idem_key, status, token, created_at, completed_at, expires_at,
       lease_expires_at, last_error
FROM idem_keys
WHERE lease_expires_at IS NOT NULL AND completed_at IS NOT NULL
  AND (last_error IS NOT NULL OR resolve_reason IS NOT NULL)
  AND status = 'failed_retryable'
  AND (completed_at, actor, operation, idem_key)
      < (sqlc.arg(before_completed_at)::timestamptz, sqlc.arg(before_actor)::text,
         sqlc.arg(before_operation)::text, sqlc.arg(before_key)::text)
ORDER BY completed_at DESC, actor DESC, operation DESC, idem_key DESC
LIMIT sqlc.arg(max_rows)::integer;

-- The actors whose name starts with @prefix (byte for byte, whatever the
-- database's collation), after the given actor ('' for the first page): a
-- loose walk of the primary key that hops from each actor to the next one,
-- at most @scan_actors hops, so that a page costs as many index descents
-- as actors it passes, never a read of their keys. A range of the
-- collation's order would not do: under a collation other than C, names
-- that start alike need not sort together. Returns the matching actors
-- and, when the walk stopped at its bound, the last actor it reached (n =
-- @scan_actors), each with its place in the walk (n: the caller orders by
-- it; an ORDER BY here would be a Sort, which the console turns off).
-- name: ConsoleActorsByPrefix :many
WITH RECURSIVE actors AS (
    (SELECT actor, 1::integer AS n
     FROM idem_keys
     WHERE actor > sqlc.arg(after_actor)::text
     ORDER BY actor
     LIMIT 1)
    UNION ALL
    SELECT (SELECT k.actor FROM idem_keys AS k WHERE k.actor > a.actor ORDER BY k.actor LIMIT 1), a.n + 1
    FROM actors AS a
    WHERE a.actor IS NOT NULL AND a.n < sqlc.arg(scan_actors)::integer
)
SELECT actor::text AS actor, n::integer AS n, starts_with(actor, sqlc.arg(prefix)::text)::boolean AS match
FROM actors
WHERE actor IS NOT NULL
  AND (starts_with(actor, sqlc.arg(prefix)::text) OR n = sqlc.arg(scan_actors)::integer);
