-- +goose NO TRANSACTION
-- +goose Up
-- Bodies kept shorter than keys (Config.BodyTTL):
--   body_expires_at  when the stored response's body and headers are
--                    dropped while the key row stays until expires_at (it
--                    still refuses a different request; a replay answers
--                    ErrResponseGone with the stored status). Written by
--                    the claim of Do and DoInTx (now() plus BodyTTL), never
--                    by the completion, which stays a HOT update. NULL: the
--                    body lives as long as the key (the default, and every
--                    reservation), or it was dropped already.
-- Prune drops bodies past their time in batches, walking the partial index
-- below in expiry order, and sets body_expires_at to NULL with the body, so
-- a row leaves the index once its body is gone. A finished row whose
-- response_status is kept and response_body is NULL is a dropped body
-- (idem writes an empty body, never NULL).
--
-- Adding a NULL column rewrites nothing; the index is built CONCURRENTLY
-- (this migration runs outside a transaction), so calls keep running while
-- it is built on a populated table. Both are skipped or dropped first when
-- they exist, so an interrupted run can simply be run again.
ALTER TABLE idem_keys ADD COLUMN IF NOT EXISTS body_expires_at timestamptz;

DROP INDEX CONCURRENTLY IF EXISTS idem_keys_body_expires_idx;
CREATE INDEX CONCURRENTLY idem_keys_body_expires_idx ON idem_keys (body_expires_at)
    WHERE body_expires_at IS NOT NULL;

-- +goose Down
-- Version 8 knows no dropped bodies: it would replay a finished row whose
-- body was dropped as an empty response, where version 9 says the response
-- is gone. Refused (SQLSTATE IDMDN, saying how many) while there are such
-- rows, unless the connection sets idem.force_down to on (idem.MigrateDown
-- with Force, idem migrate down --force). Rows whose body is still there
-- keep it for the key's whole TTL. The check and the drop run in one
-- statement (one transaction, the table locked first), so no body can be
-- dropped between them.
-- +goose StatementBegin
DO $$
DECLARE
    n bigint;
BEGIN
    LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE;
    IF coalesce(current_setting('idem.force_down', true), '') <> 'on' THEN
        SELECT count(*) INTO n FROM idem_keys
        WHERE status IN ('succeeded', 'rejected') AND response_status IS NOT NULL AND response_body IS NULL;
        IF n > 0 THEN
            RAISE EXCEPTION 'reverting migration 9 would replay % records whose response body was dropped (Config.BodyTTL) as empty responses', n
                USING ERRCODE = 'IDMDN';
        END IF;
    END IF;
    ALTER TABLE idem_keys DROP COLUMN body_expires_at;
END
$$;
-- +goose StatementEnd
