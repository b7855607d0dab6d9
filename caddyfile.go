package tokenbucket

import (
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/dustin/go-humanize"

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
//			pipeline  on|off              # default on
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
//			<dimension> <capacity> <refill> [requests|tokens] [models <glob>...] [shadow]
//			<dimension> <n> concurrent [models <glob>...] [shadow]
//			<dimension> <amount> per day|week|month [requests|tokens] [models <glob>...] [shadow]
//		}
//		quota_timezone <IANA name>     # default UTC
//		on_limit reject|wait <max_wait>  # default reject
//		max_waiting <n>                # default 1000
//		concurrency_lease <duration>   # default 10m
//		shadow
//
//		cost           <integer | placeholder>
//		cost estimate {
//			max_body           <size>      # default 1MiB, at most 1GiB
//			default_max_tokens <n>         # default 1024
//			on_invalid         reject|<n>  # default reject: 400 invalid_body
//			tokenizer          approx|o200k_base|cl100k_base  # default approx
//			read_timeout       <duration>  # default 10s
//		}
//		settle [header <name>]
//		settle {
//			include_usage
//			header <name>
//		}
//		openai_headers
//		error_format   json|openai|anthropic
//		demote [<dimension>] after <n> denials within <duration> to tier <name> for <duration>
//		on_redis_error local|allow|deny
//		local_buckets  <n>
//		local_share    <fraction>
//		deny_cache     <n>|off
//		on_deny        respond|error
//
//		audit           on|off
//		audit_window    <duration>
//		audit_client_ip on|off
//		audit_buckets   <n>
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
		case "cost":
			err = h.unmarshalCost(d)
		case "settle":
			err = h.unmarshalSettle(d)
		case "demote":
			err = h.unmarshalDemote(d)
		case "openai_headers", "shadow":
			if d.NextArg() {
				return d.ArgErr()
			}
			if dir == "shadow" {
				h.Shadow = true
			} else {
				h.OpenAIHeaders = true
			}
		case "quota_timezone":
			var v string
			if v, err = oneArg(d); err == nil {
				if zerr := quotaZoneRule(v); zerr != nil {
					return d.Errf("invalid quota_timezone %q: %v", v, zerr)
				}
				h.QuotaTimezone = v
			}
		case "on_limit":
			args := d.RemainingArgs()
			switch {
			case len(args) == 1 && args[0] == LimitReject:
				h.OnLimit = LimitReject
			case len(args) == 2 && args[0] == LimitWait:
				dur, perr := caddy.ParseDuration(args[1])
				if perr != nil {
					return d.Errf("invalid on_limit wait %q: %v", args[1], perr)
				}
				if rerr := maxWaitRule(dur); rerr != nil {
					return d.Errf("invalid on_limit wait %q: %v", args[1], rerr)
				}
				h.OnLimit, h.MaxWait = LimitWait, caddy.Duration(dur)
			default:
				return argErr(d, "on_limit", args, "reject, or wait <max_wait>")
			}
		case "max_waiting":
			var v string
			if v, err = oneArg(d); err == nil {
				n, perr := strconv.Atoi(v)
				if perr != nil {
					return d.Errf("invalid max_waiting %q: %v", v, perr)
				}
				if positiveRule(int64(n)) != nil {
					return d.Errf("invalid max_waiting %q: %v", v, errPositive)
				}
				h.MaxWaiting = n
			}
		case "concurrency_lease":
			var v string
			if v, err = oneArg(d); err == nil {
				dur, perr := caddy.ParseDuration(v)
				if perr != nil {
					return d.Errf("invalid concurrency_lease %q: %v", v, perr)
				}
				if rerr := millisRule(dur); rerr != nil {
					return d.Errf("invalid concurrency_lease %q: %v", v, rerr)
				}
				h.ConcurrencyLease = caddy.Duration(dur)
			}
		case "key_prefix", "key_secret", "tier_from", "default_tier", "on_redis_error", "on_deny", "error_format":
			var v string
			if v, err = oneArg(d); err == nil {
				*h.stringField(dir) = v
			}
		case "ipv4_prefix", "ipv6_prefix", "local_buckets":
			err = h.unmarshalInt(d, dir)
		case "deny_cache":
			var v string
			if v, err = oneArg(d); err == nil {
				if v == "off" {
					h.DenyCache = -1
				} else if n, perr := strconv.Atoi(v); perr != nil {
					return d.Errf("invalid deny_cache %q: %v; it %v, or off", v, perr, errPositive)
				} else if positiveRule(int64(n)) != nil {
					return d.Errf("invalid deny_cache %q: %v, or off", v, errPositive)
				} else {
					h.DenyCache = n
				}
			}
		case "local_share":
			var v string
			if v, err = oneArg(d); err == nil {
				share, perr := parseShare(v)
				if perr != nil {
					return d.Errf("invalid local_share %q: %v", v, perr)
				}
				if shareRule(share) != nil {
					return d.Errf("invalid local_share %q: %v", v, errShare)
				}
				h.LocalShare = share
			}
		case "audit", "audit_window", "audit_client_ip", "audit_buckets":
			err = h.unmarshalAudit(d, dir)
		case "dimension":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return argErr(d, "dimension", args, "<name> <placeholder template>")
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

// unmarshalCost reads cost <integer | placeholder> or
//
//	cost estimate {
//		max_body           <size>
//		default_max_tokens <n>
//		on_invalid         reject | <cost>
//		tokenizer          approx | o200k_base | cl100k_base
//		read_timeout       <duration>
//	}
func (h *Handler) unmarshalCost(d *caddyfile.Dispenser) error {
	v, err := oneArgOrBlock(d)
	if err != nil {
		return err
	}
	if v != "estimate" {
		if d.NextBlock(d.Nesting()) {
			return d.Errf("cost %q takes no block (only cost estimate does)", v)
		}
		h.Cost = v
		return nil
	}
	e := &Estimate{}
	h.Estimate = e
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("duplicate estimate option %q", opt)
		}
		seen[opt] = true
		arg, err := oneArg(d)
		if err != nil {
			return err
		}
		switch opt {
		case "max_body":
			size, err := humanize.ParseBytes(arg)
			if err != nil {
				return d.Errf("invalid estimate max_body %q: %v", arg, err)
			}
			if size > MaxEstimateBody || maxBodyRule(int64(size)) != nil {
				return d.Errf("invalid estimate max_body %q: %v", arg, errMaxBody)
			}
			e.MaxBody = int64(size)
		case "default_max_tokens":
			n, err := parseCost(arg)
			if err != nil || budgetRule(n) != nil {
				return d.Errf("invalid estimate default_max_tokens %q: %v", arg, errBudget)
			}
			e.DefaultMaxTokens = n
		case "on_invalid":
			n := int64(-1)
			if arg != "reject" {
				if n, err = parseCost(arg); err != nil {
					return d.Errf("invalid estimate on_invalid %q: reject or a cost: %v", arg, errInvalidCost)
				}
			}
			e.OnInvalid = &n
		case "tokenizer":
			e.Tokenizer = arg
		case "read_timeout":
			dur, err := caddy.ParseDuration(arg)
			if err != nil {
				return d.Errf("invalid estimate read_timeout %q: %v", arg, err)
			}
			if durationRule(dur) != nil {
				return d.Errf("invalid estimate read_timeout %q: %v", arg, errDuration)
			}
			e.ReadTimeout = caddy.Duration(dur)
		default:
			return d.Errf("unknown estimate option %q", opt)
		}
	}
	return nil
}

