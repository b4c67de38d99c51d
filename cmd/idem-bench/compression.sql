-- Issue 34: how PostgreSQL compresses stored bodies. JSON bodies of 4, 16 and
-- 64 orders (about 0.9, 3.7 and 14.6 kB, as a list endpoint would answer),
-- 3,000 each, written into a bytea column compressed with pglz (the default)
-- and with lz4; then whether a lower toast_tuple_target makes PostgreSQL
-- compress a body below its fixed threshold (about 2 kB a row). Run on an
-- empty scratch database:
--   createdb idem_compression && psql -d idem_compression -f cmd/idem-bench/compression.sql
\set ON_ERROR_STOP 1
\timing off
CREATE TABLE bodies AS
SELECT n, i, convert_to(json_build_object('data', (
  SELECT json_agg(json_build_object(
    'id', 'ord_' || substr(md5(random()::text), 1, 16),
    'object', 'order', 'status', (ARRAY['paid', 'pending', 'shipped', 'refunded'])[1 + floor(random() * 4)::int],
    'amount', floor(random() * 100000)::int, 'currency', 'EUR',
    'customer', 'cus_' || substr(md5(random()::text), 1, 14),
    'created', 1700000000 + floor(random() * 1e7)::int,
    'metadata', json_build_object('cart', substr(md5(random()::text), 1, 10), 'channel', 'web')))
  FROM generate_series(1, n) g), 'has_more', true)::text, 'UTF8') AS b
FROM (VALUES (4), (16), (64)) v(n), generate_series(1, 3000) i;
CREATE TABLE t_pglz (n int, b bytea COMPRESSION pglz);
CREATE TABLE t_lz4 (n int, b bytea COMPRESSION lz4);
-- "|| ''" makes a new value, which the table's method compresses (a value
-- copied as it is keeps the compression it has).
\timing on
INSERT INTO t_pglz SELECT n, b || '\x'::bytea FROM bodies;
INSERT INTO t_lz4 SELECT n, b || '\x'::bytea FROM bodies;
\timing off
SELECT n AS orders, avg(length(b))::int AS raw_bytes,
       (SELECT avg(pg_column_size(b))::int FROM t_pglz p WHERE p.n = x.n) AS pglz_bytes,
       (SELECT avg(pg_column_size(b))::int FROM t_lz4 l WHERE l.n = x.n) AS lz4_bytes
FROM bodies x GROUP BY n ORDER BY n;
-- Reading every body back (decompressing it).
\timing on
SELECT count(DISTINCT md5(b)) FROM t_pglz;
SELECT count(DISTINCT md5(b)) FROM t_lz4;
\timing off
-- toast_tuple_target at 256: is a 0.9 kB body in a row of about 1.2 kB compressed?
CREATE TABLE t_default (pad text, b bytea);
CREATE TABLE t_256 (pad text, b bytea) WITH (toast_tuple_target = 256);
INSERT INTO t_default SELECT repeat('x', 200), b || '\x'::bytea FROM bodies WHERE n = 4;
INSERT INTO t_256 SELECT repeat('x', 200), b || '\x'::bytea FROM bodies WHERE n = 4;
SELECT (SELECT avg(pg_column_size(b))::int FROM t_default) AS default_target_bytes,
       (SELECT avg(pg_column_size(b))::int FROM t_256) AS target_256_bytes;
