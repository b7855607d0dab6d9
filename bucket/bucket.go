// Package bucket holds the token-bucket semantics of token_bucket: the exact
// integer model that every store shares, and the stores that keep bucket
// state (Redis through one Lua script, or process memory).
//
// A bucket has a capacity C (tokens, the largest burst) and a refill rate r
// (tokens per second). A request costs c ≥ 0 tokens. At time now the bucket
// holds T' = min(C, T + (now - last)·r); the request is allowed when c ≤ T',
// and then T' - c is stored. A denial writes nothing and waits (c - T')/r.
// A request on several buckets is allowed only if every bucket allows it,
// and only then is any bucket charged.
//
// To keep that exact, token counts are held in integer units of 1/Scale
// token, where Scale is chosen so that one microsecond refills a whole number
// of units. Every value stays below 2^53, so the Lua script, whose numbers
// are doubles, computes the same integers as this package.
package bucket

import (
	"fmt"
	"math/big"
)

// MaxExact is the largest integer that a Lua (double) number and a JSON
// number hold exactly, 2^53. Every unit count must stay at or below it.
const MaxExact = 1 << 53

// Reason says why a request was denied.
type Reason uint8

// Reasons a request is denied, in increasing precedence.
const (
	// Allowed: nothing denied.
	Allowed Reason = iota
	// RateLimited: the bucket holds fewer tokens than the cost; the request
	// can succeed after the wait.
	RateLimited
	// CostExceedsCapacity: the cost is larger than the capacity; no wait can
	// make the request succeed.
	CostExceedsCapacity
)

// String returns the reason as used in response bodies and logs.
func (r Reason) String() string {
	switch r {
	case RateLimited:
		return "rate_limit_exceeded"
	case CostExceedsCapacity:
		return "cost_exceeds_capacity"
	default:
		return "allowed"
	}
}

// Limit is one bucket's configuration: Capacity tokens, refilled at Rate.
type Limit struct {
	Capacity int64
	Rate     Rate
}

// Spec is a Limit in the integer units that the model and the Lua script
// share. Build it with Limit.Spec.
type Spec struct {
	Capacity int64 // tokens
	Scale    int64 // units per token
	Refill   int64 // units added per microsecond
}

// Spec compiles l to integer units. It fails when the capacity is not
// positive or when capacity × scale would exceed MaxExact, which happens
// only for very large capacities with very fine-grained rates.
func (l Limit) Spec() (Spec, error) {
	if l.Capacity <= 0 {
		return Spec{}, fmt.Errorf("capacity %d must be > 0", l.Capacity)
	}
	if l.Rate.IsZero() {
		return Spec{}, fmt.Errorf("refill rate must be > 0")
	}
	// Units per microsecond = num / (den · 10^6), reduced: Refill / Scale.
	perMicro := new(big.Rat).SetFrac(big.NewInt(l.Rate.num), new(big.Int).Mul(big.NewInt(l.Rate.den), big.NewInt(1_000_000)))
	scale, refill := perMicro.Denom(), perMicro.Num()
	capUnits := new(big.Int).Mul(scale, big.NewInt(l.Capacity))
	// The wait computation divides by refill·1000 (units per millisecond).
	perMilli := new(big.Int).Mul(refill, big.NewInt(1000))
	if capUnits.Cmp(big.NewInt(MaxExact)) > 0 || perMilli.Cmp(big.NewInt(MaxExact)) > 0 {
		return Spec{}, fmt.Errorf("capacity %d with refill rate %s cannot be computed exactly (capacity × %s units per token exceeds 2^53)",
			l.Capacity, l.Rate, scale)
	}
	return Spec{Capacity: l.Capacity, Scale: scale.Int64(), Refill: refill.Int64()}, nil
}

// CapacityUnits returns the capacity in units.
func (s Spec) CapacityUnits() int64 { return s.Capacity * s.Scale }

// State is a bucket's stored state: Units tokens (in units of 1/Scale) at
// time Last (microseconds on the Redis clock). Scale records the scale the
// units were written in, so a changed limit reads old state correctly.
type State struct {
	Units int64
	Scale int64
	Last  int64
}

// Full returns the state of a bucket that has none stored: full.
func (s Spec) Full() State { return State{Units: s.CapacityUnits(), Scale: s.Scale} }