// unmarshalDemote reads
// demote [<dimension>] after <n> denials within <duration> to tier <name> for <duration>.
func (h *Handler) unmarshalDemote(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	dm := &Demote{}
	if len(args) == 11 {
		dm.Dimension, args = args[0], args[1:]
	}
	if len(args) != 10 || args[0] != "after" || args[2] != "denials" || args[3] != "within" ||
		args[5] != "to" || args[6] != "tier" || args[8] != "for" {
		return d.Errf("invalid demote %q: demote [<dimension>] after <n> denials within <duration> to tier <name> for <duration>", args)
	}
	n, err := strconv.ParseInt(args[1], 10, 64)
	if err != nil {
		return d.Errf("invalid demote denials %q: %v", args[1], err)
	}
	if err := countRule(n); err != nil {
		return d.Errf("invalid demote denials %q: %v", args[1], err)
	}
	within, err := caddy.ParseDuration(args[4])
	if err != nil {
		return d.Errf("invalid demote window %q: %v", args[4], err)
	}
	if err := millisRule(within); err != nil {
		return d.Errf("invalid demote window %q: %v", args[4], err)
	}
	span, err := caddy.ParseDuration(args[9])
	if err != nil {
		return d.Errf("invalid demote duration %q: %v", args[9], err)
	}
	if err := millisRule(span); err != nil {
		return d.Errf("invalid demote duration %q: %v", args[9], err)
	}
	dm.Denials, dm.Within, dm.Tier, dm.For = n, caddy.Duration(within), args[7], caddy.Duration(span)
	h.Demote = dm
	return nil
}

