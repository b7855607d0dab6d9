package tokenbucket

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"net/http"
	"net/netip"
	"net/textproto"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
)

// request is the buckets one request is decided on.
type request struct {
	keys      []string
	takes     []bucket.Take
	limits    []*limit
	tokensCap int64 // the smallest capacity of its enforced tokens limits (of those in shadow when it has no other); -1: none
	allCap    int64 // the smallest capacity of all its tokens limits, those in shadow included; -1: none
	leases    int32 // its concurrency limits (int32: with the flags below, one word)
	demoted   bool  // decided on a demotion's penalty tier, or demoted by this denial
	priced    bool  // its tokens limits are priced: cost is their charge
	cost      int64 // the charge of its enforced tokens limits ({http.token_bucket.cost})
	decidedAt int64 // the gateway's clock (µs) when Redis was asked: which window a quota was charged in
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
func (r *request) hasTokens() bool { return r.tokensCap >= 0 }

// localTakes returns the request's takes with the local_share specs.
func (r *request) localTakes() []bucket.Take {
	takes := make([]bucket.Take, len(r.takes))
	for i, t := range r.takes {
		t.Spec, t.Cost, t.MaxWaitMS = r.limits[i].local, r.localCost(i), 0 // never held: see on_limit
		takes[i] = t
	}
	return takes
}

// localCost is take i's cost in the local store: its cost, or the local
// capacity for a cost that fits the limit's capacity but not its
// local_share of it. Such a request takes a full local bucket, as one whose
// estimate reaches the capacity takes a full bucket in Redis, rather than
// being told cost_exceeds_capacity (do not retry) for a cost Redis allows.
func (r *request) localCost(i int) int64 {
	c, l := r.takes[i].Cost, r.limits[i]
	if c > l.local.Capacity && c <= l.spec.Capacity {
		return l.local.Capacity
	}
	return c
}

// charged is what take i charged its bucket when d allowed it: its cost,
// or with local its cost in the local store (on_redis_error local).
func (r *request) charged(i int, local bool) int64 {
	if local {
		return r.localCost(i)
	}
	return r.takes[i].Cost
}

// leads reports whether limit i, allowed by d, is the one whose charges
// its metric series counts: of the allowed limits that share the series
// (one dimension, unit and quota period: a model-scoped or shadow limit
// beside another), the one charged most, the first of them on a tie. A
// shadow limit's charge is capped at its own capacity, so the series
// counts what the enforced limits charged, once per request.
func (r *request) leads(d *bucket.Decision, i int, local bool) bool {
	s, c := r.limits[i].series, r.charged(i, local)
	for j, l := range r.limits {
		if j == i || l.series != s || d.Buckets[j].Reason != bucket.Allowed {
			continue
		}
		if cj := r.charged(j, local); cj > c || cj == c && j < i {
			return false
		}
	}
	return true
}

// inputs are what a request's buckets are built from, each resolved at
// most once per request however many tiers the request is built for (its
// own, and a demotion's penalty tier): the identity of each dimension and
// the cost of its tokens limits.
type inputs struct {
	w        http.ResponseWriter
	r        *http.Request
	repl     *caddy.Replacer
	ids      [8]string      // by dimension, the first 8; "" = skipped
	resolved uint8          // bit i: ids[i] is resolved
	hashes   [8]bucket.Hash // by dimension: ids[i] hashed, for keys
	hashed   uint8          // bit i: hashes[i] is set
	est      tokenEstimate
	cost     int64  // the cost template's value, once costSet
	costSet  bool   // est or cost is set, or costErr
	costErr  error  // why the cost cannot be had
	modelID  string // the hashed model, for the keys of scoped limits
	lease    string // the lease id of the request's concurrency slots
	now      time.Time
}

// clock returns the gateway's time, read once per request.
func (in *inputs) clock(h *Handler) time.Time {
	if in.now.IsZero() {
		in.now = h.now()
	}
	return in.now
}

// identity returns dimension i's identity (see Handler.identity), resolved
// on first use. Past the first 8 dimensions it is resolved on every use.
func (in *inputs) identity(h *Handler, i int) string {
	if i >= len(in.ids) {
		return h.identity(in.r, in.repl, i)
	}
	if in.resolved&(1<<i) == 0 {
		in.ids[i] = h.identity(in.r, in.repl, i)
		in.resolved |= 1 << i
	}
	return in.ids[i]
}

// tokensCost returns the cost of the request's tokens limits when the
// smallest of them holds capacity tokens: with estimate, the body's
// estimate capped to capacity (see tokenEstimate.cost), else the cost
// template; the body or template is read on first use. A static cost
// needs neither. It fails as readCost does.
func (in *inputs) tokensCost(h *Handler, capacity int64) (int64, error) {
	if h.Estimate == nil && h.cost >= 0 {
		return h.cost, nil
	}
	if err := in.readCost(h); err != nil {
		return 0, err
	}
	if h.Estimate != nil {
		return in.est.cost(capacity), nil
	}
	return in.cost, nil
}

// readCost reads the request's tokens cost once: with estimate, the body
// (which sets {http.token_bucket.model}), else the cost template. It fails
// with errInvalidBody, errBodyTimeout, errBodyTooLarge, errClientGone,
// errMixedModels (a body of several models where the buckets depend on
// the model) or errInvalidCost, every time it is called: a body is read at
// most once.
func (in *inputs) readCost(h *Handler) error {
	if in.costSet {
		return in.costErr
	}
	in.costSet = true
	if h.Estimate != nil {
		in.est, in.costErr = h.Estimate.estimate(in.w, in.r, h.Settle != nil && h.Settle.IncludeUsage)
		in.repl.Set("http.token_bucket.model", in.est.model) // "" without a model
		if in.costErr == nil && in.est.mixedModels && h.modelFirst {
			// The buckets depend on the model (a limit scoped by models,
			// a dimension or tier named by it), and the body's requests
			// run on several: pricing them under one would let a decoy
			// request take a batch out of another model's limits.
			in.costErr = errMixedModels
		}
	} else {
		in.cost, in.costErr = parseCost(in.repl.ReplaceAll(h.Cost, ""))
	}
	return in.costErr
}

// scopedKey returns the key of limit l's bucket for identity id and the
// request's model: the model's hash after the limit's scope, so that any
// model name gives a key of bounded length.
func (in *inputs) scopedKey(h *Handler, l *limit, id string) string {
	if in.modelID == "" {
		in.modelID = h.keyer.ID(in.est.model)
	}
	return h.keyer.KeyOf(l.dimension, in.hash(h, l.dim, id), l.keyScope, in.modelID)
}

// hash returns the <id> in keys of dimension i's identity id, hashed on
// first use (past the first 8 dimensions, on every use).
func (in *inputs) hash(h *Handler, i int, id string) *bucket.Hash {
	if i >= len(in.hashes) {
		hid := h.keyer.Hash(id)
		return &hid
	}
	if in.hashed&(1<<i) == 0 {
		in.hashes[i] = h.keyer.Hash(id)
		in.hashed |= 1 << i
	}
	return &in.hashes[i]
}

// leaseID returns the request's lease id for its concurrency slots, made
// on first use.
func (in *inputs) leaseID() string {
	if in.lease == "" {
		in.lease = newLeaseID()
	}
	return in.lease
}

// leasePrefix makes lease ids unique across gateways: 96 random bits per
// process, then a counter.
var (
	leasePrefix = func() string {
		var b [12]byte
		_, _ = rand.Read(b[:]) // never fails (crypto/rand)
		return base64.RawURLEncoding.EncodeToString(b[:]) + ":"
	}()
	leaseCount atomic.Uint64
)

// newLeaseID returns an id no other request of any gateway has.
func newLeaseID() string {
	return leasePrefix + strconv.FormatUint(leaseCount.Add(1), 36)
}

// buildRequest returns the buckets of tier t for the request of in, priced:
// see bucketsOf and price.
func (h *Handler) buildRequest(in *inputs, t *tier) (*request, error) {
	req := h.bucketsOf(in, t)
	return req, h.price(in, req)
}

// bucketsOf returns the buckets of tier t for the request of in: one per
// limit whose identity is not empty and, for a limit scoped by models,
// whose model matches (the first such limit of its dimension and unit).
// Requests limits cost 1 and concurrency limits one slot; tokens limits
// are priced by price, so that a request already denied by a requests
// limit is answered without reading its body (unless scoped limits need
// its model first).
func (h *Handler) bucketsOf(in *inputs, t *tier) *request {
	req := newRequest(len(t.limits))
	req.tokensCap = -1
	shadowCap := int64(-1) // the same over tokens limits in shadow
	var scoped uint64      // the dimensions and units whose scoped limit applies
	for i := range t.limits {
		l := &t.limits[i]
		if l.scope != 0 && (scoped&l.scope != 0 || in.est.model == "" || !l.matches(in.est.model)) {
			continue
		}
		id := in.identity(h, l.dim)
		if id == "" {
			continue
		}
		take := bucket.Take{Spec: l.spec, Cost: 1, Shadow: l.shadow}
		switch {
		case l.tokens && l.shadow:
			if shadowCap < 0 || l.spec.Capacity < shadowCap {
				shadowCap = l.spec.Capacity
			}
		case l.tokens:
			if req.tokensCap < 0 || l.spec.Capacity < req.tokensCap {
				req.tokensCap = l.spec.Capacity
			}
		}
		switch {
		case l.concurrent:
			take.Lease, take.LeaseID = h.leaseMS, in.leaseID()
			req.leases++
		case l.period != 0:
			take.Window = h.quotaWindows(l.period, in.clock(h))
		}
		key := ""
		if l.scope != 0 {
			scoped |= l.scope
			key = in.scopedKey(h, l, id)
		} else {
			key = h.keyer.KeyOf(l.dimension, in.hash(h, l.dim, id), l.keyUnit, "")
		}
		req.keys = append(req.keys, key)
		req.takes = append(req.takes, take)
		req.limits = append(req.limits, l)
	}
	req.allCap = req.tokensCap
	if shadowCap >= 0 && (req.allCap < 0 || shadowCap < req.allCap) {
		req.allCap = shadowCap
	}
	if req.tokensCap < 0 {
		req.tokensCap = shadowCap
	}
	return req
}

// price sets the cost of req's tokens limits. The estimate's cap (see
// tokenEstimate.cost) is the enforced limits' smallest capacity: a limit
// in shadow beside them never changes their charge. A limit in shadow is
// charged as if every limit were enforced, capped by the smallest of them
// all. It fails only on an invalid cost or body.
func (h *Handler) price(in *inputs, req *request) error {
	if req.tokensCap < 0 {
		return nil
	}
	c, err := in.tokensCost(h, req.tokensCap)
	if err != nil {
		return err
	}
	req.priced, req.cost = true, c
	sc := c
	if h.Estimate != nil && req.allCap < req.tokensCap {
		sc = in.est.cost(req.allCap)
	}
	for i, l := range req.limits {
		switch {
		case l.tokens && l.shadow:
			req.takes[i].Cost = sc
		case l.tokens:
			req.takes[i].Cost = c
		}
	}
	return nil
}

// identity resolves dimension i's template for request r; "" means the
// dimension is skipped because a placeholder in it is empty or unknown. A
// {http.request.header.<field>} placeholder is the field's first line
// (see headerIdentity). An identity that is an IP address is masked to the
// configured prefix.
func (h *Handler) identity(r *http.Request, repl *caddy.Replacer, i int) string {
	var id string
	if i < len(h.idSources) && h.idSources[i].key != "" {
		id = h.idSources[i].value(r, repl)
	} else {
		var err error
		id, err = repl.ReplaceFunc(h.Dimensions[i].Identity, func(key string, val any) (any, error) {
			if field, ok := strings.CutPrefix(key, reqHeaderPlaceholder); ok {
				val = headerIdentity(r.Header, textproto.CanonicalMIMEHeaderKey(field))
			}
			if caddy.ToString(val) == "" {
				return nil, errEmptyPlaceholder // unknown (nil) or empty
			}
			return val, nil
		})
		if err != nil {
			return ""
		}
	}
	if id == "" {
		return ""
	}
	return h.normalizeIdentity(id)
}

// idSource is where an identity template that is one placeholder, "{key}",
// reads its value: a request header field, a variable, or Caddy's
// replacer. For such a template Replacer.ReplaceOrErr returns the
// placeholder's value as a string, or an error when it is unknown or
// empty; value returns the same string, "" for both errors.
type idSource struct {
	key    string // the placeholder's key; "" when the template is not one placeholder
	header string // for {http.request.header.<field>}: the field, canonical
	vr     string // for {http.vars.<name>} (and {client_ip}): the variable
}

// value returns the placeholder's value for r. A header field is read
// from r as headerIdentity gives it, a variable as Caddy's replacer reads
// it (through caddyhttp.GetVar), without going through the replacer's
// providers: on a cached denial those lookups were a fifth of the
// handler's time, and each value came back boxed in an interface, an
// allocation. Two differences, neither reachable with Caddy's own
// modules: a value set for the same key with Replacer.Set, which the
// replacer would return first, is not read; and the header is read from
// r, the request this handler is given, where the replacer reads the one
// the server prepared (they share their header map unless a module passed
// on a clone). Other keys go through the replacer.
func (s *idSource) value(r *http.Request, repl *caddy.Replacer) string {
	switch {
	case s.header != "":
		return headerIdentity(r.Header, s.header)
	case s.vr != "":
		return caddy.ToString(caddyhttp.GetVar(r.Context(), s.vr))
	}
	v, _ := repl.Get(s.key)
	return caddy.ToString(v)
}

// newIDSource returns the idSource of template. Keys with braces or
// escapes, and {file.*} (memoized by the replacer), are left to
// ReplaceOrErr (key ""). The field name of a {http.request.header.*} key
// is canonicalized here, once, as Caddy's replacer canonicalizes it on
// every lookup (textproto.CanonicalMIMEHeaderKey).
func newIDSource(template string) idSource {
	if len(template) < 3 || template[0] != '{' || template[len(template)-1] != '}' {
		return idSource{}
	}
	key := template[1 : len(template)-1]
	if strings.ContainsAny(key, `{}\`) || strings.HasPrefix(key, "file.") {
		return idSource{}
	}
	if field, ok := strings.CutPrefix(key, reqHeaderPlaceholder); ok && field != "" {
		field = textproto.CanonicalMIMEHeaderKey(field)
		return idSource{key: reqHeaderPlaceholder + field, header: field}
	}
	if name, ok := strings.CutPrefix(key, varsPlaceholder); ok && name != "" {
		return idSource{key: key, vr: name}
	}
	return idSource{key: key}
}

// headerIdentity returns the first line of the request header field
// (canonical), without the spaces and tabs around it: what the upstream
// authenticates with. Caddy's own placeholder joins every line with ",",
// so a client that sent its API key and then a second line of its
// choosing got a new bucket per second line, while Go's Header.Get, Node
// and Starlette all read the first line alone; and HTTP/2 leaves the
// whitespace around a value that HTTP/1.1's parser removes (RFC 9110
// section 5.5: it is not part of the value), so " key" and "key " were
// other keys. Envoy's and Kong's rate limits read the first line too.
func headerIdentity(h http.Header, field string) string {
	v := h[field]
	if len(v) == 0 {
		return ""
	}
	return strings.Trim(v[0], " \t")
}

// errEmptyPlaceholder skips a dimension whose template has an empty or
// unknown placeholder.
var errEmptyPlaceholder = errors.New("empty or unknown placeholder")

// reqHeaderPlaceholder starts the placeholders of request header fields,
// {http.request.header.<field>}.
const reqHeaderPlaceholder = "http.request.header."

// varsPlaceholder starts the placeholders of variables, {http.vars.<name>}.
const varsPlaceholder = "http.vars."

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
