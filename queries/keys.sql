-- The statements of Do and DoInTx. Their access paths do not depend on the
-- planner's statistics: the claim, the take-over and the completion are
-- INSERT ... ON CONFLICT, which always finds the key through the primary key
-- (the arbiter index), and KeyGet is only ever run with enable_seqscan off
-- for the statement's own savepoint or transaction (see claim.go), so even
-- the generic plan a connection caches while the table is empty, or while
-- its statistics say so, is the primary key index.

-- Claims a key for the calling transaction. The primary key picks a single
-- winner: while another transaction holds an uncommitted claim on the same
-- key, the INSERT waits for it to end, at most @lock_timeout. No row means a
-- committed row holds the key: KeyGet reads it.
--
-- The bounded wait costs no statement of its own. The row's status (last,
-- so that the arguments keep their order) is a CASE whose arms run in
-- order, before the row is inserted (the VALUES row
-- is computed first, then the INSERT looks for a conflict and waits): the
-- first saves the caller's lock_timeout in idem.lock_timeout, the second
-- sets @lock_timeout, both local to the transaction (or savepoint), and
-- neither is ever NULL, so the status is 'processing'. (Until 2026-12-06 two
-- nested subqueries did this: the CASE spares the executor their setup,
-- about 5,400 instructions of the server's per claim, fresh or replayed;
-- docs/benchmarks.md.) RETURNING puts the caller's value back on the
-- one path that returns to the caller's code with the key claimed. On every
-- other path (nothing claimed, or the wait ran out) the caller rolls back to
-- its savepoint or ends the transaction before any code of the caller runs,
-- which restores lock_timeout too.
--
-- body_expires_at (Config.BodyTTL; NULL, from a body_ttl_micros of 0, when
-- the body lives as long as the key) is written with the claim too, never
-- by the completion: it is indexed (migration 00009). unknown_at (migration
-- 00010) is named, NULL, so that on a database without it the claim fails
-- (ErrUnsupported, naming the column) before fn runs, not the call's last
-- step after it.
--
-- completed_at is written with the claim: it is the value KeyComplete would
-- write (now() of the same transaction), and a completion that changes no
-- indexed column and no column an index predicate reads is a HOT update (see
-- migration 00003).
--
-- The claim names idem_refuse, which the completion calls, and never calls
-- it: the status CASE's first arm reads it as a regprocedure constant, which
-- the parser resolves and the planner folds away (a column naming it, even
-- one folded to NULL, cost a projection step on every claim): on a database
-- below migration 8 the claim fails (ErrUnsupported) before fn runs, rather
-- than the completion after it, so that a service deployed before its
-- migration does not run fn's effects outside the database on every retry.
-- (The Citus forms do not: there the completion still refuses, after fn.)
-- name: KeyClaim :one
INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, created_at, completed_at, expires_at, body_expires_at,
                       unknown_at, status)
VALUES (@actor, @operation, @idem_key, @fingerprint, now(), now(),
        now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'),
        now() + (nullif(sqlc.arg(body_ttl_micros)::bigint, 0) * interval '1 microsecond'),
        NULL,
        CASE WHEN 'idem_refuse(text,text)'::regprocedure IS NULL THEN NULL
             WHEN set_config('idem.lock_timeout', current_setting('lock_timeout'), true) IS NULL THEN NULL
             WHEN set_config('lock_timeout', sqlc.arg(lock_timeout)::text, true) IS NULL THEN NULL
             ELSE 'processing' END)
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING (set_config('lock_timeout', current_setting('idem.lock_timeout'), true) IS NOT NULL)::boolean AS claimed;

