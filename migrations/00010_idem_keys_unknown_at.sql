-- +goose NO TRANSACTION
-- +goose Up
-- When a record became unknown:
--   unknown_at       the database time at which the record's latest attempt
--                    became 'unknown', whoever made it so: its worker
--                    (Reservation.MarkUnknown), ExpireLeases, the console's
--                    expiry, or the call that found a claim of Do or
--                    DoInTx left without an outcome. Marked unknown again
--                    (the same token, a repeated MarkUnknown), it keeps the
--                    first time. A verdict (Resolve) keeps it; a new attempt
--                    that takes the record (Reserve after failed_retryable,
--                    a resume, a new request after the TTL, Do's take-over)
--                    clears it. NULL: the attempt never became unknown, or
--                    it did before this migration.
-- No index reads it, nor any index predicate, and Do's completion never
-- writes it, so that completion stays a HOT update. Adding a NULL column
-- without a default rewrites nothing (IF NOT EXISTS: an interrupted run can
-- simply be run again).
ALTER TABLE idem_keys ADD COLUMN IF NOT EXISTS unknown_at timestamptz;

-- The console's list of failed records across actors (ConsoleFailedKeys),
-- newest outcome first. 'failed_retryable' is rare, so a walk of another
-- index filtering on status would read most of the table to fill a page;
-- this partial index holds only finished reservations that carry an error
-- or an operator's reason: every failed_retryable record (FailRetryable
-- writes last_error, a verdict resolve_reason) and the few that a verdict
-- settled as succeeded, none of the records of Do and none of the
-- reservations that simply succeeded (a new attempt clears both columns).
-- Its predicate does not read status, nor any column that Do's completion
-- writes, so that completion stays a HOT update (see migration 00003).
-- Built CONCURRENTLY (this migration runs outside a transaction), dropped
-- first so that an interrupted run can be run again.
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_failed_idx;
CREATE INDEX CONCURRENTLY idem_keys_failed_idx ON idem_keys (completed_at, actor, operation, idem_key)
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NOT NULL
      AND (last_error IS NOT NULL OR resolve_reason IS NOT NULL);

-- +goose Down
-- Version 9 records no such time: the index and the column go, and with
-- them only that time (every record keeps its status, outcome and token).
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_failed_idx;
ALTER TABLE idem_keys DROP COLUMN IF EXISTS unknown_at;
