package tokenbucket

import (
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
)

// tier is a Tier compiled for the request path.
type tier struct {
	name      string
	nameValue any // name boxed once, for the tier placeholder
	limits    []limit
	policy    string // RateLimit-Policy of a request that applies every limit; "" when it has a quota (its w changes)
}

// limit is a Limit compiled for the request path.
type limit struct {
	dim        int // index into Handler.Dimensions
	dimension  string
	unit       string        // "" for requests, "tokens" or "concurrent"
	keyUnit    string        // key suffix: unit, then ":shadow" for a shadow limit (its own bucket)
	tokens     bool          // costs the request's cost rather than 1
	concurrent bool          // a concurrency limit: slots leased while in flight
	shadow     bool          // decided and charged, never enforced
	period     bucket.Period // a calendar quota's; 0 for a bucket
	models     []string
	scope      uint64  // scoped by models: the bit of its dimension and unit
	keyScope   string  // scoped by models: the key suffix before the model's hash
	rate       float64 // the configured refill_rate, tokens per second
	spec       bucket.Spec
	local      bucket.Spec // spec scaled by local_share, for on_redis_error local
	name       string      // header item name: the dimension, "-tokens" or "-concurrent" appended, "@" and the globs for a scoped limit
	policy     string      // the RateLimit-Policy item, e.g. "user";q=10;w=60; a quota's ends with "w=", its window's length is appended per request
	dimValue   any         // dimension boxed once, for the dimension placeholder
	// series numbers the metric series of its dimension, unit and quota
	// period within its tier: a model-scoped or shadow limit shares one
	// with the tier's other limits of that dimension and unit (see leads).
	series int
}

// compileTiers turns validated tiers into their request-path form and
// returns them by name with the default tier.
func compileTiers(dims []Dimension, tiers []Tier, defaultTier string, share float64, shadow bool) (map[string]*tier, *tier) {
	index := make(map[string]int, len(dims))
	for i, d := range dims {
		index[d.Name] = i
	}
	byName := make(map[string]*tier, len(tiers))
	for _, t := range tiers {
		ct := &tier{name: t.Name, nameValue: t.Name}
		scopes := map[string]uint64{} // a bit per dimension and unit with scoped limits
		series := map[string]int{}    // by dimension, unit and period
		for _, l := range t.Limits {
			spec, _ := l.spec() // validated
			cl := limit{dim: index[l.Dimension], dimension: l.Dimension, dimValue: l.Dimension, spec: spec, name: l.Dimension,
				rate: l.RefillRate, shadow: shadow || l.Shadow}
			switch l.unit() {
			case UnitTokens:
				cl.unit, cl.tokens, cl.name = UnitTokens, true, l.Dimension+"-tokens"
			case UnitConcurrent:
				cl.unit, cl.concurrent, cl.name = UnitConcurrent, true, l.Dimension+"-concurrent"
			}
			cl.keyUnit = cl.unit
			if l.Period != "" {
				cl.period, _ = bucket.ParsePeriod(l.Period) // validated
				cl.keyUnit = strings.TrimPrefix(cl.unit+":"+l.Period, ":")
				cl.name += "-per-" + l.Period
			}
			s := l.Dimension + " " + l.unit() + " " + l.Period
			if _, ok := series[s]; !ok {
				series[s] = len(series)
			}
			cl.series = series[s]
			if cl.shadow {
				cl.keyUnit = strings.TrimPrefix(cl.keyUnit+":shadow", ":")
			}
			if len(l.Models) > 0 {
				// As validate counts them: a quota and a shadow limit
				// each have a scope of their own.
				group := l.Dimension + " " + l.unit() + " " + l.Period + " " + strconv.FormatBool(cl.shadow)
				if scopes[group] == 0 {
					scopes[group] = 1 << len(scopes) // at most maxScopes, validated
				}
				cl.models, cl.scope = l.Models, scopes[group]
				cl.keyScope = strings.TrimPrefix(cl.keyUnit+":m:", ":")
				cl.name += "@" + strings.Join(l.Models, "|")
			}
			switch {
			case cl.concurrent:
				cl.policy = `"` + cl.name + `";q=` + strconv.FormatInt(sfInteger(l.Capacity), 10) + `;qu="concurrent-requests"`
				cl.local = bucket.ConcurrencySpec(localCapacity(l.Capacity, share))
			case cl.period != 0:
				cl.policy = `"` + cl.name + `";q=` + strconv.FormatInt(sfInteger(l.Capacity), 10) + ";w="
				cl.local = bucket.QuotaSpec(localCapacity(l.Capacity, share))
			default:
				cl.policy = policyItem(cl.name, l.Capacity, l.RefillRate)
				cl.local, _ = localSpec(l, spec, share) // validated (localShareHeld)
			}
			ct.limits = append(ct.limits, cl)
		}
		all := make([]*limit, len(ct.limits))
		for i := range ct.limits {
			all[i] = &ct.limits[i]
		}
		if !slices.ContainsFunc(ct.limits, func(l limit) bool { return l.period != 0 }) {
			ct.policy = string(appendPolicy(nil, all, nil, nil))
		}
		byName[t.Name] = ct
	}
	deflt := byName[tiers[0].Name]
	if defaultTier != "" {
		deflt = byName[defaultTier]
	}
	return byName, deflt
}

