package bucket

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/token-bucket/token_bucket/lua"
)

// SettleTTL is how long a request's settlement marker is kept: a second
// settlement of the same request within it changes nothing. A second call
// comes from a client library replaying the first (go-redis's
// ClusterClient does after a lost reply) within the call's timeout, or
// from the gateway's own retries of a failed settlement, which it makes
// only while the marker surely lives; Redis holds at most a minute of
// settled requests' markers (about 100 bytes each).
const SettleTTL = time.Minute

// Adjust is a settlement of one bucket: Delta tokens more to charge (> 0)
// or to give back (< 0).
type Adjust struct {
	Spec  Spec
	Delta int64
	// Window and WindowEnd are, for a calendar quota, the start and end
	// (µs) of the window the request was charged in; 0 for a token bucket.
	Window, WindowEnd int64
}

// Settle charges or gives back each bucket's delta in one script call,
// once per id (a request id): a repeated call with the same id changes
// nothing. It reports whether this call settled.
func (s Redis) Settle(ctx context.Context, id string, keys []string, adj []Adjust) (bool, error) {
	if len(keys) == 0 {
		return false, nil
	}
	all := append([]string{keys[0] + ":settled:" + id}, keys...)
	args := make([]any, 0, 1+len(adj))
	args = append(args, strconv.FormatInt(SettleTTL.Milliseconds(), 10))
	for _, a := range adj {
		b := appendFloats(nil, a.Spec.CapacityUnits(), a.Spec.Refill, a.Spec.Scale, clampDelta(a))
		if a.Window != 0 {
			b = appendFloats(b, a.Window, a.WindowEnd)
		}
		args = append(args, string(b))
	}
	n, err := run(ctx, s.Client, lua.Settle, all, args...).Int64()
	if err != nil {
		return false, fmt.Errorf("running settle script: %w", err)
	}
	return n == 1, nil
}

// Settle settles each hash-tag group of keys in its own call (one marker
// per group, on the group's slot), every group even when one fails. When
// some groups' calls fail and others succeed, the error is a
// *PartialSettleError naming the buckets that settled: that part of the
// settlement stands, whatever the failed calls' errors say of theirs.
func (s Sharded) Settle(ctx context.Context, id string, keys []string, adj []Adjust) (bool, error) {
	settled := false
	var done []int
	var first error
	for _, idx := range groupByTag(keys) {
		gk := make([]string, 0, len(idx))
		ga := make([]Adjust, 0, len(idx))
		for _, i := range idx {
			gk, ga = append(gk, keys[i]), append(ga, adj[i])
		}
		ok, err := Redis{Client: s.Client}.Settle(ctx, id, gk, ga)
		if err != nil {
			if first == nil {
				first = err
			}
			continue
		}
		done = append(done, idx...)
		settled = settled || ok
	}
	switch {
	case first == nil:
		return settled, nil
	case len(done) > 0:
		return settled, &PartialSettleError{Err: first, Settled: done}
	}
	return false, first
}

// PartialSettleError is a settlement of several hash-tag groups (Sharded)
// whose calls for some groups failed, the first with Err, while the
// others' succeeded: the buckets of those (Settled, their indexes in the
// keys given to Settle, ascending within a group) are settled, their
// markers set, and a retry settles the rest once.
type PartialSettleError struct {
	Err     error
	Settled []int
}

func (e *PartialSettleError) Error() string {
	return "settled in part, the other hash-tag groups failed: " + e.Err.Error()
}

func (e *PartialSettleError) Unwrap() error { return e.Err }

// clampDelta returns the delta in units, bounded by two capacities either
// way. Two capacities are enough to take any bucket (it holds at most one)
// down to the debt floor of minus one capacity, or up to full from the
// floor, so the bound never changes a result; it keeps 2·capacity·scale
// (below 2^54, an even number) and every sum the script forms exact in a
// double.
func clampDelta(a Adjust) int64 {
	limit := 2 * a.Spec.Capacity
	return max(-limit, min(a.Delta, limit)) * a.Spec.Scale
}

// SettleState is the model of settle.lua for one bucket: the state after
// charging (delta > 0) or giving back (delta < 0) delta tokens at now, and
// whether the bucket is kept (false: full, its key is deleted). The bucket,
// refilled to now, goes down by the charge (or up by the refund) exactly,
// floored at minus one capacity (the deepest debt a settlement makes), or
// at the deeper debt of reservations the bucket already holds, and capped
// at full.
func SettleState(now int64, s Spec, st State, delta int64) (State, bool) {
	units := refill(now, s, st)
	last := max(now, st.Last)
	least := min(units, -s.CapacityUnits())
	units -= clampDelta(Adjust{Spec: s, Delta: delta})
	units = max(units, least)
	if units >= s.CapacityUnits() {
		return s.Full(), false
	}
	return State{Units: units, Scale: s.Scale, Last: last}, true
}
