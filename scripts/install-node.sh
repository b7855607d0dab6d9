#!/usr/bin/env bash
# scripts/install-node.sh: install Debian's nodejs and npm when node or npm
# is not on PATH. The SDK tests (sdk_test.go) run the official OpenAI and
# Anthropic SDKs under Node.js; `make sdk` then installs them into
# sdk/node_modules with npm ci.
set -euo pipefail

if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
	exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
	sudo="sudo"
fi
echo "installing nodejs and npm with apt-get" >&2
$sudo apt-get update
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y nodejs npm
