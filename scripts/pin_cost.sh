#!/usr/bin/env bash
# What pinning durability and isolation costs per fenced write (issue 27, item 3: at most 3% of
# a write at a ~1.2 ms round trip), in raw SQL with pgbench (no Rust client in the way).
#
# usage: scripts/pin_cost.sh        (libpq environment: PGHOST, PGPORT, PGUSER, ...)
#   ROUNDS=7 SECONDS_EACH=5 RTT_MS=1.2 VARIANTS="stmt stmt-pinned-tx stmt-tx fn fn-nopin" \
#     scripts/pin_cost.sh
#
# The store pins `synchronous_commit` (at least on) and read committed in three ways
# (docs/design.md, "Durability of `Ok`"). None adds a round trip, so the cost is server time:
#   (a) its own sessions: set once per connection (sql::READ_COMMITTED), nothing per write;
#   (b) a pool passed in, or a transaction pooler: BEGIN ISOLATION LEVEL READ COMMITTED and a
#       set_config(..., true) pipelined before the statement and COMMIT (sql::BEGIN_READ_COMMITTED);
#   (c) the fenced function (migration 6), behind a transaction pooler: an isolation check and
#       a PERFORM set_config inside the function.
#
# Every variant is one client writing a 1 KiB value to a random key among 64, fenced by the
# lease row, at the session defaults synchronous_commit = on and read committed (PGOPTIONS, as
# (a) leaves them):
#   stmt               the fenced statement (sql::WRITE), prepared, autocommit: path (a).
#   stmt-pinned-tx     BEGIN ISOLATION LEVEL READ COMMITTED; SELECT set_config(..., true); the
#                      statement; COMMIT, in one pipeline, prepared: path (b)'s server work.
#   stmt-tx            the same pipeline with a plain BEGIN and no set_config: (b) unpinned.
#   fn                 SELECT "<t>_fenced_write"(...), the function as shipped: path (c).
#   fn-nopin           the same function without its isolation check and set_config: (c) unpinned.
#   simple-pinned      path (b) as the store sends it: BEGIN_READ_COMMITTED as one simple-query
#                      message (pgbench joins its two statements with `\;`), so its SELECT is
#                      parsed and planned every time; then the statement and COMMIT, unpipelined
#                      (pgbench pipelines no simple queries; the round trips are the same in all
#                      simple-* variants and cancel out).
#   simple-unpinned    the same with BEGIN ISOLATION LEVEL READ COMMITTED alone.
#   simple-setlocal    the same with SET LOCAL synchronous_commit = on: an alternative that would
#                      not keep remote_apply.
#   simple-cte         a plain BEGIN, and the pin as a CTE of the fenced statement: another
#                      alternative.
#
# Pin costs: stmt-pinned-tx - stmt-tx, fn - fn-nopin, simple-* - simple-unpinned, from the median
# latency over rounds; also the median of the per-round differences. Each is then given as a
# share of a fenced write at a round trip of RTT_MS: RTT_MS + the stmt variant's latency here.
#
# The WAL flush of each commit varies with the disk's other users far more than a pin costs; on a
# shared machine, run the server with fsync = off to see the pin (the commit path is the same,
# the flush is a write to the page cache). The share of the write is then an upper bound: the
# write's latency here lacks its flush. The server's CPU time per transaction is printed too;
# it leaves out the waits. Under CPU contention, the best round (min) is the steadiest figure.
#
# Creates the tables and functions of a store named pincost, from migrations/, and
# pincost_fenced_write_nopin (dropping them first); drops them at the end. Variants run
# interleaved, ROUNDS times.
set -euo pipefail

