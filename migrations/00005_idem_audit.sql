-- +goose Up
-- idem_audit is the operators' trail: one row per action that changed
-- something (a verdict recorded, a key forgotten, leases expired, keys
-- pruned), written by the console (package idemui) and the idem CLI in the
-- same transaction as the change, so a change never commits without its
-- row, nor a row without its change. A refused action changes nothing and
-- writes no row.
--   actor          the key's actor; '' for an action over many keys
--                  (expire leases, prune). On Citus it is the distribution
--                  column, as for idem_keys, so a row and its key share a node.
--   id             from idem_audit_id_seq: orders rows written in one instant
--   acted_at       when: the time of the transaction that made the change
--                  (the record's completed_at after a verdict)
--   operator       who, as the service's authorization named them
--   action         'resolve', 'forget', 'expire_leases' or 'prune'
--   operation, idem_key
--                  the key; '' for an action over many keys
--   token_before, token_after
--                  the record's fencing token before and after the change;
--                  NULL where there was no record (after a forget)
--   status_before, status_after
--                  the record's status before and after, likewise
--   verdict        'succeeded' or 'retryable' for resolve; NULL otherwise
--   reason         the operator's reason; '' when the action takes none
--   changed        how many records changed
--   detail         JSON: what a bulk action matched (its filter), the status
--                  of a stored response
CREATE SEQUENCE idem_audit_id_seq AS bigint;

CREATE TABLE idem_audit (
    actor         text        NOT NULL,
    id            bigint      NOT NULL DEFAULT nextval('idem_audit_id_seq'),
    acted_at      timestamptz NOT NULL DEFAULT now(),
    operator      text        NOT NULL,
    action        text        NOT NULL,
    operation     text        NOT NULL,
    idem_key      text        NOT NULL,
    token_before  bigint,
    token_after   bigint,
    status_before text,
    status_after  text,
    verdict       text,
    reason        text        NOT NULL,
    changed       bigint      NOT NULL,
    detail        jsonb,
    CONSTRAINT idem_audit_pkey PRIMARY KEY (actor, id)
);

ALTER SEQUENCE idem_audit_id_seq OWNED BY idem_audit.id;

-- The trail, newest first (AuditList).
CREATE INDEX idem_audit_acted_idx ON idem_audit (acted_at, id);

-- The rows about one key (AuditList filtered by key).
CREATE INDEX idem_audit_key_idx ON idem_audit (actor, operation, idem_key, acted_at);

-- +goose Down
-- Dropping the table deletes the trail of who decided what. Refused
-- (SQLSTATE IDMDN, saying how many) while it holds rows, unless the
-- connection sets idem.force_down to on (idem.MigrateDown with Force, idem
-- migrate down --force).
LOCK TABLE idem_audit IN ACCESS EXCLUSIVE MODE;
-- +goose StatementBegin
DO $$
DECLARE
    n bigint;
BEGIN
    IF coalesce(current_setting('idem.force_down', true), '') <> 'on' THEN
        SELECT count(*) INTO n FROM idem_audit;
        IF n > 0 THEN
            RAISE EXCEPTION 'reverting migration 5 would delete % rows of the operators'' audit trail (dropping idem_audit)', n
                USING ERRCODE = 'IDMDN';
        END IF;
    END IF;
END
$$;
-- +goose StatementEnd
DROP TABLE idem_audit;
