-- +goose Up
-- idem_keys is a queue by age: every key is inserted, completed once (a HOT
-- update, whose old version is dead at once) and deleted by Prune when its
-- TTL ends, so at a steady rate as many rows die as are born. PostgreSQL's
-- default autovacuum_vacuum_scale_factor (0.2) lets a fifth of the table be
-- dead before VACUUM makes the space reusable, and the table and its
-- indexes grow by that much. A twentieth (0.05) keeps the table smaller
-- per retained key in steady state (docs/benchmarks.md, "Storage at rest"),
-- at the price of VACUUMs up to four times as frequent, each of which reads
-- the indexes. ALTER TABLE ... SET takes a SHARE UPDATE EXCLUSIVE
-- lock, which no INSERT, UPDATE, DELETE or SELECT waits for, nor queues
-- behind. A value an operator set on the table before this migration is
-- kept (this sets only an unset one); docs/operations.md says how to choose
-- another. It is written 0.050, a spelling PostgreSQL keeps as written, so
-- that the Down knows its own value from an operator's 0.05.
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_class c, pg_options_to_table(c.reloptions) o
                   WHERE c.oid = 'idem_keys'::regclass AND o.option_name = 'autovacuum_vacuum_scale_factor') THEN
        ALTER TABLE idem_keys SET (autovacuum_vacuum_scale_factor = 0.050);
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- Puts back the server's default, unless the value is not this migration's
-- 0.050 (an operator's, which stays, even 0.05). Refuses nothing: no row
-- changes.
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_class c, pg_options_to_table(c.reloptions) o
               WHERE c.oid = 'idem_keys'::regclass AND o.option_name = 'autovacuum_vacuum_scale_factor'
                 AND o.option_value = '0.050') THEN
        ALTER TABLE idem_keys RESET (autovacuum_vacuum_scale_factor);
    END IF;
END
$$;
-- +goose StatementEnd
