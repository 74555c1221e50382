#!/usr/bin/env bash
# What PostgreSQL's side of a group costs beyond its statements' execution, measured with
# pgbench alone on a throwaway cluster (scripts/pg, fsync off: CPU, not the disk), at 1
# and 2 clients, prepared
# statements, ROUNDS rounds (2 by default) of SECONDS seconds (6) each:
#
#   statement by statement  ten key reads and two updates in a transaction, each
#                           statement waiting for its answer (a Sync after each)
#   one pipeline            the same transaction as one pipeline with one Sync at its end
#                           (\startpipeline ... \endpipeline)
#   deferred keys           six rows into a table with two deferred foreign keys
#   no keys                 the same six rows into a table without them
#
# The store sends its statements as pipelines, but tokio-postgres puts a Sync after each
# one; the first two bound what one Sync per pipeline could save. The last two size a
# deferred foreign-key check, which a group's events cost at COMMIT (bench/RESULTS.md).
#
#   bench/pg_protocol.sh
#   ROUNDS=3 SECONDS_EACH=10 bench/pg_protocol.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/ql-pg-protocol.XXXXXX)
cleanup() { scripts/pg stop "$work/cluster"; rm -rf "$work"; }
trap cleanup EXIT
eval "$(scripts/pg start "$work/cluster")"
pgbin=$(cat "$work/cluster/bindir")
url="host=$QL_PG_SOCKET user=postgres dbname=postgres"
"$pgbin/psql" -X -q -v ON_ERROR_STOP=1 "$url" \
  -c "CREATE TABLE t (id int PRIMARY KEY, v int)" \
  -c "INSERT INTO t SELECT g, 0 FROM generate_series(1, 1100) g" \
  -c "CREATE TABLE p1 (id int PRIMARY KEY)" -c "CREATE TABLE p2 (id int PRIMARY KEY)" \
  -c "INSERT INTO p1 SELECT generate_series(1, 1100)" -c "INSERT INTO p2 SELECT generate_series(1, 1100)" \
  -c "CREATE TABLE keyed (seq bigserial PRIMARY KEY, a int NOT NULL REFERENCES p1 DEFERRABLE INITIALLY DEFERRED, \
      b int REFERENCES p2 DEFERRABLE INITIALLY DEFERRED, payload text)" \
  -c "CREATE TABLE unkeyed (seq bigserial PRIMARY KEY, a int NOT NULL, b int, payload text)" \
  -c "VACUUM ANALYZE"

statements() {
  for i in 0 1 2 3 4 5 6 7; do echo "SELECT v FROM t WHERE id = :a + $i;"; done
  echo "UPDATE t SET v = v + 1 WHERE id = :a;"
  echo "UPDATE t SET v = v + 1 WHERE id = :a + 1;"
}
rows() { # TABLE
  local values=()
  for i in 0 1 2 3 4 5; do values+=("(:a + $i, :a + $i, 'x')"); done
  local IFS=,
  echo "INSERT INTO $1 (a, b, payload) VALUES ${values[*]};"
}
{ echo '\set a random(1, 1000)'; echo 'BEGIN;'; statements; echo 'END;'; } >"$work/each.sql"
{ printf '%s\n' '\set a random(1, 1000)' '\startpipeline' 'BEGIN;'; statements; printf '%s\n' 'END;' '\endpipeline'; } >"$work/pipeline.sql"
{ echo '\set a random(1, 1000)'; echo 'BEGIN;'; rows keyed; echo 'END;'; } >"$work/keyed.sql"
{ echo '\set a random(1, 1000)'; echo 'BEGIN;'; rows unkeyed; echo 'END;'; } >"$work/unkeyed.sql"

run() { # SCRIPT CLIENTS
  "$pgbin/pgbench" -n -M prepared -c "$2" -j "$2" -T "${SECONDS_EACH:-6}" -f "$work/$1.sql" "$url" 2>/dev/null |
    awk '/^latency average/ { l = $4 } /^tps/ { t = $3 } END { printf "%8.3f ms %9.0f tps", l, t }'
}
printf '%-24s %-8s %s\n' "transaction" "clients" "latency and rate"
for r in $(seq "${ROUNDS:-2}"); do
  for case in "each:statement by statement" "pipeline:one pipeline" "keyed:deferred keys" "unkeyed:no keys"; do
    for c in 1 2; do
      printf '%-24s %-8s %s   (round %s)\n' "${case#*:}" "$c" "$(run "${case%%:*}" "$c")" "$r"
    done
  done
done
