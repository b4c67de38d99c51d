-- +goose Up
-- idem_keys holds one row per idempotency key. A row is claimed ('processing')
-- and completed ('succeeded' or 'rejected') inside the caller's transaction, so
-- in single-transaction mode other sessions only ever see finished rows.
CREATE TABLE idem_keys (
    actor            text        NOT NULL,
    operation        text        NOT NULL,
    idem_key         text        NOT NULL,
    fingerprint      bytea       NOT NULL,
    status           text        NOT NULL,
    response_status  integer,
    response_headers jsonb,
    response_body    bytea,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,
    CONSTRAINT idem_keys_pkey PRIMARY KEY (actor, operation, idem_key),
    CONSTRAINT idem_keys_status_check
        CHECK (status IN ('processing', 'succeeded', 'rejected')),
    CONSTRAINT idem_keys_fingerprint_check CHECK (length(fingerprint) = 32),
    CONSTRAINT idem_keys_response_check
        CHECK (status = 'processing' OR (response_status IS NOT NULL AND response_body IS NOT NULL))
) WITH (fillfactor = 90);

-- Pruning walks expired rows in expiry order.
CREATE INDEX idem_keys_expires_at_idx ON idem_keys (expires_at);

-- +goose Down
-- Dropping the table deletes every record: keys whose outcome was stored
-- would run again. Refused (SQLSTATE IDMDN, saying how many) while there are
-- records, unless the connection sets idem.force_down to on (idem.MigrateDown
-- with Force, idem migrate down --force).
LOCK TABLE idem_keys IN ACCESS EXCLUSIVE MODE;
-- +goose StatementBegin
DO $$
DECLARE
    n bigint;
BEGIN
    IF coalesce(current_setting('idem.force_down', true), '') <> 'on' THEN
        SELECT count(*) INTO n FROM idem_keys;
        IF n > 0 THEN
            RAISE EXCEPTION 'reverting migration 1 would delete % records (dropping idem_keys)', n
                USING ERRCODE = 'IDMDN';
        END IF;
    END IF;
END
$$;
-- +goose StatementEnd
DROP TABLE idem_keys;
