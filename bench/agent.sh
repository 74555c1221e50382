#!/usr/bin/env bash
# ql-agent footprint (issue 4, "Footprint"): against a real ql-control over mTLS on
# loopback, prints each figure with the command that produced it:
#
#   - the stripped release binary's size (the size profile of the root Cargo.toml);
#   - RSS and threads of an agent connected for IDLE_SECS (default 60) seconds, and where
#     its RSS is (per mapping, from /proc/<pid>/smaps);
#   - what a running job's supervisor (`ql-agent supervise`) holds: Rss, Pss and its
#     private pages (/proc/<pid>/smaps_rollup);
#   - peak RSS (VmHWM) of a fresh agent that ran one job printing 1 MiB, and of another
#     that ran RUNS (default 5) jobs printing 64 MiB each: separate processes, so each peak
#     is its own; the most threads seen while the jobs ran, and (with strace, which the
#     1 MiB agent runs under) every thread the agent created in its life;
#   - the live log (PROTOCOL section 13): for each 64 MiB job, the time from its last byte
#     (the job stamps the wall clock into a file once `head` has written it) to `succeeded`
#     (the run's `finishedAt`), and the whole run from `running` to `succeeded` (the log streams
#     while the job runs; the job is held back by its pipe as fast as the log goes out);
#     next to it a `curl --data-binary` of the same 64 MiB as one artifact frame to the same
#     server (`ack_bench --frame-out` prepares the attempt), timed after the TLS handshake:
#     what a single upload of the whole log costs after the job ended. Medians.
#     With AGENT= an older agent that uploads in one frame, the same figures are its own.
#   - what the artifact store holds for each 64 MiB run once it succeeded (`du -sb` of
#     the run's directory, after at most 10 s for the live log's chunks to be removed),
#     and how many chunk files are left.
#
# Which agent binary (AGENT=... picks one):
#   AGENT=shipped (the default when cross/build's toolchain is installed): the x86_64 binary
#     that ships, built as the router binaries are (`cross/build x86_64-unknown-linux-musl`:
#     static musl, std rebuilt with the size profile); the figures issue 4's targets mean;
#   AGENT=cargo (the default otherwise): `cargo build --release` with the workspace's rustup
#     toolchain, dynamically linked to glibc; TARGET=x86_64-unknown-linux-musl builds it
#     static with rustup's prebuilt musl std instead;
#   AGENT=/path/to/ql-agent: that binary as it is.
# CONTROL=/path/to/ql-control runs that server instead of the workspace's release build.
#
#   bench/agent.sh                        # about 1.5 minutes after the build
#   IDLE_SECS=5 RUNS=1 bench/agent.sh     # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
IDLE_SECS=${IDLE_SECS:-60}
RUNS=${RUNS:-5}
MIB=$((1024 * 1024))

if [ -z "${AGENT:-}" ]; then
  if cross/build --check >/dev/null 2>&1; then AGENT=shipped; else AGENT=cargo; fi
fi
case "$AGENT" in
shipped)
  cross/build x86_64-unknown-linux-musl >&2
  agent=cross/out/x86_64-unknown-linux-musl/ql-agent
  built="cross/build x86_64-unknown-linux-musl (static musl, std built with the size profile)"
  ;;
cargo)
  if [ -n "${TARGET:-}" ]; then
    # ring compiles C for the target; on an x86_64 host the host gcc does for x86_64 musl.
    cc_var=CC_${TARGET//-/_}
    if [[ $TARGET == x86_64-*-musl ]] && [ -z "${!cc_var:-}" ] && ! command -v musl-gcc >/dev/null; then
      export "$cc_var=gcc"
    fi
    cargo build --release --locked --quiet -p ql-agent --bin ql-agent --target "$TARGET"
    agent=target/$TARGET/release/ql-agent
  else
    cargo build --release --locked --quiet -p ql-agent --bin ql-agent
    agent=target/release/ql-agent
  fi
  built="cargo build --release${TARGET:+ --target $TARGET} ($(rustc --version | cut -d' ' -f1-2), prebuilt std)"
  ;;
*)
  agent=$AGENT
  built="given as AGENT"
  ;;
esac
[ -x "$agent" ] || { echo "bench/agent.sh: no agent binary at $agent" >&2; exit 1; }
cargo build --release --locked --quiet -p ql-control --bin ql-control --example ack_bench
control=${CONTROL:-target/release/ql-control}
bench=target/release/examples/ack_bench
command -v curl >/dev/null || { echo "bench/agent.sh: curl is needed for the throughput comparison" >&2; exit 1; }

work=$(mktemp -d /tmp/ql-agent-bench.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "${KEEP:-0}" = 1 ]; then echo "state kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

