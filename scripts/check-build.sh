#!/usr/bin/env bash
# scripts/check-build.sh: build Caddy with the plugin and check that it has
# the module; that every Caddyfile of the repository (Caddyfile*.example, and
# those of deploy/, the one inside the Kubernetes ConfigMap included) is as
# caddy fmt writes it, adapts and validates; and that the Dockerfile builds
# what bin/caddy is built from: the same xcaddy command and Caddy version.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/build-caddy.sh

if ! ./bin/caddy list-modules | grep -x 'http.handlers.token_bucket' >/dev/null; then
	echo "bin/caddy does not list http.handlers.token_bucket" >&2
	exit 1
fi
echo "bin/caddy lists http.handlers.token_bucket"

# The Dockerfile runs scripts/build-caddy.sh's xcaddy build, from /src to
# /usr/bin/caddy, on the builder and runtime images of go.mod's Caddy.
want="$(scripts/build-caddy.sh --print-xcaddy /src /usr/bin/caddy)"
got="$(awk '/^RUN xcaddy /{on = 1} on {line = line " " $0; if ($0 !~ /\\$/) {print line; exit}}' Dockerfile |
	tr -d '\\' | tr -s ' \t' ' ' | sed 's/^ RUN //; s/ $//')"
if [ "$got" != "$want" ]; then
	echo "Dockerfile: its xcaddy command is not scripts/build-caddy.sh's:" >&2
	echo "  Dockerfile:            RUN $got" >&2
	echo "  scripts/build-caddy.sh: RUN $want" >&2
	exit 1
fi
version="$(scripts/build-caddy.sh --print-caddy-version)"
gomod="$(awk '$1 == "github.com/caddyserver/caddy/v2" {print $2}' go.mod)"
if [ "$gomod" != "$version" ]; then
	echo "go.mod requires caddy $gomod, scripts/build-caddy.sh builds $version" >&2
	exit 1
fi
for from in "FROM caddy:${version#v}-builder AS builder" "FROM caddy:${version#v}"; do
	grep -qxF "$from" Dockerfile || { echo "Dockerfile: no line \"$from\" (go.mod's Caddy $version)" >&2; exit 1; }
done
echo "Dockerfile: caddy ${version#v}, the xcaddy build of scripts/build-caddy.sh"

# The Caddyfile of deploy/kubernetes/configmap.yaml: the block under
# "  Caddyfile: |", four spaces of indentation taken off.
mkdir -p bin/caddyfiles
awk '/^  Caddyfile: \|$/ {on = 1; next}
	on && /^    / {print substr($0, 5); next}
	on && /^$/ {print; next}
	on {exit}' deploy/kubernetes/configmap.yaml >bin/caddyfiles/kubernetes-configmap.Caddyfile
if [ ! -s bin/caddyfiles/kubernetes-configmap.Caddyfile ]; then
	echo "deploy/kubernetes/configmap.yaml: no Caddyfile found under \"  Caddyfile: |\"" >&2
	exit 1
fi

# Every Caddyfile must be as caddy fmt writes it (its output equals the
# file), must adapt and must validate. validate provisions the handlers,
# which connect to Redis lazily: no Redis is needed (a Redis that does not
# answer is only a warning). The deploy Caddyfiles read REDIS_URL while
# Caddy runs; they are validated with a local one.
mapfile -t files < <(ls Caddyfile*.example; find deploy -name 'Caddyfile*' -type f | sort; echo bin/caddyfiles/kubernetes-configmap.Caddyfile)
for f in "${files[@]}"; do
	./bin/caddy fmt "$f" >bin/fmt.out 2>bin/fmt.log || true
	if ! cmp -s bin/fmt.out "$f"; then
		echo "caddy fmt: $f is not formatted (caddy fmt --overwrite $f):" >&2
		diff -u "$f" bin/fmt.out >&2 || true
		exit 1
	fi
	echo "caddy fmt: $f OK"
	./bin/caddy adapt --config "$f" --adapter caddyfile >/dev/null 2>bin/adapt.log ||
		{ cat bin/adapt.log >&2; echo "caddy adapt failed: $f" >&2; exit 1; }
	echo "caddy adapt: $f OK"
	REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}" \
		./bin/caddy validate --config "$f" --adapter caddyfile >/dev/null 2>bin/validate.log ||
		{ cat bin/validate.log >&2; echo "caddy validate failed: $f" >&2; exit 1; }
	echo "caddy validate: $f OK"
done