SECONDS_EACH=${SECONDS_EACH:-5}
ROUNDS=${ROUNDS:-3}
RTT_MS=${RTT_MS:-1.2}
VARIANTS=${VARIANTS:-stmt stmt-pinned-tx stmt-tx fn fn-nopin simple-pinned simple-unpinned simple-setlocal simple-cte}
dir=$(mktemp -d)
cleanup() {
    rm -rf "$dir"
    psql -qX >/dev/null 2>&1 <<'SQL' || true
DROP FUNCTION IF EXISTS "pincost_fenced_write"(UUID, TEXT, TEXT, TEXT, BYTEA, TEXT);
DROP FUNCTION IF EXISTS "pincost_fenced_write_nopin"(UUID, TEXT, TEXT, TEXT, BYTEA, TEXT);
DROP FUNCTION IF EXISTS "pincost_fenced_remove"(UUID, TEXT, TEXT, TEXT, TEXT);
DROP TABLE IF EXISTS "pincost", "pincost_lease", "pincost_crash_marker";
SQL
}
trap cleanup EXIT
# The session as the store's own (path (a)) leaves it: read committed, synchronous commit on.
export PGOPTIONS="${PGOPTIONS:-} -c client_min_messages=warning -c synchronous_commit=on \
-c default_transaction_isolation=read\\ committed"

q() { psql -qXtA -c "$1"; }

# server_cpu_us: the server's CPU time so far (scripts/server_cpu.sh).
# shellcheck source=scripts/server_cpu.sh
source "$(dirname "$0")/server_cpu.sh"

OWNER=00000000-0000-0000-0000-000000000001
# A 1 KiB value as bytea's hex text, sent as a parameter like the store's.
VALUE="\\x$(head -c 1024 /dev/zero | tr '\0' 'a' | od -An -v -tx1 | tr -d ' \n')"

# The store's own migrations, with their placeholders replaced as src/sql.rs (`substitute`)
# does. The function without its pin is migration 6's write function less its isolation check
# and its set_config: not a store's function.
names=(-e 's/{kv_created_index}/"pincost_created_idx"/g' -e 's/{kv}/"pincost"/g'
    -e 's/{lease}/"pincost_lease"/g' -e 's/{crash_marker}/"pincost_crash_marker"/g'
    -e 's/{write_fn}/"pincost_fenced_write"/g' -e 's/{remove_fn}/"pincost_fenced_remove"/g')
migrations=$(cd "$(dirname "$0")/../migrations" && pwd)
nopin=$(sed -n '/^CREATE OR REPLACE FUNCTION {write_fn}(/,/^END \$fn\$;/p' \
    "$migrations/0006_fenced_functions.sql" |
    sed -e "/IF current_setting('transaction_isolation')/,/END IF;/d" \
        -e '/PERFORM set_config/,/ELSE _commit END, true);/d' \
        -e 's/{write_fn}/"pincost_fenced_write_nopin"/' "${names[@]}")
grep -q 'pincost_fenced_write_nopin' <<<"$nopin" && ! grep -q set_config <<<"$nopin"
{
    cat <<'SQL'
DROP FUNCTION IF EXISTS "pincost_fenced_write"(UUID, TEXT, TEXT, TEXT, BYTEA, TEXT);
DROP FUNCTION IF EXISTS "pincost_fenced_write_nopin"(UUID, TEXT, TEXT, TEXT, BYTEA, TEXT);
DROP FUNCTION IF EXISTS "pincost_fenced_remove"(UUID, TEXT, TEXT, TEXT, TEXT);
DROP TABLE IF EXISTS "pincost", "pincost_lease", "pincost_crash_marker";
SQL
    cat "$migrations"/0*.sql | sed "${names[@]}"
    echo "$nopin"
    cat <<'SQL'
-- Held by the benchmark's owner id for 10 years.
INSERT INTO "pincost_lease"
    (id, owner_id, epoch, expires_at, acquired_at, holder_host, holder_pid, holder_app)
VALUES (1, :'owner', 1, now() + interval '10 years', now(), 'bench', 0, 'pin_cost.sh');
SQL
} | psql -qX -v ON_ERROR_STOP=1 -v owner="$OWNER"
psql -qX -v ON_ERROR_STOP=1 <<'SQL'
-- Every key exists: each write is an update, a store's steady state.
INSERT INTO "pincost" (primary_namespace, secondary_namespace, key, value, epoch)
SELECT 'r', 's', 'k' || i, decode(repeat('61', 1024), 'hex'), 1 FROM generate_series(0, 63) i;
VACUUM ANALYZE "pincost", "pincost_lease";
SQL

