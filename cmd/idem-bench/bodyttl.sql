-- What a dropped body saves (docs/benchmarks.md, "Bodies kept shorter than keys"):
-- 100,000 draw rows (a 51-byte body, Content-Type and Location) in a database
-- migrated to version 9, compacted, then every body dropped as Prune drops it.
--   psql -d DB -v bodyttl=false -f cmd/idem-bench/bodyttl.sql   (true: with body_expires_at set)
\set ON_ERROR_STOP on
INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, response_status, response_headers, response_body,
                       created_at, completed_at, expires_at, body_expires_at)
SELECT 'u' || (1 + i % 100000), 'POST /v1/draws', gen_random_uuid()::text, sha256(i::text::bytea), 'succeeded', 201,
       jsonb_build_object('Content-Type', jsonb_build_array('application/json'),
                          'Location', jsonb_build_array('/v1/draws/' || (100000000 + i))),
       convert_to('{"draw_id":' || (100000000 + i) || ',"box_id":1042,"items":[17,23]}', 'UTF8'),
       now(), now(), now() + interval '1 day', CASE WHEN :bodyttl THEN now() + interval '1 hour' END
FROM generate_series(1, 100000) i;
VACUUM FULL idem_keys;
SELECT 'kept' AS state, avg(pg_column_size(k.*))::int AS row_bytes, avg(octet_length(response_body))::int AS body,
       avg(pg_column_size(response_headers))::int AS headers,
       pg_relation_size('idem_keys') / 100000.0 AS heap_per_key,
       pg_relation_size('idem_keys_body_expires_idx') / 100000.0 AS body_idx_per_key,
       pg_indexes_size('idem_keys') / 100000.0 AS indexes_per_key FROM idem_keys k;
UPDATE idem_keys SET response_body = NULL, response_headers = NULL, body_expires_at = NULL;
VACUUM FULL idem_keys;
SELECT 'dropped' AS state, avg(pg_column_size(k.*))::int AS row_bytes,
       pg_relation_size('idem_keys') / 100000.0 AS heap_per_key,
       pg_relation_size('idem_keys_body_expires_idx') / 100000.0 AS body_idx_per_key,
       pg_indexes_size('idem_keys') / 100000.0 AS indexes_per_key FROM idem_keys k;
TRUNCATE idem_keys;
