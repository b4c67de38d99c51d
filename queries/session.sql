-- name: LockTimeoutPush :exec
-- Sets lock_timeout for the rest of the transaction, remembering the previous
-- value in a custom setting so LockTimeoutPop can restore it.
SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true),
       set_config('lock_timeout', sqlc.arg(lock_timeout)::text, true);

-- name: LockTimeoutPop :exec
-- Restores the lock_timeout saved by LockTimeoutPush.
SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true);
