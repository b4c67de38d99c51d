-- Issue 34: the same 100,000 draw rows in tables of each layout, then VACUUM;
-- compact sizes per key. Run on an empty scratch database:
--   createdb idem_layouts && psql -d idem_layouts -f cmd/idem-bench/layouts.sql
-- today's layout (migrations 1-6 + 00007's unknown_at)
CREATE TABLE t0 (actor text NOT NULL, operation text NOT NULL, idem_key text NOT NULL, fingerprint bytea NOT NULL,
 status text NOT NULL, response_status integer, response_headers jsonb, response_body bytea,
 created_at timestamptz NOT NULL DEFAULT now(), completed_at timestamptz, expires_at timestamptz NOT NULL,
 token bigint NOT NULL DEFAULT 0, lease_expires_at timestamptz, last_error text, resolve_reason text, resume_until timestamptz, unknown_at timestamptz,
 PRIMARY KEY (actor, operation, idem_key)) WITH (fillfactor=90);
CREATE INDEX ON t0 (expires_at);
CREATE TEMP TABLE src AS
SELECT 'u' || (1 + (random()*99999)::int) AS actor, 'draw' AS operation, gen_random_uuid()::text AS idem_key,
       sha256(g::text::bytea) AS fp, 201 AS st,
       ('{"batch_id":' || (1000000+g) || ',"prizes":["Goose Sticker"],"points_left":99}')::bytea AS body,
       '/v1/draws/' || (random()*1e9)::bigint AS loc,
       now() + g * interval '1 ms' AS t
FROM generate_series(1, 100000) g;
SELECT length(body) AS body_len FROM src LIMIT 1;
INSERT INTO t0 (actor, operation, idem_key, fingerprint, status, response_status, response_headers, response_body, created_at, completed_at, expires_at)
SELECT actor, operation, idem_key, fp, 'succeeded', st, jsonb_build_object('Content-Type', jsonb_build_array('application/json'), 'Location', jsonb_build_array(loc)), body, t, t, t + interval '1 day' FROM src;

-- step 1: column order (fixed-width first, varlena after, nullable last), same types
CREATE TABLE t1 (created_at timestamptz NOT NULL, completed_at timestamptz, expires_at timestamptz NOT NULL, token bigint NOT NULL DEFAULT 0,
 response_status integer, status text NOT NULL, actor text NOT NULL, operation text NOT NULL, idem_key text NOT NULL, fingerprint bytea NOT NULL,
 response_headers jsonb, response_body bytea,
 lease_expires_at timestamptz, resume_until timestamptz, unknown_at timestamptz, last_error text, resolve_reason text,
 PRIMARY KEY (actor, operation, idem_key)) WITH (fillfactor=90);
INSERT INTO t1 (actor, operation, idem_key, fingerprint, status, response_status, response_headers, response_body, created_at, completed_at, expires_at)
SELECT actor, operation, idem_key, fingerprint, status, response_status, response_headers, response_body, created_at, completed_at, expires_at FROM t0;
-- step 2: + status "char", response_status smallint
CREATE TABLE t2 (created_at timestamptz NOT NULL, completed_at timestamptz, expires_at timestamptz NOT NULL, token bigint NOT NULL DEFAULT 0,
 response_status smallint, status "char" NOT NULL, actor text NOT NULL, operation text NOT NULL, idem_key text NOT NULL, fingerprint bytea NOT NULL,
 response_headers jsonb, response_body bytea,
 lease_expires_at timestamptz, resume_until timestamptz, unknown_at timestamptz, last_error text, resolve_reason text,
 PRIMARY KEY (actor, operation, idem_key)) WITH (fillfactor=90);
INSERT INTO t2 SELECT created_at, completed_at, expires_at, token, response_status, 's', actor, operation, idem_key, fingerprint, response_headers, response_body FROM t0;
-- step 3: + headers as text lines instead of jsonb
CREATE TABLE t3 (LIKE t2 INCLUDING ALL);
ALTER TABLE t3 ALTER COLUMN response_headers TYPE text;
INSERT INTO t3 SELECT created_at, completed_at, expires_at, token, response_status, 's', actor, operation, idem_key, fingerprint,
  'Content-Type: application/json' || E'\n' || 'Location: ' || (response_headers->'Location'->>0), response_body FROM t0;