// localSpec scales a limit by share (0 < share ≤ 1) for the in-process
// store, so that N gateways deciding alone while Redis is away admit about
// what one Redis would: capacity ⌊C·share⌋ (at least 1), refill r·share
// (exactly, or just below: see bucket.ScaledSpec). It fails when no Spec
// of that capacity holds a rate at or just below r·share (a rate so low
// that it is under one unit a microsecond at the finest scale the capacity
// leaves room for, or a share too small to read as a fraction): then the
// limit cannot be scaled, and validate refuses the local_share.
func localSpec(l Limit, spec bucket.Spec, share float64) (bucket.Spec, error) {
	if share <= 0 || share >= 1 {
		return spec, nil
	}
	rate, err := bucket.RateFromFloat(l.RefillRate)
	if err != nil {
		return bucket.Spec{}, err
	}
	return bucket.ScaledSpec(localCapacity(l.Capacity, share), rate, share)
}

// localCapacity is a capacity scaled by local_share: ⌊capacity·share⌋, at
// least 1 (see bucket.ScaledCapacity).
func localCapacity(capacity int64, share float64) int64 {
	if share <= 0 || share >= 1 {
		return capacity
	}
	return bucket.ScaledCapacity(capacity, share)
}

// matches reports whether model matches one of the limit's model globs.
func (l *limit) matches(model string) bool {
	for _, g := range l.models {
		if globMatch(g, model) {
			return true
		}
	}
	return false
}

// globMatch reports whether s matches pattern, in which '*' matches any
// run of bytes (none included) and every other byte itself. It is linear
// in len(s) times the number of stars: a star's match is extended only
// when what follows it fails.
func globMatch(pattern, s string) bool {
	p, i := 0, 0
	star, mark := -1, 0 // the last star's position in pattern, and where in s its run ends
	for i < len(s) {
		switch {
		case p < len(pattern) && pattern[p] == '*':
			star, mark = p, i
			p++
		case p < len(pattern) && pattern[p] == s[i]:
			p++
			i++
		case star >= 0:
			mark++
			p, i = star+1, mark
		default:
			return false
		}
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}

// policyItem formats a RateLimit-Policy item (draft-ietf-httpapi-ratelimit-
// headers): q is the capacity and w the seconds an empty bucket takes to
// fill, rounded up; both clamped to RFC 9651's 15 digits (sfInteger).
func policyItem(name string, capacity int64, rate float64) string {
	w := int64(max(1, min(math.Ceil(float64(capacity)/rate), maxSFInteger)))
	return `"` + name + `";q=` + strconv.FormatInt(sfInteger(capacity), 10) + ";w=" + strconv.FormatInt(w, 10)
}

// resolveTier returns the request's tier: the one tier_from names, or the
// default tier when it is empty or names none. An unknown name is never
// trusted to create or choose anything else. A tier_from that is one
// placeholder is read without parsing the template (see idSource), a
// header field with its lines joined by ",", as the replacer gives it.
func (h *Handler) resolveTier(r *http.Request, repl *caddy.Replacer) *tier {
	var name string
	switch {
	case h.TierFrom == "":
		return h.deflt
	case h.tierSrc.key != "":
		name = h.tierSrc.value(r, repl)
	default:
		name = repl.ReplaceAll(h.TierFrom, "")
	}
	if t, ok := h.tiers[name]; ok {
		return t
	}
	return h.deflt
}
