-- The outbox (idem_events, migration 7): Publish writes an event in the
-- caller's transaction, a Relay claims due events, sends them outside any
-- transaction and records each attempt, guarded by the claim's token.
-- Header arguments go as text (::text::jsonb), as for database/sql.

-- Writes an event and wakes the relays that listen (pg_notify: delivered
-- when the caller's transaction commits, the notifications of one
-- transaction folded into one), in one round trip. A second write of the
-- same (destination, id) inserts nothing (inserted is false) and EventSame
-- tells whether it was the same event.
-- name: EventPublish :one
WITH ins AS (
    INSERT INTO idem_events (destination, id, topic, payload, header)
    VALUES (sqlc.arg(destination)::text, sqlc.arg(id)::text, sqlc.arg(topic)::text, sqlc.arg(payload)::bytea,
            sqlc.narg(header)::text::jsonb)
    ON CONFLICT (destination, id) DO NOTHING
    RETURNING 1
)
SELECT (EXISTS (SELECT 1 FROM ins) AND pg_notify('idem_events', '')::text IS NOT NULL)::boolean AS inserted;

-- Whether the stored event (destination, id) has this topic, payload and
-- header. No row: it is gone (pruned between the insert and this read).
-- name: EventSame :one
SELECT (topic = sqlc.arg(topic)::text AND payload = sqlc.arg(payload)::bytea
        AND header IS NOT DISTINCT FROM sqlc.narg(header)::text::jsonb)::boolean AS same
FROM idem_events
WHERE destination = sqlc.arg(destination)::text AND id = sqlc.arg(id)::text;

-- Claims up to @max_rows due pending events, earliest first, without
-- waiting for events another relay is claiming (SKIP LOCKED), and skipping
-- the events under a lease: each gets one more attempt, a new claim token,
-- and lease_until at the end of the lease, so no relay claims it again
-- before the lease runs out. It writes no indexed column (next_attempt_at
-- stays): a HOT update. The due scan walks idem_events_due_idx; the update
-- finds the locked rows by their ctid (a TID scan: never a scan of the
-- table, however the planner weighs a join).
-- name: EventClaim :many
UPDATE idem_events AS e
SET attempts = e.attempts + 1,
    claim = e.claim + 1,
    lease_until = now() + sqlc.arg(lease_micros)::bigint * interval '1 microsecond'
WHERE e.ctid = ANY (ARRAY(
        SELECT ctid
        FROM idem_events
        WHERE status = 'pending' AND next_attempt_at <= now() AND (lease_until IS NULL OR lease_until <= now())
        ORDER BY next_attempt_at
        LIMIT sqlc.arg(max_rows)::integer
        FOR UPDATE SKIP LOCKED))
RETURNING e.destination, e.id, e.topic, e.payload, coalesce(e.header::text, '')::text AS header, e.attempts, e.retry_from, e.claim,
          e.ctid::text AS row_version;

-- The fast path's claim (Relay: senders that answer within fastBound):
-- locks up to @max_rows due pending events, earliest first, in the relay's
-- transaction, without writing them; the same transaction records their
-- attempts (EventRecord) or, for the sends still running after the bound,
-- writes their leases (EventLeaseLocked), then commits. Returns the next
-- attempt's number. Other relays skip the locked events (SKIP LOCKED) as
-- they skip leased ones.
-- name: EventLock :many
SELECT destination, id, topic, payload, coalesce(header::text, '')::text AS header, attempts + 1 AS attempts, retry_from, claim,
       ctid::text AS row_version
FROM idem_events
WHERE status = 'pending' AND next_attempt_at <= now() AND (lease_until IS NULL OR lease_until <= now())
ORDER BY next_attempt_at
LIMIT sqlc.arg(max_rows)::integer
FOR UPDATE SKIP LOCKED;

-- EventLock again in the same transaction, for the batch a relay locks
-- while the previous batch's sends run (Relay's fastCycle): a transaction
-- does not skip the rows it locked itself, so the previous batch's events
-- (@skip, their row versions, still pending until recorded) are left out.
-- name: EventLockAhead :many
SELECT destination, id, topic, payload, coalesce(header::text, '')::text AS header, attempts + 1 AS attempts, retry_from, claim,
       ctid::text AS row_version
