package tokenbucket

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
)

// Dimension is one identity along which requests are limited.
type Dimension struct {
	// Name of the dimension, used in tier limits, keys, headers and logs:
	// 1 to 64 characters of letters, digits, '_' and '-'.
	Name string `json:"name"`
	// Identity is a placeholder template that gives the request's identity
	// in this dimension, e.g. "{http.auth.user.id}", "{client_ip}" or
	// "{http.request.header.X-API-Key}". When any placeholder in it is
	// empty or unknown, the dimension is skipped for that request, so a
	// missing value never lumps clients into one shared bucket. Identities
	// that are IP addresses are masked to ipv4_prefix / ipv6_prefix bits.
	Identity string `json:"identity"`
}

// Tier is a named set of limits, one or more per dimension.
type Tier struct {
	// Name of the tier (as given by tier_from): 1 to 64 characters of
	// letters, digits, '_' and '-'.
	Name string `json:"name"`
	// Limits of this tier. A dimension with no limit here is not limited
	// for requests in this tier.
	Limits []Limit `json:"limits"`
}

// Limit is one token bucket per identity of a dimension.
type Limit struct {
	// Dimension names a declared dimension.
	Dimension string `json:"dimension"`
	// Capacity is the most tokens the bucket holds: the largest burst.
	// An integer > 0.
	Capacity int64 `json:"capacity"`
	// RefillRate is the refill in tokens per second, > 0 and finite (0,
	// left out, for a quota or a concurrency limit). It is read as the
	// simplest fraction that rounds to this number, so the Caddyfile's
	// 10/1m (0.16666666666666666) is exactly 1/6 per second.
	RefillRate float64 `json:"refill_rate,omitempty"`
	// Unit is what a token is: "requests" (the default; each request costs
	// 1), "tokens" (each request costs the handler's cost, e.g. LLM
	// tokens) or "concurrent" (Capacity is the number of requests of an
	// identity in flight at once, across every gateway sharing the Redis;
	// RefillRate must be 0: a slot comes back when its request's response
	// has been written, or its lease lapses; see Handler.ConcurrencyLease).
	// A dimension may have one limit of each unit per model scope.
	Unit string `json:"unit,omitempty"`
	// Models scopes the limit to the requests whose model (the request
	// body's "model", read by estimate; see {http.token_bucket.model})
	// matches one of these globs, in which '*' matches any run of
	// characters and every other character itself: "gpt-4o", "gpt-4.1*",
	// "anthropic/*". A scoped limit keeps one bucket per identity per
	// model. When several scoped limits of one dimension and unit match a
	// model, the first one applies. Each glob is 1 to 128 of letters,
	// digits and ._:/@+-* (the characters of model names). Needs estimate.
	Models []string `json:"models,omitempty"`
	// Period, when set ("day", "week" or "month"), makes the limit a
	// calendar quota instead of a bucket: at most Capacity units per
	// calendar window, which starts at 00:00 (weeks on Monday, months on
	// the 1st) in Handler.QuotaTimezone, and resets at each boundary.
	// RefillRate must be 0. A denial waits until the window resets.
	Period string `json:"period,omitempty"`
	// Shadow decides and charges the limit exactly as if it were enforced,
	// but a request it alone would deny is allowed: the would-be denial is
	// counted (shadow_denials_total), audited with "shadow":true and set in
	// {http.token_bucket.shadow_denied}; the client sees nothing of the
	// limit (no 429, no Retry-After, no RateLimit item). Handler.Shadow
	// puts every limit in shadow.
	Shadow bool `json:"shadow,omitempty"`
}

// Units of a limit.
const (
	UnitRequests   = "requests"
	UnitTokens     = "tokens"
	UnitConcurrent = "concurrent"
)

// DefaultConcurrencyLease is the default concurrency_lease.
const DefaultConcurrencyLease = 10 * time.Minute

// Values of on_limit.
const (
	LimitReject = "reject"
	LimitWait   = "wait"
)

