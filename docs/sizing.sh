#!/usr/bin/env bash
# Figures for sizing a fleet (docs/SCALING.md, "Sizing for 100 times
# today's peak"): creates per second of one `orders serve` on PostgreSQL,
# the CPU that PostgreSQL and the service spend per create, and the bytes
# each table holds per order.
#
# Builds cmd/orders (or takes ORDERS_BIN), creates the database DATABASE
# afresh (dropping it first), starts `orders serve` on it with the
# in-process gateway (its records go to the schema payments of the same
# database) and the embedded NATS, runs a 5 s warm-up and then DURATION of
# `orders bench --target serve --mode create` (32 clients, 64 users). The
# CPU of every postgres process and of serve is read from /proc before and
# after the measured run; what the server spent for the gateway, the relay
# and the receipts consumer (all in serve) is counted with the creates.
# Then it waits for every receipt, prints each table's size (heap and
# TOAST, indexes) and row count, and the bench's report.
#
# Run it on a quiet machine (no tests, no other benchmark; load average
# under 1.5 at the start), from the repository root:
#
#     docs/sizing.sh
#     DURATION=20s DATABASE=postgres://root@127.0.0.1:5432/sizing docs/sizing.sh
#
# DATABASE's server must let the script drop and create that database.
set -euo pipefail

DATABASE=${DATABASE:-postgres://root@127.0.0.1:5432/sizing}
DURATION=${DURATION:-30s}
ADDR=${ADDR:-127.0.0.1:18080}
SECRET=sizing-secret-0123456789abcdef0123456789
work=$(mktemp -d)
trap 'kill "$serve" 2>/dev/null || true; rm -rf "$work"' EXIT

bin=${ORDERS_BIN:-}
if [ -z "$bin" ]; then
	bin=$work/orders
	go build -o "$bin" ./cmd/orders
fi

name=${DATABASE##*/}
name=${name%%\?*}
admin=${DATABASE%/*}/postgres
psql "$admin" -qc "DROP DATABASE IF EXISTS \"$name\"" -c "CREATE DATABASE \"$name\""

"$bin" serve --database-url "$DATABASE" --data-dir "$work/data" --addr "$ADDR" --jwt-secret "$SECRET" >"$work/serve.log" 2>&1 &
serve=$!
for _ in $(seq 150); do
	curl -fs "http://$ADDR/healthz" >/dev/null && break
	sleep 0.2
done

bench() {
	"$bin" bench --target serve --url "http://$ADDR" --jwt-secret "$SECRET" --mode create --concurrency 32 --users 64 --duration "$1"
}
# Clock ticks spent so far by each postgres process, by pid.
pgticks() {
	for p in $(pgrep -x postgres); do
		awk -v p="$p" '{print p, $14 + $15}' "/proc/$p/stat" 2>/dev/null || true
	done
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
count() { psql "$DATABASE" -Atc "SELECT count(*) FROM $1"; }

bench 5s >/dev/null
pgticks >"$work/pg0"
s0=$(ticks "$serve")
o0=$(count orders)
t0=$(date +%s.%N)
bench "$DURATION" >"$work/bench.txt"
t1=$(date +%s.%N)
o1=$(count orders)
s1=$(ticks "$serve")
pgticks >"$work/pg1"

hz=$(getconf CLK_TCK)
# A process that started during the run counts from zero.
pg=$(awk 'NR == FNR { a[$1] = $2; next } { d += $2 - (($1 in a) ? a[$1] : 0) } END { print d }' "$work/pg0" "$work/pg1")
n=$((o1 - o0))
awk -v n="$n" -v t0="$t0" -v t1="$t1" -v pg="$pg" -v sv="$((s1 - s0))" -v hz="$hz" 'BEGIN {
	s = t1 - t0
	printf "creates: %d in %.1f s, %.0f/s\n", n, s, n / s
	printf "postgres CPU: %.2f s, %.2f ms per create (%.0f creates/s per core)\n", pg / hz, 1000 * pg / hz / n, n * hz / pg
	printf "serve CPU:    %.2f s, %.2f ms per create (%.0f creates/s per core)\n", sv / hz, 1000 * sv / hz / n, n * hz / sv
}'

for _ in $(seq 120); do
	[ "$(count receipts)" = "$(count orders)" ] && break
	sleep 1
done
echo "receipts: $(count receipts) of $(count orders) orders"

psql "$DATABASE" -qc ANALYZE
psql "$DATABASE" -c "
SELECT n.nspname || '.' || c.relname AS table_name,
	c.reltuples::bigint AS row_count,
	pg_table_size(c.oid) AS heap_and_toast,
	pg_indexes_size(c.oid) AS indexes,
	pg_total_relation_size(c.oid) AS total,
	round(pg_total_relation_size(c.oid) / nullif(c.reltuples, 0)) AS bytes_per_row
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'r' AND n.nspname IN ('public', 'payments') AND c.reltuples > 0
ORDER BY total DESC"
cat "$work/bench.txt"
