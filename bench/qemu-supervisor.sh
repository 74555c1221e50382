#!/usr/bin/env bash
# What a running job's supervisor (`ql-agent supervise`) costs on a router's CPU, measured
# under qemu user-mode emulation: a cross-built agent (cross/build TARGET) against a real
# ql-control over mTLS on loopback, one job running, and the supervisor's Rss, Pss and
# private pages (/proc/<pid>/smaps_rollup) next to the agent's own.
#
#   sudo bench/qemu-supervisor.sh mipsel-unknown-linux-musl [AGENT_BINARY]
#
# A supervisor is the agent's own binary executed again, which under plain
# `qemu-<arch>-static ql-agent` fails (the kernel cannot run a foreign binary), so the
# agent then runs jobs itself (README, "Jobs outlive the agent"). This script registers the
# emulator with binfmt_misc for the run, so the agent's re-execution goes through qemu too,
# as on a router it would run natively; it needs root, and removes the registration it
# made. Every figure includes the emulator's own memory (qemu maps the guest's pages and
# its translation cache into the process), so it is an upper bound of the native cost.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: bench/qemu-supervisor.sh TARGET [AGENT_BINARY]}
agent=${2:-cross/out/$target/ql-agent}
# The magic and mask of each target's ELF header (machine, endianness), as Debian's
# qemu-user-binfmt registers them, and the oldest core cross/qemu-e2e emulates.
case "$target" in
mipsel-unknown-linux-musl)
  qemu=qemu-mipsel-static cpu=24Kc
  magic='\x7fELF\x01\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\x08\x00'
  mask='\xff\xff\xff\xff\xff\xff\xff\x00\xfe\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
  ;;
mips-unknown-linux-musl)
  qemu=qemu-mips-static cpu=24Kc
  magic='\x7fELF\x01\x02\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\x08'
  mask='\xff\xff\xff\xff\xff\xff\xff\x00\xfe\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff'
  ;;
armv7-unknown-linux-musleabihf)
  qemu=qemu-arm-static cpu=cortex-a7
  magic='\x7fELF\x01\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\x28\x00'
  mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
  ;;
aarch64-unknown-linux-musl)
  qemu=qemu-aarch64-static cpu=cortex-a53
  magic='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
  mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
  ;;
*) echo "bench/qemu-supervisor.sh: a router target: mipsel-, mips-, armv7-, aarch64-...-musl*" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "bench/qemu-supervisor.sh: registering with binfmt_misc needs root" >&2; exit 1; }
emulator=$(command -v "$qemu") || { echo "bench/qemu-supervisor.sh: $qemu not found: apt-get install qemu-user-static" >&2; exit 1; }
[ -x "$agent" ] || { echo "bench/qemu-supervisor.sh: no agent binary at $agent: run cross/build $target" >&2; exit 1; }
cargo build --release --locked --quiet -p ql-control --bin ql-control
control=target/release/ql-control

binfmt=/proc/sys/fs/binfmt_misc
entry=ql-bench-$target
work=$(mktemp -d /tmp/ql-qemu-supervisor.XXXXXX)
pids=()
mounted=
apid=
cleanup() {
  # No drain: the agent, then the job's supervisor (which outlives the agent by design).
  [ -z "$apid" ] || kill -KILL "$apid" 2>/dev/null || true
  pkill -KILL -f -- " supervise $work/" 2>/dev/null || true
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ ! -e "$binfmt/$entry" ] || echo -1 >"$binfmt/$entry"
  [ -z "$mounted" ] || umount "$binfmt"
  rm -rf "$work"
}
trap cleanup EXIT
if [ ! -e "$binfmt/register" ]; then
  mount -t binfmt_misc binfmt_misc "$binfmt"
  mounted=1
fi
# The kernel reads the \x escapes of magic and mask itself. F: it opens the emulator now,
# so it is found whatever the mount namespace of the process that executes a binary.
[ ! -e "$binfmt/$entry" ] || echo -1 >"$binfmt/$entry" # left by an interrupted run
printf ':%s:M::%s:%s:%s:F\n' "$entry" "$magic" "$mask" "$emulator" >"$binfmt/register"
export QEMU_CPU=$cpu

await_line() {
  for _ in $(seq 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "bench/qemu-supervisor.sh: timed out waiting for \`$2\` in $1:" >&2
  cat "$1" >&2
  exit 1
}
rollup() { grep -E '^(Rss|Pss|Private_Clean|Private_Dirty):' "/proc/$1/smaps_rollup" | sed 's/^/  /'; }

"$control" init --dir "$work/control" --host 127.0.0.1 >/dev/null
"$control" enroll bench-agent --dir "$work/control" --out "$work/creds" >/dev/null
"$control" serve --dir "$work/control" --listen 127.0.0.1:0 --operator-listen 127.0.0.1:0 >"$work/serve.out" 2>"$work/serve.err" &
pids+=($!)
await_line "$work/serve.out" '^listening on '
url=$(sed -n 's/^listening on //p' "$work/serve.out")

echo "# $agent ($(file -b "$agent" | cut -d, -f1-2 | sed 's/ LSB//')) on $(uname -m), through binfmt_misc: $emulator, QEMU_CPU=$cpu"
"$agent" run --server "$url" --worker-id bench-agent --cert "$work/creds/bench-agent.crt" \
  --key "$work/creds/bench-agent.key" --ca "$work/creds/ca.crt" --state-dir "$work/agent" 2>"$work/agent.err" &
apid=$!
disown "$apid" # killed, not waited for
await_line "$work/agent.err" " opened (heartbeat"
if grep -q 'without a supervisor' "$work/agent.err"; then
  echo "bench/qemu-supervisor.sh: the agent could not start a supervisor:" >&2
  cat "$work/agent.err" >&2
  exit 1
fi
echo "the agent, connected and idle:"
echo "  \$ grep -E '^(Rss|Pss|Private_Clean|Private_Dirty):' /proc/$apid/smaps_rollup"
rollup "$apid"
run=$("$control" submit --dir "$work/control" -- sh -c 'sleep 60')
await_line "$work/agent.err" ": running"
spid=$(pgrep -f -- " supervise $work/agent/" | head -n 1)
[ -n "$spid" ] || { echo "bench/qemu-supervisor.sh: no supervisor process for the running job" >&2; exit 1; }
echo "a running job's supervisor (pid $spid: $(tr '\0' ' ' <"/proc/$spid/cmdline" | cut -c1-60)...):"
echo "  \$ grep -E '^(Rss|Pss|Private_Clean|Private_Dirty):' /proc/$spid/smaps_rollup"
rollup "$spid"
echo "the agent meanwhile:"
rollup "$apid"
"$control" cancel "$run" --dir "$work/control" >/dev/null
