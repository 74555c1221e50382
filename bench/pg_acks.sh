#!/usr/bin/env bash
# ql-control on PostgreSQL: ACK transactions per second with 8 and 64 (or CLIENTS) concurrent mTLS
# clients (examples/ack_bench.rs, one keep-alive connection each, every fenced command
# one short transaction), side by side with `pgbench -N` at the same client count on the
# same server, their ratio, and the SQLite store's figure on the same machine. Also the
# store-level rate (tests/pg_throughput.rs: the same ACK cycle through the store, no
# HTTP or TLS), which isolates the database transaction from the transport. Last, what
# one ACK costs in CPU (PostgreSQL's processes, the server, the clients) beside what one
# pgbench transaction costs: on a machine they share, that bounds the ratio.
#
#   bench/pg_acks.sh            # prints the figures and the commands behind them
#   CYCLES_8=25 CYCLES_64=4 bench/pg_acks.sh   # shorter rounds
#   PG_BUFFERS=128MB bench/pg_acks.sh          # the cluster's shared_buffers (default 512MB: room for both databases)
#   PG_POOL=8 bench/pg_acks.sh                 # the replica's pg_pool_size (and the store-level pool)
#   PG_LANES=0 bench/pg_acks.sh                # the replica's pg_lanes (0: no group commit)
#   PG_FILL=1 bench/pg_acks.sh                 # the replica's pg_lane_fill (1: spread over every lane)
#   ROUNDS=3 bench/pg_acks.sh                  # three rounds in turn, a ratio for each
#   RENEWALS=50 bench/pg_acks.sh               # jobs of fifty lease renewals (default 5)
#   CLIENTS="8 16 32 64" bench/pg_acks.sh      # other client counts (default "8 64")
#   LOW_LATENCY=1 bench/pg_acks.sh             # the whole run (pgbench too) with idle cores kept
#                                              # awake: a CPU latency request of 0 (root)
#
#   SLICES=5 PGBENCH_SECONDS=2 bench/pg_acks.sh  # slices per round, and pgbench's seconds in each
#
# Each round alternates, for each client count, SLICES (3) slices of ACKs and of
# `pgbench -N` (PGBENCH_SECONDS, 4 s, each), and reads each rate over its slices: the host's
# load moves from second to second on a shared machine, and a ratio of figures taken
# minutes apart measured the host as much as the server. An ACK slice runs CYCLES_8 /
# CYCLES_64 cycles of RENEWALS + 3 ACKs per client (by default 5 renewals, a job of about
# a minute at the default 30 s lease, and 9,600 and 10,240 ACKs, a few seconds each; the
# default cycle counts shrink as RENEWALS grows, to keep about as many ACKs; other client
# counts run about 9,600 too), after a warm-up round of 8 clients that is not counted: a
# serving replica's pooled connections have their statements prepared and planned, as
# pgbench's have once it starts counting. The steal column says how much of the host's CPU
# time the hypervisor gave other guests during each kind of slice.
#
# The PostgreSQL server is a throwaway cluster (scripts/pg) started --durable: fsync and
# synchronous_commit on, as a deployment would run it (SQLite syncs its WAL before every answer that decides something).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet -p ql-control --bin ql-control --example ack_bench
cargo test --release --locked --quiet -p ql-control --test pg_throughput --no-run
bin=target/release/ql-control
bench=target/release/examples/ack_bench
work=$(mktemp -d /tmp/ql-pg-bench.XXXXXX)
cleanup() {
  kill -TERM ${pg_server:+"$pg_server"} ${sqlite_server:+"$sqlite_server"} 2>/dev/null || true
  wait 2>/dev/null || true
  scripts/pg stop "$work/cluster"
  rm -rf "$work"
}
trap cleanup EXIT

# LOW_LATENCY: a PM QoS request of 0 us held on /dev/cpu_dma_latency until the script
# exits, so that idle cores poll instead of sleeping (as a host tuned for latency does,
# e.g. tuned's latency-performance profile): every phase, pgbench's too, runs with it.
if [ -n "${LOW_LATENCY:-}" ]; then
  exec {qos}>/dev/cpu_dma_latency || { echo "LOW_LATENCY needs /dev/cpu_dma_latency writable (root)" >&2; exit 1; }
  echo 0 >&"$qos"
fi

eval "$(scripts/pg start "$work/cluster" --durable)"
pgbin=$(cat "$work/cluster/bindir")
# Room in shared buffers for both databases (pgbench's at scale 10 is about 160 MB, the
# default buffers 128 MB), as each would have on a server of its own: otherwise the
# phase after a pgbench run finds its tables evicted and writes pgbench's dirty pages out
# to read them back, while pgbench, whose tables ours barely displace, never pays back.
"$pgbin/psql" -X -q -h "$QL_PG_SOCKET" -U postgres -d postgres -c "ALTER SYSTEM SET shared_buffers = '${PG_BUFFERS:-512MB}'"
scripts/pg restart "$work/cluster"

