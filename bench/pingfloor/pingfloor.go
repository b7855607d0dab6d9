// Package pingfloor is a Caddy HTTP handler for the benchmark only: it
// makes exactly one go-redis PING per request and then calls the next
// handler. It is the floor of any limiter that makes one unbatched round
// trip to Redis per request: configuration (g) of bench/e2e.Caddyfile.
//
// scripts/bench.sh builds it into bin/caddy-bench with xcaddy --with; the
// product's bin/caddy, which the tests use, does not have it, and nothing
// in the product imports it.
//
//	bench_ping_floor <redis-url>
//
// The client is go-redis's, set up as the token_bucket handler sets up
// its own for one server (redis.go): the URL parsed by redis.ParseURL,
// dial, read and write timeouts of 1s (bench/e2e.Caddyfile's limiter
// timeout), the context's deadline honoured, no retries, go-redis's
// default pool. A failed PING answers 502, which scripts/bench.sh reports
// as non-2xx responses.
package pingfloor

import (
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

func init() {
	caddy.RegisterModule(Handler{})
	httpcaddyfile.RegisterHandlerDirective("bench_ping_floor", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("bench_ping_floor", httpcaddyfile.Before, "respond")
}

// Timeout is the client's dial, read and write timeout.
const Timeout = time.Second

// Handler makes one PING to Redis per request, then calls the next
// handler.
type Handler struct {
	// URL is the Redis server, as redis.ParseURL reads it.
	URL string `json:"url,omitempty"`

	client *redis.Client
}

// CaddyModule implements caddy.Module.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.bench_ping_floor",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision implements caddy.Provisioner.
func (h *Handler) Provision(caddy.Context) error {
	o, err := redis.ParseURL(caddy.NewReplacer().ReplaceKnown(h.URL, ""))
	if err != nil {
		return fmt.Errorf("bench_ping_floor: %w", err)
	}
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = Timeout, Timeout, Timeout
	o.ContextTimeoutEnabled = true
	o.MaxRetries = -1
	o.DialerRetries = 1
	h.client = redis.NewClient(o)
	return nil
}

// Cleanup implements caddy.CleanerUpper.
func (h *Handler) Cleanup() error {
	if h.client == nil {
		return nil
	}
	return h.client.Close()
}

// ServeHTTP implements caddyhttp.MiddlewareHandler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if err := h.client.Ping(r.Context()).Err(); err != nil {
		return caddyhttp.Error(http.StatusBadGateway, fmt.Errorf("bench_ping_floor: PING: %w", err))
	}
	return next.ServeHTTP(w, r)
}

// UnmarshalCaddyfile implements caddyfile.Unmarshaler.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive
	if !d.NextArg() {
		return d.ArgErr()
	}
	h.URL = d.Val()
	if d.NextArg() || d.NextBlock(0) {
		return d.Err("bench_ping_floor takes one argument, the Redis URL, and no block")
	}
	return nil
}

func parseCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	h := new(Handler)
	err := h.UnmarshalCaddyfile(helper.Dispenser)
	return h, err
}

var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ caddyfile.Unmarshaler       = (*Handler)(nil)
)
