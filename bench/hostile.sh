#!/usr/bin/env bash
# ql-control under attack: an honest worker's round (fresh connection, TLS 1.3 handshake,
# session open, offers poll) while 200 hostile connections at a time hold plain TCP
# connections open, trickle a request head, send 400 KiB heads or garbage instead of a
# handshake — each reopened as soon as the server ends it — and the server's RSS. The
# server runs with the limits `init` writes (control.json), on SQLite, on loopback.
#
#   bench/hostile.sh [--attackers N] [--samples K]   # prints the figures and the command
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet -p ql-control --bin ql-control --example hostile_bench
bin=target/release/ql-control
bench=target/release/examples/hostile_bench
work=$(mktemp -d /tmp/ql-hostile.XXXXXX)
trap 'kill -TERM "${server:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

# 200 attacker threads and the honest client each hold a descriptor or two.
ulimit -n 4096 2>/dev/null || true
"$bin" init --dir "$work" --host 127.0.0.1 >/dev/null
"$bin" serve --dir "$work" --listen 127.0.0.1:0 --operator-listen 127.0.0.1:0 >"$work/serve.out" 2>"$work/serve.err" &
server=$!
for _ in $(seq 100); do grep -q '^listening on ' "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
url=$(sed -n 's/^listening on //p' "$work/serve.out")

echo "# $(uname -m), $(nproc) cores; server: $bin serve (SQLite), limits as init writes them"
echo "\$ $bench --url $url --server-pid $server $*"
"$bench" --dir "$work" --url "$url" --server-pid "$server" "$@"
echo "server's refusal lines (at most one per refusal_report_ms each):"
grep -c 'since the last report' "$work/serve.err" | sed 's/^/  lines: /'
grep 'since the last report' "$work/serve.err" | tail -n 4 | sed 's/^/  /'
