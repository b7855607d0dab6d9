#!/usr/bin/env bash
# scripts/bench.sh: the benchmark suite (make bench), on 127.0.0.1, in
# under 10 minutes on a 2-core machine (the first build of bin/caddy-bench is
# extra). Three phases, each optional:
#
#   go     go test -bench over the root package and bucket/: the model,
#          the key, the deny cache, bucket.Redis.Take, the handler's
#          ServeHTTP (benchmarks_test.go, bucket/bench_test.go) and every
#          other benchmark there, with -benchmem; medians of BENCH_GO_COUNT
#          runs
#   redis  scripts/scriptstats: Redis-side µs per call of each script path
#          (INFO commandstats) and one caller's round trips against PING;
#          in the same turns the peers (go-redis/redis_rate v10, one AllowN
#          per dimension; a hash-based token bucket script, one call per
#          dimension) and the floor (one PING per decision), compared in
#          decisions/s and Redis CPU per decision; and FCALL of the same
#          code loaded with FUNCTION LOAD against EVALSHA
#   instr  instructions redis-server executes per call of each script path
#          (valgrind --tool=callgrind, scriptstats -only): the difference
#          between BENCH_INSTR_CALLS and 200 calls, over their difference;
#          unlike time, a count that the machine's load does not move; also
#          per decision of the peers and the floor, per FCALL, and per
#          decision of batches of 50, on buckets of their own or on 3 shared
#          ones
#   http   wrk against bin/caddy-bench (bench/e2e.Caddyfile): (a) respond,
#          (b) token_bucket allowed, (c) denied from the deny cache,
#          (d) token_bucket + reverse_proxy, (e) reverse_proxy alone,
#          (f) mholt/caddy-ratelimit (in memory), (g) the floor: one
#          go-redis PING per request (bench/pingfloor), (i) the 429 of (c)
#          without a limiter (static, Caddy's header and respond); with BENCH_BASELINE,
#          (h) the same as (b) served by a second Caddy built from an
#          earlier revision of this repository (bench/baseline.Caddyfile), so
#          that a change's effect on the gateway is measured in one run; the
#          configurations alternate for BENCH_ROUNDS rounds, medians and
#          ratios are reported, every configuration against (a), (f) and (g)
#
# bin/caddy-bench is bin/caddy's xcaddy build (scripts/build-caddy.sh
# --print-xcaddy) plus two plugins for the benchmark only: bench/pingfloor
# and github.com/mholt/caddy-ratelimit@BENCH_RATELIMIT_VERSION. It is cached
# as bin/caddy is; the product's bin/caddy, which the tests use, is neither
# built nor changed here.
#
# Every process it starts (redis-server, Caddy) runs on a free loopback
# port and is stopped on exit. redis-server and wrk are installed with
# apt-get when missing. With BENCH_PIN=1 (the default, on 2 or more CPUs)
# the server side (Caddy, its upstream, redis-server) runs on CPU 0 and the
# load generator (wrk, scriptstats) on CPU 1, so that the two never take
# each other's time slices; BENCH_PIN=0 lets the scheduler place them. (The
# go phase is not pinned: go test and its redis-server share both CPUs.)
#
# Results go to BENCH_OUT (default .run/bench/<time>): the raw outputs and
# summary.md, which is printed at the end. The load average is recorded
# before each phase: a busy machine makes every figure worse.
#
# BENCH_BASELINE is a git revision (a commit, a tag) of this repository:
# its tree is built with its own scripts/build-caddy.sh into
# bin/caddy-baseline-<commit> (once; kept like bin/caddy-bench), which serves
# (h). Its Caddyfile syntax must accept bench/baseline.Caddyfile.
#
# Environment (defaults): BENCH_PHASES (go,redis,instr,http), BENCH_GO_COUNT (3),
# BENCH_GO_BENCHTIME (500ms), BENCH_GO_PATTERN (.), BENCH_GO_PKGS
# (". ./bucket": every benchmark of the two packages), BENCH_ROUNDS (3),
# BENCH_DURATION (10, seconds per wrk run), BENCH_THREADS (2),
# BENCH_CONNECTIONS (50), BENCH_PIN (1), BENCH_CALLS (100000, scriptstats
# calls per path), BENCH_SAMPLES (20000, scriptstats round trips per path
# from one caller), BENCH_INSTR_CALLS (1200), BENCH_BASELINE (none), BENCH_RATELIMIT_VERSION
# (v0.1.0), BENCH_CONFIGS ("a b c d e f g i": the http phase's configurations
# to measure, in turn in this order; every one is still served, and (h)
# joins them with BENCH_BASELINE; a ratio between configurations not both
# measured is left out), BENCH_OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

