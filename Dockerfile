# Caddy with the token_bucket plugin, built from this checkout in the
# official caddy:<version>-builder pattern.
#
# Build:
#
#   docker build -t caddy-token-bucket .
#
# Run, with your Caddyfile (see Caddyfile.llm.example, or the ConfigMap of
# deploy/kubernetes/) and Redis's URL and secrets in the environment:
#
#   docker run --rm -p 8080:8080 \
#     -e REDIS_URL='redis://:password@redis.internal:6379/0' \
#     -e TOKEN_BUCKET_KEY_SECRET="$(openssl rand -hex 32)" \
#     -v "$PWD/Caddyfile:/etc/caddy/Caddyfile:ro" \
#     -v caddy_data:/data -v caddy_config:/config \
#     caddy-token-bucket
#
# The image's command is the official image's:
# caddy run --config /etc/caddy/Caddyfile --adapter caddyfile.
#
# The xcaddy line is the build CI runs for bin/caddy (scripts/build-caddy.sh
# prints it with `--print-xcaddy /src /usr/bin/caddy`, and
# scripts/check-build.sh fails when the two differ): Caddy of go.mod's
# version, with the plugin from /src, this checkout. "@v0.0.0=/src" makes Go
# build the copy as it is, without asking the module proxy for a published
# version. Add your other plugins with more --with flags.

FROM caddy:2.11.9-builder AS builder

COPY . /src
RUN xcaddy build v2.11.9 \
	--with github.com/token-bucket/token_bucket@v0.0.0=/src \
	--output /usr/bin/caddy
RUN /usr/bin/caddy list-modules | grep -qx 'http.handlers.token_bucket'

FROM caddy:2.11.9

COPY --from=builder /usr/bin/caddy /usr/bin/caddy