// DefaultMaxWaiting is the default max_waiting: the requests one gateway
// holds on reservations at once.
const DefaultMaxWaiting = 1000

// MaxMaxWait is the longest max_wait: an HTTP client waits for its answer,
// and a proxy or SDK in front of it gives up after a minute or so.
const MaxMaxWait = time.Minute

// Policies for on_redis_error.
const (
	PolicyLocal = "local"
	PolicyAllow = "allow"
	PolicyDeny  = "deny"
)

// MaxCost is the largest cost a request may carry: 2^53 - 1, the largest
// integer that JSON and the Lua script hold exactly.
const MaxCost = bucket.MaxExact - 1

// maxDimensions bounds the dimensions of a handler.
const maxDimensions = 64

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// compile turns the configuration into its request-path form, in one pure
// step (no Redis, no Caddy context, no I/O: Provision calls it, and tests
// call it directly): it sets the defaults, validates, and compiles the
// tiers, the identity templates, the cost, the keyer, the demotion rule,
// the tokenizer and the in-process stores.
func (h *Handler) compile() error {
	if h.KeyPrefix == "" {
		h.KeyPrefix = "rl:"
	}
	if h.IPv4Prefix == 0 {
		h.IPv4Prefix = 32
	}
	if h.IPv6Prefix == 0 {
		h.IPv6Prefix = 64
	}
	if h.ConcurrencyLease == 0 {
		h.ConcurrencyLease = caddy.Duration(DefaultConcurrencyLease)
	}
	if err := h.validate(); err != nil {
		return err
	}
	if err := h.Estimate.provision(); err != nil {
		return err
	}
	h.tiers, h.deflt = compileTiers(h.Dimensions, h.Tiers, h.DefaultTier, h.LocalShare, h.Shadow)
	h.modelFirst = h.needsModelFirst()
	h.leaseMS = time.Duration(h.ConcurrencyLease).Milliseconds()
	h.windows = new([4]atomic.Pointer[bucket.Windows])
	h.quotaLoc = time.UTC
	if h.QuotaTimezone != "" {
		h.quotaLoc, _ = time.LoadLocation(h.QuotaTimezone) // validated
	}
	if h.OnLimit == LimitWait {
		h.maxWaitMS = time.Duration(h.MaxWait).Milliseconds()
		if h.MaxWaiting == 0 {
			h.MaxWaiting = DefaultMaxWaiting
		}
	}
	// A header field goes through the replacer, which joins its lines
	// with ",": a repeated tier header names no tier.
	h.tierSrc = newIDSource(h.TierFrom)
	h.tierSrc.header = ""
	h.idSources = make([]idSource, len(h.Dimensions))
	for i, d := range h.Dimensions {
		h.idSources[i] = newIDSource(d.Identity)
	}
	h.cost, _ = staticCost(h.Cost)
	// An unknown placeholder is an error, not a secret of its own text;
	// one that evaluates empty (an unset variable) means no secret, which
	// Provision logs. The error shows no part of the value: the braces may
	// be a literal secret's.
	secret, err := caddy.NewReplacer().ReplaceOrErr(h.KeySecret, false, true)
	if err != nil {
		return errors.New(`key_secret: an unknown placeholder (a literal "{" or "}" in the secret is written \{ or \})`)
	}
	h.keyer = bucket.NewKeyer(h.KeyPrefix, secret)
	if h.now == nil {
		h.now = time.Now
	}
	h.demote = h.Demote.compile(h.Dimensions, h.tiers)
	if h.DenyCache >= 0 && h.demote == nil { // every denial must reach Redis to be counted
		h.denials = bucket.NewDenyCache(h.DenyCache, h.now)
	}
	if h.OnRedisError == "" {
		h.OnRedisError = PolicyLocal
	}
	return nil
}

