-- The outbox for operators: `idem events list` (cmd/idem) and the
-- console's deliveries page (idemui). The relay's statements are in
-- outbox.sql.
--
-- "Overdue": a pending event due for longer than overdue_micros, which no
-- relay has sent (none runs, or they are behind).

-- Lists events, newest first (by created_at, then destination and id),
-- filtered: an empty status or destination matches every event; overdue
-- keeps only the overdue ones. It reads idem_events in created_at order
-- up to max_rows matches: an outbox that the relay prunes
-- (RelayOptions.TTL, FailedTTL) stays small enough for that. The failed
-- and the overdue events have lists of their own, which an index serves.
-- name: EventList :many
SELECT destination, id, topic, status, attempts, next_attempt_at, created_at,
       delivered_at, failed_at, coalesce(last_error, '')::text AS last_error,
       (status = 'pending' AND next_attempt_at < now() - make_interval(secs => sqlc.arg(overdue_micros)::bigint / 1e6))::boolean AS overdue
FROM idem_events
WHERE (sqlc.arg(status)::text = '' OR status = sqlc.arg(status)::text)
  AND (sqlc.arg(destination)::text = '' OR destination = sqlc.arg(destination)::text)
  AND (NOT sqlc.arg(only_overdue)::boolean
       OR (status = 'pending' AND next_attempt_at < now() - make_interval(secs => sqlc.arg(overdue_micros)::bigint / 1e6)))
ORDER BY created_at DESC, destination, id
LIMIT sqlc.arg(max_rows)::integer;

-- Lists the overdue events, the longest overdue first, optionally for one
-- destination (empty: every one): a walk of idem_events_due_idx in its
-- order, however many events are pending.
-- name: EventListOverdue :many
SELECT destination, id, topic, status, attempts, next_attempt_at, created_at,
       delivered_at, failed_at, coalesce(last_error, '')::text AS last_error,
       true::boolean AS overdue
FROM idem_events
WHERE status = 'pending'
  AND next_attempt_at < now() - make_interval(secs => sqlc.arg(overdue_micros)::bigint / 1e6)
  AND (sqlc.arg(destination)::text = '' OR destination = sqlc.arg(destination)::text)
ORDER BY next_attempt_at
LIMIT sqlc.arg(max_rows)::integer;

-- Lists the failed events, newest first, optionally for one destination
-- (empty: every one): a walk of idem_events_failed_idx in its order,
-- however many events were delivered.
-- name: EventListFailed :many
SELECT destination, id, topic, status, attempts, next_attempt_at, created_at,
       delivered_at, failed_at, coalesce(last_error, '')::text AS last_error,
       false::boolean AS overdue
FROM idem_events
WHERE status = 'failed'
  AND (sqlc.arg(destination)::text = '' OR destination = sqlc.arg(destination)::text)
ORDER BY created_at DESC, destination, id
LIMIT sqlc.arg(max_rows)::integer;
