# Makefile: the commands of this repository. Each target does its own setup
# on a fresh Debian machine with Go (redis-server, nodejs and npm are
# installed when missing).

.PHONY: run test allocs bench bench-once fuzz fuzz-short soak fmt fmt-check vet redis node sdk build check-build clean

# Run the demo gateway of Caddyfile.example on 127.0.0.1:8080 with its own Redis.
run:
	scripts/run.sh

# Everything CI checks: a short fuzz run of every target, the request
# path's allocation bounds (read without the race detector, which
# allocates), then every test. go test -race runs last, so its summary
# lines end the output.
test: redis sdk vet fmt-check check-build fuzz-short allocs bench-once
	go test -race -count=1 ./...

# Every Go benchmark once, so that none breaks unnoticed between runs of
# make bench (their figures are make bench's).
bench-once: redis
	go test -count=1 -run '^$$' -bench . -benchtime 1x ./...

# The heap allocations of one request through the handler (allocs_test.go).
allocs: redis
	go test -count=1 -run '^TestHandlerAllocations$$' .

FUZZTIME ?= 10
SOAK ?= 3m

# Each fuzz target for FUZZTIME seconds (a longer hunt: make fuzz FUZZTIME=600).
fuzz:
	scripts/fuzz.sh $(FUZZTIME)

# A short run of every target that every test run includes: a count of
# executions, not seconds (see scripts/fuzz.sh on Go 1.26's deadline race).
fuzz-short:
	scripts/fuzz.sh 2000x

# A bounded soak: steady load, Redis restarted every 30 s, config reloaded
# every 10 s; fails on growth of goroutines, Redis clients or heap.
soak: redis
	scripts/soak.sh $(SOAK)

# The benchmark suite of BENCHMARKS.md: Go benchmarks, Redis-side µs per
# script call, and wrk against a built Caddy.
bench: redis
	scripts/bench.sh

fmt:
	gofmt -l -w .

fmt-check:
	@files="$$(gofmt -l .)"; \
	if [ -n "$$files" ]; then echo "gofmt -l reports unformatted files (run make fmt):"; echo "$$files"; exit 1; fi; \
	echo "gofmt: OK"

vet:
	go vet ./...

# redis-server on PATH: the tests start their own on free ports.
redis:
	scripts/install-redis.sh

# node and npm on PATH, for the SDK tests (sdk_test.go).
node:
	scripts/install-node.sh

# The OpenAI and Anthropic SDKs of sdk/package-lock.json in sdk/node_modules,
# installed again only when it is missing or the lock file changed.
sdk: sdk/node_modules/.package-lock.json

sdk/node_modules/.package-lock.json: sdk/package.json sdk/package-lock.json | node
	cd sdk && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# bin/caddy (Caddy + this plugin, cached), built with the xcaddy line the
# Dockerfile uses.
build:
	scripts/build-caddy.sh

# build, then: the module is listed, the Dockerfile's xcaddy line and Caddy
# version match the script's, and every example Caddyfile is caddy fmt
# clean, adapts and validates.
check-build:
	scripts/check-build.sh

clean:
	rm -rf bin .run
	go clean -testcache