-- Claims a key whose row is over: a finished row past its TTL (an expired
-- key is a new request), or a reservation that certainly did not execute
-- ('failed_retryable') asked for again with the same fingerprint. Returns no
-- row when the row holding the key is neither (another transaction took it
-- over first). Inserts when the row is gone (pruned). The row becomes Do's:
-- no token, lease or window (resume_until) of a reservation is left on it.
-- The wait is bounded, and idem_refuse named, as in KeyClaim. The DO
-- UPDATE reads the clock only from the proposed row (excluded.created_at
-- is now()), never calls a function of its own.
-- name: KeyTakeOver :one
INSERT INTO idem_keys AS k (actor, operation, idem_key, fingerprint, created_at, completed_at, expires_at, body_expires_at,
                            unknown_at, status)
VALUES (@actor, @operation, @idem_key, @fingerprint, now(), now(),
        now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'),
        now() + (nullif(sqlc.arg(body_ttl_micros)::bigint, 0) * interval '1 microsecond'),
        NULL,
        CASE WHEN 'idem_refuse(text,text)'::regprocedure IS NULL THEN NULL
             WHEN set_config('idem.lock_timeout', current_setting('lock_timeout'), true) IS NULL THEN NULL
             WHEN set_config('lock_timeout', sqlc.arg(lock_timeout)::text, true) IS NULL THEN NULL
             ELSE 'processing' END)
ON CONFLICT (actor, operation, idem_key) DO UPDATE
SET fingerprint      = excluded.fingerprint,
    status           = 'processing',
    response_status  = NULL,
    response_headers = NULL,
    response_body    = NULL,
    created_at       = excluded.created_at,
    completed_at     = excluded.completed_at,
    expires_at       = excluded.expires_at,
    body_expires_at  = excluded.body_expires_at,
    token            = 0,
    lease_expires_at = NULL,
    resume_until     = NULL,
    last_error       = NULL,
    resolve_reason   = NULL,
    unknown_at       = NULL
WHERE (k.expires_at <= excluded.created_at AND k.status IN ('succeeded', 'rejected', 'failed_retryable'))
   OR (k.status = 'failed_retryable' AND k.fingerprint = excluded.fingerprint)
RETURNING (set_config('lock_timeout', current_setting('idem.lock_timeout'), true) IS NOT NULL)::boolean AS claimed;

-- KeyClaim for Citus. On Citus the wait happens on the worker that holds
-- the key's shard, and set_config never reaches it (nor is idem.lock_timeout
-- known there): the call bounds the wait with SET LOCAL lock_timeout
-- statements around this one instead, which Citus propagates to the
-- workers (citus.propagate_set_commands = 'local'; see claim.go).
-- name: KeyClaimCitus :one
INSERT INTO idem_keys (actor, operation, idem_key, fingerprint, status, created_at, completed_at, expires_at, body_expires_at,
                       unknown_at)
VALUES (@actor, @operation, @idem_key, @fingerprint, 'processing', now(), now(),
        now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'),
        now() + (nullif(sqlc.arg(body_ttl_micros)::bigint, 0) * interval '1 microsecond'),
        NULL)
ON CONFLICT (actor, operation, idem_key) DO NOTHING
RETURNING true AS claimed;

-- KeyTakeOver for Citus (see KeyClaimCitus). Citus accepts the DO UPDATE
-- because it reads the clock only from the proposed row.
-- name: KeyTakeOverCitus :one
INSERT INTO idem_keys AS k (actor, operation, idem_key, fingerprint, status, created_at, completed_at, expires_at, body_expires_at,
                            unknown_at)
VALUES (@actor, @operation, @idem_key, @fingerprint, 'processing', now(), now(),
        now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'),
        now() + (nullif(sqlc.arg(body_ttl_micros)::bigint, 0) * interval '1 microsecond'),
        NULL)
ON CONFLICT (actor, operation, idem_key) DO UPDATE
SET fingerprint      = excluded.fingerprint,
    status           = 'processing',
    response_status  = NULL,
    response_headers = NULL,
    response_body    = NULL,
    created_at       = excluded.created_at,
    completed_at     = excluded.completed_at,
    expires_at       = excluded.expires_at,
    body_expires_at  = excluded.body_expires_at,
    token            = 0,
    lease_expires_at = NULL,
    resume_until     = NULL,
    last_error       = NULL,
    resolve_reason   = NULL,
    unknown_at       = NULL
