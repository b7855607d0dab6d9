package tokenbucket

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
)

// Demote moves an identity that keeps hammering while limited to a stricter
// tier for a while, e.g. 20 denials within 1m demote it to tier "penalty"
// for 10m. Denials are counted, and the demotion made, in the same Redis
// call that decides the request; the demotion lapses by itself. While an
// identity is demoted its requests are decided on the penalty tier's limits
// (the same buckets, the stricter capacity and refill), the 429 body says
// "demoted":true and {http.token_bucket.demoted} is "true". Every denial must
// reach Redis to be counted, so the deny cache is off for a handler with a
// demotion rule. Every request is priced in both tiers before that call:
// when the penalty tier has a tokens limit, every request's body is
// estimated, an invalid one refused (or priced by on_invalid), even when
// its own tier has none. Not with Redis Cluster; not while on_redis_error
// decides.
type Demote struct {
	// Dimension whose identity is demoted (default: the first dimension).
	Dimension string `json:"dimension,omitempty"`
	// Denials is how many denials (rate_limit_exceeded) demote, ≥ 1.
	Denials int64 `json:"denials"`
	// Within is the window in which they are counted, > 0.
	Within caddy.Duration `json:"within"`
	// Tier is the penalty tier; it must exist.
	Tier string `json:"tier"`
	// For is how long the demotion lasts, > 0.
	For caddy.Duration `json:"for"`
}

// demotion is a Demote compiled for the request path.
type demotion struct {
	dim     int
	name    string
	penalty *tier
	rule    bucket.DemoteRule
}

func (d *Demote) validate(h *Handler) error {
	if d == nil {
		return nil
	}
	switch {
	case countRule(d.Denials) != nil:
		return fmt.Errorf("demote.denials %d: %v", d.Denials, countRule(d.Denials))
	case millisRule(time.Duration(d.Within)) != nil: // the script counts milliseconds
		return fmt.Errorf("demote.within %v: %v", time.Duration(d.Within), millisRule(0))
	case millisRule(time.Duration(d.For)) != nil:
		return fmt.Errorf("demote.for %v: %v", time.Duration(d.For), millisRule(0))
	case h.Redis != nil && h.Redis.Cluster:
		return errors.New("demote: not supported with redis cluster")
	}
	dim := d.Dimension
	if dim == "" {
		if len(h.Dimensions) == 0 {
			return errors.New("demote: no dimension to demote")
		}
		dim = h.Dimensions[0].Name
	} else if !slices.ContainsFunc(h.Dimensions, func(x Dimension) bool { return x.Name == dim }) {
		return fmt.Errorf("demote.dimension %q: not a declared dimension", d.Dimension)
	}
	i := slices.IndexFunc(h.Tiers, func(t Tier) bool { return t.Name == d.Tier })
	if i < 0 {
		return fmt.Errorf("demote.tier %q: no tier has that name", d.Tier)
	}
	// A demoted request is decided on the penalty tier's buckets; an
	// enforced limit on the demoted dimension (whose identity is never
	// empty then) that no model escapes makes sure one of them applies. A
	// limit scoped by models, or in shadow, left a demoted request of
	// another model, or every one, without a limit.
	if !slices.ContainsFunc(h.Tiers[i].Limits, func(l Limit) bool { return l.Dimension == dim }) {
		return fmt.Errorf("demote.tier %q: has no limit on the demoted dimension %q", d.Tier, dim)
	}
	if !slices.ContainsFunc(h.Tiers[i].Limits, func(l Limit) bool { return l.Dimension == dim && len(l.Models) == 0 && !l.Shadow }) {
		return fmt.Errorf("demote.tier %q: its limits on the demoted dimension %q are all scoped by models or in shadow; "+
			"it needs one that applies to every request", d.Tier, dim)
	}
	return nil
}

func (d *Demote) compile(dims []Dimension, tiers map[string]*tier) *demotion {
	if d == nil {
		return nil
	}
	c := &demotion{penalty: tiers[d.Tier], name: dims[0].Name,
		rule: bucket.DemoteRule{Denials: d.Denials, Window: time.Duration(d.Within), Span: time.Duration(d.For)}}
	for i, dim := range dims {
		if dim.Name == d.Dimension {
			c.dim, c.name = i, dim.Name
		}
	}
	return c
}
