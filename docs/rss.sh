#!/usr/bin/env bash
# Resident memory of `orders serve` under keyed load (issue 11, point 4).
#
# Builds cmd/orders, starts `orders serve` on a data dir of its own (the
# embedded SQLite file, or PostgreSQL with --database-url), drives it with
# `orders bench --target serve` until REQUESTS keyed POST /v1/orders have
# been answered, samples VmRSS and VmHWM from /proc/PID/status every 10 s
# into a CSV, prints RSS at start, at 100k, 500k and 1M answers and its
# peak, and the Go heap seen by the garbage collector (the service runs
# with GODEBUG=gctrace=1; it has no pprof endpoint), stops the service and
# runs `orders audit` on its data.
#
# Load: `--mode create` (a fresh key per request) in runs of CREATE_RUN
# while fewer than CREATE_SECONDS have passed, then `--mode replay` (256
# keys created first, then repeated) in runs of REPLAY_RUN, so that a
# slow machine still reaches REQUESTS. The answers are counted by the
# service itself (orders_http_responses_total of POST /v1/orders on
# /metrics), warm-up creates of replay runs included.
#
# Usage, from the repository root:
#   docs/rss.sh                                    # embedded SQLite
#   docs/rss.sh postgres://root@127.0.0.1:5432/x   # an empty database you made
# Environment: REQUESTS (1000000), CREATE_SECONDS (2700), CREATE_RUN
# (600s), REPLAY_RUN (120s), PORT (18480), CONCURRENCY (32), USERS (8),
# OUT (a new temp dir; kept, with the CSV, the bench JSON and the logs).
set -euo pipefail

dburl=${1:-}
requests=${REQUESTS:-1000000}
create_seconds=${CREATE_SECONDS:-2700}
create_run=${CREATE_RUN:-600s}
replay_run=${REPLAY_RUN:-120s}
port=${PORT:-18480}
conc=${CONCURRENCY:-32}
users=${USERS:-8}
out=${OUT:-$(mktemp -d /tmp/orders-rss.XXXXXX)}
mkdir -p "$out/data"
url=http://127.0.0.1:$port
bin=$out/orders
csv=$out/rss.csv

go build -o "$bin" ./cmd/orders
dbflag=()
[ -n "$dburl" ] && dbflag=(--database-url "$dburl")

GODEBUG=gctrace=1 "$bin" serve --addr 127.0.0.1:"$port" --data-dir "$out/data" "${dbflag[@]}" >"$out/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 60); do curl -sf "$url/healthz" >/dev/null && break; sleep 1; done

answered() {
	curl -s -m 5 "$url/metrics" | awk '
		index($0, "orders_http_responses_total{route=\"POST /v1/orders\"") == 1 { s += $NF }
		END { print s + 0 }'
}

# Sampler: one row every 10 s while the service runs.
(
	echo "unix,elapsed_s,vmrss_kb,vmhwm_kb,threads,post_answered,post_201,idem_replays"
	t0=$(date +%s)
	while kill -0 $pid 2>/dev/null; do
		now=$(date +%s)
		st=$(awk '/^VmRSS/{r=$2} /^VmHWM/{h=$2} /^Threads/{t=$2} END{print r "," h "," t}' /proc/$pid/status 2>/dev/null) || break
		curl -s -m 5 "$url/metrics" | awk -v pre="$now,$((now - t0)),$st" '
			$1 == "idem_replays_total" { rp = $2 }
			index($0, "orders_http_responses_total{route=\"POST /v1/orders\"") == 1 {
				all += $NF; if (index($0, "code=\"201\"")) ok += $NF }
			END { printf "%s,%d,%d,%d\n", pre, all, ok, rp }'
		sleep 10
	done
) >"$csv" &
sampler=$!

t0=$(date +%s)
i=0
while [ "$(answered)" -lt "$requests" ]; do
	i=$((i + 1))
	if [ $(($(date +%s) - t0)) -lt "$create_seconds" ]; then mode=create d=$create_run; else mode=replay d=$replay_run; fi
	echo "$(date -u +%T) run $i: $mode for $d, answered so far $(answered), load $(cut -d' ' -f1-3 /proc/loadavg)"
	"$bin" bench --target serve --url "$url" --data-dir "$out/data" --mode $mode \
		--users "$users" --concurrency "$conc" --duration $d --json >"$out/bench-$i-$mode.json"
	awk '/"rows"/ { f = 1 } /"ratios"/ { f = 0 } f' "$out/bench-$i-$mode.json" | tr -d ' \n' | cut -c1-400
	echo
done
echo "answered: $(answered)"
curl -s "$url/metrics" | grep -E '^orders_http_responses_total\{route="POST|^idem_(completed|replays|conflicts|failed)_total'

sleep 11 # one more sample at the end
kill -TERM $pid
wait $pid || true
wait $sampler || true
trap - EXIT

echo
echo "RSS (MB) by POST /v1/orders answered, from $csv:"
awk -F, -v n="$requests" '
	NR == 2 { printf "  start            %7.1f\n", $3 / 1024 }
	NR > 1 {
		if ($3 > peak) peak = $3
		if ($4 > hwm) hwm = $4
		split("100000 500000 1000000", m, " ")
		for (k = 1; k <= 3; k++) if (!(k in done) && m[k] <= n && $6 >= m[k]) {
			done[k] = 1; printf "  at %-7d (%7d answered) %7.1f\n", m[k], $6, $3 / 1024 }
		last = $3
	}
	END { printf "  last sample      %7.1f\n  peak VmRSS       %7.1f (VmHWM %.1f)\n", last / 1024, peak / 1024, hwm / 1024 }' "$csv"

# gctrace: "gc N @Ts P%: … A->B->C MB, D MB goal, …": C is the live heap after that GC.
echo "Go heap (GODEBUG=gctrace=1, in $out/serve.log):"
grep '^gc ' "$out/serve.log" | sed -E 's/.* ([0-9]+)->([0-9]+)->([0-9]+) MB, ([0-9]+) MB goal.*/\2 \3/' |
	awk '{ if ($1 > top) top = $1; if ($2 > live) live = $2; n++ }
		END { printf "  %d collections, largest heap %d MB, largest live heap after a collection %d MB\n", n, top, live }'
grep '^gc ' "$out/serve.log" | tail -1

echo
"$bin" audit --data-dir "$out/data" "${dbflag[@]}"