mib() { awk -v kb="$1" 'BEGIN { printf "%.2f MiB", kb / 1024 }'; }
field() { awk -v f="$1:" '$1 == f { print $2 }' "/proc/$2/status"; }
status_lines() {
  echo "  \$ grep -E 'VmRSS|VmHWM|RssAnon|RssFile|Threads' /proc/$1/status"
  grep -E 'VmRSS|VmHWM|RssAnon|RssFile|Threads' "/proc/$1/status" | sed 's/^/  /'
}
# Waits up to 30 s for a line matching $2 in file $1.
await_line() {
  for _ in $(seq 300); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "bench/agent.sh: timed out waiting for \`$2\` in $1:" >&2
  cat "$1" >&2
  exit 1
}
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

"$control" init --dir "$work/control" --host 127.0.0.1 >/dev/null
"$control" enroll bench-agent --dir "$work/control" --out "$work/creds" >/dev/null
"$control" serve --dir "$work/control" --listen 127.0.0.1:0 --operator-listen 127.0.0.1:0 >"$work/serve.out" 2>"$work/serve.err" &
pids+=($!)
await_line "$work/serve.out" '^listening on '
url=$(sed -n 's/^listening on //p' "$work/serve.out")

# Starts an agent, default settings, with a state directory $1 of its own, under the
# wrapper command in the other arguments if any; sets $apid (the agent) and $wpid (what to
# wait for).
start_agent() {
  local name=$1
  shift
  "$@" "$agent" run --server "$url" --worker-id bench-agent --cert "$work/creds/bench-agent.crt" \
    --key "$work/creds/bench-agent.key" --ca "$work/creds/ca.crt" --state-dir "$work/$name" \
    2>"$work/$name.err" &
  wpid=$!
  apid=$wpid
  pids+=("$wpid")
  if [ $# -gt 0 ]; then
    # The wrapper's child that runs the agent's binary: strace forks a probe of its own
    # first, which exits at once.
    apid=
    local child children
    for _ in $(seq 100); do
      # One line of pids without a newline: read fills the array and says end of file.
      children=()
      read -ra children 2>/dev/null <"/proc/$wpid/task/$wpid/children" || true
      for child in "${children[@]}"; do
        [ "$(readlink -f "/proc/$child/exe" 2>/dev/null)" = "$(readlink -f "$agent")" ] && apid=$child
      done
      [ -n "$apid" ] && break
      sleep 0.1
    done
    [ -n "$apid" ] || { echo "bench/agent.sh: no agent started under $1" >&2; exit 1; }
  fi
  await_line "$work/$name.err" 'session .* opened'
}
stop_agent() {
  kill -TERM "$apid"
  wait "$wpid" || true
}
# Keeps the most threads of process $1 in file $2 until the file is removed.
sample_threads() {
  local max=0 t
  while [ -f "$2" ] && t=$(field Threads "$1" 2>/dev/null) && [ -n "$t" ]; do
    if [ "$t" -gt "$max" ]; then max=$t; echo "$max" >"$2"; fi
    sleep 0.02
  done
}
# Submits a job printing $1 bytes (then stamping the time into $work/last-byte) and waits
# until its run has succeeded; sets $run.
run_job() {
  local status=
  run=$("$control" submit --dir "$work/control" --log-limit "$1" -- sh -c \
    "head -c $1 /dev/zero; date +%s%3N >$work/last-byte")
  for _ in $(seq 1200); do
    status=$("$control" show "$run" --dir "$work/control" --json | sed -n 's/^  "status": "\(.*\)",$/\1/p')
    case "$status" in succeeded) return 0 ;; failed | cancelled | timed_out) break ;; esac
    sleep 0.1
  done
  echo "bench/agent.sh: run $run ended ${status:-nowhere}" >&2
  "$control" show "$run" --dir "$work/control" >&2
  exit 1
}
# The run's times, from `show --json` and the job's stamp of its last byte (ms since the
# epoch, in file $2): "<last byte to succeeded ms> <running to succeeded ms>".
run_times() {
  "$control" show "$1" --dir "$work/control" --json | python3 -c '
import json, sys
from datetime import datetime, timezone
t = lambda s: datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp() * 1000
run = json.load(sys.stdin)
last = int(open(sys.argv[1]).read())
print(round(t(run["finishedAt"]) - last), round(t(run["finishedAt"]) - t(run["startedAt"])))' "$2"
}

echo "# ql-agent footprint on $(uname -m), $(nproc) cores, Linux $(uname -r); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# agent: $agent ($(file -b "$agent" | cut -d, -f1-2 | sed 's/ LSB//')), default settings"
echo "#   built by $built"
echo "# ql-control: $control serve (SQLite) on $url"
echo

