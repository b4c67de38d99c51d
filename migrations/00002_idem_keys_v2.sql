-- +goose Up
-- Version 2 of idem_keys.
--
-- The three CHECK constraints go: PostgreSQL rebuilds their expressions for
-- every INSERT and UPDATE (25-40 us of server CPU per call, measured), and the
-- library already refuses every value they refused before a statement runs.
--
-- The reservation mode (Reserve, Complete, FailRetryable, MarkUnknown,
-- Heartbeat, ExpireLeases, Resolve) adds three columns and two statuses:
--   token            fencing token of the current owner; 0 for rows written by
--                    Do, which never commit while 'processing'. Tokens come
--                    from idem_keys_token_seq, so they never repeat, not even
--                    after a row was pruned or forgotten and claimed again.
--   lease_expires_at end of the owner's lease (database clock); NULL for Do.
--   last_error       why a reservation failed or became unknown.
-- status is one of 'processing', 'succeeded', 'rejected', 'failed_retryable'
-- or 'unknown'.
ALTER TABLE idem_keys
    DROP CONSTRAINT idem_keys_status_check,
    DROP CONSTRAINT idem_keys_fingerprint_check,
    DROP CONSTRAINT idem_keys_response_check,
    ADD COLUMN token            bigint NOT NULL DEFAULT 0,
    ADD COLUMN lease_expires_at timestamptz,
    ADD COLUMN last_error       text;

CREATE SEQUENCE idem_keys_token_seq AS bigint;

-- ExpireLeases walks the leases of committed 'processing' rows in expiry order.
CREATE INDEX idem_keys_lease_idx ON idem_keys (lease_expires_at)
    WHERE status = 'processing' AND lease_expires_at IS NOT NULL;

-- ListUnknown pages through 'unknown' rows, oldest first.
CREATE INDEX idem_keys_unknown_idx ON idem_keys (created_at, actor, operation, idem_key)
    WHERE status = 'unknown';

-- +goose Down
-- Version 1 knows neither reservations nor their statuses: the records of
-- reservations that are unknown, in flight (processing with a lease) or
-- failed_retryable are deleted, and their keys become free, so a retry
-- would run the work again. Refused (SQLSTATE IDMDN, saying how many) while
-- there are such records, unless the connection sets idem.force_down to on
-- (idem.MigrateDown with Force, idem migrate down --force). The table is
-- locked first, so none can be written between the count and the delete.
LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE;
-- +goose StatementBegin
DO $$
DECLARE
    n bigint;
BEGIN
    IF coalesce(current_setting('idem.force_down', true), '') <> 'on' THEN
        SELECT count(*) INTO n FROM idem_keys
        WHERE status NOT IN ('processing', 'succeeded', 'rejected')
           OR (status = 'processing' AND lease_expires_at IS NOT NULL);
        IF n > 0 THEN
            RAISE EXCEPTION 'reverting migration 2 would delete % records whose outcome may have happened (unknown, in flight or failed_retryable)', n
                USING ERRCODE = 'IDMDN';
        END IF;
    END IF;
END
$$;
-- +goose StatementEnd
DROP INDEX idem_keys_unknown_idx;
DROP INDEX idem_keys_lease_idx;
DROP SEQUENCE idem_keys_token_seq;
DELETE FROM idem_keys WHERE status NOT IN ('processing', 'succeeded', 'rejected')
    OR (status = 'processing' AND lease_expires_at IS NOT NULL);
ALTER TABLE idem_keys
    DROP COLUMN last_error,
    DROP COLUMN lease_expires_at,
    DROP COLUMN token,
    ADD CONSTRAINT idem_keys_status_check
        CHECK (status IN ('processing', 'succeeded', 'rejected')),
    ADD CONSTRAINT idem_keys_fingerprint_check CHECK (length(fingerprint) = 32),
    ADD CONSTRAINT idem_keys_response_check
        CHECK (status = 'processing' OR (response_status IS NOT NULL AND response_body IS NOT NULL));
