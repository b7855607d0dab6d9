#!/usr/bin/env bash
# scripts/check-build.sh: build Caddy with the plugin and check that it has
# the module and that Caddyfile.example (and every other Caddyfile*.example)
# adapts and validates.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/build-caddy.sh

if ! ./bin/caddy list-modules | grep -x 'http.handlers.token_bucket' >/dev/null; then
	echo "bin/caddy does not list http.handlers.token_bucket" >&2
	exit 1
fi
echo "bin/caddy lists http.handlers.token_bucket"

# Every example config must adapt and validate. validate provisions the
# handlers, which connect to Redis lazily: no Redis is needed (a Redis that
# does not answer is only a warning).
for f in Caddyfile*.example; do
	./bin/caddy adapt --config "$f" --adapter caddyfile >/dev/null 2>bin/adapt.log ||
		{ cat bin/adapt.log >&2; echo "caddy adapt failed: $f" >&2; exit 1; }
	echo "caddy adapt: $f OK"
	./bin/caddy validate --config "$f" --adapter caddyfile >/dev/null 2>bin/validate.log ||
		{ cat bin/validate.log >&2; echo "caddy validate failed: $f" >&2; exit 1; }
	echo "caddy validate: $f OK"
done
