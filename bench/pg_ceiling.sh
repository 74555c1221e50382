#!/usr/bin/env bash
# How fast could PostgreSQL itself run a lease renewal? The statements ql-control sends
# for one renewal (the cheapest ACK, five of every eight in bench/pg_acks.sh's cycle),
# replayed by pgbench with nothing else in the way: pgbench's C client, prepared
# statements, the same two pipelines ql-control sends (the locked load with DB time and
# admission, then the audit record, the lease's write and COMMIT), no TLS, no HTTP, no
# ql-control process, on real rows of a real run. Beside it, `pgbench -N` at the same
# client count in the same run, and variants that each leave one part of the renewal
# out, so each part's price shows, and one that also writes the attempt's copy of the
# lease, as builds before schema version 22 did.
#
#   bench/pg_ceiling.sh                     # 8 and 64 clients, 10 s each
#   SECONDS_EACH=5 CLIENTS="8" bench/pg_ceiling.sh
#   ROUNDS=3 bench/pg_ceiling.sh            # three rounds in turn (one figure here moves by a tenth)
#
# A renewal replayed this way costs the database what it costs under ql-control, minus
# nothing: the rate it reaches is a ceiling for ACKs over mTLS, which also pay for the
# server, TLS and HTTP on the same cores, and for the cycle's polls, claims and
# completions, which write more. (At 64 clients ql-control's lanes share one COMMIT among
# several ACKs, which this replay does not; at 8 clients no group forms, see README.)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --quiet -p ql-control --bin ql-control --example ack_bench
bin=target/release/ql-control
bench=target/release/examples/ack_bench
work=$(mktemp -d /tmp/ql-pg-ceiling.XXXXXX)
cleanup() {
  [ -z "${server:-}" ] || kill -TERM "$server" 2>/dev/null || true
  wait 2>/dev/null || true
  scripts/pg stop "$work/cluster"
  rm -rf "$work"
}
trap cleanup EXIT

eval "$(scripts/pg start "$work/cluster" --durable)"
pgbin=$(cat "$work/cluster/bindir")
psql() { "$pgbin/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$QL_PG_SOCKET" -U postgres "$@"; }
# shellcheck source=bench/lib/pg.sh
source bench/lib/pg.sh

# One real cycle through a real server leaves a session, a run, its attempt and lease,
# the worker and its certificate: the rows a renewal reads and writes.
"$bin" migrate --database "$QL_PG_OWNER_URL" >/dev/null
"$bin" init --dir "$work/s" --host 127.0.0.1 >/dev/null
server=$(start_server "$work/s" --database "$QL_PG_URL")
url=$(sed -n 's/^listening on //p' "$work/s/serve.out")
"$bin" enroll bench-warmup --dir "$work/s" --out "$work/s/bench-workers" >/dev/null
"$bench" --dir "$work/s" --url "$url" --clients 1 --cycles 1 --renewals 1 --database "$QL_PG_URL" >/dev/null
kill -TERM "$server"; wait "$server" 2>/dev/null || true; server=

# Each pgbench client renews a lease of its own, as each agent does: copies of that
# cycle's session, run, attempt and lease named after the client (written as the
# superuser with triggers and foreign keys off, for the copy only).
max_clients=0
for c in ${CLIENTS:-8 64}; do [ "$c" -gt "$max_clients" ] && max_clients=$c; done
psql -d qinglong <<SQL
SET session_replication_role = replica;
CREATE TEMP TABLE one AS SELECT a.id AS attempt, a.run_id AS run, a.session_id AS session FROM attempts a LIMIT 1;
INSERT INTO sessions SELECT (jsonb_populate_record(NULL::sessions, to_jsonb(s) || jsonb_build_object('id', 'ses_b' || n, 'generation', 100 + n))).*
  FROM sessions s, one, generate_series(0, $max_clients - 1) n WHERE s.id = one.session;
INSERT INTO runs SELECT (jsonb_populate_record(NULL::runs, to_jsonb(r) || jsonb_build_object('id', 'run_b' || n, 'current_attempt_id', 'att_b' || n))).*
  FROM runs r, one, generate_series(0, $max_clients - 1) n WHERE r.id = one.run;
INSERT INTO attempts SELECT (jsonb_populate_record(NULL::attempts, to_jsonb(a) || jsonb_build_object('id', 'att_b' || n, 'run_id', 'run_b' || n, 'session_id', 'ses_b' || n))).*
  FROM attempts a, one, generate_series(0, $max_clients - 1) n WHERE a.id = one.attempt;
INSERT INTO leases SELECT (jsonb_populate_record(NULL::leases, to_jsonb(l) || jsonb_build_object('attempt_id', 'att_b' || n, 'run_id', 'run_b' || n, 'session_id', 'ses_b' || n))).*
  FROM leases l, one, generate_series(0, $max_clients - 1) n WHERE l.attempt_id = one.attempt;
VACUUM ANALYZE;
SQL
worker="bench-0"
serial=$(psql -d qinglong -c "SELECT serial FROM certificates WHERE worker = '$worker' LIMIT 1")

