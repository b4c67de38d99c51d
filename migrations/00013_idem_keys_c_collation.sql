-- +goose NO TRANSACTION
-- +goose Up
-- The key's operation and idem_key in the "C" collation: byte for byte.
-- Every claim, completion and replay finds its key by descending the
-- primary key, and a B-tree of text in the database's collation compares
-- with strcoll (varstr_cmp); in "C" it compares with memcmp. A replay runs
-- about 2 % fewer instructions of the server's, a fresh call about 9,000
-- fewer (docs/benchmarks.md, issue 30's seventh look), and more on a
-- database whose locale is slower to compare (en_US.UTF-8, say). Equality
-- is the same in every deterministic collation, so no key changes: the
-- same keys collide, the same keys differ. Only an order changes, the
-- console's lists of keys, which now sort as the bytes do (as Go sorts
-- strings). actor keeps the database's collation: Citus distributes the
-- table by it and refuses to alter it, and neighbouring keys most often
-- share an actor, which varstr_cmp compares with memcmp anyway.
--
-- Without stopping the calls:
--   1. a unique index on the key in "C" is built CONCURRENTLY (calls go on
--      while it reads the table);
--   2. one short transaction, the table locked: the two partial indexes
--      that name the key columns (which ALTER ... TYPE would rebuild under
--      the lock, reading the whole table) are dropped, the primary key
--      constraint is dropped, the two columns change collation (no row is
--      rewritten or read: text to text, and the new index is kept, not
--      rebuilt) and that index becomes the primary key, renamed
--      idem_keys_pkey. The lock is held for milliseconds (docs/operations.md
--      gives the longest call measured at 3,000,000 keys); the wait for it
--      is bounded at a second, tried ten times;
--   3. the two partial indexes are built again CONCURRENTLY. Until they
--      are, the console's lists of open and failed records, ListUnknown
--      and ExpireLeases read the table instead.
-- Every step is skipped or dropped first when done, so an interrupted run
-- can simply be run again (a run interrupted after step 2 builds the
-- index of step 1 again, and drops it). Statements separate, as Citus
-- wants them; on a distributed table Citus runs each on every shard.
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_pkey_c;
CREATE UNIQUE INDEX CONCURRENTLY idem_keys_pkey_c ON idem_keys (actor, operation COLLATE "C", idem_key COLLATE "C");

-- +goose StatementBegin
DO $$
DECLARE
    attempt int := 0;
BEGIN
    IF (SELECT attcollation FROM pg_attribute
        WHERE attrelid = 'idem_keys'::regclass AND attname = 'idem_key') = '"C"'::regcollation THEN
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '1s', true);
    LOOP
        BEGIN
            DROP INDEX IF EXISTS idem_keys_open_created_idx;
            DROP INDEX IF EXISTS idem_keys_failed_idx;
            ALTER TABLE idem_keys DROP CONSTRAINT idem_keys_pkey;
            ALTER TABLE idem_keys ALTER COLUMN operation TYPE text COLLATE "C",
                                  ALTER COLUMN idem_key TYPE text COLLATE "C";
            ALTER TABLE idem_keys ADD CONSTRAINT idem_keys_pkey PRIMARY KEY USING INDEX idem_keys_pkey_c;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            attempt := attempt + 1;
            IF attempt >= 10 THEN
                RAISE;
            END IF;
            PERFORM pg_sleep(1);
        END;
    END LOOP;
END
$$;
-- +goose StatementEnd

DROP INDEX CONCURRENTLY IF EXISTS idem_keys_pkey_c;
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_open_created_idx;
CREATE INDEX CONCURRENTLY idem_keys_open_created_idx ON idem_keys (created_at, actor, operation, idem_key)
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL;
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_failed_idx;
CREATE INDEX CONCURRENTLY idem_keys_failed_idx ON idem_keys (completed_at, actor, operation, idem_key)
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NOT NULL
      AND (last_error IS NOT NULL OR resolve_reason IS NOT NULL);

-- +goose Down
-- Back to the database's collation, the same three steps the other way
-- (skipped when the key is not in "C": nothing of this migration's is
-- left). No row changes.
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_pkey_d;
CREATE UNIQUE INDEX CONCURRENTLY idem_keys_pkey_d ON idem_keys (actor, operation COLLATE "default", idem_key COLLATE "default");

-- +goose StatementBegin
DO $$
DECLARE
    attempt int := 0;
BEGIN
    IF (SELECT attcollation FROM pg_attribute
        WHERE attrelid = 'idem_keys'::regclass AND attname = 'idem_key') <> '"C"'::regcollation THEN
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '1s', true);
    LOOP
        BEGIN
            DROP INDEX IF EXISTS idem_keys_open_created_idx;
            DROP INDEX IF EXISTS idem_keys_failed_idx;
            ALTER TABLE idem_keys DROP CONSTRAINT idem_keys_pkey;
            ALTER TABLE idem_keys ALTER COLUMN operation TYPE text COLLATE "default",
                                  ALTER COLUMN idem_key TYPE text COLLATE "default";
            ALTER TABLE idem_keys ADD CONSTRAINT idem_keys_pkey PRIMARY KEY USING INDEX idem_keys_pkey_d;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            attempt := attempt + 1;
            IF attempt >= 10 THEN
                RAISE;
            END IF;
            PERFORM pg_sleep(1);
        END;
    END LOOP;
END
$$;
-- +goose StatementEnd

DROP INDEX CONCURRENTLY IF EXISTS idem_keys_pkey_d;
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_open_created_idx;
CREATE INDEX CONCURRENTLY idem_keys_open_created_idx ON idem_keys (created_at, actor, operation, idem_key)
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NULL;
DROP INDEX CONCURRENTLY IF EXISTS idem_keys_failed_idx;
CREATE INDEX CONCURRENTLY idem_keys_failed_idx ON idem_keys (completed_at, actor, operation, idem_key)
    WHERE lease_expires_at IS NOT NULL AND completed_at IS NOT NULL
      AND (last_error IS NOT NULL OR resolve_reason IS NOT NULL);