-- step 4: + completed_at dropped (Do rows: = created_at) -- measure only
CREATE TABLE t4 (LIKE t3 INCLUDING ALL);
ALTER TABLE t4 DROP COLUMN completed_at;
INSERT INTO t4 (created_at, expires_at, token, response_status, status, actor, operation, idem_key, fingerprint, response_headers, response_body)
SELECT created_at, expires_at, token, response_status, status, actor, operation, idem_key, fingerprint, response_headers, response_body FROM t3;
-- step 5: + fillfactor 100
CREATE TABLE t5 (LIKE t3 INCLUDING ALL) WITH (fillfactor=100);
INSERT INTO t5 SELECT * FROM t3;
-- narrower pk: key hash (bigint) instead of operation+key text in the PK
CREATE TABLE t6 (LIKE t3 INCLUDING DEFAULTS);
ALTER TABLE t6 ADD COLUMN key_hash bigint;
INSERT INTO t6 SELECT t3.*, hashtextextended(operation || E'\x1f' || idem_key, 0) FROM t3;
ALTER TABLE t6 ADD PRIMARY KEY (actor, key_hash);
CREATE INDEX ON t1 (expires_at); CREATE INDEX ON t2 (expires_at); CREATE INDEX ON t3 (expires_at); CREATE INDEX ON t4 (expires_at); CREATE INDEX ON t5 (expires_at); CREATE INDEX ON t6 (expires_at);
VACUUM ANALYZE;
SELECT c.relname, pg_relation_size(c.oid)/100000.0 AS heap_per_key,
  (SELECT string_agg(i.indexrelid::regclass::text || '=' || round(pg_relation_size(i.indexrelid)/100000.0,1), ' ') FROM pg_index i WHERE i.indrelid=c.oid) AS idx,
  round((pg_relation_size(c.oid)+pg_indexes_size(c.oid))/100000.0,1) AS total,
  (SELECT round(avg(pg_column_size(x.*)),1) FROM (SELECT * FROM t0 LIMIT 0) x) AS dummy
FROM pg_class c WHERE relname IN ('t0','t1','t2','t3','t4','t5','t6') ORDER BY relname;
SELECT 't0', avg(pg_column_size(t0.*)) FROM t0 UNION ALL SELECT 't1', avg(pg_column_size(t1.*)) FROM t1 UNION ALL SELECT 't2', avg(pg_column_size(t2.*)) FROM t2 UNION ALL SELECT 't3', avg(pg_column_size(t3.*)) FROM t3 UNION ALL SELECT 't4', avg(pg_column_size(t4.*)) FROM t4;
SELECT avg(pg_column_size(response_headers)) FROM t0; SELECT avg(pg_column_size(response_headers)) FROM t3;
DROP TABLE IF EXISTS t7, t8, t9;
-- t7: lean row: fixed first, token NULL for Do rows, status "char", response status smallint, headers text, PK (actor, key_hash uuid)
CREATE TABLE t7 (created_at timestamptz NOT NULL, completed_at timestamptz, expires_at timestamptz NOT NULL,
 response_status smallint, status "char" NOT NULL, actor text NOT NULL, key_hash uuid NOT NULL, operation text NOT NULL, idem_key text NOT NULL,
 fingerprint bytea NOT NULL, response_headers text, response_body bytea,
 token bigint, lease_expires_at timestamptz, resume_until timestamptz, unknown_at timestamptz, last_error text, resolve_reason text,
 PRIMARY KEY (actor, key_hash)) WITH (fillfactor=90);
INSERT INTO t7 SELECT created_at, completed_at, expires_at, response_status, 's', actor, md5(operation || E'\x1f' || idem_key)::uuid, operation, idem_key, fingerprint, response_headers, response_body FROM t3;
CREATE INDEX ON t7 (expires_at);
-- t8: t7 with the key's text dropped (only its hash kept) -- for scale only
CREATE TABLE t8 (LIKE t7 INCLUDING ALL) WITH (fillfactor=90);
ALTER TABLE t8 DROP COLUMN operation, DROP COLUMN idem_key;
INSERT INTO t8 SELECT created_at, completed_at, expires_at, response_status, status, actor, key_hash, fingerprint, response_headers, response_body FROM t7;
-- t9: t7 with completed_at dropped too (and fillfactor 100)
CREATE TABLE t9 (LIKE t7 INCLUDING ALL) WITH (fillfactor=100);
ALTER TABLE t9 DROP COLUMN completed_at;
INSERT INTO t9 (created_at, expires_at, response_status, status, actor, key_hash, operation, idem_key, fingerprint, response_headers, response_body) SELECT created_at, expires_at, response_status, status, actor, key_hash, operation, idem_key, fingerprint, response_headers, response_body FROM t7;
VACUUM ANALYZE t7; VACUUM ANALYZE t8; VACUUM ANALYZE t9;
SELECT c.relname, round(pg_relation_size(c.oid)/100000.0,1) AS heap_per_key,
  (SELECT string_agg(i.indexrelid::regclass::text || '=' || round(pg_relation_size(i.indexrelid)/100000.0,1), ' ') FROM pg_index i WHERE i.indrelid=c.oid) AS idx,
  round((pg_relation_size(c.oid)+pg_indexes_size(c.oid))/100000.0,1) AS total
FROM pg_class c WHERE relname IN ('t7','t8','t9') ORDER BY relname;
SELECT 't7', avg(pg_column_size(t7.*)) FROM t7 UNION ALL SELECT 't8', avg(pg_column_size(t8.*)) FROM t8 UNION ALL SELECT 't9', avg(pg_column_size(t9.*)) FROM t9;