size=$(stat -c %s "$agent")
echo "binary (stripped; profile.release: opt-level z, LTO, 1 codegen unit, panic abort):"
echo "  \$ stat -c %s $agent"
echo "  $size bytes = $(mib $((size / 1024)))"
echo

start_agent idle
echo "idle: an agent connected for $IDLE_SECS s (session open, long-polling):"
sleep "$IDLE_SECS"
status_lines "$apid"
echo "  \$ awk '...sum Rss per mapping...' /proc/$apid/smaps"
awk '/^[0-9a-f]+-[0-9a-f]+ / { m = $6 == "" ? "[anonymous]" : $6 }
  /^Rss:/ { rss[m] += $2 }
  END { for (m in rss) if (rss[m] > 0) printf "  %6d kB  %s\n", rss[m], m }' "/proc/$apid/smaps" | sort -rn
idle_rss=$(field VmRSS "$apid")
idle_threads=$(field Threads "$apid")
stop_agent
echo

# A job's supervisor (ql-agent supervise, the same binary): what one running job costs
# besides the agent. Pss shares the binary's pages among the processes that map them;
# Private_Dirty is what this process alone holds.
start_agent supervised
await_line "$work/supervised.err" " opened (heartbeat"
run=$("$control" submit --dir "$work/control" -- sh -c 'sleep 60')
await_line "$work/supervised.err" ": running"
spid=$(pgrep -f -- " supervise $work/supervised/" | head -n 1)
echo "a running job's supervisor (one per job), beside the agent:"
echo "  \$ grep -E '^(Rss|Pss|Private_Clean|Private_Dirty):' /proc/$spid/smaps_rollup"
grep -E '^(Rss|Pss|Private_Clean|Private_Dirty):' "/proc/$spid/smaps_rollup" | sed 's/^/  /'
sup_dirty=$(awk '/^Private_Dirty:/ { print $2 }' "/proc/$spid/smaps_rollup")
sup_rss=$(awk '/^Rss:/ { print $2 }' "/proc/$spid/smaps_rollup")
echo "  the agent meanwhile: VmRSS $(field VmRSS "$apid") kB (idle: $idle_rss kB)"
"$control" cancel "$run" --dir "$work/control" >/dev/null
stop_agent
echo

declare -A peak most
created=
tail_ms=()
whole_ms=()
store_lines=()
curl_ms=()
curl_lines=()
for case in 1 64; do
  bytes=$((case * MIB))
  n=1
  wrapper=()
  if [ "$case" = 1 ] && command -v strace >/dev/null; then
    # Only clone and clone3 stop the agent (seccomp-bpf), so it runs at about full speed.
    wrapper=(strace -f -qq --seccomp-bpf -e 'trace=clone,clone3' -e signal=none -o "$work/clone.trace")
  fi
  start_agent "log$case" "${wrapper[@]}"
  echo 1 >"$work/threads$case"
  sample_threads "$apid" "$work/threads$case" &
  if [ "$case" = 64 ]; then
    n=$RUNS
    "$bench" --dir "$work/control" --url "$url" --clients 0 --cycles 0 --uploads "$RUNS" --upload-mib 64 \
      --frame-out "$work/frame" >"$work/frame.out"
    pem() { sed -n "s/^$1 //p" "$work/frame.out"; }
    mapfile -t targets < <(pem url)
  fi
  echo "peak: a fresh agent runs $n job(s) printing $case MiB (\`head -c $bytes /dev/zero\`, --log-limit $bytes):"
  for i in $(seq 0 $((n - 1))); do
    run_job "$bytes"
    [ "$case" = 64 ] || continue
    read -r tail whole < <(run_times "$run" "$work/last-byte")
    tail_ms+=("$tail")
    whole_ms+=("$whole")
    # The run's share of the artifact store, once its chunks are gone (or 10 s passed).
    rundir=$(find "$work/control/artifacts" -mindepth 2 -maxdepth 2 -type d -name "$run")
    for _ in $(seq 100); do
      [ -z "$(find "$rundir" -name '*.chunk.*' -print -quit)" ] && break
      sleep 0.1
    done
    store_bytes=$(du -sb "$rundir" | cut -f1)
    store_lines+=("  $store_bytes bytes = $(mib $((store_bytes / 1024))), $(find "$rundir" -name '*.chunk.*' | wc -l) chunk file(s) left")
    # The same bytes with curl, right after the agent's upload, to the same server.
    cmd=(curl -sS --cacert "$(pem ca)" --cert "$(pem cert)" --key "$(pem key)" -X PUT
      -H 'Content-Type: application/vnd.qinglong.worker-artifact' -H 'Expect: 100-continue'
      --data-binary "@$work/frame" -o "$work/curl.body")
    read -r code connected total < <("${cmd[@]}" -w '%{http_code} %{time_appconnect} %{time_total}\n' "${targets[$i]}")
    [ "$code" = 200 ] || { echo "bench/agent.sh: curl got $code: $(cat "$work/curl.body")" >&2; exit 1; }
    curl_ms+=("$(awk -v c="$connected" -v t="$total" 'BEGIN { printf "%d", (t - c) * 1000 }')")
    curl_lines+=("  $code in $(awk -v t="$total" 'BEGIN { printf "%d", t * 1000 }') ms, ${curl_ms[-1]} ms after the handshake: $(cat "$work/curl.body")")
  done
  status_lines "$apid"
  peak[$case]=$(field VmHWM "$apid")
  most[$case]=$(cat "$work/threads$case")
  rm "$work/threads$case"
  echo "  most threads seen (Threads in /proc/$apid/status every 20 ms while the jobs ran): ${most[$case]}"
  echo "  \$ grep -E 'log (stored|sealed)' $work/log$case.err"
  grep -E 'log (stored|sealed)' "$work/log$case.err" | sed 's/^/  /'
  stop_agent
  if [ "${#wrapper[@]}" -gt 0 ]; then
    # strace -f follows the job's supervisor too: count the agent's own lines (each starts
    # with the pid that made the call).
    created=$(awk -v p="$apid" '$1 == p && /CLONE_THREAD/' "$work/clone.trace" | wc -l)
    echo "  \$ ${wrapper[*]} $agent run ...; awk '\$1 == $apid && /CLONE_THREAD/' $work/clone.trace | wc -l"
    echo "  threads the agent created in its whole life (start, connect, the job, drain): $created"
  fi
  echo