# shellcheck source=bench/lib/pg.sh
source bench/lib/pg.sh
process_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ sub(/.*\) /, ""); print ($12 + $13) / hz }' "/proc/$1/stat"; }
# Runs a command, printing its output; its own CPU seconds (user + system) go to $work/time.
timed() { local TIMEFORMAT="%U %S"; { time "$@" 2>/dev/null; } 2>"$work/time"; }
own_cpu() { awk '{ print $1 + $2 }' "$work/time"; }
"$bin" migrate --database "$QL_PG_OWNER_URL" >/dev/null

# ack_bench enrols its workers as bench-<i> in DIR/bench-workers, and enrolment never
# overwrites a file: start each round from a fresh directory, with the CA certificate
# written first (its clients enrol concurrently).
fresh_workers() {
  rm -rf "$1/bench-workers"
  "$bin" enroll bench-warmup --dir "$1" --out "$1/bench-workers" >/dev/null
}

"$bin" init --dir "$work/pg-state" --host 127.0.0.1 >/dev/null
"$bin" init --dir "$work/sqlite-state" --host 127.0.0.1 >/dev/null
# 64 clients connect at once from one address: more than the per-address handshake cap
# that protects a real server. PG_POOL sets pg_pool_size (16 by default), PG_LANES
# pg_lanes and PG_FILL pg_lane_fill (the defaults when unset).
for state in "$work/pg-state" "$work/sqlite-state"; do
  python3 - "$state/control.json" "${PG_POOL:-16}" "${PG_LANES:-}" "${PG_FILL:-}" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["max_handshakes_per_ip"] = c["max_handshakes"]
c["pg_pool_size"] = int(sys.argv[2])
if sys.argv[3]:
    c["pg_lanes"] = int(sys.argv[3])
if sys.argv[4]:
    c["pg_lane_fill"] = int(sys.argv[4])
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
done
pg_server=$(start_server "$work/pg-state" --database "$QL_PG_URL")
pg_url=$(sed -n 's/^listening on //p' "$work/pg-state/serve.out")

# pgbench's own database, owned by the superuser, beside ours on the same server.
"$pgbin/psql" -X -q -h "$QL_PG_SOCKET" -U postgres -d postgres -c "CREATE DATABASE pgbench"
"$pgbin/pgbench" -q -i -s 10 -h "$QL_PG_SOCKET" -U postgres pgbench >/dev/null 2>&1

