#!/usr/bin/env bash
# scripts/install-redis.sh: install Debian's redis-server (with redis-cli)
# when it is not on PATH. The tests and scripts/run.sh start their own
# redis-server processes on free loopback ports; nothing here starts one.
# (On a host run by systemd, Debian's package itself enables and starts a
# system Redis on 127.0.0.1:6379, which the tests and scripts/run.sh leave
# alone.)
set -euo pipefail

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
	exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
	sudo="sudo"
fi
echo "installing redis-server with apt-get" >&2
$sudo apt-get update
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y redis-server