// reservationsExact checks that every token bucket stays exact with
// on_limit wait: a reservation takes it below zero by up to what refills
// in max_wait, and that debt and the capacity must stay below 2^53 units.
func (h *Handler) reservationsExact() error {
	wait := time.Duration(h.MaxWait).Microseconds()
	for i, t := range h.Tiers {
		for j, l := range t.Limits {
			spec, err := l.spec()
			if err != nil || l.Period != "" || l.Unit == UnitConcurrent {
				continue // reported by Tier.validate, or never reserves
			}
			if spec.Refill > (bucket.MaxExact-spec.CapacityUnits())/wait {
				return fmt.Errorf("tiers[%d].limits[%d]: tier %q, dimension %q: refill_rate %v with max_wait %v cannot be computed exactly (the debt of what refills in max_wait exceeds 2^53 units); lower max_wait",
					i, j, t.Name, l.Dimension, l.RefillRate, time.Duration(h.MaxWait))
			}
		}
	}
	return nil
}

// localShareHeld checks that local_share (0 < share < 1) scales every
// limit: the share is read as a fraction (see bucket.RateFromFloat), and
// each token bucket has a scaled Spec whose refill is at most its share of
// the rate (see localSpec). A limit that could not be scaled would be
// enforced whole by the in-process store, each gateway admitting more than
// its share while Redis is away.
func (h *Handler) localShareHeld() error {
	share := h.LocalShare
	if share <= 0 || share >= 1 {
		return nil // the default, the whole limit, or refused by shareRule
	}
	if _, err := bucket.RateFromFloat(share); err != nil {
		return fmt.Errorf("local_share %v: too small to scale the limits by: must be at least 1/%d", share, int64(math.MaxInt64))
	}
	for i, t := range h.Tiers {
		for j, l := range t.Limits {
			spec, err := l.spec()
			if err != nil || l.Period != "" || l.Unit == UnitConcurrent {
				continue // reported by Tier.validate, or scaled in capacity alone
			}
			if _, err := localSpec(l, spec, share); err != nil {
				return fmt.Errorf("tiers[%d].limits[%d]: tier %q, dimension %q: local_share %v cannot scale refill_rate %v: %v; raise local_share",
					i, j, t.Name, l.Dimension, share, l.RefillRate, err)
			}
		}
	}
	return nil
}

// modelPlaceholder is the request's model, set when its body is read.
const modelPlaceholder = "{http.token_bucket.model}"

// needsModelFirst reports whether a request's buckets depend on its model:
// a limit is scoped by models, or a dimension or tier_from names
// {http.token_bucket.model}. Then the body is read before the buckets are
// built; else only when a tokens limit is priced.
func (h *Handler) needsModelFirst() bool {
	if h.Estimate == nil {
		return false
	}
	if strings.Contains(h.TierFrom, modelPlaceholder) {
		return true
	}
	for _, d := range h.Dimensions {
		if strings.Contains(d.Identity, modelPlaceholder) {
			return true
		}
	}
	for _, t := range h.Tiers {
		for _, l := range t.Limits {
			if len(l.Models) > 0 {
				return true
			}
		}
	}
	return false
}