PHASES="${BENCH_PHASES:-go,redis,instr,http}"
GO_COUNT="${BENCH_GO_COUNT:-3}"
GO_BENCHTIME="${BENCH_GO_BENCHTIME:-500ms}"
GO_PATTERN="${BENCH_GO_PATTERN:-.}"
GO_PKGS="${BENCH_GO_PKGS:-. ./bucket}"
ROUNDS="${BENCH_ROUNDS:-3}"
DURATION="${BENCH_DURATION:-10}"
THREADS="${BENCH_THREADS:-2}"
CONNECTIONS="${BENCH_CONNECTIONS:-50}"
PIN="${BENCH_PIN:-1}"
CALLS="${BENCH_CALLS:-100000}"
SAMPLES="${BENCH_SAMPLES:-20000}"
RATELIMIT_VERSION="${BENCH_RATELIMIT_VERSION:-v0.1.0}"
INSTR_CALLS="${BENCH_INSTR_CALLS:-1200}"
OUT="${BENCH_OUT:-.run/bench/$(date -u +%Y%m%dT%H%M%SZ)}"
SERVED="a b c d e f g i" # every configuration bench/e2e.Caddyfile serves
CONFIGS="${BENCH_CONFIGS:-$SERVED}"
seen=" "
for c in $CONFIGS; do
	case " $SERVED " in
	*" $c "*) ;;
	*)
		echo "BENCH_CONFIGS: unknown configuration '$c' (want some of: $SERVED; (h) comes with BENCH_BASELINE)" >&2
		exit 2
		;;
	esac
	case "$seen" in
	*" $c "*)
		echo "BENCH_CONFIGS: configuration '$c' named twice" >&2
		exit 2
		;;
	esac
	seen+="$c "
done
BASELINE="${BENCH_BASELINE:-}"
if [ -n "$BASELINE" ]; then
	BASELINE="$(git rev-parse --verify "$BASELINE^{commit}")"
	SERVED+=" h"
	CONFIGS+=" h"
fi
if [ "$PIN" = 1 ] && { [ "$(nproc)" -lt 2 ] || ! command -v taskset >/dev/null 2>&1; }; then
	PIN=0
fi

HZ="$(getconf CLK_TCK)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.md"
tmp="$(mktemp -d)"
pids=()
failed=()

