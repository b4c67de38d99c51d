-- +goose Up
-- idem_events is the outbox: one row per event that idem.Publish wrote in
-- the application's transaction, sent by a Relay after that transaction
-- commits (docs/messages.md).
--   destination, id
--                  the receiver and the event's id there: the key. On
--                  Citus, destination is the distribution column.
--   topic, payload, header
--                  what is sent (header: a JSON object of string arrays,
--                  NULL when the event has none)
--   status         'pending' (to send, or being sent), 'delivered' (the
--                  receiver accepted it) or 'failed' (its schedule ran out,
--                  or the error was permanent; RetryEvent sends it again)
--   attempts       the attempts made so far, every claim counting one; the
--                  next attempt's number is attempts + 1
--   retry_from     attempts when RetryEvent last sent the event back (0
--                  before): the relay's schedule restarts from there
--   next_attempt_at
--                  pending: when the event is due (the key of
--                  idem_events_due_idx). A claim leaves it as it is
--   lease_until    the end of the last claim's lease (NULL before any, or
--                  after the attempt is recorded): a relay claims a due
--                  event only when this is NULL or past, so no other relay
--                  claims it while the lease lasts. No index reads it, nor
--                  attempts or claim: a claim is a HOT update (no index
--                  entry written), given room in the page (fillfactor)
--   claim          the claim's fencing token, one more at every claim: a
--                  relay records its attempt's outcome only while the event
--                  still carries the token it claimed it with, so a stalled
--                  relay's late answer never overwrites a newer claim's
--   created_at, delivered_at, failed_at
--                  when published, delivered, marked failed
--   delivered_attempt, delivery_started_at, delivery_micros
--                  the attempt that delivered the event: its number, when
--                  the relay called the Sender and how long it took. It is
--                  kept here rather than in idem_event_attempts, so that a
--                  delivery at the first attempt writes no row there
--   last_error     the last attempt's error; NULL after a delivery
--   retried_at, retry_reason
--                  the last RetryEvent, and the operator's reason
--   expires_at     when a delivered or failed event may be pruned; NULL
--                  while pending
CREATE TABLE idem_events (
    destination     text        NOT NULL,
    id              text        NOT NULL,
    topic           text        NOT NULL,
    payload         bytea       NOT NULL,
    header          jsonb,
    status          text        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts        integer     NOT NULL DEFAULT 0,
    retry_from      integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_until     timestamptz,
    claim           bigint      NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz,
    failed_at       timestamptz,
    delivered_attempt   integer,
    delivery_started_at timestamptz,
    delivery_micros     bigint,
    last_error      text,
    retried_at      timestamptz,
    retry_reason    text,
    expires_at      timestamptz,
    CONSTRAINT idem_events_pkey PRIMARY KEY (destination, id)
) WITH (fillfactor = 50);
-- fillfactor 50: half of each page is left free at insert, so that the
-- claim's new row version fits in the same page (a HOT update). A claim
-- takes events published together, which sit together in a few pages:
-- with 80, only about a quarter of a batch of 100 fitted (measured); with
-- 50, nearly all. The price: pages half full until their events are
-- delivered and pruned.

-- The relay's claim: the pending events that are due, earliest first. A
-- partial index holds only pending rows, so with a million of them the
-- claim reads the first few entries; delivered and failed rows are not in
-- it at all. The events under a lease stay in it at their place (the claim
-- does not move them) and the claim skips them by lease_until: at most
-- the relays' claimed events, a few hundred entries.
CREATE INDEX idem_events_due_idx ON idem_events (next_attempt_at) WHERE status = 'pending';

-- Pruning: the finished events past their expiry, earliest first.
CREATE INDEX idem_events_expires_idx ON idem_events (expires_at) WHERE expires_at IS NOT NULL;

-- The failed events, newest first (`idem events list --status failed`, the
-- console's deliveries page): only failed rows, so the list reads its page
-- however many events were delivered. The claim never writes its columns.
CREATE INDEX idem_events_failed_idx ON idem_events (created_at DESC, destination, id) WHERE status = 'failed';

-- idem_event_attempts is the attempt log: one row per attempt whose outcome
-- a relay recorded, except the attempt that delivered the event, which its
-- row in idem_events holds (an attempt cut by a relay's crash leaves none;
-- the event's attempts counts it). A delivery that came too late to count
-- (a newer claim, or RetryEvent, came first) has its row here.
--   destination, event_id
--                  the event (on Citus, co-located with idem_events by
--                  destination)
--   attempt        its number, from 1
--   started_at     when the relay called the Sender
--   duration_micros
--                  how long the Sender took
--   error          the Sender's error; NULL for a delivery
--   permanent      whether the error was marked idem.Permanent
--   claim          the claim the attempt was made under
CREATE TABLE idem_event_attempts (
    destination     text        NOT NULL,
    event_id        text        NOT NULL,
    attempt         integer     NOT NULL,
    started_at      timestamptz NOT NULL,
    duration_micros bigint      NOT NULL,
    error           text,
    permanent       boolean     NOT NULL DEFAULT false,
    claim           bigint      NOT NULL,
    CONSTRAINT idem_event_attempts_pkey PRIMARY KEY (destination, event_id, attempt)
);

-- +goose Down
-- Dropping the tables deletes the events that were published and not yet
-- delivered: the application committed them, and nothing would send them.
-- Refused (SQLSTATE IDMDN, saying how many) while events are pending or
-- failed, unless the connection sets idem.force_down to on (idem.MigrateDown
-- with Force, idem migrate down --force). Delivered events go without a
-- word. The table is locked first, so no event can be published between
-- the count and the drop.
LOCK TABLE idem_events IN ACCESS EXCLUSIVE MODE;
-- +goose StatementBegin
DO $$
DECLARE
    n bigint;
BEGIN
    IF coalesce(current_setting('idem.force_down', true), '') <> 'on' THEN
        SELECT count(*) INTO n FROM idem_events WHERE status IN ('pending', 'failed');
        IF n > 0 THEN
            RAISE EXCEPTION 'reverting migration 7 would delete % undelivered events (pending or failed, dropping idem_events)', n
                USING ERRCODE = 'IDMDN';
        END IF;
    END IF;
END
$$;
-- +goose StatementEnd
DROP TABLE idem_event_attempts;
DROP TABLE idem_events;
