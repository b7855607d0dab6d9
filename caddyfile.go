package tokenbucket

import (
	"math"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("token_bucket", parseCaddyfile)
	// After forward_auth, so that authentication has set the identity and
	// tier placeholders by the time the limiter runs.
	httpcaddyfile.RegisterDirectiveOrder("token_bucket", httpcaddyfile.After, "forward_auth")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	var tb Handler
	err := tb.UnmarshalCaddyfile(h.Dispenser)
	return &tb, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	token_bucket [<matcher>] {
//		redis <redis://[user:pass@]host:port[/db] | rediss://...>
//		redis [<url>] {
//			address   <host:port> [<host:port>...]
//			cluster                         # the addresses are Cluster seeds
//			sentinel  <master_name>         # the addresses are Sentinels
//			sentinel_password <secret>
//			username  <name>
//			password  <secret>
//			db        <n>
//			tls
//			tls_ca    <pem_file>
//			tls_server_name <name>
//			timeout   <duration>
//			pool_size <n>
//			breaker_failures <n>
//			breaker_cooldown <duration>
//		}
//		key_prefix <string>
//		key_secret <secret>
//
//		dimension <name> <placeholder template>
//		ipv4_prefix <bits>
//		ipv6_prefix <bits>
//
//		tier_from    <placeholder>
//		default_tier <name>
//		tier <name> {
//			<dimension> <capacity> <refill> [requests|tokens]
//		}
//
//		cost           <integer | placeholder>
//		on_redis_error local|allow|deny
//		local_buckets  <n>
//		local_share    <fraction>
//		on_deny        respond|error
//	}
//
// <refill> is <amount>/<period> (10/1m, 25/s, 600/1h, 0.5/s) or a bare
// amount per second; see bucket.ParseRate. Every problem is reported with
// the value and the line it is on.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := map[string]bool{}
	for d.NextBlock(0) {
		dir := d.Val()
		if dir != "dimension" && dir != "tier" {
			if seen[dir] {
				return d.Errf("duplicate subdirective %q", dir)
			}
			seen[dir] = true
		}
		var err error
		switch dir {
		case "redis":
			err = h.unmarshalRedis(d)
		case "key_prefix", "key_secret", "tier_from", "default_tier", "cost", "on_redis_error", "on_deny":
			var v string
			if v, err = oneArg(d); err == nil {
				*h.stringField(dir) = v
			}
		case "ipv4_prefix", "ipv6_prefix", "local_buckets":
			err = h.unmarshalInt(d, dir)
		case "local_share":
			var v string
			if v, err = oneArg(d); err == nil {
				share, perr := strconv.ParseFloat(v, 64)
				if perr != nil || !(share > 0 && share <= 1) {
					return d.Errf("invalid local_share %q: must be a fraction > 0 and ≤ 1", v)
				}
				h.LocalShare = share
			}
		case "dimension":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.ArgErr()
			}
			h.Dimensions = append(h.Dimensions, Dimension{Name: args[0], Identity: args[1]})
		case "tier":
			err = h.unmarshalTier(d)
		default:
			return d.Errf("unknown subdirective %q", dir)
		}
		if err != nil {
			return err
		}
	}
	if err := h.validate(); err != nil {
		return d.Errf("token_bucket: %v", err)
	}
	return nil
}

func (h *Handler) stringField(name string) *string {
	switch name {
	case "key_prefix":
		return &h.KeyPrefix
	case "key_secret":
		return &h.KeySecret
	case "tier_from":
		return &h.TierFrom
	case "default_tier":
		return &h.DefaultTier
	case "cost":
		return &h.Cost
	case "on_redis_error":
		return &h.OnRedisError
	default:
		return &h.OnDeny
	}
}

func (h *Handler) unmarshalInt(d *caddyfile.Dispenser, name string) error {
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return d.Errf("invalid %s %q: must be a whole number > 0", name, v)
	}
	switch name {
	case "ipv4_prefix":
		h.IPv4Prefix = n
	case "ipv6_prefix":
		h.IPv6Prefix = n
	default:
		h.LocalBuckets = n
	}
	return nil
}

