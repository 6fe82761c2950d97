#!/usr/bin/env bash
# The MultiXact experiment of docs/benchmarks-archive.md, in raw SQL with pgbench (no Rust
# client in the way): the unfenced upsert, the fenced statement (one lease row, FOR KEY SHARE),
# and the same fence spread over 16 lease rows (client i share-locks row i % 16; a takeover
# would have to change the owner of all 16 rows, each a key column, so it still waits for every
# writer).
#
# usage: scripts/multixact_pgbench.sh        (libpq environment: PGHOST, PGPORT, PGUSER, ...)
#   CLIENTS=16 SECONDS_EACH=5 ROUNDS=5 VARIANTS="unfenced nolock fenced fenced16" \
#     scripts/multixact_pgbench.sh
#
# `nolock` is not a fence: the fenced statement without `FOR KEY SHARE`, to tell the cost of the
# statement's shape from the cost of the lock.
#
# Creates mx_kv, mx_lease and mx_lease16 in the target database (dropping them first) and drops
# them at the end. Variants run interleaved, ROUNDS times. Per run it prints the throughput,
# the MultiXacts created per transaction (growth of mxid_age(datminmxid)), the WAL bytes per
# transaction and, when the server runs on this machine (its postmaster is found as the parent
# of our backend), the server's CPU time per transaction from /proc.
set -euo pipefail

CLIENTS=${CLIENTS:-16}
SECONDS_EACH=${SECONDS_EACH:-5}
ROUNDS=${ROUNDS:-3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"; psql -qX -c "DROP TABLE IF EXISTS mx_kv, mx_lease, mx_lease16" >/dev/null 2>&1 || true' EXIT
export PGOPTIONS="${PGOPTIONS:-} -c client_min_messages=warning"
q() { psql -qXtA -c "$1"; }

# server_cpu_us: the server's CPU time so far (scripts/server_cpu.sh).
# shellcheck source=scripts/server_cpu.sh
source "$(dirname "$0")/server_cpu.sh"

psql -qX -v ON_ERROR_STOP=1 <<'SQL'
DROP TABLE IF EXISTS mx_kv, mx_lease, mx_lease16;
CREATE TABLE mx_kv (
    primary_namespace TEXT NOT NULL, secondary_namespace TEXT NOT NULL, key TEXT NOT NULL,
    value BYTEA NOT NULL, created_seq BIGINT GENERATED ALWAYS AS IDENTITY, epoch BIGINT NOT NULL,
    PRIMARY KEY (primary_namespace, secondary_namespace, key));
-- As pgfence's lease table: owner_id UNIQUE (a key column), fillfactor 10.
CREATE TABLE mx_lease (id INT PRIMARY KEY, owner_id UUID NOT NULL UNIQUE, epoch BIGINT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL) WITH (fillfactor = 10);
INSERT INTO mx_lease VALUES (1, '00000000-0000-0000-0000-000000000001', 1, now() + interval '1 day');
-- 16 fence rows; (id, owner_id) UNIQUE makes owner_id a key column of every row.
CREATE TABLE mx_lease16 (id INT PRIMARY KEY, owner_id UUID NOT NULL, epoch BIGINT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL, UNIQUE (id, owner_id)) WITH (fillfactor = 10);
INSERT INTO mx_lease16 SELECT i, '00000000-0000-0000-0000-000000000001', 1, now() + interval '1 day'
  FROM generate_series(0, 15) i;
INSERT INTO mx_kv (primary_namespace, secondary_namespace, key, value, epoch)
SELECT 'bench', 'kv', 'k' || i, decode(repeat('ab', 1024), 'hex'), 1 FROM generate_series(0, 1023) i;
VACUUM ANALYZE mx_kv, mx_lease, mx_lease16;
SQL

cat >"$dir/unfenced.sql" <<'SQL'
\set k random(0, 1023)
INSERT INTO mx_kv (primary_namespace, secondary_namespace, key, value, epoch)
VALUES ('bench', 'kv', 'k' || :k, decode(repeat('ab', 1024), 'hex'), 1)
ON CONFLICT (primary_namespace, secondary_namespace, key)
DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch;
SQL
cat >"$dir/fenced.sql" <<'SQL'
\set k random(0, 1023)
WITH lease AS (
    SELECT epoch FROM mx_lease
     WHERE id = 1 AND owner_id = '00000000-0000-0000-0000-000000000001'
       AND expires_at > clock_timestamp()
       FOR KEY SHARE
), written AS (
    INSERT INTO mx_kv (primary_namespace, secondary_namespace, key, value, epoch)
    SELECT 'bench', 'kv', 'k' || :k, decode(repeat('ab', 1024), 'hex'), lease.epoch FROM lease
    ON CONFLICT (primary_namespace, secondary_namespace, key)
    DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch
)
SELECT EXISTS (SELECT 1 FROM lease);
SQL
sed -e 's/FROM mx_lease$/FROM mx_lease16/' -e 's/WHERE id = 1 AND/WHERE id = :client_id % 16 AND/' \
    "$dir/fenced.sql" >"$dir/fenced16.sql"
# Not a fence: the fenced statement's shape without the row lock, to tell the cost of the CTE
# shape from the cost of the lock.
sed -e '/FOR KEY SHARE/d' "$dir/fenced.sql" >"$dir/nolock.sql"

for round in $(seq 1 "$ROUNDS"); do
    for variant in ${VARIANTS:-unfenced nolock fenced fenced16}; do
        mx0=$(q "SELECT mxid_age(datminmxid) FROM pg_database WHERE datname = current_database()")
        wal0=$(q "SELECT pg_current_wal_lsn() - '0/0'")
        cpu0=$(server_cpu_us)
        out=$(pgbench -n -M prepared -c "$CLIENTS" -j 2 -T "$SECONDS_EACH" -f "$dir/$variant.sql" 2>&1)
        mx1=$(q "SELECT mxid_age(datminmxid) FROM pg_database WHERE datname = current_database()")
        wal1=$(q "SELECT pg_current_wal_lsn() - '0/0'")
        cpu1=$(server_cpu_us)
        tx=$(sed -n 's/number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
        tps=$(sed -n 's/tps = \([0-9.]*\).*/\1/p' <<<"$out")
        lat=$(sed -n 's/latency average = \([0-9.]*\).*/\1/p' <<<"$out")
        cpu=-
        if [ -n "$cpu0" ] && [ -n "$cpu1" ]; then cpu=$(( (cpu1 - cpu0) / tx )); fi
        printf 'round=%s variant=%-8s clients=%s tps=%8.0f latency_ms=%s multixacts_per_tx=%.3f wal_bytes_per_tx=%.0f server_cpu_us_per_tx=%s\n' \
            "$round" "$variant" "$CLIENTS" "$tps" "$lat" \
            "$(bc -l <<<"($mx1 - $mx0) / $tx")" "$(bc -l <<<"($wal1 - $wal0) / $tx")" "$cpu"
    done
done
