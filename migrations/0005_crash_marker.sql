-- pgfence schema version 5: the crash marker, for deferred writes.
--
-- An UNLOGGED table writes no WAL. PostgreSQL empties it in every crash recovery: after an
-- immediate stop or a server crash, and when the postmaster reinitializes after one backend
-- crashed. A standby has no rows of it either, so a promoted replica starts with it empty. The
-- store writes a token of its own into its one row when it takes the lease. `flush()` checks,
-- in its durable commit, that the token is still there. If it is gone, the server crashed or
-- failed over since, and deferred writes not flushed before may be lost (src/sql.rs, FLUSH).

CREATE UNLOGGED TABLE IF NOT EXISTS {crash_marker} (
    id    INT  PRIMARY KEY CHECK (id = 1),
    token UUID NOT NULL
);
