package tokenbucket

import (
	"math"
	"net/http"
	"net/netip"
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
	policy    string // RateLimit-Policy of a request that applies every limit
}

// limit is a Limit compiled for the request path.
type limit struct {
	dim       int // index into Handler.Dimensions
	dimension string
	unit      string // key suffix: "" for requests, "tokens" for tokens
	tokens    bool   // costs the request's cost rather than 1
	spec      bucket.Spec
	local     bucket.Spec // spec scaled by local_share, for on_redis_error local
	name      string      // header item name: the dimension, "-tokens" appended for tokens
	policy    string      // the RateLimit-Policy item, e.g. "user";q=10;w=60
	dimValue  any         // dimension boxed once, for the dimension placeholder
}

// compileTiers turns validated tiers into their request-path form and
// returns them by name with the default tier.
func compileTiers(dims []Dimension, tiers []Tier, defaultTier string, share float64) (map[string]*tier, *tier) {
	index := make(map[string]int, len(dims))
	for i, d := range dims {
		index[d.Name] = i
	}
	byName := make(map[string]*tier, len(tiers))
	for _, t := range tiers {
		ct := &tier{name: t.Name, nameValue: t.Name}
		for _, l := range t.Limits {
			spec, _ := l.spec() // validated
			cl := limit{dim: index[l.Dimension], dimension: l.Dimension, dimValue: l.Dimension, spec: spec, name: l.Dimension}
			if l.unit() == UnitTokens {
				cl.unit, cl.tokens, cl.name = UnitTokens, true, l.Dimension+"-tokens"
			}
			cl.policy = policyItem(cl.name, l.Capacity, l.RefillRate)
			cl.local = localSpec(l, spec, share)
			ct.limits = append(ct.limits, cl)
		}
		all := make([]*limit, len(ct.limits))
		for i := range ct.limits {
			all[i] = &ct.limits[i]
		}
		ct.policy = string(appendPolicy(nil, all))
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
// what one Redis would: capacity ⌊C·share⌋ (at least 1), refill r·share.
func localSpec(l Limit, spec bucket.Spec, share float64) bucket.Spec {
	if share <= 0 || share >= 1 {
		return spec
	}
	rate, err := bucket.RateFromFloat(l.RefillRate * share)
	if err != nil {
		return spec
	}
	s, err := bucket.Limit{Capacity: max(1, int64(float64(l.Capacity)*share)), Rate: rate}.Spec()
	if err != nil {
		return spec
	}
	return s
}

// policyItem formats a RateLimit-Policy item (draft-ietf-httpapi-ratelimit-
// headers): q is the capacity and w the seconds an empty bucket takes to
// fill, rounded up.
func policyItem(name string, capacity int64, rate float64) string {
	w := int64(math.Ceil(float64(capacity) / rate))
	return `"` + name + `";q=` + strconv.FormatInt(capacity, 10) + ";w=" + strconv.FormatInt(max(w, 1), 10)
}

// resolveTier returns the request's tier: the one tier_from names, or the
// default tier when it is empty or names none. An unknown name is never
// trusted to create or choose anything else.
func (h *Handler) resolveTier(repl *caddy.Replacer) *tier {
	if h.TierFrom == "" {
		return h.deflt
	}
	if t, ok := h.tiers[repl.ReplaceAll(h.TierFrom, "")]; ok {
		return t
	}
	return h.deflt
}

// request is the buckets one request is decided on.
type request struct {
	keys    []string
	takes   []bucket.Take
	limits  []*limit
	demoted bool // decided on a demotion's penalty tier, or demoted by this denial
}

// requestOf1 and requestOf4 hold a request and the arrays its slices use,
// so that a request of up to four buckets is one allocation.
type (
	requestOf1 struct {
		req    request
		keys   [1]string
		takes  [1]bucket.Take
		limits [1]*limit
	}
	requestOf4 struct {
		req    request
		keys   [4]string
		takes  [4]bucket.Take
		limits [4]*limit
	}
)

// newRequest returns an empty request with room for n buckets.
func newRequest(n int) *request {
	switch {
	case n <= 1:
		b := new(requestOf1)
		b.req = request{keys: b.keys[:0], takes: b.takes[:0], limits: b.limits[:0]}
		return &b.req
	case n <= 4:
		b := new(requestOf4)
		b.req = request{keys: b.keys[:0:n], takes: b.takes[:0:n], limits: b.limits[:0:n]}
		return &b.req
	}
	return &request{keys: make([]string, 0, n), takes: make([]bucket.Take, 0, n), limits: make([]*limit, 0, n)}
}

// hasTokens reports whether the request is charged in a "tokens" limit.
func (r *request) hasTokens() bool {
	for _, l := range r.limits {
		if l.tokens {
			return true
		}
	}
	return false
}

// localTakes returns the request's takes with the local_share specs.
func (r *request) localTakes() []bucket.Take {
	takes := make([]bucket.Take, len(r.takes))
	for i, t := range r.takes {
		takes[i] = bucket.Take{Spec: r.limits[i].local, Cost: t.Cost}
	}
	return takes
}

// cachedDenial answers from the deny cache: when any of the request's
// buckets is known to deny its cost, it returns those buckets as a request
// of their own with their decision.
func (h *Handler) cachedDenial(req *request) (*request, bucket.Decision, bool) {
	var sub *request
	var results []bucket.Result
	for i, k := range req.keys {
		wait, remaining, ok := h.denials.Check(k, req.takes[i].Cost)
		if !ok {
			continue
		}
		if sub == nil { // room for this bucket and every one after it
			sub = newRequest(len(req.keys) - i)
			results = make([]bucket.Result, 0, len(req.keys)-i)
		}
		sub.keys, sub.takes, sub.limits = append(sub.keys, k), append(sub.takes, req.takes[i]), append(sub.limits, req.limits[i])
		results = append(results, bucket.Result{Remaining: remaining, Reason: bucket.RateLimited, RetryAfterMS: wait})
	}
	if sub == nil {
		return nil, bucket.Decision{}, false
	}
	return sub, bucket.Summarize(results), true
}

// inputs are what a request's buckets are built from, each resolved at
// most once per request however many tiers the request is built for (its
// own, and a demotion's penalty tier): the identity of each dimension and
// the cost of its tokens limits.
type inputs struct {
	r        *http.Request
	repl     *caddy.Replacer
	ids      [8]string // by dimension, the first 8; "" = skipped
	resolved uint8     // bit i: ids[i] is resolved
	cost     int64     // the tokens cost, once costSet
	costSet  bool
}

// identity returns dimension i's identity (see Handler.identity), resolved
// on first use. Past the first 8 dimensions it is resolved on every use.
func (in *inputs) identity(h *Handler, i int) string {
	if i >= len(in.ids) {
		return h.identity(in.repl, i)
	}
	if in.resolved&(1<<i) == 0 {
		in.ids[i] = h.identity(in.repl, i)
		in.resolved |= 1 << i
	}
	return in.ids[i]
}

// tokensCost returns the cost of the request's tokens limits: the body
// estimate with estimate, else the cost template, evaluated on first use
// and set as {http.token_bucket.cost}; a static cost needs neither. It
// fails with errInvalidBody or errInvalidCost.
func (in *inputs) tokensCost(h *Handler) (int64, error) {
	if in.costSet {
		return in.cost, nil
	}
	var cost int64
	var err error
	switch {
	case h.Estimate != nil:
		cost, err = h.Estimate.estimate(in.r)
	case h.cost < 0:
		cost, err = parseCost(in.repl.ReplaceAll(h.Cost, ""))
	default:
		return h.cost, nil
	}
	if err != nil {
		return 0, err
	}
	in.repl.Set("http.token_bucket.cost", cost)
	in.cost, in.costSet = cost, true
	return cost, nil
}

// buildRequest returns the buckets of tier t for the request of in: one
// per limit whose identity is not empty. It fails only on an invalid cost
// or body.
func (h *Handler) buildRequest(in *inputs, t *tier) (*request, error) {
	req := newRequest(len(t.limits))
	for i := range t.limits {
		l := &t.limits[i]
		id := in.identity(h, l.dim)
		if id == "" {
			continue
		}
		c := int64(1)
		if l.tokens {
			var err error
			if c, err = in.tokensCost(h); err != nil {
				return nil, err
			}
		}
		req.keys = append(req.keys, h.keyer.Key(l.dimension, id, l.unit))
		req.takes = append(req.takes, bucket.Take{Spec: l.spec, Cost: c})
		req.limits = append(req.limits, l)
	}
	return req, nil
}

// identity resolves dimension i's template; "" means the dimension is
// skipped because a placeholder in it is empty or unknown. An identity that
// is an IP address is masked to the configured prefix.
func (h *Handler) identity(repl *caddy.Replacer, i int) string {
	var id string
	if i < len(h.idKeys) && h.idKeys[i] != "" {
		// What ReplaceOrErr gives for a lone placeholder, without copying
		// the value into a new string.
		if v, ok := repl.Get(h.idKeys[i]); ok {
			id = caddy.ToString(v)
		}
	} else {
		var err error
		if id, err = repl.ReplaceOrErr(h.Dimensions[i].Identity, true, true); err != nil {
			return ""
		}
	}
	if id == "" {
		return ""
	}
	return h.normalizeIdentity(id)
}

// placeholderKey returns key when template is exactly one placeholder,
// "{key}", and "" otherwise. For such a template Replacer.ReplaceOrErr
// returns the placeholder's value as a string, or an error when it is
// unknown or empty. Keys with braces or escapes, and {file.*} (memoized
// by the replacer), are left to ReplaceOrErr.
func placeholderKey(template string) string {
	if len(template) < 3 || template[0] != '{' || template[len(template)-1] != '}' {
		return ""
	}
	key := template[1 : len(template)-1]
	if strings.ContainsAny(key, `{}\`) || strings.HasPrefix(key, "file.") {
		return ""
	}
	return key
}

// normalizeIdentity gives an identity its form in keys: an IP address is
// masked to ipv4_prefix / ipv6_prefix bits (an IPv4-mapped IPv6 address
// counts as IPv4), anything else is kept as it is. The admin API uses it
// for identities typed by an operator.
func (h *Handler) normalizeIdentity(id string) string {
	if !mayBeAddr(id) {
		return id // API keys and names: spares ParseAddr's error value
	}
	ip, err := netip.ParseAddr(id)
	if err != nil {
		return id
	}
	ip = ip.Unmap().WithZone("")
	bits := h.IPv6Prefix
	if ip.Is4() {
		bits = h.IPv4Prefix
	}
	p, err := ip.Prefix(bits)
	if err != nil {
		return id
	}
	var buf [len("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128")]byte
	return string(p.AppendTo(buf[:0])) // as p.String(), in one allocation
}

// mayBeAddr reports whether netip.ParseAddr could accept s: before any
// '%' (an IPv6 zone, which may hold any byte) only hex digits, '.' and
// ':', with at least one '.' or ':'.
func mayBeAddr(s string) bool {
	sep := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '.' || c == ':':
			sep = true
		case c == '%':
			return sep
		case '0' <= c && c <= '9', 'a' <= c && c <= 'f', 'A' <= c && c <= 'F':
		default:
			return false
		}
	}
	return sep
}