# sql::WRITE with the table names filled in; $1..$5 are pgbench variables (parameters).
cat >"$dir/write.sql" <<'SQL'
WITH lease AS (
    SELECT epoch, expires_at FROM "pincost_lease"
     WHERE id = 1 AND owner_id = :owner::uuid AND expires_at > clock_timestamp()
       FOR KEY SHARE
), valid AS (
    SELECT epoch FROM lease WHERE expires_at > clock_timestamp()
), written AS (
    INSERT INTO "pincost" (primary_namespace, secondary_namespace, key, value, epoch)
    SELECT 'r', 's', 'k' || :k, :value::bytea, valid.epoch FROM valid
    ON CONFLICT (primary_namespace, secondary_namespace, key)
    DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch
)
SELECT EXISTS (SELECT 1 FROM valid);
SQL
write=$(cat "$dir/write.sql")

{ echo '\set k random(0, 63)'; echo "$write"; } >"$dir/stmt.sql"
cat >"$dir/stmt-pinned-tx.sql" <<SQL
\\set k random(0, 63)
\\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, true);
$write
COMMIT;
\\endpipeline
SQL
sed -e 's/^BEGIN ISOLATION LEVEL READ COMMITTED;/BEGIN;/' -e '/set_config/d' \
    "$dir/stmt-pinned-tx.sql" >"$dir/stmt-tx.sql"
# As the store sends BEGIN_READ_COMMITTED: one simple-query message (pgbench's `\;` joins the
# statements into one), then the statement and COMMIT, each a message of its own here. The
# three differ only in the first message; the round trips they add are the same.
{
    echo '\set k random(0, 63)'
    echo "BEGIN ISOLATION LEVEL READ COMMITTED \\; SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, true);"
    # The simple protocol puts a variable's text into the statement: quote it.
    sed -e "s/:owner::uuid/':owner'::uuid/" -e "s/:value::bytea/':value'::bytea/" <<<"$write"
    echo 'COMMIT;'
} >"$dir/simple-pinned.sql"
sed 's/ \\; SELECT set_config.*;$/ \\; SET LOCAL synchronous_commit = on;/' \
    "$dir/simple-pinned.sql" >"$dir/simple-setlocal.sql"
sed 's/ \\; SELECT set_config.*;$/;/' "$dir/simple-pinned.sql" >"$dir/simple-unpinned.sql"
# The pin as a CTE of the statement itself (sql::pinned), after a plain BEGIN.
sed "s/^SELECT EXISTS (SELECT 1 FROM valid);\$/, pinned AS (SELECT set_config('synchronous_commit', \
CASE current_setting('synchronous_commit') WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, true))\\
SELECT EXISTS (SELECT 1 FROM valid) FROM pinned;/" "$dir/simple-unpinned.sql" >"$dir/simple-cte.sql"
grep -q 'FROM pinned;' "$dir/simple-cte.sql"
cat >"$dir/fn.sql" <<'SQL'
\set k random(0, 63)
SELECT "pincost_fenced_write"(:owner::uuid, 'r', 's', 'k' || :k, :value::bytea, 'on');
SQL
sed 's/"pincost_fenced_write"/"pincost_fenced_write_nopin"/' "$dir/fn.sql" >"$dir/fn-nopin.sql"

for variant in $VARIANTS; do
    [ -f "$dir/$variant.sql" ] || { echo "unknown variant: $variant" >&2; exit 2; }
done
# Epoch 0 on every key: at the end, epoch 1 (the lease's) shows which keys the fence let through.
psql -qX -c 'UPDATE "pincost" SET epoch = 0' >/dev/null

results="$dir/results"
for round in $(seq 1 "$ROUNDS"); do
    for variant in $VARIANTS; do
        mode=prepared
        case $variant in simple-*) mode=simple ;; esac
        cpu0=$(server_cpu_us)
        out=$(pgbench -n -M "$mode" -c 1 -j 1 -T "$SECONDS_EACH" -D owner="$OWNER" \
            -D value="$VALUE" -f "$dir/$variant.sql" 2>&1) || { echo "$out" >&2; exit 1; }
        cpu1=$(server_cpu_us)
        tx=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
        tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out")
        lat=$(sed -n 's/^latency average = \([0-9.]*\).*/\1/p' <<<"$out")
        cpu=-
        if [ -n "$cpu0" ] && [ -n "$cpu1" ]; then cpu=$(( (cpu1 - cpu0) / tx )); fi
        printf 'round=%s variant=%-16s mode=%-8s tps=%7.0f latency_ms=%s server_cpu_us_per_tx=%s\n' \
            "$round" "$variant" "$mode" "$tps" "$lat" "$cpu"
        echo "$round $variant $tps $lat $cpu" >>"$results"
    done
