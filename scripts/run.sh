#!/usr/bin/env bash
# scripts/run.sh: run the demo LLM gateway of Caddyfile.example.
#
# Installs redis-server when it is missing, starts a private one on a free
# loopback port (no persistence), builds bin/caddy with the plugin (cached),
# and runs Caddy in the foreground. Ctrl-C stops Caddy and Redis.
#
# Environment: GATEWAY_PORT (default 8080), UPSTREAM_PORT (default 8081),
# CADDY_ADMIN (default localhost:2019; "off" disables the admin API).
set -euo pipefail
cd "$(dirname "$0")/.."

export GATEWAY_PORT="${GATEWAY_PORT:-8080}"
export UPSTREAM_PORT="${UPSTREAM_PORT:-8081}"

# free_port prints a TCP port on 127.0.0.1 that is free right now.
free_port() {
	python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

scripts/install-redis.sh

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

redis_port="$(free_port)"
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
	--dir "$redis_dir" --daemonize no --logfile "$redis_dir/redis.log" &
redis_pid=$!
for _ in $(seq 50); do
	[ "$(redis-cli -p "$redis_port" ping 2>/dev/null)" = PONG ] && break
	sleep 0.1
done
if [ "$(redis-cli -p "$redis_port" ping 2>/dev/null)" != PONG ]; then
	echo "redis-server did not start on 127.0.0.1:$redis_port:" >&2
	cat "$redis_dir/redis.log" >&2
	exit 1
fi
export REDIS_URL="redis://127.0.0.1:$redis_port"
echo "redis-server on 127.0.0.1:$redis_port (pid $redis_pid, no persistence)"

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

  # the buckets in Redis (hashed identities, never raw keys)
  redis-cli -p $redis_port --scan --pattern 'rl:*'

Ctrl-C stops Caddy and Redis.

MSG

./bin/caddy run --config Caddyfile.example --adapter caddyfile &
caddy_pid=$!
wait "$caddy_pid"
