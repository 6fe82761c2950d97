# Sourced by the pgbench scripts (scripts/multixact_pgbench.sh, scripts/pin_cost.sh): the server's
# CPU time, for a figure per transaction. Needs psql and the libpq environment of the server.
#
# server_cpu_us prints the CPU time (µs, from clock ticks) of the postmaster and all its
# children, live (utime + stime) and exited (the postmaster's cutime + cstime: pgbench's backends
# exit at its end). It prints nothing if the server is not on this machine. The postmaster is
# found as the parent of the checkpointer, a long-lived child. Unlike a latency, the figure
# leaves out waits, such as for the WAL flush.
checkpointer=$(psql -qXtA -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'")
postmaster=$(sed 's/.*) //' "/proc/$checkpointer/stat" 2>/dev/null | awk '{print $2}' || true)
server_cpu_us() {
    [ -n "$postmaster" ] || return 0
    local hz total=0 pid stat
    hz=$(getconf CLK_TCK)
    for stat in /proc/[0-9]*/stat; do
        pid=${stat#/proc/}; pid=${pid%/stat}
        # Fields after the ")" of the command name: 2 = ppid, 12 = utime, 13 = stime.
        read -r ppid ticks children < <(sed 's/.*) //' "$stat" 2>/dev/null |
            awk '{print $2, $12 + $13, $14 + $15}') || continue
        if [ "$pid" = "$postmaster" ]; then total=$((total + ticks + children)); fi
        if [ "$ppid" = "$postmaster" ]; then total=$((total + ticks)); fi
    done
    echo $((total * 1000000 / hz))
}