cleanup() {
	local pid
	for pid in "${pids[@]}"; do
		kill "$pid" 2>/dev/null || true
	done
	for pid in "${pids[@]}"; do
		wait "$pid" 2>/dev/null || true
	done
	rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

has_phase() { [[ ",$PHASES," == *",$1,"* ]]; }
say() { echo "$@" | tee -a "$SUMMARY"; }
load_average() { cut -d' ' -f1-3 /proc/loadavg; }

# start_server starts a process in the background, on CPU $1 when pinned,
# with its output in log $2, and records its pid in pids (taskset execs the
# command, so $! is the server's own pid).
start_server() {
	local cpu="$1" log="$2"
	shift 2
	if [ "$PIN" = 1 ]; then
		taskset -c "$cpu" "$@" >"$log" 2>&1 </dev/null &
	else
		"$@" >"$log" 2>&1 </dev/null &
	fi
	started=$!
	pids+=("$started")
}

# client runs a load generator in the foreground, on CPU 1 when pinned.
client() { if [ "$PIN" = 1 ]; then taskset -c 1 "$@"; else "$@"; fi; }

free_port() {
	python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

install_tools() {
	scripts/install-redis.sh
	local missing=()
	command -v wrk >/dev/null 2>&1 || missing+=(wrk)
	command -v taskset >/dev/null 2>&1 || missing+=(util-linux)
	command -v python3 >/dev/null 2>&1 || missing+=(python3)
	if has_phase instr; then command -v valgrind >/dev/null 2>&1 || missing+=(valgrind); fi
	[ ${#missing[@]} -eq 0 ] && return
	local sudo=""
	[ "$(id -u)" -ne 0 ] && sudo="sudo"
	echo "installing ${missing[*]} with apt-get" >&2
	$sudo apt-get update
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y "${missing[@]}"
}

# start_redis starts a redis-server on CPU $1 and sets redis_port.
start_redis() {
	redis_port="$(free_port)"
	local dir="$tmp/redis-$redis_port"
	mkdir -p "$dir"
	start_server "$1" "$dir/redis.log" redis-server --port "$redis_port" --bind 127.0.0.1 --save '' \
		--appendonly no --dir "$dir" --daemonize no --logfile ''
	redis_pid=$started
	for _ in $(seq 100); do
		[ "$(redis-cli -p "$redis_port" ping 2>/dev/null)" = PONG ] && return
		sleep 0.05
	done
	cat "$dir/redis.log" >&2
	echo "redis-server did not start on 127.0.0.1:$redis_port" >&2
	exit 1
}

# stop_pid stops a process this script started and forgets it.
stop_pid() {
	local pid rest=()
	kill "$1" 2>/dev/null || true
	wait "$1" 2>/dev/null || true
	for pid in "${pids[@]}"; do
		[ "$pid" = "$1" ] || rest+=("$pid")
	done
	pids=("${rest[@]}")
}

machine() {
	local mem
	mem="$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
	say "# Benchmark run $(date -u '+%Y-%m-%d %H:%M:%SZ')"
	say ""
	say "- machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $mem"
	say "- go: $(go version | cut -d' ' -f3-)"
	say "- redis-server: $(redis-server --version | grep -o 'v=[^ ]*' | cut -d= -f2)"
	say "- wrk: $(wrk -v 2>&1 | head -n1 | cut -d' ' -f2)"
	say "- pinning: $([ "$PIN" = 1 ] && echo 'server side (Caddy, its upstream, redis-server) on CPU 0, load (wrk, scriptstats) on CPU 1' || echo none)"
	say "- load average at start (1, 5, 15 min): $(load_average)"
	say ""
}

# --- go: go test -bench --------------------------------------------------

go_phase() {
	say "## Go benchmarks (go test -bench, median of $GO_COUNT runs; load average before: $(load_average))"
	say ""
	say '```'
	say "go test -run '^\$' -bench '$GO_PATTERN' -benchmem -benchtime $GO_BENCHTIME -count $GO_COUNT -timeout 8m $GO_PKGS"
	say '```'
	say ""
	# A failing benchmark fails the suite, but only at the end: the other
	# figures are still worth having.
	local rc=0
	# shellcheck disable=SC2086 # GO_PKGS is a list
	go test -run '^$' -bench "$GO_PATTERN" -benchmem -benchtime "$GO_BENCHTIME" -count "$GO_COUNT" -timeout 8m \
		$GO_PKGS 2>&1 | tee "$OUT/go-bench.txt" || rc=$?
	if [ "$rc" -ne 0 ]; then
		failed+=("go test (exit $rc)")
		say "**go test failed (exit $rc)**; its failures (see go-bench.txt):"
		say ""
		grep -A2 -e '^--- FAIL' -e '^FAIL' "$OUT/go-bench.txt" | sed 's/^/    /' | tee -a "$SUMMARY"
		say ""
	fi
	{
		echo "| benchmark | ns/op | B/op | allocs/op |"
		echo "|---|---:|---:|---:|"
		# A log line written during a benchmark can split its result line:
		# the name, then the figures on a later line.
		awk '
			/^Benchmark/ { pending = $1 }
			/ ns\/op/ {
				name = ($1 ~ /^Benchmark/) ? $1 : pending
				sub(/-[0-9]+$/, "", name)
				if (name == "") next
				if (!(name in n)) order[++count] = name
				for (i = 1; i < NF; i++) {
					if ($(i+1) == "ns/op") ns[name, ++n[name]] = $i
					if ($(i+1) == "B/op") bytes[name] = $i
					if ($(i+1) == "allocs/op") allocs[name] = $i
				}
				pending = ""
			}
			END {
				for (k = 1; k <= count; k++) {
					name = order[k]; m = n[name]
					for (i = 1; i <= m; i++) v[i] = ns[name, i] + 0
					for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
					med = (m % 2) ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
					printf "| %s | %.0f | %s | %s |\n", name, med, bytes[name], allocs[name]
				}
			}' "$OUT/go-bench.txt"
		echo
	} >>"$SUMMARY"
}

# --- redis: scripts/scriptstats ------------------------------------------

redis_phase() {
	say "## Redis side (scripts/scriptstats; load average before: $(load_average))"
	say ""
	go build -o "$tmp/scriptstats" ./scripts/scriptstats
	start_redis 0
	say '```'
	say "go run ./scripts/scriptstats -addr 127.0.0.1:<port> -calls $CALLS -clients 50 -samples $SAMPLES"
	say '```'
	say ""
	client "$tmp/scriptstats" -addr "127.0.0.1:$redis_port" -calls "$CALLS" -clients 50 -samples "$SAMPLES" |
		tee "$OUT/scriptstats.md" >>"$SUMMARY" || failed+=("scriptstats (exit $?)")
	cat "$OUT/scriptstats.md"
	say ""
	stop_pid "$redis_pid"
}

# instructions prints the instructions (callgrind's total Ir) a
# redis-server executes from its start to its shutdown, with $2 calls of the
# scriptstats path whose name starts with $1 in between; nothing when the
# calls failed. The server runs its timer (serverCron) once a second rather
# than 10 times: the timer's work goes with the wall-clock time, which
# valgrind stretches the more the busier the machine is (at the default hz,
# two runs at load 10 differed by 14% on a script's floor).
instructions() {
	local port out
	port="$(free_port)"
	out="$tmp/callgrind.$port"
	valgrind --tool=callgrind --callgrind-out-file="$out" redis-server --port "$port" --bind 127.0.0.1 --hz 1 \
		--save '' --appendonly no --dir "$tmp" --logfile '' >"$out.log" 2>&1 &
	local pid=$!
	for _ in $(seq 200); do
		[ "$(redis-cli -p "$port" ping 2>/dev/null)" = PONG ] && break
		sleep 0.1
	done
	local ok=1
	"$tmp/scriptstats" -addr "127.0.0.1:$port" -only "$1" -serial "$2" || ok=0
	redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
	wait "$pid" || true
	# Nothing is printed when the calls failed: the caller reports it.
	[ "$ok" = 1 ] && awk '/^(summary|totals):/ { print $2; exit }' "$out"
	rm -f "$out" "$out.log"
}

instr_phase() {
	say "## Redis side in instructions (valgrind --tool=callgrind; load average before: $(load_average))"
	say ""
	say "Instructions redis-server executes per call, I/O included: (Ir with $INSTR_CALLS calls − Ir with"
	say "200 calls) / $((INSTR_CALLS - 200)), one caller (a batch of 50 decisions: 120 and 20 calls). The count is the"
	say "same whatever else the machine is doing."
	say "A call of a peer or of the PING floor is one 3-dimension decision (a peer's three calls, one PING)."
	say ""
	go build -o "$tmp/scriptstats" ./scripts/scriptstats
	say "| path | instructions per call |"
	say "|---|---:|"
	local p low high
	declare -A ir=()
	for p in "INCR" "empty script" "TIME+GET script" "TIME+GET+SET script" \
		"allow, 1 bucket" "allow, 3 buckets" "deny, 1 bucket" "deny, 3 buckets" \
		"FCALL allow, 1 bucket" "FCALL allow, 3 buckets" "FCALL deny, 1 bucket" "FCALL deny, 3 buckets" \
		"redis_rate" "hash script" "PING" "batch of 50 decisions, one lua.Batch call" "batch of 50 decisions, pipelined" \
		"batch of 50 decisions on 3 shared buckets, one lua.Batch call" "batch of 50 decisions on 3 shared buckets, pipelined"; do
		# Redis Functions need Redis 7 (scriptstats leaves the paths out).
		[[ "$p" == FCALL* ]] && [ "$(redis-server --version | grep -o 'v=[0-9]*' | cut -d= -f2)" -lt 7 ] && continue
		# A batch's call is 50 decisions: 20 and 120 of them, and its
		# figure per decision too.
		local n0=200 n1="$INSTR_CALLS"
		[[ "$p" == "batch of 50 decisions"* ]] && n0=20 n1=120
		low="$(instructions "$p" "$n0")"
		high="$(instructions "$p" "$n1")"
		if [ -z "$low" ] || [ -z "$high" ]; then
			failed+=("callgrind: $p")
			continue
		fi
		ir[$p]=$(((high - low) / (n1 - n0)))
		say "| $p | ${ir[$p]} |"
		if [[ "$p" == "batch of 50 decisions"* ]]; then
			ir[$p, per decision]=$((ir[$p] / 50))
			say "| $p, per decision | ${ir[$p, per decision]} |"
		fi
	done
	say ""
	say "| ratio of instructions | |"
	say "|---|---:|"
	local d
	for d in "allow, 1 bucket" "allow, 3 buckets" "deny, 1 bucket" "deny, 3 buckets"; do
		instr_ratio "FCALL ÷ EVALSHA, $d" "FCALL $d" "$d"
	done
	for p in "redis_rate" "hash script" "PING"; do
		instr_ratio "allow, 3 buckets ÷ $p, per decision" "allow, 3 buckets" "$p"
	done
	instr_ratio "a decision in one lua.Batch call ÷ pipelined, batches of 50" \
		"batch of 50 decisions, one lua.Batch call, per decision" "batch of 50 decisions, pipelined, per decision"
	instr_ratio "a decision in one lua.Batch call ÷ allow, 3 buckets alone" \
		"batch of 50 decisions, one lua.Batch call, per decision" "allow, 3 buckets"
	instr_ratio "on 3 shared buckets: a decision in one lua.Batch call ÷ pipelined, batches of 50" \
		"batch of 50 decisions on 3 shared buckets, one lua.Batch call, per decision" \
		"batch of 50 decisions on 3 shared buckets, pipelined, per decision"
	say ""
}

# instr_ratio reports ir[$2] / ir[$3] as row $1, when both were counted.
instr_ratio() {
	[ -n "${ir[$2]:-}" ] && [ -n "${ir[$3]:-}" ] || return 0
	say "| $1 | $(awk -v a="${ir[$2]}" -v b="${ir[$3]}" 'BEGIN { printf "%.3f", a / b }') |"
}

# --- http: wrk against Caddy ----------------------------------------------

# send_get opens file descriptor 3 to port $1 and sends GET / on it as
# wrk sends it, with Connection: close; the caller reads the response and
# closes 3.
send_get() {
	exec 3<>"/dev/tcp/127.0.0.1/$1"
	printf 'GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-User: bench-user\r\nX-API-Key: bench-key\r\nConnection: close\r\n\r\n' >&3
}

# status prints the HTTP status of GET / on port $1, as wrk sends it.
status() {
	local line
	send_get "$1"
	read -r line <&3
	exec 3<&-
	echo "$line" | cut -d' ' -f2
}

# field_names prints the names of the header fields (lower case, sorted)
# of the response to GET / on port $1, as wrk sends it.
field_names() {
	local line
	send_get "$1"
	read -r line <&3 # the status line
	while IFS= read -r line <&3 && [ "${line%$'\r'}" != "" ]; do
		line="${line%%:*}"
		echo "${line,,}"
	done | sort
	exec 3<&-
}

wait_port() {
	for _ in $(seq 200); do
		(exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return
		sleep 0.05
	done
	echo "nothing listens on 127.0.0.1:$1; see $OUT/caddy-*.log" >&2
	exit 1
}

# command_calls prints the calls of command $1 (lower case) that Redis has
# run since it started.
command_calls() {
	redis-cli -p "$redis_port" info commandstats | tr -d '\r' |
		awk -F'[=,:]' -v c="cmdstat_$1" '$1 == c { print $3; found = 1 } END { if (!found) print 0 }'
}

# cpu_ticks prints the CPU time (user + system, in clock ticks) that
# process $1 has used.
cpu_ticks() { awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$1/stat"; }

# local_decisions prints the requests that on_redis_error decided (the sum
# of caddy_token_bucket_local_decisions_total) in the gateway whose metrics
# site is on port $1.
local_decisions() {
	exec 3<>"/dev/tcp/127.0.0.1/$1"
	printf 'GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3
	awk '/^caddy_token_bucket_local_decisions_total/ { n += $NF } END { printf "%d\n", n }' <&3
	exec 3<&-
}

# run_wrk runs wrk on config $1 for $2 seconds into file $3, and appends the
# EVALSHA and PING calls Redis ran meanwhile, the requests on_redis_error
# decided and the CPU ticks each server used. A gateway merges the
# decisions of a batch into one EVALSHA (of lua/batch.lua), so EVALSHA per
# request is less than one; the requests that Redis did not decide are
# those on_redis_error did.
run_wrk() {
	local calls pings degraded metrics=$BENCH_PORT_METRICS ticks=() names=(gateway upstream redis) pids i
	# (h) is served by the baseline's own gateway process.
	pids=("$gateway_pid" "$upstream_pid" "$redis_pid")
	if [ "$1" = h ]; then
		pids[0]="$baseline_pid"
		metrics=$BENCH_PORT_METRICS_H
	fi
	calls="$(command_calls evalsha)"
	pings="$(command_calls ping)"
	degraded="$(local_decisions "$metrics")"
	for i in 0 1 2; do ticks+=("$(cpu_ticks "${pids[i]}")"); done
	client wrk -t"$THREADS" -c"$CONNECTIONS" -d"$2s" --latency \
		-H 'X-User: bench-user' -H 'X-API-Key: bench-key' "http://127.0.0.1:${port[$1]}/" >"$3"
	echo "evalsha_calls $(($(command_calls evalsha) - calls))" >>"$3"
	echo "local_decisions $(($(local_decisions "$metrics") - degraded))" >>"$3"
	echo "ping_calls $(($(command_calls ping) - pings))" >>"$3"
	for i in 0 1 2; do
		echo "cpu_${names[i]} $(($(cpu_ticks "${pids[i]}") - ticks[i]))" >>"$3"
	done
}

# build_caddy_bench builds bin/caddy-bench when it is missing, when its
# xcaddy line changed, or when a Go or Lua source, go.mod or go.sum is newer
# than it (as scripts/build-caddy.sh does for bin/caddy). The line is
# bin/caddy's (scripts/build-caddy.sh --print-xcaddy) plus:
#
#   --replace <module>=.                 every version of this module is the
#                                        work tree, so that the next package
#                                        resolves without the module proxy
#   --with <module>/bench/pingfloor      the floor of configuration (g)
#   --with github.com/mholt/caddy-ratelimit@<version>   configuration (f)
build_caddy_bench() {
	local out=bin/caddy-bench module=github.com/token-bucket/token_bucket xcaddy_version line stamp
	xcaddy_version="$(sed -n 's/^XCADDY_VERSION=\([^ ]*\).*/\1/p' scripts/build-caddy.sh)"
	read -ra line <<<"$(scripts/build-caddy.sh --print-xcaddy . "./$out")"
	line=("${line[@]:1}" --replace "$module=." --with "$module/bench/pingfloor"
		--with "github.com/mholt/caddy-ratelimit@$RATELIMIT_VERSION")
	stamp="xcaddy $xcaddy_version ${line[*]}"
	if [ -x "$out" ] && [ "$(cat "$out.stamp" 2>/dev/null)" = "$stamp" ] &&
		[ -z "$(find . -path ./bin -prune -o -path ./.git -prune -o -path ./.run -prune -o \
			\( -name '*.go' ! -name '*_test.go' -o -name '*.lua' -o -name go.mod -o -name go.sum \) \
			-newer "$out" -print | head -n 1)" ]; then
		echo "bin/caddy-bench is up to date"
		return
	fi
	mkdir -p bin
	echo "building bin/caddy-bench: $stamp"
	rm -f "$out.stamp"
	if ! go run "github.com/caddyserver/xcaddy/cmd/xcaddy@$xcaddy_version" "${line[@]}" >bin/xcaddy-bench.log 2>&1; then
		tail -n 40 bin/xcaddy-bench.log >&2
		echo "xcaddy build of bin/caddy-bench failed; full log: bin/xcaddy-bench.log" >&2
		exit 1
	fi
	echo "$stamp" >"$out.stamp"
}

# build_caddy_baseline builds bin/caddy-baseline-<commit> from the tree of
# commit $BASELINE with that tree's own scripts/build-caddy.sh, once.
build_caddy_baseline() {
	baseline_bin="bin/caddy-baseline-$BASELINE"
	if [ -x "$baseline_bin" ]; then
		echo "$baseline_bin is built"
		return
	fi
	local src="$tmp/baseline"
	mkdir -p "$src" bin
	git archive "$BASELINE" | tar -x -C "$src"
	echo "building $baseline_bin with the tree's scripts/build-caddy.sh"
	if ! (cd "$src" && scripts/build-caddy.sh) >"bin/caddy-baseline.log" 2>&1; then
		tail -n 40 bin/caddy-baseline.log >&2
		echo "the build of $BASELINE failed; full log: bin/caddy-baseline.log" >&2
		exit 1
	fi
	mv "$src/bin/caddy" "$baseline_bin"
}

start_caddy() {
	build_caddy_bench
	[ -n "$BASELINE" ] && build_caddy_baseline
	start_redis 0
	export BENCH_REDIS_URL="redis://127.0.0.1:$redis_port"
	export BENCH_PORT_UPSTREAM
	BENCH_PORT_UPSTREAM="$(free_port)"
	export BENCH_PORT_METRICS BENCH_PORT_METRICS_H
	BENCH_PORT_METRICS="$(free_port)"
	BENCH_PORT_METRICS_H="$(free_port)"
	declare -gA port
	local c
	for c in $SERVED; do
		port[$c]="$(free_port)"
		export "BENCH_PORT_${c^^}=${port[$c]}"
	done
	# Caddy's data and config directories stay out of $HOME.
	export XDG_DATA_HOME="$tmp/data" XDG_CONFIG_HOME="$tmp/config"
	start_server 0 "$OUT/caddy-upstream.log" ./bin/caddy-bench run --config bench/upstream.Caddyfile --adapter caddyfile
	upstream_pid=$started
	start_server 0 "$OUT/caddy-gateway.log" ./bin/caddy-bench run --config bench/e2e.Caddyfile --adapter caddyfile
	gateway_pid=$started
	if [ -n "$BASELINE" ]; then
		start_server 0 "$OUT/caddy-baseline.log" "./$baseline_bin" run --config bench/baseline.Caddyfile --adapter caddyfile
		baseline_pid=$started
	fi
	wait_port "$BENCH_PORT_UPSTREAM"
	for c in $SERVED; do wait_port "${port[$c]}"; done
}

# check_statuses makes sure each configuration answers as it should before
# it is measured: 429 for (c) from its second request on and for (i), 200
# elsewhere; and that (i) sends the header fields that (c) sends.
check_statuses() {
	local c want got names_c names_i
	status "${port[c]}" >/dev/null
	for c in $CONFIGS; do
		want=200
		case "$c" in c | i) want=429 ;; esac
		got="$(status "${port[$c]}")"
		if [ "$got" != "$want" ]; then
			echo "config ($c) on port ${port[$c]} answered $got, want $want; see $OUT/caddy-gateway.log" >&2
			exit 1
		fi
	done
	names_c="$(field_names "${port[c]}")"
	names_i="$(field_names "${port[i]}")"
	if [ "$names_c" != "$names_i" ]; then
		echo "configs (c) and (i) send different header fields; bench/e2e.Caddyfile's (i) must copy (c)'s 429:" >&2
		diff <(echo "$names_c") <(echo "$names_i") >&2 || true
		exit 1
	fi
}

# field prints a figure of a wrk output: rps, p50 and p99 (ms), requests,
# non2xx, errors, evalsha, local, ping, cpu_gateway, cpu_upstream, cpu_redis
# (ticks).
field() {
	awk -v f="$2" '
		function ms(v) {
			if (v ~ /us$/) return v / 1000
			if (v ~ /ms$/) return v + 0
			if (v ~ /s$/) return v * 1000
			return v
		}
		f == "rps" && /^Requests\/sec:/ { print $2 }
		f == "p50" && $1 == "50%" { print ms($2) }
		f == "p99" && $1 == "99%" { print ms($2) }
		f == "requests" && / requests in / { print $1 }
		f == "non2xx" && /Non-2xx or 3xx responses:/ { n = $NF }
		f == "errors" && /Socket errors:/ { gsub(/,/, ""); n = $4 + $6 + $8 + $10 }
		f == "evalsha" && $1 == "evalsha_calls" { print $2 }
		f == "local" && $1 == "local_decisions" { print $2 }
		f == "ping" && $1 == "ping_calls" { print $2 }
		f ~ /^cpu_/ && $1 == f { print $2 }
		END { if ((f == "non2xx" || f == "errors") && n == "") print 0; else if (f == "non2xx" || f == "errors") print n }
	' "$1"
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

http_phase() {
	say "## End to end (wrk -t$THREADS -c$CONNECTIONS, ${DURATION}s per run, $ROUNDS rounds; load average before: $(load_average))"
	say ""
	start_caddy
	say "- caddy: bin/caddy-bench, $(./bin/caddy-bench version | cut -d' ' -f1), with this plugin, bench/pingfloor and mholt/caddy-ratelimit $RATELIMIT_VERSION"
	check_statuses
	local c r
	for c in $CONFIGS; do # warm up: connections, the Lua script, Go's heap
		run_wrk "$c" 2 "$OUT/wrk-$c-warmup.txt"
	done
	for r in $(seq "$ROUNDS"); do
		for c in $CONFIGS; do
			echo "round $r/$ROUNDS, config ($c), load average $(load_average)" >&2
			run_wrk "$c" "$DURATION" "$OUT/wrk-$c-$r.txt"
		done
	done
	check_statuses
	http_summary
}

http_summary() {
	declare -A name=(
		[a]="plain respond"
		[b]="token_bucket, 3 dimensions, allowed"
		[c]="token_bucket, client denied (deny cache)"
		[d]="token_bucket, 3 dimensions, allowed + reverse_proxy"
		[e]="reverse_proxy alone"
		[f]="mholt/caddy-ratelimit, in memory, one zone keyed by the 3 dimensions"
		[g]="floor: one go-redis PING per request (bench_ping_floor)"
		[i]="the 429 of (c), static: Caddy's header and respond"
		[h]="as (b), at ${BASELINE:0:12} (the baseline)"
	)
	local c r f warnings=()
	say '```'
	say "wrk -t$THREADS -c$CONNECTIONS -d${DURATION}s --latency -H 'X-User: bench-user' -H 'X-API-Key: bench-key' http://127.0.0.1:<port>/"
	say '```'
	say ""
	say "CPU µs per request: CPU time each server process used during the runs (/proc/<pid>/stat), over the requests wrk completed."
	say "On_redis_error: the requests decided without Redis (the gateway's caddy_token_bucket_local_decisions_total), 0 when Redis decided every one. EVALSHA per request is less than 1 where the gateway merged the decisions of a batch into one call."
	say ""
	say "| config | req/s, median | req/s, each round | p50 ms | p99 ms | non-2xx | socket errors | on_redis_error | EVALSHA per request | PING per request | CPU µs/req: gateway | upstream | redis-server | total |"
	say "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
	for c in $CONFIGS; do
		local rounds="" p50 p99 non2xx=0 errors=0 requests=0 evalsha=0 locals=0 ping=0 gw=0 up=0 rd=0 per pings
		for r in $(seq "$ROUNDS"); do
			f="$OUT/wrk-$c-$r.txt"
			rounds+="$(printf '%.0f' "$(field "$f" rps)") "
			non2xx=$((non2xx + $(field "$f" non2xx)))
			errors=$((errors + $(field "$f" errors)))
			requests=$((requests + $(field "$f" requests)))
			evalsha=$((evalsha + $(field "$f" evalsha)))
			locals=$((locals + $(field "$f" local)))
			ping=$((ping + $(field "$f" ping)))
			gw=$((gw + $(field "$f" cpu_gateway)))
			up=$((up + $(field "$f" cpu_upstream)))
			rd=$((rd + $(field "$f" cpu_redis)))
		done
		p50="$(for r in $(seq "$ROUNDS"); do field "$OUT/wrk-$c-$r.txt" p50; done | median)"
		p99="$(for r in $(seq "$ROUNDS"); do field "$OUT/wrk-$c-$r.txt" p99; done | median)"
		per="$(awk -v e="$evalsha" -v n="$requests" 'BEGIN { printf "%.3f", e / n }')"
		pings="$(awk -v e="$ping" -v n="$requests" 'BEGIN { printf "%.3f", e / n }')"
		say "| ($c) ${name[$c]} | $(printf '%.0f' "$(median_of "$c" rps)") | ${rounds% } | $p50 | $p99 | $non2xx | $errors | $locals | $per | $pings |" \
			"$(awk -v g="$gw" -v u="$up" -v r="$rd" -v n="$requests" -v hz="$HZ" \
				'BEGIN { k = 1e6 / hz / n; printf "%.1f | %.1f | %.1f | %.1f |", g * k, u * k, r * k, (g + u + r) * k }')"
		case "$c" in
		b | d | h) [ "$locals" -ne 0 ] &&
			warnings+=("($c): $locals requests were decided by on_redis_error (Redis slower than the 1s timeout, or the breaker open), not by Redis") ;;
		c) awk -v p="$per" 'BEGIN { exit !(p > 0.01) }' &&
			warnings+=("($c): $per EVALSHA per request: the deny cache did not answer every request") ;;
		g) awk -v p="$pings" 'BEGIN { exit !(p < 0.99) }' &&
			warnings+=("($c): only $pings PING per request") ;;
		esac
		if [ "$errors" -ne 0 ]; then
			warnings+=("($c): $errors socket errors (connect, read, write or timeout)")
		fi
		if [[ "$c" == [ci] ]] && [ "$non2xx" -ne "$requests" ]; then
			warnings+=("($c): $non2xx of $requests responses were not 2xx; all should have been 429")
		elif [[ "$c" != [ci] ]] && [ "$non2xx" -ne 0 ]; then
			warnings+=("($c): $non2xx responses were not 2xx")
		fi
	done
	say ""
	for f in "${warnings[@]}"; do
		say "**warning**: $f."
	done
	[ ${#warnings[@]} -gt 0 ] && say ""
	say "| ratio | of the medians | median of the rounds' ratios | each round | target | |"
	say "|---|---:|---:|---|---:|---|"
	ratio "(b)/(a): limiter allowed / respond" b a 0.6
	ratio "(d)/(e): limiter + proxy / proxy" d e 0.9
	ratio "(c)/(a): denied from cache / respond" c a 0.9
	ratio "(c)/(a): gateway CPU per request, denied from cache / respond" c a 1.25 gw "<="
	ratio "(i)/(a): gateway CPU per request, the static 429 / respond" i a "" gw
	ratio "(c)/(i): gateway CPU per request, denied from cache / the static 429" c i "" gw
	ratio "(b)/(g): limiter allowed / the PING floor" b g
	ratio "(b)/(f): limiter allowed / caddy-ratelimit" b f
	ratio "(f)/(a): caddy-ratelimit / respond" f a
	ratio "(g)/(a): the PING floor / respond" g a
	if [ -n "$BASELINE" ]; then
		ratio "(b)/(h): gateway CPU per allowed request, this tree / the baseline" b h 0.75 gw "<="
		ratio "(b)/(h): redis-server CPU per allowed request, this tree / the baseline" b h 0.6 redis "<="
		ratio "(b)/(h): limiter allowed, this tree / the baseline" b h
	fi
	say ""
	say "Every configuration against (a) plain respond, (f) caddy-ratelimit and (g) the PING floor: the ratio"
	say "of the medians, in brackets the median of the rounds' ratios. CPU: all server processes' CPU µs per request."
	say ""
	say "| config | req/s ÷ (a) | req/s ÷ (f) | req/s ÷ (g) | CPU/req ÷ (a) | CPU/req ÷ (f) | CPU/req ÷ (g) |"
	say "|---|---:|---:|---:|---:|---:|---:|"
	for c in $CONFIGS; do
		say "| ($c) ${name[$c]} | $(ratio_cell "$c" a rps) | $(ratio_cell "$c" f rps) | $(ratio_cell "$c" g rps) |" \
			"$(ratio_cell "$c" a cpu) | $(ratio_cell "$c" f cpu) | $(ratio_cell "$c" g cpu) |"
	done
	say ""
}

# metric prints figure $3 of config $1 in round $2: rps (requests per
# second), gw (the gateway's CPU µs per request), redis (redis-server's
# CPU µs per request) or cpu (every server process's CPU µs per request).
metric() {
	local f="$OUT/wrk-$1-$2.txt"
	case "$3" in
	rps) field "$f" rps ;;
	gw) awk -v t="$(field "$f" cpu_gateway)" -v n="$(field "$f" requests)" -v hz="$HZ" 'BEGIN { print t * 1e6 / hz / n }' ;;
	redis) awk -v t="$(field "$f" cpu_redis)" -v n="$(field "$f" requests)" -v hz="$HZ" 'BEGIN { print t * 1e6 / hz / n }' ;;
	cpu) awk -v t="$(($(field "$f" cpu_gateway) + $(field "$f" cpu_upstream) + $(field "$f" cpu_redis)))" \
		-v n="$(field "$f" requests)" -v hz="$HZ" 'BEGIN { print t * 1e6 / hz / n }' ;;
	esac
}

# median_of prints the median over the rounds of metric $2 of config $1.
median_of() {
	local r
	for r in $(seq "$ROUNDS"); do metric "$1" "$r" "$2"; done | median
}

# ratios prints, for metric $3 (default rps) of config $1 over config $2:
# the ratio of their medians, the median of the ratios of each round (the
# two ran a few seconds apart, so a change in the machine's load affects
# both) and each round's, tab-separated.
ratios() {
	local r each="" v m
	for r in $(seq "$ROUNDS"); do
		each+="$(awk -v x="$(metric "$1" "$r" "${3:-rps}")" -v y="$(metric "$2" "$r" "${3:-rps}")" \
			'BEGIN { printf "%.2f", (y > 0) ? x / y : 0 }') "
	done
	v="$(awk -v x="$(median_of "$1" "${3:-rps}")" -v y="$(median_of "$2" "${3:-rps}")" \
		'BEGIN { printf "%.2f", (y > 0) ? x / y : 0 }')"
	m="$(printf '%.2f' "$(echo "$each" | tr ' ' '\n' | grep . | median)")"
	printf '%s\t%s\t%s\n' "$v" "$m" "${each% }"
}

# measured reports whether config $1 is among those measured (BENCH_CONFIGS).
measured() {
	case " $CONFIGS " in
	*" $1 "*) return 0 ;;
	esac
	return 1
}