echo "# $(uname -m), $(nproc) cores; PostgreSQL $("$pgbin/postgres" --version | awk '{print $3}') (fsync on),"
echo "# server: $bin serve --database (one replica, pool of ${PG_POOL:-16} connections, pg_lanes ${PG_LANES:-default}, pg_lane_fill ${PG_FILL:-default})"
[ -z "${LOW_LATENCY:-}" ] || echo "# LOW_LATENCY: a CPU latency request of 0 us held for the whole run (idle cores poll)"
renewals=${RENEWALS:-5}
per_cycle=$((renewals + 3))
cycles_for() {
  case $1 in
    64) echo "${CYCLES_64:-$(((20 * 8 + per_cycle - 1) / per_cycle))}" ;;
    8) echo "${CYCLES_8:-$(((150 * 8 + per_cycle - 1) / per_cycle))}" ;;
    *) echo "$(((1200 * 8 / $1 + per_cycle - 1) / per_cycle))" ;;
  esac
}
fresh_workers "$work/pg-state"
"$bench" --dir "$work/pg-state" --url "$pg_url" --clients 8 --cycles 10 --renewals 5 --database "$QL_PG_URL" >/dev/null
# ROUNDS rounds in turn (for each client count, slices of ACKs and of pgbench in turn, then
# the store-level rate): pgbench's own rate moves between runs on a shared machine, so each
# ratio is of figures taken together.
rounds=${ROUNDS:-1}
# Checkpoints the server has made so far: a phase with one inside pays for full-page
# writes the others do not, so the summary marks such a round with `*`. (Forcing one
# before every phase would not be fairer: right after a checkpoint pgbench's random
# updates write a full page for nearly every row they touch.)
checkpoints() {
  "$pgbin/psql" -X -q -At -h "$QL_PG_SOCKET" -U postgres -d postgres \
    -c "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
}
# Every phase starts with both databases vacuumed and analysed, as pgbench vacuums its
# own tables before each run: otherwise autovacuum, set off by the phase before (pgbench's
# 50,000 updates or more, or a round's runs and events), works on the two cores during a
# round of a few seconds, and the round after a pgbench run paid for pgbench's upkeep.
settle() {
  for db in qinglong pgbench; do
    "$pgbin/psql" -X -q -h "$QL_PG_SOCKET" -U postgres -d "$db" -c "VACUUM (ANALYZE)"
  done
}
# The host's CPU time so far (/proc/stat, all cores): stolen and in all, in ticks. On a
# virtual machine the hypervisor's other guests take a share (steal) that moves from
# second to second, and it slows the ACK chain's many hand-offs more than pgbench's
# parallel backends: so each round alternates SLICES slices of each, and reports the
# steal both saw.
host_ticks() { awk '/^cpu / { t = 0; for (i = 2; i <= 9; i++) t += $i; print $9, t }' /proc/stat; }
declare -A marked
declare -A ack tps direct cost pgcost steal
slices=${SLICES:-3}
for round in $(seq "$rounds"); do
for clients in ${CLIENTS:-8 64}; do
  k=$clients.$round
  cycles=$(cycles_for "$clients")
  # Sums over the round's slices: ACKs, their seconds, the CPU seconds of the cluster,
  # the server and the clients over the ACK slices; pgbench's transactions, seconds and
  # CPU; the host's stolen and total ticks in each kind of slice.
  acks=0 ack_s=0 ack_pg=0 ack_server=0 ack_client=0 txs=0 tx_s=0 tx_pg=0 tx_client=0
  ack_steal=0 ack_ticks=0 tx_steal=0 tx_ticks=0
  for _ in $(seq "$slices"); do
    echo "\$ $bench --clients $clients --cycles $cycles --renewals $renewals --database \$QL_PG_URL"
    fresh_workers "$work/pg-state"
    settle
    c0=$(checkpoints)
    pg0=$(cluster_cpu "$work/cluster") server0=$(process_cpu "$pg_server")
    read -r st0 tt0 <<<"$(host_ticks)"
    line=$(timed "$bench" --dir "$work/pg-state" --url "$pg_url" --clients "$clients" --cycles "$cycles" --renewals "$renewals" \
      --database "$QL_PG_URL")
    read -r st1 tt1 <<<"$(host_ticks)"
    echo "$line"
    # What the ACKs cost in CPU seconds of the cluster, the server and the clients, the
    # slice's submits and enrolments included.
    read -r acks ack_s ack_pg ack_server ack_client < <(echo "$line" | awk -v acks="$acks" -v ack_s="$ack_s" \
      -v ack_pg="$ack_pg" -v pg0="$pg0" -v pg1="$(cluster_cpu "$work/cluster")" \
      -v ack_server="$ack_server" -v server0="$server0" -v server1="$(process_cpu "$pg_server")" \
      -v ack_client="$ack_client" -v client="$(own_cpu)" \
      '{ for (i = 1; i <= NF; i++) { if ($i == "ACK") n = $(i - 1); if ($i == "in") s = $(i + 1) } }
       END { print acks + n, ack_s + s, ack_pg + pg1 - pg0, ack_server + server1 - server0, ack_client + client }')
    ack_steal=$((ack_steal + st1 - st0)) ack_ticks=$((ack_ticks + tt1 - tt0))
    [ "$(checkpoints)" = "$c0" ] || marked[$k]="*"
    echo "\$ pgbench -N -c $clients -j 2 -T ${PGBENCH_SECONDS:-4} pgbench"
    settle
    c0=$(checkpoints)
    pg0=$(cluster_cpu "$work/cluster")
    read -r st0 tt0 <<<"$(host_ticks)"
    out=$(timed "$pgbin/pgbench" -N -c "$clients" -j 2 -T "${PGBENCH_SECONDS:-4}" -h "$QL_PG_SOCKET" -U postgres pgbench)
    read -r st1 tt1 <<<"$(host_ticks)"
    rate=$(echo "$out" | sed -n 's/^tps = \([0-9.]*\).*/\1/p' | head -1)
    n=$(echo "$out" | sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p')
    echo "pgbench -N: $rate tps"
    read -r txs tx_s tx_pg tx_client < <(awk -v txs="$txs" -v tx_s="$tx_s" -v n="$n" -v rate="$rate" \
      -v tx_pg="$tx_pg" -v pg0="$pg0" -v pg1="$(cluster_cpu "$work/cluster")" -v tx_client="$tx_client" -v client="$(own_cpu)" \
      'BEGIN { print txs + n, tx_s + n / rate, tx_pg + pg1 - pg0, tx_client + client }')
    tx_steal=$((tx_steal + st1 - st0)) tx_ticks=$((tx_ticks + tt1 - tt0))
    [ "$(checkpoints)" = "$c0" ] || marked[$k]="*"
  done
  read -r "ack[$k]" "cost[$k]" <<<"$(awk -v n="$acks" -v s="$ack_s" -v p="$ack_pg" -v v="$ack_server" -v c="$ack_client" \
    'BEGIN { printf "%.1f %.3f %.3f %.3f", n / s, p * 1e3 / n, v * 1e3 / n, c * 1e3 / n }')"
  read -r "tps[$k]" "pgcost[$k]" <<<"$(awk -v n="$txs" -v s="$tx_s" -v p="$tx_pg" -v c="$tx_client" \
    'BEGIN { printf "%.1f %.3f %.3f", n / s, p * 1e3 / n, c * 1e3 / n }')"
  steal[$k]=$(awk -v a="$ack_steal" -v b="$ack_ticks" -v c="$tx_steal" -v d="$tx_ticks" \
    'BEGIN { printf "%.0f / %.0f", a * 100 / b, c * 100 / d }')
  echo "\$ QL_BENCH_POOL=${PG_POOL:-16} QL_BENCH_LANES=${PG_LANES:-} QL_BENCH_FILL=${PG_FILL:-} QL_BENCH_CLIENTS=$clients QL_BENCH_CYCLES=$cycles QL_BENCH_RENEWALS=$renewals cargo test --release --test pg_throughput"
  settle
  line=$(QL_BENCH_POOL=${PG_POOL:-16} QL_BENCH_LANES=${PG_LANES:-} QL_BENCH_FILL=${PG_FILL:-} QL_BENCH_CLIENTS=$clients QL_BENCH_CYCLES=$cycles QL_BENCH_RENEWALS=$renewals cargo test --release --locked --quiet -p ql-control \
    --test pg_throughput -- --nocapture 2>/dev/null | grep '^store-level')
  echo "$line"
  direct[$k]=$(echo "$line" | awk '{for (i = 1; i <= NF; i++) if ($i == "ACK/s,") print $(i - 1)}')
done
done
kill -TERM "$pg_server"; wait "$pg_server" 2>/dev/null || true; pg_server=

sqlite_server=$(start_server "$work/sqlite-state")
sqlite_url=$(sed -n 's/^listening on //p' "$work/sqlite-state/serve.out")
fresh_workers "$work/sqlite-state"
"$bench" --dir "$work/sqlite-state" --url "$sqlite_url" --clients 8 --cycles 10 --renewals 5 >/dev/null
declare -A lite
for clients in ${CLIENTS:-8 64}; do
  cycles=$(cycles_for "$clients")
  echo "\$ $bench --clients $clients --cycles $cycles --renewals $renewals   # SQLite"
  fresh_workers "$work/sqlite-state"
  line=$("$bench" --dir "$work/sqlite-state" --url "$sqlite_url" --clients "$clients" --cycles "$cycles" --renewals "$renewals")
  echo "$line"
  lite[$clients]=$(echo "$line" | awk '{for (i = 1; i <= NF; i++) if ($i == "ACK/s,") print $(i - 1)}')
done

echo
echo "clients  PostgreSQL ACK/s (mTLS)  ratio  store-level ACK/s  ratio  pgbench -N tps  SQLite ACK/s (mTLS)  steal %"
echo "(each round $slices slices of ACKs and of pgbench in turn; steal %: the host's CPU time taken by the"
echo "hypervisor in the ACK slices / the pgbench slices; * a checkpoint fell inside a slice)"
for clients in ${CLIENTS:-8 64}; do
  for round in $(seq "$rounds"); do
    k=$clients.$round
    awk -v c="$clients" -v a="${ack[$k]}" -v d="${direct[$k]}" -v t="${tps[$k]}" \
      -v s="${lite[$clients]}" -v m="${marked[$k]:-}" -v st="${steal[$k]}" \
      'BEGIN { printf "%7d  %23.0f  %5.2f  %17.0f  %5.2f  %14.0f  %19.0f  %7s %s\n", c, a, a / t, d, d / t, t, s, st, m }'
  done
done
echo
echo "CPU ms of one ACK over mTLS (PostgreSQL, the server, the clients) and of one pgbench -N"
echo "transaction (PostgreSQL, pgbench), on the same $(nproc) cores; a ratio of 0.5 over mTLS needs"
echo "an ACK's whole cost under twice the transaction's:"
echo "clients  ACK: PostgreSQL  server  client  total   pgbench tx: PostgreSQL  pgbench  total"
for clients in ${CLIENTS:-8 64}; do
  for round in $(seq "$rounds"); do
    k=$clients.$round
    read -r p s c <<<"${cost[$k]}"
    read -r tp tc <<<"${pgcost[$k]}"
    awk -v n="$clients" -v p="$p" -v s="$s" -v c="$c" -v tp="$tp" -v tc="$tc" \
      'BEGIN { printf "%7d  %15.3f  %6.3f  %6.3f  %5.3f   %22.3f  %7.3f  %5.3f\n", n, p, s, c, p + s + c, tp, tc, tp + tc }'
  done
done
