#!/usr/bin/env bash
# ql-control benchmark: ACK transactions per second and p50/p99 latency on the SQLite
# store with 1, 8 and 64 concurrent mTLS clients (one keep-alive connection each) on
# loopback, and the server's peak RSS after three 64 MiB artifact uploads (measured first,
# on a fresh server, so the ACK runs do not inflate it).
#
#   bench/control.sh            # prints the figures and the commands behind them
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet -p ql-control --bin ql-control --example ack_bench
bin=target/release/ql-control
bench=target/release/examples/ack_bench
work=$(mktemp -d /tmp/ql-bench.XXXXXX)
trap 'kill -TERM "${server:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$bin" init --dir "$work" --host 127.0.0.1 >/dev/null
"$bin" serve --dir "$work" --listen 127.0.0.1:0 --operator-listen 127.0.0.1:0 >"$work/serve.out" 2>"$work/serve.err" &
server=$!
for _ in $(seq 100); do grep -q '^listening on ' "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
url=$(sed -n 's/^listening on //p' "$work/serve.out")

echo "# $(uname -m), $(nproc) cores; server: $bin serve (SQLite, WAL, synchronous=FULL)"
echo "\$ $bench --clients 0 --uploads 3 --upload-mib 64"
"$bench" --dir "$work" --url "$url" --clients 0 --cycles 0 --uploads 3 --upload-mib 64
echo "server peak RSS (VmHWM) after the uploads: $(awk '/VmHWM/ {print $2, $3}' /proc/$server/status)"
for clients in 1 8 64; do
  # Long enough (a few seconds each) for a steady figure, not a burst into empty tables.
  cycles=$(( clients == 64 ? 12 : clients == 8 ? 60 : 200 ))
  echo "\$ $bench --clients $clients --cycles $cycles --renewals 5"
  "$bench" --dir "$work" --url "$url" --clients "$clients" --cycles "$cycles" --renewals 5
done
