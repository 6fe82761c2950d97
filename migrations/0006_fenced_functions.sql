-- pgfence schema version 6: a fenced write and a fenced remove as server-side functions, for
-- stores that do not own their server sessions (behind a transaction pooler, or on a pool
-- passed in). {write_fn}, {remove_fn}, {kv} and {lease} are replaced by quoted names.
--
-- Behind a transaction pooler every statement is unnamed, so a plain statement is parsed and
-- planned on every execution. PL/pgSQL caches each statement's plan in the server session,
-- across the clients a pooler hands that session to. So a write is one cheap unnamed
-- `SELECT {write_fn}(...)`, with no BEGIN and no COMMIT around it: its implicit transaction
-- commits when the statement ends.
--
-- Each function does what the fenced statement in src/sql.rs (WRITE, REMOVE) and the
-- pipelined BEGIN ISOLATION LEVEL READ COMMITTED around it do, in the same order:
--
-- 1. It refuses to run at any level but read committed (SQLSTATE PF001), before it changes
--    anything. A function cannot change the level of the transaction it runs in; a pooler's
--    neighbour may have set `default_transaction_isolation`. Only read committed re-reads the
--    lease row after waiting for its lock (see src/sql.rs, WRITE). The client then runs the
--    statement in its own BEGIN ISOLATION LEVEL READ COMMITTED instead.
-- 2. It sets `synchronous_commit` for the transaction only: `_commit` is 'on' (at least on: a
--    session's 'remote_apply' is kept), or 'off' for a write that is meant to commit
--    asynchronously. The commit right after the statement obeys it.
-- 3. It locks the lease row FOR KEY SHARE, by owner id and expiry, and checks the expiry again
--    once the lock is granted. The lock is held until commit, so a takeover (which changes
--    owner_id, a key column) waits for this write. Returns false, changing nothing, when the
--    lease is not held by `_owner`.
-- 4. It changes the key, and returns true.
--
-- SECURITY INVOKER (the default): the caller's privileges on the tables apply. EXECUTE is
-- granted to PUBLIC by default. CREATE OR REPLACE: a function left behind by a dropped table
-- of the same name is replaced.

CREATE OR REPLACE FUNCTION {write_fn}(
    _owner UUID, _primary TEXT, _secondary TEXT, _key TEXT, _value BYTEA, _commit TEXT)
RETURNS BOOLEAN LANGUAGE plpgsql AS $fn$
DECLARE
    _epoch   BIGINT;
    _expires TIMESTAMPTZ;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pgfence: a fenced write runs at read committed, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'PF001';
    END IF;
    PERFORM set_config('synchronous_commit',
        CASE WHEN _commit = 'on' AND current_setting('synchronous_commit') = 'remote_apply'
             THEN 'remote_apply' ELSE _commit END, true);
    SELECT epoch, expires_at INTO _epoch, _expires FROM {lease}
     WHERE id = 1 AND owner_id = _owner AND expires_at > clock_timestamp()
       FOR KEY SHARE;
    IF NOT FOUND OR _expires <= clock_timestamp() THEN
        RETURN false;
    END IF;
    INSERT INTO {kv} (primary_namespace, secondary_namespace, key, value, epoch)
    VALUES (_primary, _secondary, _key, _value, _epoch)
    ON CONFLICT (primary_namespace, secondary_namespace, key)
    DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch;
    RETURN true;
END $fn$;

CREATE OR REPLACE FUNCTION {remove_fn}(
    _owner UUID, _primary TEXT, _secondary TEXT, _key TEXT, _commit TEXT)
RETURNS BOOLEAN LANGUAGE plpgsql AS $fn$
DECLARE
    _expires TIMESTAMPTZ;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pgfence: a fenced remove runs at read committed, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'PF001';
    END IF;
    PERFORM set_config('synchronous_commit',
        CASE WHEN _commit = 'on' AND current_setting('synchronous_commit') = 'remote_apply'
             THEN 'remote_apply' ELSE _commit END, true);
    SELECT expires_at INTO _expires FROM {lease}
     WHERE id = 1 AND owner_id = _owner AND expires_at > clock_timestamp()
       FOR KEY SHARE;
    IF NOT FOUND OR _expires <= clock_timestamp() THEN
        RETURN false;
    END IF;
    DELETE FROM {kv}
     WHERE primary_namespace = _primary AND secondary_namespace = _secondary AND key = _key;
    RETURN true;
END $fn$;
