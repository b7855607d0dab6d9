#!/usr/bin/env bash
# scripts/fuzz.sh [seconds | <count>x]: run every fuzz target with
# `go test -fuzz` for the given seconds each (default 10; give more for a
# real hunt, e.g. scripts/fuzz.sh 600), or for a count of executions
# (scripts/fuzz.sh 5000x, what make test runs). Without -fuzz, `go test`
# already runs each target over its seeds: the f.Add calls and the
# committed corpus in testdata/fuzz/<FuzzName>/ of the package.
#
# A count has no wall-clock deadline: Go 1.26's fuzz coordinator can
# report a spurious "context deadline exceeded" failure, with no crasher,
# when a -fuzztime duration ends while a worker is busy (golang/go#75804,
# fixed in Go 1.27), so the run CI depends on is counted, not timed.
#
# A crasher is written to testdata/fuzz/<FuzzName>/<hash> by go test and
# the run stops with its error: commit that file as a regression seed with
# the fix. The corpus the fuzzer grows lives in the Go cache
# ($(go env GOCACHE)/fuzz), not in the repository.
#
# The first run compiles the packages with coverage instrumentation, which
# takes a few minutes for the Caddy package on 2 cores; later runs reuse
# the build cache.
set -euo pipefail
cd "$(dirname "$0")/.."

budget="${1:-10}"
case "$budget" in
'' | *[!0-9x]* | *x*x* | x*) echo "usage: scripts/fuzz.sh [seconds | <count>x]" >&2; exit 2 ;;
*x) ;;
*) budget="${budget}s" ;;
esac

# package:target, in the order they run.
targets=(
	./bucket:FuzzParseRate
	./bucket:FuzzKey
	./bucket:FuzzParseReply
	.:FuzzParseCost
	.:FuzzCaddyfile
	.:FuzzNormalizeIdentity
	.:FuzzSettle
	./llm:FuzzParseRequest
	./llm:FuzzWithStreamUsage
	./llm:FuzzUsageReader
	./llm:FuzzUsageChunkFilter
)

# count_files prints the number of files under a directory, 0 if none.
count_files() {
	if [ -d "$1" ]; then find "$1" -type f | wc -l; else echo 0; fi
}

cache="$(go env GOCACHE)/fuzz/$(go list -m)"
status=0
summary=()
for t in "${targets[@]}"; do
	pkg="${t%%:*}"
	name="${t##*:}"
	sub="${pkg#.}"
	echo "== $name ($pkg): $budget"
	start=$(date +%s)
	if ! go test -run '^$' -fuzz "^${name}\$" -fuzztime "$budget" "$pkg"; then
		status=1
		summary+=("$name: FAILED (see testdata/fuzz/$name under $pkg)")
		continue
	fi
	seeds=$(count_files "$pkg/testdata/fuzz/$name")
	corpus=$(count_files "$cache$sub/$name")
	summary+=("$name: ok in $(($(date +%s) - start))s; committed seeds $seeds, generated corpus $corpus")
done

echo
printf '%s\n' "${summary[@]}"
exit $status