// Take is one bucket of a request: its Spec and the cost in tokens.
type Take struct {
	Spec Spec
	Cost int64
	// Shadow marks a limit in shadow mode: it is decided, and charged when
	// it allows an allowed request, exactly as if enforced, but its denial
	// does not deny the request (Decision.ShadowDenied reports it).
	Shadow bool
	// Lease > 0 makes the take a concurrency limit (see ConcurrencySpec):
	// Spec.Capacity slots, of which a cost of 1 takes one for Lease
	// milliseconds, under LeaseID, until released (Redis.Release) or the
	// lease lapses. It never refills.
	Lease int64
	// LeaseID names the request's lease, the same in every concurrency
	// take of one request.
	LeaseID string
	// Window, when set, makes the take a calendar quota: Spec.Capacity
	// tokens (scale 1, no refill) per window, in the window of these that
	// holds the store's clock (see Windows).
	Window *Windows
	// MaxWaitMS > 0 lets a token bucket (not a shadow one, a quota or a
	// concurrency limit) allow a cost that it holds only after a wait of at
	// most this many milliseconds: a reservation. It is charged at once,
	// going below zero by at most what refills in MaxWaitMS, and its
	// Result is Allowed with the wait in RetryAfterMS (Decision.WaitMS).
	MaxWaitMS int64
}

// reserves reports whether a bucket of t that denies with wait (ms) makes
// a reservation instead. The script and the model decide it alike: a
// deficit d units is reservable when d ≤ MaxWaitMS·1000·refill, that is
// exactly when ⌈d / (1000·refill)⌉ ≤ MaxWaitMS.
func (t Take) reserves(wait int64) bool {
	return t.MaxWaitMS > 0 && !t.Shadow && t.Lease == 0 && t.Window == nil && wait <= t.MaxWaitMS
}

// QuotaSpec is the Spec of a calendar quota of n tokens: scale 1, no
// refill.
func QuotaSpec(n int64) Spec { return Spec{Capacity: n, Scale: 1} }

// ConcurrencySpec is the Spec of a concurrency limit of n slots: scale 1,
// no refill.
func ConcurrencySpec(n int64) Spec { return Spec{Capacity: n, Scale: 1} }

// ConcurrencyRetryMS is the wait a full concurrency limit reports: a slot
// frees when some request in flight ends, which no clock predicts, so the
// client is told to retry after a second (Retry-After: 1).
const ConcurrencyRetryMS = 1000

// costUnits returns the cost in units; a cost above the capacity is clamped
// to capacity + 1 token, which keeps it above the capacity without
// overflowing.
func (t Take) costUnits() int64 { return min(t.Cost, t.Spec.Capacity+1) * t.Spec.Scale }

// Result is the outcome for one bucket.
type Result struct {
	// Remaining is the tokens left, floored: after the charge when the
	// request is allowed, as they stand when it is denied. It is negative
	// while a bucket is in debt after a settlement.
	Remaining int64
	// Reason is Allowed when this bucket alone would allow the request.
	Reason Reason
	// RetryAfterMS is the wait in milliseconds, rounded up, when Reason is
	// RateLimited; for an Allowed bucket, the wait of its reservation (0:
	// none).
	RetryAfterMS int64
	// FullMS is the time until this bucket is full again, in milliseconds
	// rounded up; when the bucket was charged it is the key's TTL. 0 for a
	// concurrency limit, which fills when its requests end.
	FullMS int64
	// Shadow is the take's Shadow: this result does not decide the request.
	Shadow bool
}

// Decision is the outcome for a whole request.
type Decision struct {
	Allowed bool
	// Reason is the strongest reason among the buckets:
	// CostExceedsCapacity over RateLimited.
	Reason Reason
	// RetryAfterMS is the largest wait among the rate-limited buckets, 0
	// when allowed or when the cost exceeds a capacity.
	RetryAfterMS int64
	// Deciding is the index of the bucket that set Reason and RetryAfterMS,
	// -1 when allowed.
	Deciding int
	Buckets  []Result
	// ShadowDenied is set when a shadow bucket would have denied the
	// request (its Result has a Reason other than Allowed).
	ShadowDenied bool
	// WaitMS is, for an allowed request, the longest wait of its
	// reservations: the request may go on after it. 0 when none.
	WaitMS int64
}

// RetryAfterSeconds returns the Retry-After header value: the wait rounded
// up to whole seconds and never below 1 (RFC 9110 §10.2.3 has no sub-second
// form, and 0 would invite an immediate retry).
func (d *Decision) RetryAfterSeconds() int64 {
	return max(1, ceilDiv(d.RetryAfterMS, 1000))
}