WHERE (k.expires_at <= excluded.created_at AND k.status IN ('succeeded', 'rejected', 'failed_retryable'))
   OR (k.status = 'failed_retryable' AND k.fingerprint = excluded.fingerprint)
RETURNING true AS claimed;

-- Stores the final outcome of a key this transaction claimed, and fails
-- when the claimed row is not there as the claim left it: fn changed it
-- (its status, fingerprint, token, lease or expiry) or deleted it. The
-- failure is an error of this very statement (idem_refuse, SQLSTATE IDMRC,
-- migration 8), so that nothing sent after it in the same round trip runs: not
-- the COMMIT of DoInTx, not the RELEASE of Do's savepoint. The call then
-- undoes fn's writes and the claim (ErrKeyRowChanged).
--
-- One INSERT ... ON CONFLICT, no subquery or CTE around it: the refusal
-- lives in its RETURNING, which sees the row the statement wrote. The
-- update keeps token 0 only when the row is as the claim left it, and
-- writes -1 otherwise; should the row be gone, the proposed row (token -1,
-- which no claim writes) is inserted. Either way RETURNING then raises,
-- which undoes the write. (The CTE with an aggregate this replaced cost
-- about a tenth of a fresh call's server time in executor setup:
-- docs/benchmarks.md, "Issue 30: where the time went".)
--
-- The update changes status, the response columns and expires_at (to the
-- value the claim wrote: now() of the same transaction plus the TTL) and
-- token (to the value it had), none of them read by an index predicate and
-- the indexed ones unchanged, so it is HOT.
-- name: KeyComplete :exec
INSERT INTO idem_keys AS k (actor, operation, idem_key, fingerprint, status, token, expires_at,
                            response_status, response_headers, response_body, completed_at)
VALUES (@actor, @operation, @idem_key, @fingerprint, @status, -1,
        now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'),
        sqlc.arg(response_status)::integer, sqlc.narg(response_headers)::text::jsonb,
        sqlc.arg(response_body)::bytea, now())
ON CONFLICT (actor, operation, idem_key) DO UPDATE
SET status           = excluded.status,
    response_status  = excluded.response_status,
    response_headers = excluded.response_headers,
    response_body    = excluded.response_body,
    expires_at       = excluded.expires_at,
    token            = CASE WHEN k.status = 'processing' AND k.token = 0 AND k.lease_expires_at IS NULL
                              AND k.fingerprint = excluded.fingerprint AND k.expires_at = excluded.expires_at
                            THEN 0 ELSE -1 END
RETURNING CASE WHEN k.token = 0 THEN 1
               ELSE idem_refuse('IDMRC', 'idem_keys row changed under fn')
          END::integer AS stored;

-- KeyComplete for Citus, which refuses a function that is not IMMUTABLE in
-- a RETURNING clause: the same completion, its refusal in a query around
-- it, which the coordinator runs (the CTE costs executor setup that the
-- PostgreSQL form saves).
-- name: KeyCompleteCitus :exec
WITH stored AS (
    INSERT INTO idem_keys AS k (actor, operation, idem_key, fingerprint, status, token, expires_at,
                                response_status, response_headers, response_body, completed_at)
    VALUES (@actor, @operation, @idem_key, @fingerprint, @status, -1,
            now() + (sqlc.arg(ttl_micros)::bigint * interval '1 microsecond'),
            sqlc.arg(response_status)::integer, sqlc.narg(response_headers)::text::jsonb,
            sqlc.arg(response_body)::bytea, now())
    ON CONFLICT (actor, operation, idem_key) DO UPDATE
    SET status           = excluded.status,
        response_status  = excluded.response_status,
        response_headers = excluded.response_headers,
        response_body    = excluded.response_body,
        expires_at       = excluded.expires_at
    WHERE k.status = 'processing' AND k.token = 0 AND k.lease_expires_at IS NULL
      AND k.fingerprint = excluded.fingerprint AND k.expires_at = excluded.expires_at
    RETURNING k.token
)
SELECT CASE WHEN min(token) = 0 THEN 1
            ELSE idem_refuse('IDMRC', 'idem_keys row changed under fn (' || count(*) || ')')
       END::integer AS stored
