-- +goose Up
-- Reservations that resume within the receiver's window
-- (ReserveOptions.ResumeWithin):
--   resume_until     end of the window in which an attempt whose lease ran
--                    out, or that its worker marked unknown, is taken over
--                    by the next Reserve (resumed, with a new token) instead
--                    of waiting for a person: the first reservation of the
--                    key's TTL generation plus ResumeWithin. NULL: no
--                    window. Later attempts of the generation (resumes, new
--                    attempts after failed_retryable) never move it; Do's
--                    take-over clears it.
-- No index reads it, nor any index predicate: ListResumable, ListUnknown and
-- ExpireLeases walk the indexes of open reservations (migration 3) and test
-- it on the rows they find, and Do's completion, which never writes it,
-- stays a HOT update. Adding a NULL column rewrites nothing.
ALTER TABLE idem_keys ADD COLUMN resume_until timestamptz;

-- +goose Down
-- Version 5 knows no windows: dropping the column would turn attempts that
-- resume by themselves into cases for a person, and take the window from
-- the next attempt of a failed_retryable record. Refused (SQLSTATE IDMDN,
-- saying how many) while records that are processing, unknown or
-- failed_retryable hold a window that has not ended, unless the connection
-- sets idem.force_down to on (idem.MigrateDown with Force, idem migrate
-- down --force). Forced, no record is deleted or changed otherwise: an
-- attempt in doubt becomes unknown as version 5 decides it (its lease ran
-- out, or its worker marked it) and waits for Resolve. The table is locked
-- first, so no window can be written between the count and the drop.
LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE;
-- +goose StatementBegin
DO $$
DECLARE
    n bigint;
BEGIN
    IF coalesce(current_setting('idem.force_down', true), '') <> 'on' THEN
        SELECT count(*) INTO n FROM idem_keys
        WHERE status IN ('processing', 'unknown', 'failed_retryable') AND resume_until > now();
        IF n > 0 THEN
            RAISE EXCEPTION 'reverting migration 6 would drop the resume windows of % records (processing, unknown or failed_retryable inside ReserveOptions.ResumeWithin): they would wait for a person instead of resuming', n
                USING ERRCODE = 'IDMDN';
        END IF;
    END IF;
END
$$;
-- +goose StatementEnd
ALTER TABLE idem_keys DROP COLUMN resume_until;