// Decide applies one request to its buckets at time now (microseconds) and
// returns the decision. states holds each bucket's stored state (Full for a
// bucket with none) and is used as scratch space: afterwards only the
// entries with charged[i] set are states to store, each with a TTL of
// Buckets[i].FullMS. charged stays all false on a denial, which stores
// nothing. Costs must be ≥ 0.
func Decide(now int64, takes []Take, states []State, charged []bool) Decision {
	d := Decision{Allowed: true, Deciding: -1, Buckets: make([]Result, len(takes))}
	for i, t := range takes {
		var units int64
		switch {
		case t.Lease > 0:
			units = min(states[i].Units, t.Spec.Capacity) // free slots: no refill
		case t.Window != nil:
			// What is left in the window that holds now; a state of
			// another window is an unused quota. Last becomes the
			// window's end.
			start, end := t.Window.At(now)
			units = t.Spec.Capacity
			if states[i].Last == start {
				units -= states[i].Units
			}
			states[i].Last = end
		default:
			units = refill(now, t.Spec, states[i])
		}
		states[i].Units, states[i].Scale = units, t.Spec.Scale
		r := &d.Buckets[i]
		r.Shadow = t.Shadow
		switch cost := t.costUnits(); {
		case t.Cost > t.Spec.Capacity:
			r.Reason = CostExceedsCapacity
		case cost > units && t.Lease > 0:
			r.Reason, r.RetryAfterMS = RateLimited, ConcurrencyRetryMS
		case cost > units && t.Window != nil:
			r.Reason, r.RetryAfterMS = RateLimited, max(1, ceilDiv(states[i].Last-now, 1000))
		case cost > units:
			r.RetryAfterMS = ceilDiv(cost-units, t.Spec.Refill*1000)
			if !t.reserves(r.RetryAfterMS) {
				r.Reason = RateLimited
			}
		}
	}
	d.summarize()
	for i, t := range takes {
		units := states[i].Units
		r := &d.Buckets[i]
		// A shadow bucket is charged when it allows, as if enforced; a
		// bucket with a reservation is charged now.
		charge := d.Allowed && t.Cost > 0 && r.Reason == Allowed
		if charge {
			units -= t.costUnits()
			charged[i] = true
		}
		r.Remaining = floorDiv(units, t.Spec.Scale)
		switch {
		case t.Window != nil:
			end := states[i].Last
			r.FullMS = max(1, ceilDiv(end-now, 1000))
			// The stored state: the units used, in the window's start.
			start, _ := t.Window.At(now)
			states[i] = State{Units: t.Spec.Capacity - units, Scale: 1, Last: start}
		case t.Lease > 0:
			states[i].Units = units
		default:
			if charge {
				states[i].Units = units
				states[i].Last = max(now, states[i].Last)
			}
			r.FullMS = ceilDiv(t.Spec.CapacityUnits()-units, t.Spec.Refill*1000) + ceilDiv(states[i].Last-now, 1000)
		}
	}
	return d
}

// Summarize returns the decision of a request whose buckets gave results.
func Summarize(results []Result) Decision {
	d := Decision{Buckets: results}
	d.summarize()
	return d
}

// summarize sets the request's Reason, RetryAfterMS, Deciding, Allowed and
// ShadowDenied from its buckets' results: any CostExceedsCapacity wins (no
// wait helps), else the RateLimited bucket with the longest wait; shadow
// buckets only set ShadowDenied.
func (d *Decision) summarize() {
	d.Reason, d.RetryAfterMS, d.Deciding, d.ShadowDenied, d.WaitMS = Allowed, 0, -1, false, 0
	for i, r := range d.Buckets {
		if r.Shadow {
			d.ShadowDenied = d.ShadowDenied || r.Reason != Allowed
			continue
		}
		if r.Reason == Allowed {
			d.WaitMS = max(d.WaitMS, r.RetryAfterMS) // a reservation's wait
			continue
		}
		if r.Reason > d.Reason || (r.Reason == RateLimited && d.Reason == RateLimited && r.RetryAfterMS > d.RetryAfterMS) {
			d.Reason, d.RetryAfterMS, d.Deciding = r.Reason, r.RetryAfterMS, i
		}
	}
	if d.Reason == CostExceedsCapacity {
		d.RetryAfterMS = 0
	}
	d.Allowed = d.Reason == Allowed
	if !d.Allowed {
		d.WaitMS = 0
	}
}

// refill returns the units a bucket holds at now, in s's scale.
func refill(now int64, s Spec, st State) int64 {
	capUnits := s.CapacityUnits()
	units := st.Units
	if st.Scale != s.Scale {
		// The limit changed since the state was written: keep the whole
		// tokens, dropping a fraction, so a change never grants a token that
		// was not there.
		units = min(floorDiv(units, st.Scale), s.Capacity) * s.Scale
	}
	units = min(units, capUnits)
	if now > st.Last {
		if room := capUnits - units; (now - st.Last) >= ceilDiv(room, s.Refill) {
			units = capUnits
		} else {
			units += (now - st.Last) * s.Refill
		}
	}
	return units
}

// floorDiv returns ⌊a/b⌋ for b > 0, also for a < 0 (a bucket in debt after
// a settlement), as Lua's math.floor does.
func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && a < 0 {
		q--
	}
	return q
}

// ceilDiv returns ⌈a/b⌉ for a ≥ 0, b > 0, and 0 for a ≤ 0.
func ceilDiv(a, b int64) int64 {
	if a <= 0 {
		return 0
	}
	return (a + b - 1) / b
}