// unmarshalSettle reads settle [header <name>] or
//
//	settle {
//		include_usage
//		keep_failed
//		header <name>
//	}
func (h *Handler) unmarshalSettle(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	h.Settle = &Settle{}
	switch {
	case len(args) == 0:
	case len(args) == 2 && args[0] == "header" && args[1] == "":
		return emptyErr(d, "settle header")
	case len(args) == 2 && args[0] == "header":
		h.Settle.Header = args[1]
	default:
		return d.Errf("invalid settle %q: settle, settle header <name>, or a settle block", args)
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if seen[opt] || (opt == "header" && h.Settle.Header != "") {
			return d.Errf("duplicate settle option %q", opt)
		}
		seen[opt] = true
		switch opt {
		case "include_usage":
			if args := d.RemainingArgs(); len(args) > 0 {
				return argErr(d, opt, args, "no arguments")
			}
			h.Settle.IncludeUsage = true
		case "keep_failed":
			if args := d.RemainingArgs(); len(args) > 0 {
				return argErr(d, opt, args, "no arguments")
			}
			h.Settle.KeepFailed = true
		case "header":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			h.Settle.Header = v
		default:
			return d.Errf("unknown settle option %q", opt)
		}
	}
	return nil
}

// oneArgOrBlock reads exactly one argument, not empty, that may be
// followed by a block.
func oneArgOrBlock(d *caddyfile.Dispenser) (string, error) {
	name := d.Val()
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	v := d.Val()
	if d.NextArg() {
		return "", d.ArgErr()
	}
	if v == "" {
		return "", emptyErr(d, name)
	}
	return v, nil
}

// emptyErr reports an empty value (""), which would otherwise read as the
// subdirective left out: its default, silently.
func emptyErr(d *caddyfile.Dispenser, name string) error {
	return d.Errf("%s: an empty value; leave the subdirective out for its default", name)
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
	case "on_redis_error":
		return &h.OnRedisError
	case "on_deny":
		return &h.OnDeny
	case "error_format":
		return &h.ErrorFormat
	}
	panic("stringField: no field " + name)
}

func (h *Handler) unmarshalInt(d *caddyfile.Dispenser, name string) error {
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return d.Errf("invalid %s %q: %v", name, v, err)
	}
	var rule error
	switch name {
	case "ipv4_prefix":
		rule = prefixRule(n, 32)
	case "ipv6_prefix":
		rule = prefixRule(n, 128)
	default:
		rule = positiveRule(int64(n))
	}
	if rule != nil {
		return d.Errf("invalid %s %q: %v", name, v, rule)
	}
	switch name {
	case "ipv4_prefix":
		h.IPv4Prefix = n
	case "ipv6_prefix":
		h.IPv6Prefix = n
	case "local_buckets":
		h.LocalBuckets = n
	default:
		panic("unmarshalInt: no field " + name)
	}
	return nil
}