# ratio_cell prints "v [m]" of ratios $1 $2 $3 for a table cell, "–" when
# either config was not measured.
ratio_cell() {
	local v m each
	if ! measured "$1" || ! measured "$2"; then
		echo "–"
		return
	fi
	IFS=$'\t' read -r v m each < <(ratios "$1" "$2" "$3")
	echo "$v [$m]"
}

# ratio reports a row: $1 the label, config $2 over config $3, of metric
# $5 (default rps), against target $4 (none when empty) in the direction
# $6 (">=", the default, or "<="); nothing when either config was not
# measured.
ratio() {
	local v m each target="" verdict=""
	measured "$2" && measured "$3" || return 0
	IFS=$'\t' read -r v m each < <(ratios "$2" "$3" "${5:-rps}")
	if [ -n "${4:-}" ]; then
		if [ "${6:->=}" = "<=" ]; then
			target="≤ $4"
			verdict="$(awk -v v="$v" -v t="$4" 'BEGIN { print (v <= t) ? "meets" : "**short**" }')"
		else
			target="≥ $4"
			verdict="$(awk -v v="$v" -v t="$4" 'BEGIN { print (v >= t) ? "meets" : "**short**" }')"
		fi
	fi
	say "| $1 | $v | $m | $each | $target | $verdict |"
}

install_tools
: >"$SUMMARY"
machine
start=$SECONDS
has_phase go && go_phase
has_phase redis && redis_phase
has_phase instr && instr_phase
has_phase http && http_phase
say "- load average at end: $(load_average); wall time $((SECONDS - start))s"
echo
echo "==== $SUMMARY"
cat "$SUMMARY"
if [ ${#failed[@]} -gt 0 ]; then
	echo "bench: failed: ${failed[*]}" >&2
	exit 1
fi
