#!/usr/bin/env bash
# ql-control's artifact stores side by side: three 64 MiB artifact uploads over mTLS on
# loopback, each into a fresh server, first with the state directory's files, then into an
# S3 bucket (s3s-fs from scripts/s3, on loopback too); the upload throughput ack_bench
# reports and the server's peak RSS (VmHWM) after them.
#
#   bench/s3.sh            # prints the figures and the commands behind them
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet -p ql-control --bin ql-control --example ack_bench
bin=target/release/ql-control
bench=target/release/examples/ack_bench
s3s=$(scripts/s3 install)
work=$(mktemp -d /tmp/ql-bench-s3.XXXXXX)
stop_all() {
  kill -TERM "${server:-}" 2>/dev/null || true
  wait 2>/dev/null || true
  scripts/s3 stop "$work/s3" 2>/dev/null || true
  rm -rf "$work"
}
trap stop_all EXIT

# One store's run: a fresh state directory and server, three uploads, its peak RSS.
measure() {
  local name=$1; shift
  local dir="$work/$name"
  "$bin" init --dir "$dir" --host 127.0.0.1 >/dev/null
  "$bin" serve --dir "$dir" --listen 127.0.0.1:0 --operator-listen 127.0.0.1:0 "$@" \
    >"$dir.out" 2>"$dir.err" &
  server=$!
  for _ in $(seq 100); do grep -q '^listening on ' "$dir.out" 2>/dev/null && break; sleep 0.1; done
  local url
  url=$(sed -n 's/^listening on //p' "$dir.out")
  [ -n "$url" ] || { cat "$dir.err" >&2; exit 1; }
  echo "## $(sed -n 's/^ql-control: //p' "$dir.err" | head -1)"
  echo "\$ $bench --clients 0 --cycles 0 --uploads 3 --upload-mib 64"
  "$bench" --dir "$dir" --url "$url" --clients 0 --cycles 0 --uploads 3 --upload-mib 64
  echo "server peak RSS (VmHWM) after the uploads: $(awk '/VmHWM/ {print $2, $3}' /proc/$server/status)"
  kill -TERM "$server"
  wait "$server" 2>/dev/null || true
  server=
}

echo "# $(uname -m), $(nproc) cores; server: $bin serve (SQLite); bucket: $s3s (loopback)"
measure files
eval "$(scripts/s3 start "$work/s3")"
measure s3 --artifacts "$QL_S3_BUCKET_URL/bench"
echo "s3s-fs peak RSS (VmHWM): $(awk '/VmHWM/ {print $2, $3}' "/proc/$(cat "$work/s3/pid")/status")"
