-- pgfence schema version 4: compare namespaces and keys byte by byte (collation "C"), whatever
-- the database's default collation is.
--
-- Under a linguistic collation (en_US.UTF-8 and the like, the default of many databases) the
-- primary key's order comes from the C library or ICU, and it changes between their versions
-- (glibc 2.28 reordered even plain ASCII strings). After such an operating-system upgrade, an
-- index built under the old order silently misses rows and lets duplicate keys in, until it is
-- rebuilt. Byte order never changes, and to a KV store keys are opaque names.
-- `list` now returns keys in byte order everywhere.
--
-- Only the two indexes are rebuilt; the table is not rewritten. The rebuild locks the table
-- while it runs, once, in the setup transaction of the first store that takes the lease.
ALTER TABLE {kv}
    ALTER COLUMN primary_namespace   TYPE TEXT COLLATE "C",
    ALTER COLUMN secondary_namespace TYPE TEXT COLLATE "C",
    ALTER COLUMN key                 TYPE TEXT COLLATE "C";