func (h *Handler) unmarshalRedis(d *caddyfile.Dispenser) error {
	h.Redis = new(RedisConfig)
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 1:
		if args[0] == "" {
			return emptyErr(d, "redis")
		}
		h.Redis.URL = args[0]
	default:
		return argErr(d, "redis", args, "at most one URL")
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
				return argErr(d, "address", nil, "one or more <host:port>")
			}
			if slices.Contains(h.Redis.Address, "") {
				return emptyErr(d, "address")
			}
		case "username", "password", "sentinel", "sentinel_password", "tls_ca", "tls_server_name":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			*h.Redis.stringField(opt) = v
		case "cluster":
			if args := d.RemainingArgs(); len(args) > 0 {
				return argErr(d, opt, args, "no arguments")
			}
			h.Redis.Cluster = true
		case "db", "pool_size", "breaker_failures":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			n, err := strconv.Atoi(v)
			if err != nil {
				return d.Errf("invalid redis %s %q: %v", opt, v, err)
			}
			if nonNegativeRule(n) != nil {
				return d.Errf("invalid redis %s %q: %v", opt, v, errNonNegative)
			}
			switch opt {
			case "db":
				h.Redis.DB = n
			case "pool_size":
				if err := poolSizeRule(n); err != nil {
					return d.Errf("invalid redis pool_size %q: %v", v, err)
				}
				h.Redis.PoolSize = n
			case "breaker_failures":
				h.Redis.BreakerFailures = n
			}
		case "tls":
			if args := d.RemainingArgs(); len(args) > 0 {
				return argErr(d, opt, args, "no arguments")
			}
			h.Redis.TLS = true
		case "pipeline":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			if v != "on" && v != "off" {
				return d.Errf("invalid redis pipeline %q: must be on or off", v)
			}
			on := v == "on"
			h.Redis.Pipeline = &on
		case "timeout", "breaker_cooldown":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			dur, err := caddy.ParseDuration(v)
			if err != nil {
				return d.Errf("invalid redis %s %q: %v", opt, v, err)
			}
			if durationRule(dur) != nil {
				return d.Errf("invalid redis %s %q: %v", opt, v, errDuration)
			}
			switch opt {
			case "timeout":
				h.Redis.Timeout = caddy.Duration(dur)
			case "breaker_cooldown":
				h.Redis.BreakerCooldown = caddy.Duration(dur)
			}
		default:
			return d.Errf("unknown redis option %q", opt)
		}
	}
	return h.Redis.checkLiteral(d)
}

