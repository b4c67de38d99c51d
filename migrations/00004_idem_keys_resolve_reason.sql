-- +goose Up
-- Resolve keeps the reason the record failed or became unknown (last_error)
-- and stores the operator's reason beside it.
--   resolve_reason   why an operator resolved the record (Resolution.Reason);
--                    NULL until Resolve ran.
ALTER TABLE idem_keys ADD COLUMN resolve_reason text;

-- +goose Down
-- Nothing is lost: the operator's reason goes back into last_error, after
-- the original failure reason, as Resolve stored it before this migration
-- (there it replaced the original).
UPDATE idem_keys
SET last_error = CASE WHEN last_error IS NULL OR last_error = '' THEN resolve_reason
                      ELSE last_error || '; resolved: ' || resolve_reason END
WHERE resolve_reason IS NOT NULL;
ALTER TABLE idem_keys DROP COLUMN resolve_reason;