// validate checks the configuration and returns the first problem, naming
// the JSON field and its value. It has no side effects.
func (h *Handler) validate() error {
	if err := h.Redis.validate(); err != nil {
		return err
	}
	if strings.ContainsAny(h.KeyPrefix, "{}") {
		return fmt.Errorf("key_prefix %q: must not contain '{' or '}' (they would set the Redis Cluster hash slot)", h.KeyPrefix)
	}
	if len(h.KeyPrefix) > 64 {
		return fmt.Errorf("key_prefix %q: longer than 64 bytes", h.KeyPrefix)
	}
	if err := prefixRule(h.IPv4Prefix, 32); h.IPv4Prefix != 0 && err != nil {
		return fmt.Errorf("ipv4_prefix %d: %v", h.IPv4Prefix, err)
	}
	if err := prefixRule(h.IPv6Prefix, 128); h.IPv6Prefix != 0 && err != nil {
		return fmt.Errorf("ipv6_prefix %d: %v", h.IPv6Prefix, err)
	}
	if len(h.Dimensions) > maxDimensions {
		return fmt.Errorf("dimensions: %d declared, at most %d", len(h.Dimensions), maxDimensions)
	}
	dims := make(map[string]bool, len(h.Dimensions))
	for i, d := range h.Dimensions {
		if !nameRE.MatchString(d.Name) {
			return fmt.Errorf("dimensions[%d].name %q: must be 1 to 64 letters, digits, '_' or '-'", i, d.Name)
		}
		if dims[d.Name] {
			return fmt.Errorf("dimensions[%d].name %q: duplicate dimension", i, d.Name)
		}
		if strings.TrimSpace(d.Identity) == "" {
			return fmt.Errorf("dimensions[%d].identity: dimension %q has no identity template", i, d.Name)
		}
		dims[d.Name] = true
	}
	if len(h.Tiers) == 0 {
		return fmt.Errorf("tiers: at least one tier is required")
	}
	tiers := make(map[string]bool, len(h.Tiers))
	for i, t := range h.Tiers {
		if err := t.validate(i, dims); err != nil {
			return err
		}
		if tiers[t.Name] {
			return fmt.Errorf("tiers[%d].name %q: duplicate tier", i, t.Name)
		}
		tiers[t.Name] = true
	}
	if h.DefaultTier != "" && !tiers[h.DefaultTier] {
		return fmt.Errorf("default_tier %q: no tier has that name", h.DefaultTier)
	}
	if err := h.Demote.validate(h); err != nil {
		return err
	}
	if err := h.Estimate.validate(); err != nil {
		return err
	}
	if h.Estimate != nil && h.Cost != "" {
		return fmt.Errorf("cost %q and estimate: set one, not both", h.Cost)
	}
	if h.Settle != nil && h.Settle.Header != "" && !httpguts.ValidHeaderFieldName(h.Settle.Header) {
		return fmt.Errorf("settle.header %q: not a header name (RFC 9110 section 5.1: a token)", h.Settle.Header)
	}
	if h.Estimate == nil {
		for i, t := range h.Tiers {
			for j, l := range t.Limits {
				if len(l.Models) > 0 {
					return fmt.Errorf("tiers[%d].limits[%d].models %q: needs estimate (cost estimate), which reads the request body's model", i, j, l.Models)
				}
			}
		}
	}
	if err := millisRule(time.Duration(h.ConcurrencyLease)); h.ConcurrencyLease != 0 && err != nil {
		return fmt.Errorf("concurrency_lease %v: %v", time.Duration(h.ConcurrencyLease), err)
	}
	if err := quotaZoneRule(h.QuotaTimezone); h.QuotaTimezone != "" && err != nil {
		return fmt.Errorf("quota_timezone %q: %v", h.QuotaTimezone, err)
	}
	switch h.OnLimit {
	case "", LimitReject:
		if h.MaxWait != 0 {
			return fmt.Errorf("max_wait %v: only with on_limit wait", time.Duration(h.MaxWait))
		}
		if h.MaxWaiting != 0 {
			return fmt.Errorf("max_waiting %d: only with on_limit wait", h.MaxWaiting)
		}
	case LimitWait:
		if err := maxWaitRule(time.Duration(h.MaxWait)); err != nil {
			return fmt.Errorf("max_wait %v: %v", time.Duration(h.MaxWait), err)
		}
		if err := h.reservationsExact(); err != nil {
			return err
		}
		if lease := time.Duration(h.ConcurrencyLease); lease != 0 && lease < 2*time.Duration(h.MaxWait) {
			// A held request's slots are taken when it is decided and first
			// renewed half a lease later: the wait must fit in that half.
			return fmt.Errorf("concurrency_lease %v: at least twice max_wait (%v) with on_limit wait, so that a held request's slots outlast its wait",
				lease, time.Duration(h.MaxWait))
		}
	default:
		return fmt.Errorf("on_limit %q: must be reject or wait", h.OnLimit)
	}
	if err := positiveRule(int64(h.MaxWaiting)); h.MaxWaiting != 0 && err != nil {
		return fmt.Errorf("max_waiting %d: %v", h.MaxWaiting, err)
	}
	if h.Settle != nil && h.Settle.IncludeUsage && h.Estimate == nil {
		return errors.New("settle.include_usage needs estimate (cost estimate), which reads the request body it adds stream_options to")
	}
	if _, err := staticCost(h.Cost); err != nil {
		return fmt.Errorf("cost %q: %v", h.Cost, err)
	}
	switch h.OnRedisError {
	case "", PolicyLocal, PolicyAllow, PolicyDeny:
	default:
		return fmt.Errorf("on_redis_error %q: must be local, allow or deny", h.OnRedisError)
	}
	switch h.OnDeny {
	case "", DenyRespond, DenyError:
	default:
		return fmt.Errorf("on_deny %q: must be respond or error", h.OnDeny)
	}
	switch h.ErrorFormat {
	case "", FormatJSON, FormatOpenAI, FormatAnthropic:
	default:
		return fmt.Errorf("error_format %q: must be json, openai or anthropic", h.ErrorFormat)
	}
	if err := shareRule(h.LocalShare); h.LocalShare != 0 && err != nil {
		return fmt.Errorf("local_share %v: %v", h.LocalShare, err)
	}
	if err := h.localShareHeld(); err != nil {
		return err
	}
	if err := positiveRule(int64(h.DenyCache)); h.DenyCache != 0 && h.DenyCache != -1 && err != nil {
		return fmt.Errorf("deny_cache %d: %v, or -1 for off", h.DenyCache, err)
	}
	if h.DenyCache > 0 && h.Demote != nil {
		return fmt.Errorf("deny_cache %d: there is no deny cache with demote, whose denials must all reach Redis to be counted; leave deny_cache out", h.DenyCache)
	}
	if err := positiveRule(int64(h.LocalBuckets)); h.LocalBuckets != 0 && err != nil {
		return fmt.Errorf("local_buckets %d: %v", h.LocalBuckets, err)
	}
	return h.AuditOptions.validate()
}

