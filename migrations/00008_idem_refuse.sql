-- +goose Up
-- idem_refuse raises an error with an SQLSTATE of idem's own (class ID) and
-- a message, so that a statement that must refuse says why in a code the
-- drivers read (package driver's faults), not in a message text: KeyComplete
-- when fn changed the claimed row (IDMRC), KeyAbortIfClaimed when fn's
-- COMMIT released the claim into an enclosing transaction (IDMCR). It is
-- called in a CASE only when the statement must fail, as its result (an
-- integer it never returns), so the statements and their round trips are
-- the ones they were, and KeyComplete's update stays HOT. On Citus it must
-- exist on the workers too, where the statements run: Distribute creates
-- it there (create_distributed_function).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idem_refuse(code text, message text) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- Version 7's statements do not call it; nothing is stored in it.
DROP FUNCTION idem_refuse(text, text);