done
written=$(psql -qXtA -c 'SELECT count(*) FROM "pincost" WHERE epoch = 1')
echo "keys written under the lease: $written of 64"

# Per variant the medians over rounds; per pin the difference of the medians, the median of the
# per-round differences (rounds are interleaved, so a round's variants share its conditions),
# and the same for the server's CPU time.
awk -v rtt="$RTT_MS" -v variants="$VARIANTS" '
function median(list,   a, n, i, j, t) {
    n = split(list, a, " ")
    if (n == 0) return "-"
    for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) {
        t = a[j]; a[j] = a[j - 1]; a[j - 1] = t
    }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{
    tps[$2] = tps[$2] " " $3; lat[$2] = lat[$2] " " $4; at[$1, $2] = $4
    if ($5 != "-") { cpu[$2] = cpu[$2] " " $5; cpu_at[$1, $2] = $5 }
    rounds[$1] = 1
}
function minimum(list,   a, n, i, m) {
    n = split(list, a, " ")
    m = a[1]
    for (i = 2; i <= n; i++) if (a[i] + 0 < m + 0) m = a[i]
    return m
}
function pin(name, with, without,   d, r, diffs, cpu_diffs) {
    if (!((with) in lat) || !((without) in lat)) return
    for (r in rounds) if ((r, with) in at && (r, without) in at) {
        diffs = diffs " " (at[r, with] - at[r, without]) * 1000
        if ((r, with) in cpu_at && (r, without) in cpu_at)
            cpu_diffs = cpu_diffs " " cpu_at[r, with] - cpu_at[r, without]
    }
    printf "%s: %s - %s\n", name, with, without
    d = (median(lat[with]) - median(lat[without])) * 1000
    printf "  latency     %+7.1f us = %+6.2f%% of the write (per-round median %+7.1f us)\n", \
        d, d / 10 / write_ms, median(diffs)
    d = (minimum(lat[with]) - minimum(lat[without])) * 1000
    printf "  best round  %+7.1f us = %+6.2f%% of the write (difference of the minimum latencies)\n", \
        d, d / 10 / write_ms
    if (!((with) in cpu) || !((without) in cpu)) return
    d = median(cpu[with]) - median(cpu[without])
    printf "  server CPU  %+7.1f us = %+6.2f%% of the write (per-round median %+7.1f us)\n", \
        d, d / 10 / write_ms, median(cpu_diffs)
}
END {
    printf "\n%-16s %11s %8s %14s %15s   (medians of %d rounds; min: best round)\n", \
        "variant", "latency ms", "tps", "server CPU us", "min latency ms", length(rounds)
    n = split(variants, v, " ")
    for (i = 1; i <= n; i++) if (v[i] in lat)
        printf "%-16s %11.4f %8.0f %14s %15.3f\n", v[i], median(lat[v[i]]), median(tps[v[i]]), \
            (v[i] in cpu) ? median(cpu[v[i]]) : "-", minimum(lat[v[i]])
    if (!("stmt" in lat)) exit
    write_ms = rtt + median(lat["stmt"])
    printf "\nThe write: a fenced write at a %s ms round trip takes %s ms + the stmt latency here", \
        rtt, rtt
    printf " = %.3f ms.\nTarget: a pin costs at most 3%% of it, %.1f us.\n\n", write_ms, write_ms * 30
    pin("pin (b), prepared", "stmt-pinned-tx", "stmt-tx")
    pin("pin (c), the function", "fn", "fn-nopin")
    pin("pin (b), as the store sends it", "simple-pinned", "simple-unpinned")
    pin("pin (b) as SET LOCAL", "simple-setlocal", "simple-unpinned")
    pin("pin (b) as a CTE of the statement", "simple-cte", "simple-unpinned")
}' "$results"