# The statements as ql-control sends them (see the server log with log_statement = all),
# the keys named by the client instead of bound from the request.
session_cols="id, worker, generation, state, capacity, labels::text AS labels, agent_version, arch, created_at, seen_at, expires_at"
run_cols="id, project, spec, labels::text AS labels, agent_labels::text AS agent_labels, status, stop, retry_budget, retries_used, attempts, lease_generations, current_attempt_id, deadline_at, created_at, started_at, finished_at, error_code, summary, schedule"
attempt_cols="id, run_id, number, executor_type, status, offer_id, session_id, worker, lease_worker, lease_session_id, lease_session_generation, lease_offer_id, lease_generation, lease_token_digest, lease_version, lease_expires_at, executor_handle, log_artifact_id, callback_sequence, callback_digest, exit_code, signal, worker_finished_at, artifact, end_kind, created_at, started_at, ended_at, error_code, summary, log_acked, log_sealed, claimed_artifact"
lease_cols="attempt_id, run_id, state, worker, session_id, session_generation, offer_id, lease_generation, token_digest, version, expires_at, ttl_ms"
now="(floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint + 0::bigint"
renewal() { # LOCK AUDIT PROJECTION -> a pgbench script
  local lock=$1 audit=$2 projection=$3
  cat <<SQL
\startpipeline
BEGIN;
SELECT pg_advisory_xact_lock(hashtextextended('attempt:' || ('att_b' || :client_id), 0));
SELECT $session_cols FROM sessions WHERE id = 'ses_b' || :client_id $lock;
SELECT $run_cols FROM runs WHERE id = 'run_b' || :client_id $lock;
SELECT $attempt_cols FROM attempts WHERE id = 'att_b' || :client_id $lock;
SELECT $lease_cols FROM leases WHERE attempt_id = 'att_b' || :client_id $lock;
SELECT $now, w.disabled_at, w.revoked_at, c.worker, c.issued_at, c.not_after, c.revoked_at FROM (SELECT 1) one LEFT JOIN workers w ON w.id = '$worker' LEFT JOIN certificates c ON c.serial = '$serial';
\endpipeline
\startpipeline
SQL
  [ "$audit" = yes ] && echo "INSERT INTO audit (at, principal, route, outcome) VALUES ($now, '$worker', 'lease.renew', 'admitted');"
  echo "UPDATE leases SET version = version + 1, expires_at = $now + 30000 WHERE attempt_id = 'att_b' || :client_id RETURNING 1;"
  [ "$projection" = yes ] &&
    echo "UPDATE attempts SET lease_version = lease_version + 1, lease_expires_at = $now + 30000 WHERE id = 'att_b' || :client_id RETURNING 1;"
  printf 'COMMIT;\n\\endpipeline\n'
}
renewal "FOR UPDATE" yes no >"$work/renewal.sql"
renewal "" yes no >"$work/unlocked.sql"
renewal "FOR UPDATE" no no >"$work/unaudited.sql"
renewal "" no no >"$work/bare.sql"
renewal "FOR UPDATE" yes yes >"$work/two-writes.sql"

psql -d postgres -c "CREATE DATABASE pgbench"
"$pgbin/pgbench" -q -i -s 10 -h "$QL_PG_SOCKET" -U postgres pgbench >/dev/null 2>&1

seconds=${SECONDS_EACH:-10}
# Runs pgbench; prints its tps and the cluster's CPU ms per transaction.
run() { # CLIENTS pgbench-args...
  local clients=$1 c0 out n
  shift
  c0=$(cluster_cpu "$work/cluster")
  out=$("$pgbin/pgbench" -c "$clients" -j 2 -T "$seconds" -h "$QL_PG_SOCKET" "$@" 2>&1)
  n=$(echo "$out" | sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p')
  [ -n "$n" ] || { echo "$out" >&2; exit 1; }
  echo "$out" | sed -n 's/^tps = \([0-9.]*\).*/\1/p' | head -1 |
    awk -v n="$n" -v c0="$c0" -v c1="$(cluster_cpu "$work/cluster")" '{ printf "%.0f %.3f\n", $1, (c1 - c0) * 1e3 / n }'
}
ql() { run "$1" -n -M prepared -U ql_runtime -f "$work/$2.sql" qinglong; }

echo "# $(uname -m), $(nproc) cores; PostgreSQL $("$pgbin/postgres" --version | awk '{print $3}') (fsync on), ${seconds} s per figure"
printf '%-8s %-44s %8s %8s %s\n' clients "transaction" tps "x -N" "PostgreSQL CPU ms/tx"
for _ in $(seq "${ROUNDS:-1}"); do
for clients in ${CLIENTS:-8 64}; do
  read -r base base_cpu <<<"$(run "$clients" -N -U postgres pgbench)"
  printf '%-8s %-44s %8s %8s %s\n' "$clients" "pgbench -N" "$base" 1.00 "$base_cpu"
  for variant in renewal unlocked unaudited bare two-writes; do
    case $variant in
      renewal) what="a renewal, as ql-control sends it" ;;
      unlocked) what="  without its four row locks" ;;
      unaudited) what="  without its audit record" ;;
      bare) what="  without either" ;;
      two-writes) what="  with the attempt's copy of the lease too" ;;
    esac
    read -r tps cpu <<<"$(ql "$clients" "$variant")"
    printf '%-8s %-44s %8s %8s %s\n' "$clients" "$what" "$tps" "$(awk -v a="$tps" -v b="$base" 'BEGIN { printf "%.2f", a / b }')" "$cpu"
  done
done
done
echo
echo "# the renewal replayed (pgbench -n -M prepared -f renewal.sql, as ql_runtime on ql-control's database):"
cat "$work/renewal.sql"