func (h *Handler) unmarshalRedis(d *caddyfile.Dispenser) error {
	h.Redis = new(RedisConfig)
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 1:
		h.Redis.URL = args[0]
	default:
		return d.ArgErr()
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("duplicate redis option %q", opt)
		}
		seen[opt] = true
		switch opt {
		case "address":
			h.Redis.Address = d.RemainingArgs()
			if len(h.Redis.Address) == 0 {
				return d.ArgErr()
			}
		case "username", "password", "sentinel", "sentinel_password", "tls_ca", "tls_server_name":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			*h.Redis.stringField(opt) = v
		case "cluster":
			if d.NextArg() {
				return d.ArgErr()
			}
			h.Redis.Cluster = true
		case "db", "pool_size", "breaker_failures":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 || (n == 0 && opt != "db") {
				return d.Errf("invalid redis %s %q: must be a whole number", opt, v)
			}
			switch opt {
			case "db":
				h.Redis.DB = n
			case "pool_size":
				h.Redis.PoolSize = n
			default:
				h.Redis.BreakerFailures = n
			}
		case "tls":
			if d.NextArg() {
				return d.ArgErr()
			}
			h.Redis.TLS = true
		case "timeout", "breaker_cooldown":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			dur, err := caddy.ParseDuration(v)
			if err != nil || dur <= 0 {
				return d.Errf("invalid redis %s %q: must be a duration > 0", opt, v)
			}
			if opt == "timeout" {
				h.Redis.Timeout = caddy.Duration(dur)
			} else {
				h.Redis.BreakerCooldown = caddy.Duration(dur)
			}
		default:
			return d.Errf("unknown redis option %q", opt)
		}
	}
	return nil
}

func (h *Handler) unmarshalTier(d *caddyfile.Dispenser) error {
	name, err := oneArg(d)
	if err != nil {
		return err
	}
	t := Tier{Name: name}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		l, err := unmarshalLimit(d)
		if err != nil {
			return err
		}
		t.Limits = append(t.Limits, l)
	}
	h.Tiers = append(h.Tiers, t)
	return nil
}

// unmarshalLimit reads <dimension> <capacity> <refill> [requests|tokens].
func unmarshalLimit(d *caddyfile.Dispenser) (Limit, error) {
	l := Limit{Dimension: d.Val()}
	args := d.RemainingArgs()
	if len(args) < 2 || len(args) > 3 {
		return l, d.ArgErr()
	}
	capacity, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || capacity <= 0 || capacity > MaxCost {
		return l, d.Errf("invalid capacity %q for dimension %q: must be a whole number from 1 to %d", args[0], l.Dimension, int64(MaxCost))
	}
	rate, err := bucket.ParseRate(args[1])
	if err != nil {
		return l, d.Errf("invalid refill %q for dimension %q: %v", args[1], l.Dimension, err)
	}
	// The JSON form holds the rate as a float; make sure it reads back as
	// the same exact rate.
	if back, err := bucket.RateFromFloat(rate.Float64()); err != nil || back != rate || math.IsInf(rate.Float64(), 0) {
		return l, d.Errf("invalid refill %q for dimension %q: too fine-grained to hold exactly", args[1], l.Dimension)
	}
	l.Capacity, l.RefillRate = capacity, rate.Float64()
	if len(args) == 3 {
		if args[2] != UnitRequests && args[2] != UnitTokens {
			return l, d.Errf("invalid unit %q for dimension %q: must be requests or tokens", args[2], l.Dimension)
		}
		if args[2] == UnitTokens {
			l.Unit = UnitTokens
		}
	}
	return l, nil
}

func (c *RedisConfig) stringField(name string) *string {
	switch name {
	case "username":
		return &c.Username
	case "password":
		return &c.Password
	case "sentinel":
		return &c.Sentinel
	case "sentinel_password":
		return &c.SentinelPassword
	case "tls_ca":
		return &c.TLSCA
	default:
		return &c.TLSServerName
	}
}

func oneArg(d *caddyfile.Dispenser) (string, error) {
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	v := d.Val()
	if d.NextArg() {
		return "", d.ArgErr()
	}
	return v, nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Handler)(nil)
