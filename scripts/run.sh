#!/usr/bin/env bash
# scripts/run.sh: run the demo LLM gateway of Caddyfile.example.
#
# Installs redis-server when it is missing, starts a private one on a free
# loopback port (no persistence), builds bin/caddy with the plugin (cached),
# and runs Caddy in the foreground. Ctrl-C stops Caddy and Redis.
#
# Environment: GATEWAY_PORT (default 8080), UPSTREAM_PORT (default 8081),
# CADDY_ADMIN (default localhost:2019; "off" disables the admin API),
# REDIS_URL (default: the private redis-server; set, no Redis is started and
# the gateway uses that one, e.g. another gateway's, whose limits it then
# shares).
set -euo pipefail
cd "$(dirname "$0")/.."

export GATEWAY_PORT="${GATEWAY_PORT:-8080}"
export UPSTREAM_PORT="${UPSTREAM_PORT:-8081}"

# free_port prints a TCP port on 127.0.0.1 that nothing listens on right
# now (bash's /dev/tcp: a refused connection), below the kernel's range of
# ephemeral ports (net.ipv4.ip_local_port_range, 32768-60999 by default):
# a port in that range may be the local end of an outgoing connection,
# which no listener can bind.
free_port() {
	local port lo=32768 hi=60999 from to
	read -r lo hi </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
	from=$((lo > 21024 ? lo - 20000 : hi + 1)) to=$((lo > 21024 ? lo - 1 : 65535))
	for _ in $(seq 100); do
		port=$((from + RANDOM % (to - from + 1)))
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
			echo "$port"
			return 0
		fi
	done
	echo "run.sh: no free port found" >&2
	return 1
}

redis_dir="$(mktemp -d)"
redis_pid=""
caddy_pid=""
cleanup() {
	trap - EXIT INT TERM
	[ -n "$caddy_pid" ] && kill "$caddy_pid" 2>/dev/null && wait "$caddy_pid" 2>/dev/null
	[ -n "$redis_pid" ] && kill "$redis_pid" 2>/dev/null && wait "$redis_pid" 2>/dev/null
	rm -rf "$redis_dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start_redis() {
	scripts/install-redis.sh
	# Another process may take the port between the probe and the bind:
	# a redis-server that exits is started again on another port.
	for _ in 1 2 3; do
		redis_port="$(free_port)"
		redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
			--dir "$redis_dir" --daemonize no --logfile "$redis_dir/redis.log" &
		redis_pid=$!
		for _ in $(seq 50); do
			[ "$(redis-cli -p "$redis_port" ping 2>/dev/null)" = PONG ] && break
			kill -0 "$redis_pid" 2>/dev/null || break
			sleep 0.1
		done
		[ "$(redis-cli -p "$redis_port" ping 2>/dev/null)" = PONG ] && break
		kill "$redis_pid" 2>/dev/null || true
		wait "$redis_pid" 2>/dev/null || true
		redis_pid=""
	done
	if [ -z "$redis_pid" ]; then
		echo "redis-server did not start on 127.0.0.1:$redis_port:" >&2
		cat "$redis_dir/redis.log" >&2
		exit 1
	fi
	export REDIS_URL="redis://127.0.0.1:$redis_port"
	echo "redis-server on 127.0.0.1:$redis_port (pid $redis_pid, no persistence)"
}

if [ -n "${REDIS_URL:-}" ]; then
	echo "using the Redis at $REDIS_URL (none started)"
else
	start_redis
fi

scripts/build-caddy.sh
./bin/caddy list-modules | grep -x 'http.handlers.token_bucket' >/dev/null ||
	{ echo "bin/caddy lacks http.handlers.token_bucket" >&2; exit 1; }

gw="http://127.0.0.1:$GATEWAY_PORT"
cat <<MSG

Gateway: $gw  (upstream 127.0.0.1:$UPSTREAM_PORT, Redis $REDIS_URL)
Try, in another terminal:

  # one request on the free tier (10 requests burst, about 10 a minute)
  curl -i -H 'Authorization: Bearer sk-free-demo' -H 'Content-Type: application/json' \\
    -d '{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}' \\
    $gw/v1/chat/completions

  # 14 more: 200 until the burst of 10 is spent, then 429 with Retry-After
  for i in \$(seq 14); do
    curl -s -o /dev/null -w '%{http_code} retry-after=%header{retry-after} remaining=%header{x-ratelimit-remaining} tokens=%header{x-ratelimit-remaining-tokens}\\n' \\
      -H 'Authorization: Bearer sk-free-demo' -d '{}' $gw/v1/chat/completions
  done

  # other tiers: sk-standard-demo (60, 1/s), sk-enterprise-demo (1500, 25/s),
  # X-API-Key works as well as Authorization: Bearer
  curl -i -H 'X-API-Key: sk-enterprise-demo' -d '{}' $gw/v1/chat/completions

  # a stream, as the SDKs ask for one: settled from the usage chunk the
  # gateway asks the upstream for and takes out
  curl -N -H 'Authorization: Bearer sk-standard-demo' \\
    -d '{"model":"demo-model","stream":true,"messages":[{"role":"user","content":"hi"}]}' \\
    $gw/v1/chat/completions

  # the buckets in Redis (hashed identities, never raw keys), without the
  # settlements' markers
  redis-cli -u $REDIS_URL --scan --pattern 'rl:*' | grep -v ':settled:'

Ctrl-C stops Caddy${redis_pid:+ and Redis}.

MSG

./bin/caddy run --config Caddyfile.example --adapter caddyfile &
caddy_pid=$!
wait "$caddy_pid"