func (t Tier) validate(i int, dims map[string]bool) error {
	if !nameRE.MatchString(t.Name) {
		return fmt.Errorf("tiers[%d].name %q: must be 1 to 64 letters, digits, '_' or '-'", i, t.Name)
	}
	if len(t.Limits) == 0 {
		return fmt.Errorf("tiers[%d].limits: tier %q has no limits", i, t.Name)
	}
	seen := make(map[string]bool, len(t.Limits))
	scoped := map[string]bool{}
	for j, l := range t.Limits {
		field := fmt.Sprintf("tiers[%d].limits[%d]", i, j)
		if !dims[l.Dimension] {
			return fmt.Errorf("%s.dimension %q: tier %q limits an undeclared dimension", field, l.Dimension, t.Name)
		}
		if _, err := l.spec(); err != nil {
			return fmt.Errorf("%s: tier %q, dimension %q: %v", field, t.Name, l.Dimension, err)
		}
		unit := l.unit()
		if l.Period != "" {
			unit += " per " + l.Period // a quota: its own key
		}
		if l.Shadow {
			unit += " shadow" // its own bucket, beside an enforced one
		}
		if len(l.Models) == 0 {
			if seen[l.Dimension+" "+unit] {
				return fmt.Errorf("%s: tier %q has two %s limits on dimension %q", field, t.Name, unit, l.Dimension)
			}
			seen[l.Dimension+" "+unit] = true
		}
		if len(l.Models) > 0 {
			if scoped[l.Dimension+" "+unit] = true; len(scoped) > maxScopes {
				return fmt.Errorf("%s.models: tier %q scopes limits of more than %d dimension and unit pairs by models", field, t.Name, maxScopes)
			}
		}
		for k, g := range l.Models {
			if !modelGlobRE.MatchString(g) {
				return fmt.Errorf("%s.models[%d] %q: must be 1 to 128 letters, digits or ._:/@+-*", field, k, g)
			}
			if seen[l.Dimension+" "+unit+" "+g] {
				return fmt.Errorf("%s.models[%d] %q: tier %q has two %s limits on dimension %q for this model glob", field, k, g, t.Name, unit, l.Dimension)
			}
			seen[l.Dimension+" "+unit+" "+g] = true
		}
	}
	return nil
}