FROM idem_events
WHERE status = 'pending' AND next_attempt_at <= now() AND (lease_until IS NULL OR lease_until <= now())
  AND NOT (ctid = ANY (sqlc.arg(skip)::text[]::tid[]))
ORDER BY next_attempt_at
LIMIT sqlc.arg(max_rows)::integer
FOR UPDATE SKIP LOCKED;

-- Gives the events that EventLock locked, and whose sends still run, a
-- lease, as EventClaim would have (one more attempt, a new token), in the
-- transaction that locked them: when it commits, the sends go on under the
-- lease. Found by the row versions EventLock returned (a TID scan).
-- name: EventLeaseLocked :many
UPDATE idem_events
SET attempts = attempts + 1,
    claim = claim + 1,
    lease_until = now() + sqlc.arg(lease_micros)::bigint * interval '1 microsecond'
WHERE ctid = ANY (sqlc.arg(row_versions)::text[]::tid[]) AND status = 'pending'
RETURNING destination, id, claim, ctid::text AS row_version;

-- Records a batch of attempts and their events' new states, given as a
-- JSON array of objects (one per attempt: destination, id, claim, attempt,
-- started_at, duration_micros, error, permanent, and the new state: status
-- 'pending' with delay_micros, or 'delivered' / 'failed' with ttl_micros,
-- after which the event is pruned). The state is written only while the
-- event still carries the claim's token and is pending, so a newer claim,
-- RetryEvent or the pruner that came first is left as it is. A delivery
-- that is written goes into the event's row (delivered_attempt, ...); every
-- other attempt gets a row in idem_event_attempts
-- (the same attempt twice is kept once). Returns how many states were
-- written. A written state counts the attempt (attempts: a claim by
-- EventLock counts none) and moves the token on, so that no other record
-- of the same claim lands after it. Each event is found by the row version its claim returned (a
-- TID scan, never a scan of the table): a row that changed since (a newer
-- claim) is not found, which is as if its token had changed. Which
-- deliveries were not written is read from the UPDATE's own RETURNING,
-- never from the table (a NOT EXISTS over idem_events under an OR was
-- planned as a hashed scan of every pending event). An attempt is logged
-- without checking that its event still exists (only a relay stalled past
-- a delivered event's TTL could log one for a pruned event).
-- name: EventRecord :one
WITH r AS (
    SELECT x.value ->> 'destination' AS destination, x.value ->> 'id' AS id,
           (x.value ->> 'claim')::bigint AS claim, (x.value ->> 'row_version')::tid AS row_version,
           (x.value ->> 'attempt')::integer AS attempt,
           (x.value ->> 'started_at')::timestamptz AS started_at,
           (x.value ->> 'duration_micros')::bigint AS duration_micros, x.value ->> 'error' AS error,
           (x.value ->> 'permanent')::boolean AS permanent, x.value ->> 'status' AS status,
           (x.value ->> 'delay_micros')::bigint AS delay_micros, (x.value ->> 'ttl_micros')::bigint AS ttl_micros
    FROM jsonb_array_elements(sqlc.arg(attempts)::text::jsonb) AS x
), written AS (
    UPDATE idem_events AS e
    SET status = r.status,
        attempts = greatest(e.attempts, r.attempt),
        claim = e.claim + 1,
        next_attempt_at = CASE WHEN r.status = 'pending'
                               THEN now() + r.delay_micros * interval '1 microsecond'
                               ELSE e.next_attempt_at END,
        lease_until = NULL,
        delivered_at = CASE WHEN r.status = 'delivered' THEN now() END,
        failed_at = CASE WHEN r.status = 'failed' THEN now() END,
        delivered_attempt = CASE WHEN r.status = 'delivered' THEN r.attempt END,
        delivery_started_at = CASE WHEN r.status = 'delivered' THEN r.started_at END,
        delivery_micros = CASE WHEN r.status = 'delivered' THEN r.duration_micros END,
        last_error = r.error,
        expires_at = CASE WHEN r.status <> 'pending' THEN now() + r.ttl_micros * interval '1 microsecond' END
    FROM r
    WHERE e.ctid = ANY (ARRAY(SELECT row_version FROM r))
      AND e.destination = r.destination AND e.id = r.id AND e.claim = r.claim AND e.status = 'pending'
    RETURNING e.destination, e.id
), logged AS (
    INSERT INTO idem_event_attempts (destination, event_id, attempt, started_at, duration_micros, error, permanent, claim)
    SELECT r.destination, r.id, r.attempt, r.started_at, r.duration_micros, r.error, r.permanent, r.claim
    FROM r
    WHERE r.error IS NOT NULL
       OR NOT EXISTS (SELECT 1 FROM written w WHERE w.destination = r.destination AND w.id = r.id)
    ON CONFLICT DO NOTHING
)
SELECT count(*)::bigint AS written FROM written;

-- EventRecord for deliveries alone (no error: each event delivered), the
-- common case, as arrays rather than JSON (measured: a tenth of the cost of
-- a batch less than EventRecord's JSON). Same rules as EventRecord: each
-- event found by its claim's row version, written only while it carries
-- the claim's token and is pending, the attempt counted and the token moved
-- on; a delivery not written gets a row in idem_event_attempts. The row
-- versions go through ARRAY(SELECT ...), which the planner cannot weigh:
-- with them as a plain array it scans a small table rather than look up a
-- hundred row versions.
-- name: EventRecordDeliveries :one
WITH d AS (
    -- Set-returning functions side by side in a select list run in step.
    SELECT unnest(sqlc.arg(destinations)::text[]) AS destination, unnest(sqlc.arg(ids)::text[]) AS id,
           unnest(sqlc.arg(claims)::bigint[]) AS claim, unnest(sqlc.arg(row_versions)::text[]::tid[]) AS row_version,
           unnest(sqlc.arg(attempts)::integer[]) AS attempt, unnest(sqlc.arg(started_at)::timestamptz[]) AS started_at,
           unnest(sqlc.arg(duration_micros)::bigint[]) AS duration_micros
), written AS (
    UPDATE idem_events AS e
    SET status = 'delivered',
        attempts = greatest(e.attempts, d.attempt),
        claim = e.claim + 1,
        lease_until = NULL,
        delivered_at = now(),
        failed_at = NULL,
        delivered_attempt = d.attempt,
        delivery_started_at = d.started_at,
        delivery_micros = d.duration_micros,
        last_error = NULL,
        expires_at = now() + sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'
    FROM d
    WHERE e.ctid = ANY (ARRAY(SELECT row_version FROM d)) AND e.ctid = d.row_version
      AND e.destination = d.destination AND e.id = d.id AND e.claim = d.claim AND e.status = 'pending'
    RETURNING e.destination, e.id
), logged AS (
    INSERT INTO idem_event_attempts (destination, event_id, attempt, started_at, duration_micros, error, permanent, claim)
    SELECT d.destination, d.id, d.attempt, d.started_at, d.duration_micros, NULL, false, d.claim
    FROM d
    WHERE NOT EXISTS (SELECT 1 FROM written w WHERE w.destination = d.destination AND w.id = d.id)
    ON CONFLICT DO NOTHING
)
SELECT count(*)::bigint AS written FROM written;

-- The fast path's record of the deliveries of the events its own
-- transaction locked (EventLock), before its COMMIT: while the locks hold,
-- no other relay, RetryEvent or pruner can change the rows, so each is
-- found by the row version EventLock returned and written, with nothing to
-- log (no RETURNING of which were written, no attempt row). Found by a
-- TID scan of the row versions (through ARRAY(SELECT ...), as in
-- EventRecordDeliveries: joined to the arrays directly, a small table is
-- scanned whole). Should a row not be as
-- EventLock left it (not pending, another token or attempt), the statement
-- fails (idem_refuse, SQLSTATE IDMRL) and its transaction with it: the
-- relay then records the batch as when its connection breaks, with
-- EventRecordDeliveries, which logs what it cannot write.
-- name: EventRecordLocked :one
WITH d AS (
    SELECT unnest(sqlc.arg(row_versions)::text[]::tid[]) AS row_version, unnest(sqlc.arg(claims)::bigint[]) AS claim,
           unnest(sqlc.arg(attempts)::integer[]) AS attempt, unnest(sqlc.arg(started_at)::timestamptz[]) AS started_at,
           unnest(sqlc.arg(duration_micros)::bigint[]) AS duration_micros
), written AS (
    UPDATE idem_events AS e
    SET status = 'delivered',
        attempts = d.attempt,
        claim = e.claim + 1,
        lease_until = NULL,
        delivered_at = now(),
        failed_at = NULL,
        delivered_attempt = d.attempt,
        delivery_started_at = d.started_at,
        delivery_micros = d.duration_micros,
        last_error = NULL,
        expires_at = now() + sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'
    FROM d
    WHERE e.ctid = ANY (ARRAY(SELECT row_version FROM d)) AND e.ctid = d.row_version
      AND e.claim = d.claim AND e.attempts = d.attempt - 1 AND e.status = 'pending'
    RETURNING 1
)
SELECT (CASE WHEN count(*) = cardinality(sqlc.arg(row_versions)::text[]) THEN count(*)
             ELSE idem_refuse('IDMRL', 'the relay''s locked events changed under its transaction (' || count(*) || ' of '
                                       || cardinality(sqlc.arg(row_versions)::text[]) || ' written)') END)::bigint AS written
FROM written;

-- Deletes up to @batch_size finished events past their expiry, and their
-- attempt logs. SKIP LOCKED: several relays prune without waiting for each
-- other.
-- name: EventPrune :one
WITH old AS (
    DELETE FROM idem_events AS e
    USING (SELECT destination, id
           FROM idem_events
           WHERE expires_at <= now() AND status IN ('delivered', 'failed')
           ORDER BY expires_at
           LIMIT sqlc.arg(batch_size)::integer
           FOR UPDATE SKIP LOCKED) AS o
    WHERE e.destination = o.destination AND e.id = o.id
    RETURNING e.destination, e.id
), gone AS (
    DELETE FROM idem_event_attempts AS a
    USING old
    WHERE a.destination = old.destination AND a.event_id = old.id
)
SELECT count(*)::bigint FROM old;

-- One event, for LookupEvent: next_attempt_at is, while a relay's lease
-- holds it, the lease's end (when another relay may claim it).
-- name: EventLookup :one
SELECT destination, id, topic, payload, coalesce(header::text, '')::text AS header, status, attempts, retry_from,
       (CASE WHEN status = 'pending' AND lease_until > next_attempt_at THEN lease_until
             ELSE next_attempt_at END)::timestamptz AS next_attempt_at, claim, created_at, delivered_at, failed_at, delivered_attempt,
       delivery_started_at, delivery_micros, last_error, retried_at, retry_reason, expires_at
FROM idem_events
WHERE destination = sqlc.arg(destination)::text AND id = sqlc.arg(id)::text;

-- The attempt log of one event, in order.
-- name: EventAttempts :many
SELECT attempt, started_at, duration_micros, error, permanent, claim
FROM idem_event_attempts
WHERE destination = sqlc.arg(destination)::text AND event_id = sqlc.arg(id)::text
ORDER BY attempt;

-- Sends a failed event again: pending and due now, its schedule restarting
-- after the attempts made so far, the reason recorded. 0 rows: the event is
-- missing or not failed (EventLookup tells which).
-- name: EventRetry :execrows
UPDATE idem_events
SET status = 'pending',
    next_attempt_at = now(),
    lease_until = NULL,
    retry_from = attempts,
    retried_at = now(),
    retry_reason = sqlc.arg(reason)::text,
    failed_at = NULL,
    expires_at = NULL
WHERE destination = sqlc.arg(destination)::text AND id = sqlc.arg(id)::text AND status = 'failed';

-- Gives back a claimed event that was not sent (Run ended before a worker
-- took it, or its lease was nearly over): its lease ended, so due again
-- at its place, the claim's attempt uncounted (a HOT update). Guarded by the claim's token, as EventRecord.
-- name: EventRelease :execrows
UPDATE idem_events
SET lease_until = NULL, attempts = attempts - 1
WHERE destination = sqlc.arg(destination)::text AND id = sqlc.arg(id)::text
  AND claim = sqlc.arg(claim)::bigint AND status = 'pending';

-- EventClaim for Citus, which refuses FOR UPDATE in a query over a
-- distributed table. The due events are picked without locks (Citus plans
-- the subquery first), then updated with the conditions checked again on
-- each row the UPDATE locks: an event another relay claimed meanwhile has
-- its next_attempt_at at the end of that claim's lease, is no longer due,
-- and is left out. Concurrent claims wait for each other's rows instead of
-- skipping them; no event is claimed twice. Run picks the statement per
-- database.
-- name: EventClaimCitus :many
UPDATE idem_events AS e
SET attempts = e.attempts + 1,
    claim = e.claim + 1,
    lease_until = now() + sqlc.arg(lease_micros)::bigint * interval '1 microsecond'
WHERE (e.destination, e.id) IN (
        SELECT destination, id
        FROM idem_events
        WHERE status = 'pending' AND next_attempt_at <= now() AND (lease_until IS NULL OR lease_until <= now())
        ORDER BY next_attempt_at
        LIMIT sqlc.arg(max_rows)::integer)
  AND e.status = 'pending' AND e.next_attempt_at <= now() AND (e.lease_until IS NULL OR e.lease_until <= now())
RETURNING e.destination, e.id, e.topic, e.payload, coalesce(e.header::text, '')::text AS header, e.attempts, e.retry_from, e.claim,
          e.ctid::text AS row_version;

-- EventPrune for Citus, which refuses FOR UPDATE in a query over a
-- distributed table: deletes up to @batch_size finished events past their
-- expiry, their conditions checked again on the rows the DELETE locks, and
-- the attempt logs of the events it deleted. Run at READ COMMITTED: a
-- relay that picked the events another relay is pruning waits for that
-- batch (Citus serializes multi-shard modifications shard by shard), then
-- finds them gone and deletes nothing. At REPEATABLE READ it would fail
-- instead (40001, could not serialize access due to concurrent delete).
-- name: EventPruneCitus :one
WITH old AS (
    DELETE FROM idem_events
    WHERE (destination, id) IN (
            SELECT destination, id
            FROM idem_events
            WHERE expires_at <= now() AND status IN ('delivered', 'failed')
            ORDER BY expires_at, destination, id
            LIMIT sqlc.arg(batch_size)::integer)
      AND expires_at <= now() AND status IN ('delivered', 'failed')
    RETURNING destination, id
), gone AS (
    DELETE FROM idem_event_attempts
    WHERE (destination, event_id) IN (SELECT destination, id FROM old)
)
SELECT count(*)::bigint FROM old;

-- EventRecord for one attempt, for Citus: every statement names one
-- destination, so Citus routes it to one worker (it refuses EventRecord's
-- correlated subquery over a CTE). The relay queues one per attempt in its
-- pipeline. Same rules as EventRecord.
-- name: EventRecordOne :execrows
WITH logged AS (
    INSERT INTO idem_event_attempts (destination, event_id, attempt, started_at, duration_micros, error, permanent, claim)
    SELECT sqlc.arg(destination)::text, sqlc.arg(id)::text, sqlc.arg(attempt)::integer,
           sqlc.arg(started_at)::timestamptz, sqlc.arg(duration_micros)::bigint, sqlc.narg(error)::text,
           sqlc.arg(permanent)::boolean, sqlc.arg(claim)::bigint
    WHERE EXISTS (SELECT 1 FROM idem_events
                  WHERE destination = sqlc.arg(destination)::text AND id = sqlc.arg(id)::text
                    AND (sqlc.narg(error)::text IS NOT NULL OR claim <> sqlc.arg(claim)::bigint OR status <> 'pending'))
    ON CONFLICT DO NOTHING
)
UPDATE idem_events
SET status = sqlc.arg(status)::text,
    next_attempt_at = CASE WHEN sqlc.arg(status)::text = 'pending'
                           THEN now() + sqlc.arg(delay_micros)::bigint * interval '1 microsecond'
                           ELSE next_attempt_at END,
    lease_until = NULL,
    delivered_at = CASE WHEN sqlc.arg(status)::text = 'delivered' THEN now() END,
    failed_at = CASE WHEN sqlc.arg(status)::text = 'failed' THEN now() END,
    delivered_attempt = CASE WHEN sqlc.arg(status)::text = 'delivered' THEN sqlc.arg(attempt)::integer END,
    delivery_started_at = CASE WHEN sqlc.arg(status)::text = 'delivered' THEN sqlc.arg(started_at)::timestamptz END,
    delivery_micros = CASE WHEN sqlc.arg(status)::text = 'delivered' THEN sqlc.arg(duration_micros)::bigint END,
    last_error = sqlc.narg(error)::text,
    expires_at = CASE WHEN sqlc.arg(status)::text <> 'pending'
                      THEN now() + sqlc.arg(ttl_micros)::bigint * interval '1 microsecond' END
WHERE destination = sqlc.arg(destination)::text AND id = sqlc.arg(id)::text
  AND claim = sqlc.arg(claim)::bigint AND status = 'pending';
