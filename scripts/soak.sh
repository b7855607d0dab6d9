#!/usr/bin/env bash
# scripts/soak.sh [duration] [flags]: the soak test, bounded: default 3
# minutes ("180" means seconds, "10m" works too). It builds Caddy with the
# plugin (xcaddy, cached as bin/caddy-<hash of the sources>), starts one
# redis-server and one Caddy with its admin API on free loopback ports,
# drives a steady load, kills and restarts Redis on its port every 30 s
# and reloads the config through POST /load every 10 s. It samples the
# gateway's goroutines and heap (admin /debug/pprof), RSS and open files,
# and the clients connected to Redis (CLIENT LIST) after a 15 s warm-up
# and at the end, prints a table of the figures, and fails when one grew
# beyond its bound (goroutines +50, Redis clients +5, heap 2x), a request
# failed, or a reload did not take. It stops by itself.
#
# Flags go to the driver (go run ./cmd/soak -h): e.g. -rps 800.
set -euo pipefail
cd "$(dirname "$0")/.."

duration="${1:-3m}"
case "$duration" in
*[!0-9]*) ;;
*) duration="${duration}s" ;;
esac
shift || true

scripts/install-redis.sh
exec go run ./cmd/soak -duration "$duration" "$@"