FROM stored;

-- Reads the committed row that holds a key: its response, its TTL, lease
-- and body's time, and now() of the same statement, against which the
-- driver judges those (driver.Row.Judge: expired, leased, the lease's time
-- left, and whether the body is gone: NULL, which idem writes only when
-- Prune drops a body, or past its body_expires_at, as KeyLookup says it;
-- the drivers read NULL as nil and an empty body as empty, database/sql
-- through nullbytea.Bytes). Nothing is computed here: every expression in a read's
-- select list costs executor setup on every replay (until 2026-12-06 the
-- statement also computed expired, leased and the lease's time left, 8,800
-- instructions of the server's a replay, and whether the body was gone,
-- about 3,000 more; docs/benchmarks.md, issue 30's sixth and seventh
-- looks). A body_expires_at of +-infinity (idem never writes one) fails
-- database/sql's scan, as expires_at's does. Run only with enable_seqscan
-- off (see above).
-- name: KeyGet :one
SELECT fingerprint, status, response_status, response_headers, response_body,
       body_expires_at, expires_at, lease_expires_at, now()::timestamptz AS now
FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key;

-- Turns the row a claim of Do or DoInTx left committed without an outcome
-- ('processing', no token, no lease: fn committed the call's transaction
-- itself, or the process stopped before the call could run this) into an
-- outcome in doubt: fn's writes may be durable, so the key must never run
-- again blindly. The record becomes what a reservation whose lease ran out
-- becomes, so that ListUnknown finds it (a lease that ended now, no
-- completed_at: idem_keys_open_created_idx) and Resolve names it (a new
-- token, drawn in a CTE: see ReserveAcquire). Like a reservation's, its
-- body has no time of its own (body_expires_at NULL: the claim's BodyTTL
-- was for the response the call would have stored), so that a response
-- Resolve stores lives as long as the key. No row changed: no such row
-- (fn rolled back, and the claim with it; or another call marked it
-- first, KeyLookup tells).
-- name: KeyMarkUnknown :execrows
WITH next AS (SELECT nextval('idem_keys_token_seq') AS token)
UPDATE idem_keys
SET status           = 'unknown',
    token            = (SELECT next.token FROM next),
    lease_expires_at = now(),
    completed_at     = NULL,
    body_expires_at  = NULL,
    last_error       = sqlc.arg(reason)::text,
    unknown_at       = now()
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND status = 'processing' AND idem_keys.token = 0 AND lease_expires_at IS NULL
  AND fingerprint = @fingerprint;

-- Runs in the caller's transaction after fn ended the savepoint that Do ran
-- it in, when that savepoint was nested in a transaction still open (pgx's
-- Begin on a pgx.Tx: its Commit is RELEASE SAVEPOINT, which also releases
-- Do's own savepoint and keeps the claim and fn's writes in the enclosing
-- transaction). When the claim is there ('processing', no token, no lease,
-- the claim's fingerprint), the statement fails (idem_refuse, SQLSTATE
-- IDMCR, as in KeyComplete), which aborts the enclosing transaction: it
-- cannot commit the claim without an outcome. Otherwise (fn rolled back to
-- its savepoint, and the claim with it) it returns 0 and changes nothing.
-- name: KeyAbortIfClaimed :one
SELECT CASE WHEN count(*) = 0 THEN 0
            ELSE idem_refuse('IDMCR', 'fn released its claim into the enclosing transaction (' || count(*) || ')')
       END::integer AS claimed
FROM idem_keys
WHERE actor = @actor AND operation = @operation AND idem_key = @idem_key
  AND status = 'processing' AND token = 0 AND lease_expires_at IS NULL
  AND fingerprint = @fingerprint;
