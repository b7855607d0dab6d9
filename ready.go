package tokenbucket

import (
	"net/http"

	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(Ready{})
	httpcaddyfile.RegisterHandlerDirective("token_bucket_ready", parseReadyCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("token_bucket_ready", httpcaddyfile.Before, "respond")
}

// Ready is a readiness probe for the rate limiter: it answers 200 with a
// JSON body when Redis answers a PING within the timeout (on a Redis
// Cluster, every master CLUSTER INFO with cluster_state:ok) and the shared
// client's circuit breaker is not open, and 503 when either fails: while
// the breaker is open the handlers do not call Redis and decide by
// on_redis_error, though Redis may answer again, until breaker_cooldown
// has passed. With AllowDegraded it stays 200, reporting "degraded", for
// gateways whose on_redis_error policy (local or allow) keeps serving
// without Redis. The body is {"status":"ready"|"degraded"|"unavailable",
// "redis":"up"|"down","breaker":"closed"|"open"|"half_open"}. It uses the
// same shared client as token_bucket handlers with the same redis
// configuration.
type Ready struct {
	// Redis says how to reach Redis, as in token_bucket; give the same
	// settings to probe the same client.
	Redis *RedisConfig `json:"redis,omitempty"`
	// AllowDegraded answers 200 with "status":"degraded" when Redis is
	// down, for a load balancer that should keep sending traffic to a
	// gateway that decides locally.
	AllowDegraded bool `json:"allow_degraded,omitempty"`

	conn    *conn
	poolKey string
	logger  *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (Ready) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.token_bucket_ready",
		New: func() caddy.Module { return new(Ready) },
	}
}

// Provision takes the shared Redis client.
func (rd *Ready) Provision(ctx caddy.Context) error {
	rd.logger = ctx.Logger()
	if err := rd.Redis.validate(); err != nil {
		return err
	}
	r, err := rd.Redis.resolve()
	if err != nil {
		return err
	}
	rd.conn, rd.poolKey, err = acquire(ctx, r, rd.logger)
	return err
}

// Cleanup releases the shared Redis client.
func (rd *Ready) Cleanup() error {
	if rd.poolKey == "" {
		return nil
	}
	rd.conn.dropLogger(rd.logger)
	_, err := conns.Delete(rd.poolKey)
	return err
}

// ServeHTTP answers the probe; it does not call next.
func (rd *Ready) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	if rd.conn.hold() { // a reload must not close the client under the probe
		defer rd.conn.release()
	}
	state := rd.conn.breaker.State()
	breaker := `","breaker":"` + breakerState(state) + `"}` + "\n"
	redis := `","redis":"up`
	if err := rd.conn.ping(r.Context()); err != nil {
		redis = `","redis":"down`
	} else if state != gobreaker.StateOpen {
		return writeJSON(w, http.StatusOK, []byte(`{"status":"ready`+redis+breaker))
	}
	if rd.AllowDegraded {
		return writeJSON(w, http.StatusOK, []byte(`{"status":"degraded`+redis+breaker))
	}
	return writeJSON(w, http.StatusServiceUnavailable, []byte(`{"status":"unavailable`+redis+breaker))
}

func parseReadyCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	var rd Ready
	err := rd.UnmarshalCaddyfile(h.Dispenser)
	return &rd, err
}

// UnmarshalCaddyfile sets up the probe from Caddyfile tokens. Syntax:
//
//	token_bucket_ready [<matcher>] {
//		redis <url> | redis [<url>] { ... }   # as in token_bucket
//		allow_degraded
//	}
func (rd *Ready) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "redis":
			if rd.Redis != nil {
				return d.Errf("duplicate subdirective %q", "redis")
			}
			var h Handler
			if err := h.unmarshalRedis(d); err != nil {
				return err
			}
			rd.Redis = h.Redis
		case "allow_degraded":
			if d.NextArg() {
				return d.ArgErr()
			}
			if rd.AllowDegraded {
				return d.Errf("duplicate subdirective %q", "allow_degraded")
			}
			rd.AllowDegraded = true
		default:
			return d.Errf("unknown subdirective %q", d.Val())
		}
	}
	if err := rd.Redis.validate(); err != nil {
		return d.Errf("token_bucket_ready: %v", err)
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Ready)(nil)
	_ caddy.CleanerUpper          = (*Ready)(nil)
	_ caddyhttp.MiddlewareHandler = (*Ready)(nil)
	_ caddyfile.Unmarshaler       = (*Ready)(nil)
)
