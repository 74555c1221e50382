# shellcheck shell=bash
# Shared by bench/pg_acks.sh and bench/pg_ceiling.sh (sourced, not run): the CPU a
# throwaway PostgreSQL cluster has used, and a ql-control server started for a round.
# Expects $bin (the ql-control binary).

# CPU seconds the cluster in DIR has used so far: the postmaster's own and its reaped
# children's (backends of clients that have gone), and its live children's.
cluster_cpu() { # DIR
  python3 - "$(head -1 "$1/data/postmaster.pid")" <<'PY'
import os, sys
postmaster, ticks = int(sys.argv[1]), 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if int(pid) == postmaster:
        ticks += sum(map(int, f[11:15]))  # utime, stime, cutime, cstime
    elif int(f[1]) == postmaster:
        ticks += int(f[11]) + int(f[12])
print(ticks / os.sysconf("SC_CLK_TCK"))
PY
}

# Starts `ql-control serve` on the state directory DIR (further arguments go to serve),
# waits until it listens and prints its pid; its address is in DIR/serve.out.
start_server() { # DIR [--database URL]
  # shellcheck disable=SC2154 # $bin is the sourcing script's
  "$bin" serve --dir "$1" --listen 127.0.0.1:0 --operator-listen 127.0.0.1:0 "${@:2}" >"$1/serve.out" 2>"$1/serve.err" &
  local pid=$!
  for _ in $(seq 100); do grep -q '^listening on ' "$1/serve.out" 2>/dev/null && break; sleep 0.1; done
  echo "$pid"
}
