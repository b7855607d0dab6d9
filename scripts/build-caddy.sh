#!/usr/bin/env bash
# scripts/build-caddy.sh: build ./bin/caddy, Caddy with this plugin, using
# xcaddy. The binary is cached: it is rebuilt only when it is missing, when
# a Go or Lua source, go.mod or go.sum is newer than it, or when the pinned
# versions below change.
#
# The plugin is given as github.com/token-bucket/token_bucket@v0.0.0=. : the
# "=." builds this work tree, and the explicit version makes Go take the
# replacement as is, without first asking the module proxy for the module's
# latest published version (a module proxy that answers that question with
# anything but "not found" would fail the build).
#
# The Dockerfile runs the same xcaddy build, from /src to /usr/bin/caddy, in
# caddy:<CADDY_VERSION>-builder (whose xcaddy is XCADDY_VERSION);
# scripts/check-build.sh fails when its xcaddy line is not the one this
# prints:
#
#   scripts/build-caddy.sh --print-xcaddy <source dir> <output>
#   scripts/build-caddy.sh --print-caddy-version
set -euo pipefail
cd "$(dirname "$0")/.."

XCADDY_VERSION=v0.4.5
CADDY_VERSION=v2.11.9 # go.mod's github.com/caddyserver/caddy/v2
MODULE=github.com/token-bucket/token_bucket
OUT=bin/caddy
STAMP="xcaddy $XCADDY_VERSION caddy $CADDY_VERSION"

# xcaddy_args prints, one a line, the arguments of the one xcaddy build of
# this repository: Caddy CADDY_VERSION with the plugin from the source tree
# $1, written to $2.
xcaddy_args() {
	printf '%s\n' build "$CADDY_VERSION" --with "$MODULE@v0.0.0=$1" --output "$2"
}

case "${1:-}" in
--print-xcaddy)
	echo "xcaddy $(xcaddy_args "${2:?source dir}" "${3:?output}" | paste -sd ' ')"
	exit 0
	;;
--print-caddy-version)
	echo "$CADDY_VERSION"
	exit 0
	;;
"") ;;
*)
	echo "usage: $0 [--print-xcaddy <source dir> <output> | --print-caddy-version]" >&2
	exit 2
	;;
esac

stale() {
	[ -x "$OUT" ] || return 0
	[ "$(cat "$OUT.stamp" 2>/dev/null)" = "$STAMP" ] || return 0
	[ -n "$(find . -path ./bin -prune -o -path ./.git -prune -o \
		\( -name '*.go' ! -name '*_test.go' -o -name '*.lua' -o -name go.mod -o -name go.sum \) \
		-newer "$OUT" -print | head -n 1)" ]
}

if ! stale; then
	echo "bin/caddy is up to date ($STAMP)"
	exit 0
fi

mkdir -p bin
echo "building bin/caddy with xcaddy ($STAMP); the first build takes several minutes"
rm -f "$OUT.stamp"
mapfile -t args < <(xcaddy_args . "./$OUT")
if ! go run "github.com/caddyserver/xcaddy/cmd/xcaddy@$XCADDY_VERSION" "${args[@]}" >bin/xcaddy.log 2>&1; then
	tail -n 40 bin/xcaddy.log >&2
	echo "xcaddy build failed; full log: bin/xcaddy.log" >&2
	exit 1
fi
echo "$STAMP" >"$OUT.stamp"
echo "built bin/caddy: $("./$OUT" version)"