done
echo "the 64 MiB runs, from \`ql-control show RUN --json\`: last byte (the completion's finishedAt) to"
echo "succeeded (the run's finishedAt), and running to succeeded:"
for i in "${!tail_ms[@]}"; do echo "  ${tail_ms[$i]} ms after the last byte; ${whole_ms[$i]} ms in all"; done
echo

echo "the artifact store for each 64 MiB run once it succeeded:"
echo "  \$ du -sb $work/control/artifacts/PROJECT/RUN; find ... -name '*.chunk.*' | wc -l"
printf '%s\n' "${store_lines[@]}"
echo

echo "curl: after each of the agent's 64 MiB runs, the same 64 MiB as an artifact frame of an"
echo "attempt held at running (by ack_bench), to the same server:"
echo "  \$ $bench --clients 0 --cycles 0 --uploads $RUNS --upload-mib 64 --frame-out $work/frame"
echo "  \$ $(printf '%q ' "${cmd[@]}")-w '%{http_code} %{time_appconnect} %{time_total}' URL"
printf '%s\n' "${curl_lines[@]}"
echo

tail_med=$(printf '%s\n' "${tail_ms[@]}" | median)
whole_med=$(printf '%s\n' "${whole_ms[@]}" | median)
curl_med=$(printf '%s\n' "${curl_ms[@]}" | median)
rate() { awk -v ms="$1" 'BEGIN { printf "%.0f MiB/s", 64 / (ms / 1000) }'; }
threads_most=$((most[1] > most[64] ? most[1] : most[64]))
echo "# summary (targets for x86_64)"
row() { printf '%-38s %-20s %s\n' "$@"; }
row "binary, stripped" "$(mib $((size / 1024)))" "<= 1.50 MiB"
row "RSS after ${IDLE_SECS} s connected" "$(mib "$idle_rss")" "<= 2.00 MiB"
row "peak RSS, 1 MiB log" "$(mib "${peak[1]}")" "about the 64 MiB one"
row "peak RSS, 64 MiB log" "$(mib "${peak[64]}")" "<= 2.50 MiB"
row "threads: idle / most seen / created" "$idle_threads / $threads_most / ${created:-?}" "<= 2"
row "a job's supervisor: private / RSS" "$sup_dirty kB / $sup_rss kB" "per running job"
row "64 MiB log: last byte to succeeded" "$tail_med ms" "median of $RUNS"
row "64 MiB log: running to succeeded" "$whole_med ms" "$(rate "$whole_med") end to end, median of $RUNS"
row "64 MiB in one frame, curl" "$curl_med ms" "$(rate "$curl_med"), after the handshake"
row "64 MiB log: artifact store after" "${store_lines[0]# }" "the log stored once"
