-- pgfence schema version 1: the KV rows and the lease row.
-- {kv} and {lease} are replaced by the quoted table names before this runs.

CREATE TABLE {kv} (
    primary_namespace   TEXT   NOT NULL,
    secondary_namespace TEXT   NOT NULL,
    key                 TEXT   NOT NULL,
    value               BYTEA  NOT NULL,
    -- Creation order for newest-first pagination; an update keeps the original number.
    created_seq         BIGINT GENERATED ALWAYS AS IDENTITY,
    -- Epoch of the lease under which the row was last written.
    epoch               BIGINT NOT NULL,
    PRIMARY KEY (primary_namespace, secondary_namespace, key)
);

-- Exactly one row. owner_id is UNIQUE so that it is a key column: a takeover (which changes
-- owner_id) conflicts with the FOR KEY SHARE lock every mutation takes, while a renewal
-- (which changes only expires_at) does not. A low fillfactor leaves room on the page so each
-- renewal is a HOT update and dead row versions do not pile up in front of the writers.
CREATE TABLE {lease} (
    id          INT         PRIMARY KEY CHECK (id = 1),
    owner_id    UUID        NOT NULL UNIQUE,
    epoch       BIGINT      NOT NULL,
    expires_at  TIMESTAMPTZ NOT NULL,
    acquired_at TIMESTAMPTZ NOT NULL,
    holder_host TEXT        NOT NULL,
    holder_pid  INT         NOT NULL,
    holder_app  TEXT        NOT NULL
) WITH (fillfactor = 10);
