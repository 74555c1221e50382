#!/usr/bin/env bash
# ql-control benchmark: ACK transactions per second and p50/p99 latency on the SQLite
# store with 1, 8 and 64 concurrent mTLS clients (one keep-alive connection each) on
# loopback; the server's fsync/fdatasync calls per round (perf stat), so ACKs per sync call
# and the 64-client rate as a multiple of the 1-client rate; and the server's peak RSS
# after three 64 MiB artifact uploads (measured first, on a fresh server, so the ACK runs
# do not inflate it).
#
#   bench/control.sh            # prints the figures and the commands behind them
#   BIN=/path/ql-control ACK_BENCH=/path/ack_bench bench/control.sh   # other builds
#   PROFILE=1 bench/control.sh  # also where the server's CPU went in each round (perf)
#   SET='{"commit_window_us": 0}' bench/control.sh   # with other settings
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-target/release/ql-control}
bench=${ACK_BENCH:-target/release/examples/ack_bench}
if [ -z "${BIN:-}${ACK_BENCH:-}" ]; then
  cargo build --release --locked --quiet -p ql-control --bin ql-control --example ack_bench
fi
work=$(mktemp -d /tmp/ql-bench.XXXXXX)
trap 'kill -TERM "${server:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$bin" init --dir "$work" --host 127.0.0.1 >/dev/null
# 64 clients connect at once from one address: more than the per-address handshake cap
# that protects a real server.
# SET='{"commit_window_us": 0}' changes any other setting of control.json.
python3 - "$work/control.json" "${SET:-{\}}" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["max_handshakes_per_ip"] = c["max_handshakes"]
c.update(json.loads(sys.argv[2]))
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
"$bin" serve --dir "$work" --listen 127.0.0.1:0 --operator-listen 127.0.0.1:0 >"$work/serve.out" 2>"$work/serve.err" &
server=$!
for _ in $(seq 100); do grep -q '^listening on ' "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
url=$(sed -n 's/^listening on //p' "$work/serve.out")
# The server's fsync and fdatasync calls, counted by the kernel's syscall tracepoints
# (perf stat: no stop of the server, unlike strace).
count_syncs() { perf stat -x, -e syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync -p "$server" -o "$work/syncs" & }
syncs() { awk -F, '$3 ~ /sys_enter_f/ {n += $1} END {print n + 0}' "$work/syncs"; }

echo "# $(uname -m), $(nproc) cores; server: $bin serve (SQLite, WAL synced before every answer that decides)"
echo "\$ $bench --clients 0 --uploads 3 --upload-mib 64"
"$bench" --dir "$work" --url "$url" --clients 0 --cycles 0 --uploads 3 --upload-mib 64
echo "server peak RSS (VmHWM) after the uploads: $(awk '/VmHWM/ {print $2, $3}' /proc/$server/status)"
declare -A rate
for clients in 1 8 64; do
  # Long enough (a few seconds each) for a steady figure, not a burst into empty tables.
  cycles=$(( clients == 64 ? 30 : clients == 8 ? 100 : 300 ))
  echo "\$ $bench --clients $clients --cycles $cycles --renewals 5"
  count_syncs; counter=$!
  [ -z "${PROFILE:-}" ] || { perf record -q -F 999 -g -p "$server" -o "$work/perf.data" 2>/dev/null & profiler=$!; }
  line=$("$bench" --dir "$work" --url "$url" --clients "$clients" --cycles "$cycles" --renewals 5)
  kill -INT "$counter"; wait "$counter" 2>/dev/null || true
  synced=$(syncs)
  if [ -n "${PROFILE:-}" ]; then
    kill -INT "$profiler"; wait "$profiler" 2>/dev/null || true
    echo "server CPU by function (perf, self time; top 25):"
    perf report -q -i "$work/perf.data" --no-children --sort dso,sym --percent-limit 0.7 2>/dev/null \
      | grep -v '^$' | grep '%' | head -25
  fi
  echo "$line"
  acks=$(echo "$line" | awk '{print $3}')
  rate[$clients]=$(echo "$line" | awk '{for (i = 1; i <= NF; i++) if ($i == "ACK/s,") print $(i - 1)}')
  # The round's sync calls include those of its polls and claims (and of the submits the
  # server noticed), so the figure is a lower bound on ACKs per fsync.
  echo "server fsync+fdatasync calls: $synced, $(awk -v a="$acks" -v s="$synced" 'BEGIN {printf "%.1f", a / (s ? s : 1)}') ACKs per sync call"
done
echo "64 clients / 1 client: $(awk -v a="${rate[64]}" -v b="${rate[1]}" 'BEGIN {printf "%.2f", a / b}') x the ACK rate"