// maxScopes bounds the dimension and unit pairs of a tier whose limits are
// scoped by models: bucketsOf marks the pairs already matched in a uint64.
const maxScopes = 64

// modelGlobRE is what a models glob may hold.
var modelGlobRE = regexp.MustCompile(`^[A-Za-z0-9._:/@+*-]{1,128}$`)

func (l Limit) unit() string {
	if l.Unit == "" {
		return UnitRequests
	}
	return l.Unit
}

// spec checks the limit's numbers and compiles them.
func (l Limit) spec() (bucket.Spec, error) {
	switch l.Unit {
	case "", UnitRequests, UnitTokens, UnitConcurrent:
	default:
		return bucket.Spec{}, fmt.Errorf("unit %q: must be requests, tokens or concurrent", l.Unit)
	}
	if err := capacityRule(l.Capacity); err != nil {
		return bucket.Spec{}, fmt.Errorf("capacity %d: %v", l.Capacity, err)
	}
	if l.Period != "" {
		if _, err := bucket.ParsePeriod(l.Period); err != nil {
			return bucket.Spec{}, err
		}
		if l.Unit == UnitConcurrent {
			return bucket.Spec{}, fmt.Errorf("period %q: a concurrent limit is not a quota", l.Period)
		}
		if l.RefillRate != 0 {
			return bucket.Spec{}, fmt.Errorf("refill_rate %v: a quota (period %s) has no refill (0)", l.RefillRate, l.Period)
		}
		return bucket.QuotaSpec(l.Capacity), nil
	}
	if l.Unit == UnitConcurrent {
		if l.RefillRate != 0 {
			return bucket.Spec{}, fmt.Errorf("refill_rate %v: a concurrent limit has no refill (0)", l.RefillRate)
		}
		return bucket.ConcurrencySpec(l.Capacity), nil
	}
	if math.IsNaN(l.RefillRate) || math.IsInf(l.RefillRate, 0) || l.RefillRate <= 0 {
		return bucket.Spec{}, fmt.Errorf("refill_rate %v: must be a finite number > 0", l.RefillRate)
	}
	rate, err := bucket.RateFromFloat(l.RefillRate)
	if err != nil {
		return bucket.Spec{}, fmt.Errorf("refill_rate %v: %v", l.RefillRate, err)
	}
	return bucket.Limit{Capacity: l.Capacity, Rate: rate}.Spec()
}

// staticCost parses a cost that has no placeholders; it returns -1 for a
// template to evaluate per request.
func staticCost(cost string) (int64, error) {
	if cost == "" {
		return 1, nil
	}
	if i := strings.IndexByte(cost, '{'); i >= 0 && strings.IndexByte(cost[i+1:], '}') > 0 {
		return -1, nil // a placeholder: evaluated per request
	}
	return parseCost(cost)
}

// parseCost reads a request's cost: an integer from 0 to MaxCost, in
// decimal digits only (no sign, fraction or exponent).
func parseCost(s string) (int64, error) {
	if s == "" {
		return 0, errInvalidCost
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, errInvalidCost
		}
	}
	// Leading zeros do not change the value ("007" is 7); MaxCost has 16
	// digits, so more significant digits than that are an overflow.
	if s = strings.TrimLeft(s, "0"); s == "" {
		return 0, nil
	} else if len(s) > 16 {
		return 0, errInvalidCost
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n > MaxCost {
		return 0, errInvalidCost
	}
	return n, nil
}

var errInvalidCost = fmt.Errorf("must be an integer from 0 to %d", int64(MaxCost))