// checkLiteral reports, at its line, what a load would refuse in a redis
// block written without placeholders in its URL and addresses (those are
// resolved when the config loads, on the host that runs it): the checks
// of validate and resolve (a cluster URL with a database, a second
// address without cluster or sentinel, a sentinel_password without
// Sentinels). The tls_ca file and the credentials' placeholders are read
// when the config loads.
func (c *RedisConfig) checkLiteral(d *caddyfile.Dispenser) error {
	if strings.Contains(c.URL, "{") || slices.ContainsFunc(c.Address, func(a string) bool { return strings.Contains(a, "{") }) {
		return nil
	}
	lit := *c
	lit.TLSCA = ""
	// The credentials are not checked but for a sentinel_password's
	// presence, and their {file.*} placeholders must not be read on the
	// host that adapts the Caddyfile (a secret there, or an error logged
	// for its absence).
	lit.Username, lit.Password = "", ""
	if lit.SentinelPassword != "" {
		lit.SentinelPassword = "x"
	}
	err := lit.validate()
	if err == nil {
		_, err = lit.resolve()
	}
	if err != nil {
		return d.Errf("%v", err)
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

// unmarshalLimit reads <dimension> <capacity> <refill> [requests|tokens]
// or <dimension> <n> concurrent, then [models <glob>...] [shadow].
func unmarshalLimit(d *caddyfile.Dispenser) (Limit, error) {
	l := Limit{Dimension: d.Val()}
	args := d.RemainingArgs()
	if i := slices.Index(args, "shadow"); i >= 0 && i == len(args)-1 {
		l.Shadow, args = true, args[:i]
	}
	if i := slices.Index(args, "models"); i >= 0 {
		if l.Models = args[i+1:]; len(l.Models) == 0 {
			return l, d.Errf("models for dimension %q: at least one model glob", l.Dimension)
		}
		args = args[:i]
	}
	if len(args) >= 3 && args[1] == "per" {
		n, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil {
			return l, d.Errf("invalid quota amount %q for dimension %q: %v", args[0], l.Dimension, err)
		}
		if capacityRule(n) != nil {
			return l, d.Errf("invalid quota amount %q for dimension %q: %v", args[0], l.Dimension, errCapacity)
		}
		if _, err := bucket.ParsePeriod(args[2]); err != nil {
			return l, d.Errf("invalid quota for dimension %q: %v", l.Dimension, err)
		}
		l.Capacity, l.Period = n, args[2]
		switch {
		case len(args) == 3:
		case len(args) == 4 && (args[3] == UnitRequests || args[3] == UnitTokens):
			if args[3] == UnitTokens {
				l.Unit = UnitTokens
			}
		default:
			return l, argErr(d, "limit "+l.Dimension, args, "<amount> per day|week|month [requests|tokens], then [models <glob>...] [shadow]")
		}
		return l, nil
	}
	if len(args) == 2 && args[1] == UnitConcurrent {
		n, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil {
			return l, d.Errf("invalid concurrent %q for dimension %q: %v", args[0], l.Dimension, err)
		}
		if capacityRule(n) != nil {
			return l, d.Errf("invalid concurrent %q for dimension %q: %v", args[0], l.Dimension, errCapacity)
		}
		l.Capacity, l.Unit = n, UnitConcurrent
		return l, nil
	}
	if len(args) < 2 || len(args) > 3 {
		return l, argErr(d, "limit "+l.Dimension, args, "<capacity> <refill> [requests|tokens], <amount> per day|week|month [requests|tokens] or <n> concurrent, then [models <glob>...] [shadow]")
	}
	capacity, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil {
		return l, d.Errf("invalid capacity %q for dimension %q: %v", args[0], l.Dimension, err)
	}
	if capacityRule(capacity) != nil {
		return l, d.Errf("invalid capacity %q for dimension %q: %v", args[0], l.Dimension, errCapacity)
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
			return l, d.Errf("invalid unit %q for dimension %q: must be requests or tokens (a concurrency limit is <n> concurrent, without a refill)", args[2], l.Dimension)
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
	case "tls_server_name":
		return &c.TLSServerName
	}
	panic("stringField: no redis field " + name)
}

// oneArg reads the one argument, not empty, of the subdirective at the
// cursor.
func oneArg(d *caddyfile.Dispenser) (string, error) {
	name := d.Val()
	args := d.RemainingArgs()
	if len(args) != 1 {
		return "", argErr(d, name, args, "one value")
	}
	if args[0] == "" {
		return "", emptyErr(d, name)
	}
	return args[0], nil
}

// argErr reports a wrong argument count, naming the subdirective and the
// arguments given, except those that may hold a secret.
func argErr(d *caddyfile.Dispenser, name string, args []string, want string) error {
	switch name {
	case "redis", "password", "sentinel_password", "key_secret":
		return d.Errf("%s: wrong argument count %d, want %s", name, len(args), want)
	}
	return d.Errf("%s %q: wrong argument count, want %s", name, args, want)
}

// unmarshalAudit reads one of the audit subdirectives (see AuditOptions).
func (h *Handler) unmarshalAudit(d *caddyfile.Dispenser, name string) error {
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	switch name {
	case "audit", "audit_client_ip":
		if v != "on" && v != "off" {
			return d.Errf("invalid %s %q: must be on or off", name, v)
		}
		on := v == "on"
		if name == "audit" {
			h.Audit = &on
		} else {
			h.AuditClientIP = &on
		}
	case "audit_window":
		dur, err := caddy.ParseDuration(v)
		if err != nil {
			return d.Errf("invalid audit_window %q: %v", v, err)
		}
		if durationRule(dur) != nil {
			return d.Errf("invalid audit_window %q: %v", v, errDuration)
		}
		h.AuditWindow = caddy.Duration(dur)
	case "audit_buckets":
		n, err := strconv.Atoi(v)
		if err != nil {
			return d.Errf("invalid audit_buckets %q: %v", v, err)
		}
		if positiveRule(int64(n)) != nil {
			return d.Errf("invalid audit_buckets %q: %v", v, errPositive)
		}
		h.AuditBuckets = n
	}
	return nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Handler)(nil)

// parseShare reads a local_share: a decimal number ("0.25") or a fraction
// of two ("1/3", as the docs write 1/N for N gateways).
func parseShare(v string) (float64, error) {
	num, den, frac := strings.Cut(v, "/")
	share, err := strconv.ParseFloat(num, 64)
	if err != nil || !frac {
		return share, err
	}
	d, err := strconv.ParseFloat(den, 64)
	if err != nil {
		return 0, err
	}
	if d == 0 {
		return 0, errors.New("division by zero")
	}
	return share / d, nil
}
