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

-- +goose Down
-- Version 9 records no such time: the column goes, and with it only that
-- time (every record keeps its status, outcome and token).
ALTER TABLE idem_keys DROP COLUMN IF EXISTS unknown_at;
