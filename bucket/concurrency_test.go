package bucket

import (
	"context"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// clockFromArgv replaces lua.ClockLine in a script whose clock the test
// drives: the last two ARGV are the seconds and microseconds.
const clockFromArgv = "local clock = {ARGV[#ARGV - 1], ARGV[#ARGV]}"

// takeClock is token_bucket.lua, and leaseClock lease.lua, with the clock
// driven by the test; otherwise the production text.
var (
	takeClock  = redis.NewScript(strings.Replace(lua.Source, lua.ClockLine, clockFromArgv, 1))
	leaseClock = redis.NewScript(strings.Replace(lua.LeaseSource, lua.ClockLine, clockFromArgv, 1))
)

// takeAt runs Redis.Take's call (the same KEYS and ARGV) at now
// (microseconds) on the driven script.
func takeAt(t *testing.T, rdb *redis.Client, now int64, keys []string, takes []Take) Decision {
	t.Helper()
	args := append(appendArgs(nil, takes), now/1_000_000, now%1_000_000)
	vals, err := takeClock.Run(context.Background(), rdb, keys, args...).Int64Slice()
	if err != nil {
		t.Fatalf("take at %d: %v", now, err)
	}
	d, err := ParseReply(vals, takes)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// leaseAt runs Redis.Renew's (span > 0) or Redis.Release's (span 0) call at
// now on the driven script.
func leaseAt(t *testing.T, rdb *redis.Client, now int64, keys []string, id string, span int64) int64 {
	t.Helper()
	n, err := leaseClock.Run(context.Background(), rdb, keys, id, strconv.FormatInt(span, 10),
		now/1_000_000, now%1_000_000).Int64()
	if err != nil {
		t.Fatalf("lease at %d: %v", now, err)
	}
	return n
}

// conc is a take of one slot of a concurrency limit of n slots.
func conc(n, lease int64, id string) Take {
	return Take{Spec: ConcurrencySpec(n), Cost: 1, Lease: lease, LeaseID: id}
}

// leases returns the lease ids held at key, sorted.
func leases(t *testing.T, c redis.Cmdable, key string) []string {
	t.Helper()
	ids, err := c.ZRange(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatalf("ZRANGE %s: %v", key, err)
	}
	slices.Sort(ids)
	return ids
}

// full is the result of a full concurrency limit.
var full = Result{Reason: RateLimited, RetryAfterMS: ConcurrencyRetryMS}

// denied is the decision of a request whose only take is a full
// concurrency limit.
var denied = Decision{Reason: RateLimited, RetryAfterMS: ConcurrencyRetryMS, Deciding: 0, Buckets: []Result{full}}

// allowedWith is the decision of a request whose only take is a
// concurrency limit that allows, leaving left slots.
func allowedWith(left int64) Decision {
	return Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Remaining: left}}}
}

// redisTime returns Redis's clock in milliseconds.
func redisTime(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	tm, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return tm.UnixMilli()
}

// TestConcurrencyRedis runs concurrency limits through Redis.Take,
// Redis.Renew and Redis.Release on a real redis-server and its clock. The
// leases are a minute long, so none lapses during the test.
func TestConcurrencyRedis(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	st := Redis{Client: rdb}
	const lease = 60_000
	take := func(keys []string, takes ...Take) Decision {
		t.Helper()
		d, err := st.Take(ctx, keys, takes)
		if err != nil {
			t.Fatalf("Take(%q): %v", keys, err)
		}
		return d
	}
	release := func(keys []string, id string) int64 {
		t.Helper()
		n, err := st.Release(ctx, keys, id)
		if err != nil {
			t.Fatalf("Release(%q, %s): %v", keys, id, err)
		}
		return n
	}
	renew := func(keys []string, id string, ms int64) int64 {
		t.Helper()
		n, err := st.Renew(ctx, keys, id, ms)
		if err != nil {
			t.Fatalf("Renew(%q, %s): %v", keys, id, err)
		}
		return n
	}

	t.Run("three_slots", func(t *testing.T) {
		k := []string{"cc:{a}"}
		for i, left := range []int64{2, 1, 0} {
			sameDecision(t, fmt.Sprint("take ", i+1), take(k, conc(3, lease, fmt.Sprint("r", i+1))), allowedWith(left))
		}
		d := take(k, conc(3, lease, "r4"))
		sameDecision(t, "fourth take", d, denied)
		if d.RetryAfterSeconds() != 1 {
			t.Errorf("Retry-After %d, want 1", d.RetryAfterSeconds())
		}
		if got := leases(t, rdb, k[0]); !slices.Equal(got, []string{"r1", "r2", "r3"}) {
			t.Fatalf("leases %q, want r1 r2 r3", got)
		}
		// A release frees one slot for the next request, and one only.
		if n := release(k, "r2"); n != 1 {
			t.Fatalf("release of r2 gave back %d, want 1", n)
		}
		sameDecision(t, "take after a release", take(k, conc(3, lease, "r5")), allowedWith(0))
		sameDecision(t, "take after that", take(k, conc(3, lease, "r6")), denied)
		if n := release(k, "r2"); n != 0 {
			t.Fatalf("second release of r2 gave back %d, want 0", n)
		}
		sameDecision(t, "take after a second release", take(k, conc(3, lease, "r7")), denied)
		if got := leases(t, rdb, k[0]); !slices.Equal(got, []string{"r1", "r3", "r5"}) {
			t.Fatalf("leases %q, want r1 r3 r5", got)
		}
		// A peek (cost 0) takes nothing.
		peek := conc(3, lease, "p")
		peek.Cost = 0
		sameDecision(t, "peek", take(k, peek), Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Remaining: 0}}})
		if n := release(k, "r1") + release(k, "r3") + release(k, "r5"); n != 3 {
			t.Fatalf("releasing every lease gave back %d, want 3", n)
		}
		sameDecision(t, "peek when empty", take(k, peek), Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Remaining: 3}}})
		if n := rdb.Exists(ctx, k[0]).Val(); n != 0 {
			t.Errorf("%s exists with no lease", k[0])
		}
	})

	// The key lives at least as long as its longest lease, and the lease's
	// expiry is the Redis clock plus the lease.
	t.Run("ttl", func(t *testing.T) {
		k := []string{"cc:{ttl}"}
		pttl := func() int64 {
			t.Helper()
			return rdb.PTTL(ctx, k[0]).Val().Milliseconds()
		}
		t0 := redisTime(t, rdb)
		take(k, conc(5, lease, "long"))
		t1 := redisTime(t, rdb)
		if p := pttl(); p > lease || p < lease-ttlSlackMS {
			t.Errorf("PTTL %d ms after a take of a %d ms lease", p, lease)
		}
		if s := rdb.ZScore(ctx, k[0], "long").Val(); int64(s) < t0+lease || int64(s) > t1+lease {
			t.Errorf("lease expiry %v, want the Redis clock (%d..%d) + %d", s, t0, t1, lease)
		}
		take(k, conc(5, 1_000, "short"))
		if p := pttl(); p > lease || p < lease-ttlSlackMS {
			t.Errorf("PTTL %d ms after a shorter lease, want the longer lease's %d", p, lease)
		}
		take(k, conc(5, 2*lease, "longer"))
		if p := pttl(); p > 2*lease || p < 2*lease-ttlSlackMS {
			t.Errorf("PTTL %d ms after a longer lease, want %d", p, 2*lease)
		}
		if n := renew(k, "short", 3*lease); n != 1 {
			t.Errorf("renew gave %d, want 1", n)
		}
		if p := pttl(); p > 3*lease || p < 3*lease-ttlSlackMS {
			t.Errorf("PTTL %d ms after a renewal, want %d", p, 3*lease)
		}
	})

	t.Run("renew", func(t *testing.T) {
		k := []string{"cc:{renew}"}
		take(k, conc(2, 10_000, "a"))
		before := rdb.ZScore(ctx, k[0], "a").Val()
		if n := renew(k, "a", lease); n != 1 {
			t.Fatalf("renewing a held lease: %d, want 1", n)
		}
		if after := rdb.ZScore(ctx, k[0], "a").Val(); after < before+lease-10_000 {
			t.Errorf("renewed expiry %v, was %v: want at least %d ms later", after, before, lease-10_000)
		}
		if got := leases(t, rdb, k[0]); !slices.Equal(got, []string{"a"}) {
			t.Errorf("leases %q after a renewal, want a", got)
		}
		// A renewal of a released lease, or of one never taken, adds
		// nothing.
		if n := release(k, "a"); n != 1 {
			t.Fatalf("release: %d, want 1", n)
		}
		if n := renew(k, "a", lease); n != 0 {
			t.Errorf("renewing a released lease: %d, want 0", n)
		}
		if n := renew(k, "never", lease); n != 0 {
			t.Errorf("renewing a lease never taken: %d, want 0", n)
		}
		if n := rdb.ZCard(ctx, k[0]).Val(); n != 0 {
			t.Errorf("%d leases after renewing released ones, want 0", n)
		}
		if _, err := st.Renew(ctx, k, "a", 0); err == nil {
			t.Error("a renewal of 0 ms was accepted")
		}
		if n, err := st.Release(ctx, nil, "a"); n != 0 || err != nil {
			t.Errorf("release of no keys: %d, %v", n, err)
		}
	})

	// One lease id over two limits: renewed and released on both, counted
	// per key.
	t.Run("two_limits", func(t *testing.T) {
		k := []string{"cc:{two}:a", "cc:{two}:b"}
		d := take(k, conc(1, lease, "x"), conc(2, lease, "x"))
		sameDecision(t, "take both", d, Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Remaining: 0}, {Remaining: 1}}})
		if n := renew(k, "x", 2*lease); n != 2 {
			t.Errorf("renew: %d, want 2", n)
		}
		if n := release(k, "x"); n != 2 {
			t.Errorf("release: %d, want 2", n)
		}
		if n := release(k, "x"); n != 0 {
			t.Errorf("second release: %d, want 0", n)
		}
	})

	// All or nothing: a token bucket that denies leaves the concurrency
	// limit untouched, and a full concurrency limit leaves the token bucket
	// uncharged.
	t.Run("all_or_nothing", func(t *testing.T) {
		kc, kb := "cc:{aon}:c", "cc:{aon}:b"
		one := shSpec(t, 1)
		take([]string{kb}, Take{Spec: one, Cost: 1})
		d := take([]string{kc, kb}, conc(3, lease, "q"), Take{Spec: one, Cost: 1})
		if d.Allowed || d.Reason != RateLimited || d.Deciding != 1 || d.Buckets[0] != (Result{Remaining: 3}) {
			t.Errorf("denied by the token bucket: %+v; want denied by bucket 1, 3 slots free", d)
		}
		if n := rdb.ZCard(ctx, kc).Val(); n != 0 {
			t.Errorf("%d leases after a denied request, want 0", n)
		}

		kf, kt := "cc:{aon}:full", "cc:{aon}:t"
		take([]string{kf}, conc(1, lease, "holder"))
		d = take([]string{kt, kf}, Take{Spec: shSpec(t, 10), Cost: 1}, conc(1, lease, "q2"))
		sameDecision(t, "denied by the full limit", d, Decision{Reason: RateLimited, RetryAfterMS: ConcurrencyRetryMS, Deciding: 1,
			Buckets: []Result{{Remaining: 10}, full}})
		if n := rdb.Exists(ctx, kt).Val(); n != 0 {
			t.Errorf("the token bucket was charged for a request a full concurrency limit denied")
		}
		if got := leases(t, rdb, kf); !slices.Equal(got, []string{"holder"}) {
			t.Errorf("leases %q, want holder", got)
		}
	})

	// A full shadow concurrency limit lets the request through without a
	// slot; one with a free slot gives it one, as if enforced.
	t.Run("shadow", func(t *testing.T) {
		kc, kb := "cc:{sh}:c", "cc:{sh}:b"
		take([]string{kc}, conc(1, lease, "holder"))
		sh := conc(1, lease, "y")
		sh.Shadow = true
		d := take([]string{kb, kc}, Take{Spec: shSpec(t, 10), Cost: 1}, sh)
		sameDecision(t, "full shadow limit", d, Decision{Allowed: true, Deciding: -1, ShadowDenied: true,
			Buckets: []Result{{Remaining: 9, FullMS: 3_600_000}, {Reason: RateLimited, RetryAfterMS: ConcurrencyRetryMS, Shadow: true}}})
		if got := leases(t, rdb, kc); !slices.Equal(got, []string{"holder"}) {
			t.Errorf("leases %q, want holder alone", got)
		}
		if n := release([]string{kc}, "holder"); n != 1 {
			t.Fatalf("release: %d", n)
		}
		sh.LeaseID = "z"
		d = take([]string{kc}, sh)
		sameDecision(t, "free shadow limit", d, Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Shadow: true}}})
		if got := leases(t, rdb, kc); !slices.Equal(got, []string{"z"}) {
			t.Errorf("leases %q, want z", got)
		}
	})
}

// TestConcurrencyLeaseLapse drives the Redis clock: a lease lapses exactly
// its lease after the take (a slot is free from that millisecond, not the
// one before), a renewal moves that to the lease after the renewal, and a
// release frees the slot at once.
func TestConcurrencyLeaseLapse(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const lease = 30_000 // ms
	const L = lease * 1000
	t0 := baseTime

	t.Run("lapse", func(t *testing.T) {
		k := []string{"lp:{lapse}"}
		sameDecision(t, "take", takeAt(t, rdb, t0, k, []Take{conc(1, lease, "r1")}), allowedWith(0))
		sameDecision(t, "a millisecond before the lapse", takeAt(t, rdb, t0+L-1000, k, []Take{conc(1, lease, "r2")}), denied)
		sameDecision(t, "a microsecond before the lapse", takeAt(t, rdb, t0+L-1, k, []Take{conc(1, lease, "r2")}), denied)
		sameDecision(t, "at the lapse", takeAt(t, rdb, t0+L, k, []Take{conc(1, lease, "r2")}), allowedWith(0))
		// The take that found the lapsed lease dropped it.
		if got := leases(t, rdb, k[0]); !slices.Equal(got, []string{"r2"}) {
			t.Errorf("leases %q, want r2 alone", got)
		}
		if n := leaseAt(t, rdb, t0+L, k, "r1", lease); n != 0 {
			t.Errorf("renewing the lapsed and dropped lease: %d, want 0", n)
		}
	})

	t.Run("renew", func(t *testing.T) {
		k := []string{"lp:{renew}"}
		takeAt(t, rdb, t0, k, []Take{conc(1, lease, "r1")})
		renewed := t0 + 10_000_000
		if n := leaseAt(t, rdb, renewed, k, "r1", lease); n != 1 {
			t.Fatalf("renew before the lapse: %d, want 1", n)
		}
		sameDecision(t, "at the old lapse", takeAt(t, rdb, t0+L, k, []Take{conc(1, lease, "r2")}), denied)
		sameDecision(t, "a millisecond before the new lapse", takeAt(t, rdb, renewed+L-1000, k, []Take{conc(1, lease, "r2")}), denied)
		sameDecision(t, "at the new lapse", takeAt(t, rdb, renewed+L, k, []Take{conc(1, lease, "r2")}), allowedWith(0))
	})

	t.Run("release", func(t *testing.T) {
		k := []string{"lp:{release}"}
		takeAt(t, rdb, t0, k, []Take{conc(2, lease, "r1")})
		takeAt(t, rdb, t0, k, []Take{conc(2, lease, "r2")})
		sameDecision(t, "full", takeAt(t, rdb, t0+1000, k, []Take{conc(2, lease, "r3")}), denied)
		if n := leaseAt(t, rdb, t0+2000, k, "r1", 0); n != 1 {
			t.Fatalf("release: %d, want 1", n)
		}
		if n := leaseAt(t, rdb, t0+2000, k, "r1", lease); n != 0 {
			t.Fatalf("renew after the release: %d, want 0", n)
		}
		sameDecision(t, "after the release", takeAt(t, rdb, t0+3000, k, []Take{conc(2, lease, "r3")}), allowedWith(0))
		if n := leaseAt(t, rdb, t0+4000, k, "r1", 0); n != 0 {
			t.Fatalf("second release: %d, want 0", n)
		}
		sameDecision(t, "after the second release", takeAt(t, rdb, t0+5000, k, []Take{conc(2, lease, "r4")}), denied)
	})
}

// TestConcurrencyLapsedLeaseIsGone: a lease that lapsed is gone even while
// its entry is still in the sorted set (no take has dropped it since):
// Renew does not take it again (returns 0, and the slot stays free), and
// Release gives back nothing (its slot came back at the lapse), as
// Redis.Renew, Redis.Release and lua/lease.lua document.
func TestConcurrencyLapsedLeaseIsGone(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const lease = 30_000
	t0 := baseTime
	lapsed := t0 + lease*1000

	k := []string{"lg:{renew}"}
	takeAt(t, rdb, t0, k, []Take{conc(1, lease, "r1")})
	if n := leaseAt(t, rdb, lapsed, k, "r1", lease); n != 0 {
		t.Errorf("renewing a lapsed lease returned %d, want 0", n)
	}
	sameDecision(t, "a take after renewing the lapsed lease", takeAt(t, rdb, lapsed, k, []Take{conc(1, lease, "r2")}), allowedWith(0))

	k = []string{"lg:{release}"}
	takeAt(t, rdb, t0, k, []Take{conc(1, lease, "r1")})
	if n := leaseAt(t, rdb, lapsed, k, "r1", 0); n != 0 {
		t.Errorf("releasing a lapsed lease returned %d, want 0 (its slot came back at the lapse)", n)
	}
}

// TestLuaMatchesModelConcurrency drives the Lua scripts (take, renew,
// release; clock driven) and a model through the same random steps: two
// concurrency limits whose sizes change now and then, two token buckets,
// random shadow takes, leases of several lengths, a clock that mostly moves
// forward and sometimes back. The model holds each limit's sorted set (lease
// id → expiry ms); Decide decides on its free slots. Every decision, every
// renew and release count, every sorted set and token bucket state, and the
// TTL set by a take must agree.
func TestLuaMatchesModelConcurrency(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	seed := uint64(20260611)
	r := rand.New(rand.NewPCG(seed, seed))

	ckeys := []string{"rc:{x}:c0", "rc:{x}:c1"}
	bkeys := []string{"rc:{x}:b0", "rc:{x}:b1"}
	slots := []int64{1 + r.Int64N(3), 1 + r.Int64N(3)}
	rate, err := ParseRate("6/m") // a token every 10 s
	if err != nil {
		t.Fatal(err)
	}
	bspecs := make([]Spec, 2)
	for i, capacity := range []int64{2, 4} {
		if bspecs[i], err = (Limit{Capacity: capacity, Rate: rate}).Spec(); err != nil {
			t.Fatal(err)
		}
	}
	sets := map[string]map[string]int64{ckeys[0]: {}, ckeys[1]: {}}
	model := map[string]State{}
	var issued []string
	live := func(key string, ms int64) int64 {
		var n int64
		for _, exp := range sets[key] {
			if exp > ms {
				n++
			}
		}
		return n
	}
	// lapsedHeld says whether id's entry is still in some set after its
	// lease lapsed (TestConcurrencyLapsedLeaseIsGone covers that case).
	lapsedHeld := func(id string, ms int64) bool {
		for _, set := range sets {
			if exp, ok := set[id]; ok && exp <= ms {
				return true
			}
		}
		return false
	}
	now := baseTime
	var allowed, deniedFull, shadowFull, renewed, released int
	const steps = 3000
	for step := 0; step < steps; step++ {
		switch x := r.IntN(100); {
		case x < 30:
		case x < 90:
			now += r.Int64N(3_000_000)
		case x < 97:
			now += r.Int64N(40_000_000)
		default:
			now -= r.Int64N(2_000_000)
		}
		if r.IntN(150) == 0 {
			slots[r.IntN(2)] = 1 + r.Int64N(3)
		}
		ms := floorDiv(now, 1000)
		where := fmt.Sprintf("step %d at %d", step, now)
		switch op := r.IntN(100); {
		case op < 30 && len(issued) > 0: // renew or release a lease
			// Mostly a recent lease, which may still be held.
			id := issued[len(issued)-1-r.IntN(min(len(issued), 6))]
			if r.IntN(10) == 0 {
				id = issued[r.IntN(len(issued))]
			}
			if lapsedHeld(id, ms) {
				continue
			}
			var span int64
			if op < 15 {
				span = []int64{1000, 5000, 20_000}[r.IntN(3)]
			}
			var want int64
			for _, k := range ckeys {
				if exp, ok := sets[k][id]; ok && exp > ms {
					want++
					if span > 0 {
						sets[k][id] = ms + span
					} else {
						delete(sets[k], id)
					}
				}
			}
			if got := leaseAt(t, rdb, now, ckeys, id, span); got != want {
				t.Fatalf("%s: lease %s span %d: %d, model %d", where, id, span, got, want)
			}
			if want > 0 && span > 0 {
				renewed++
			} else if want > 0 {
				released++
			}
		default: // a request
			id := fmt.Sprint("q", step)
			var keys []string
			var takes []Take
			for _, i := range r.Perm(4)[:1+r.IntN(4)] {
				var tk Take
				if i < 2 {
					tk = conc(slots[i], []int64{1000, 5000, 20_000}[r.IntN(3)], id)
					if r.IntN(8) == 0 {
						tk.Cost = 0
					}
					keys = append(keys, ckeys[i])
				} else {
					tk = Take{Spec: bspecs[i-2], Cost: r.Int64N(2)}
					keys = append(keys, bkeys[i-2])
				}
				tk.Shadow = r.IntN(4) == 0
				takes = append(takes, tk)
			}
			states := make([]State, len(keys))
			for j, k := range keys {
				if takes[j].Lease > 0 {
					states[j] = State{Units: takes[j].Spec.Capacity - live(k, ms), Scale: 1}
				} else if st, ok := model[k]; ok {
					states[j] = st
				} else {
					states[j] = takes[j].Spec.Full()
				}
			}
			charged := make([]bool, len(keys))
			want := Decide(now, takes, states, charged)
			got := takeAt(t, rdb, now, keys, takes)
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("%s: takes %+v\nlua   %+v\nmodel %+v", where, takes, got, want)
			}
			leased := false
			for j, k := range keys {
				if !charged[j] {
					continue
				}
				if takes[j].Lease == 0 {
					model[k] = states[j]
					continue
				}
				for lid, exp := range sets[k] {
					if exp <= ms {
						delete(sets[k], lid)
					}
				}
				sets[k][id] = ms + takes[j].Lease
				leased = true
				if p := rdb.PTTL(ctx, k).Val().Milliseconds(); p < takes[j].Lease-ttlSlackMS || p > takes[j].Lease {
					t.Fatalf("%s: %s PTTL %d ms after a take of a %d ms lease", where, k, p, takes[j].Lease)
				}
			}
			if leased {
				issued = append(issued, id)
			}
			for j, res := range want.Buckets {
				if takes[j].Lease == 0 || takes[j].Cost == 0 {
					continue
				}
				switch {
				case res.Reason == RateLimited && !takes[j].Shadow:
					deniedFull++
				case res.Reason == RateLimited && want.Allowed:
					shadowFull++
				}
			}
			if want.Allowed {
				allowed++
			}
		}
		// The stored state equals the model's, every key.
		for _, k := range ckeys {
			zs, err := rdb.ZRangeWithScores(ctx, k, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]int64{}
			for _, z := range zs {
				got[z.Member.(string)] = int64(z.Score)
			}
			if len(got) != len(sets[k]) || (len(got) > 0 && !reflect.DeepEqual(got, sets[k])) {
				t.Fatalf("%s: %s holds %v, model %v", where, k, got, sets[k])
			}
		}
		for _, k := range bkeys {
			wantVal := ""
			if st, ok := model[k]; ok {
				wantVal = EncodeState(st)
			}
			if v, _ := rdb.Get(ctx, k).Result(); v != wantVal {
				t.Fatalf("%s: %s holds another state than the model's %+v", where, k, model[k])
			}
		}
		// Keys expire on the real clock while the test drives the script's:
		// keep every key.
		for _, k := range append(ckeys, bkeys...) {
			rdb.Persist(ctx, k)
		}
	}
	for what, n := range map[string]int{"allowed": allowed, "denied by a full limit": deniedFull,
		"let through by a full shadow limit": shadowFull, "renewed": renewed, "released": released} {
		if n < steps/50 {
			t.Errorf("%d requests %s: the random steps do not exercise it", n, what)
		}
	}
	t.Logf("%d steps: %d allowed, %d denied by a full limit, %d through a full shadow limit, %d renewals, %d releases",
		steps, allowed, deniedFull, shadowFull, renewed, released)
}

// TestLocalConcurrency: the in-process store holds a concurrency limit as
// its free slots; Release gives one back, never above the limit.
func TestLocalConcurrency(t *testing.T) {
	fixed := time.UnixMicro(baseTime)
	l := NewLocal(10, func() time.Time { return fixed })
	ctx := context.Background()
	k := []string{"c"}
	c2 := []Take{conc(2, 60_000, "")}
	take := func(where string, keys []string, takes []Take, want Decision) {
		t.Helper()
		d, err := l.Take(ctx, keys, takes)
		if err != nil {
			t.Fatal(err)
		}
		sameDecision(t, where, d, want)
	}
	take("first", k, c2, allowedWith(1))
	take("second", k, c2, allowedWith(0))
	take("third", k, c2, denied)
	if st, _ := l.lru.Peek("c"); st.Units != 0 {
		t.Fatalf("holds %+v, want 0 free slots", st)
	}
	l.Release(k, c2)
	if st, _ := l.lru.Peek("c"); st.Units != 1 {
		t.Fatalf("holds %+v after a release, want 1 free slot", st)
	}
	take("after a release", k, c2, allowedWith(0))
	take("after that", k, c2, denied)
	l.Release(k, c2)
	l.Release(k, c2)
	if _, ok := l.lru.Peek("c"); ok || l.Len() != 0 {
		t.Fatalf("a limit released back to full is still held (%d buckets)", l.Len())
	}
	l.Release(k, c2) // a release more than taken gives nothing
	take("full again", k, c2, allowedWith(1))
	take("and", k, c2, allowedWith(0))
	take("no more", k, c2, denied)

	// All or nothing: a denying token bucket leaves the slots alone.
	one := shSpec(t, 1)
	take("drain", []string{"b"}, []Take{{Spec: one, Cost: 1}},
		Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Remaining: 0, FullMS: 3_600_000}}})
	take("denied by the bucket", []string{"d", "b"}, []Take{conc(2, 60_000, ""), {Spec: one, Cost: 1}},
		Decision{Reason: RateLimited, RetryAfterMS: 3_600_000, Deciding: 1,
			Buckets: []Result{{Remaining: 2}, {Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 3_600_000}}})
	if _, ok := l.lru.Peek("d"); ok {
		t.Error("a denied request took a slot")
	}
	// A full shadow limit lets the request through and takes nothing.
	sh := conc(2, 60_000, "")
	sh.Shadow = true
	take("full shadow limit", []string{"c", "e"}, []Take{sh, {Spec: one, Cost: 1}},
		Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
			{Reason: RateLimited, RetryAfterMS: ConcurrencyRetryMS, Shadow: true}, {Remaining: 0, FullMS: 3_600_000}}})
	if st, _ := l.lru.Peek("c"); st.Units != 0 {
		t.Errorf("a full shadow limit holds %+v, want 0 free slots", st)
	}
}

// TestLocalConcurrencyParallel: 32 goroutines taking and releasing slots
// of a limit of 5 never hold more than 5 at once, and end with all 5 free.
func TestLocalConcurrencyParallel(t *testing.T) {
	l := NewLocal(10, nil)
	k, c5 := []string{"p"}, []Take{conc(5, 60_000, "")}
	var held, peak atomic.Int64
	done := make(chan struct{})
	for g := 0; g < 32; g++ {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := 0; i < 200; i++ {
				d, _ := l.Take(context.Background(), k, c5)
				if !d.Allowed {
					continue
				}
				n := held.Add(1)
				for {
					p := peak.Load()
					if n <= p || peak.CompareAndSwap(p, n) {
						break
					}
				}
				held.Add(-1)
				l.Release(k, c5)
			}
		}()
	}
	for g := 0; g < 32; g++ {
		<-done
	}
	if p := peak.Load(); p > 5 || p < 1 {
		t.Errorf("peak of %d slots held at once, want 1..5", p)
	}
	if d, _ := l.Take(context.Background(), k, []Take{{Spec: ConcurrencySpec(5), Lease: 60_000}}); d.Buckets[0].Remaining != 5 {
		t.Errorf("%d slots free at the end, want 5", d.Buckets[0].Remaining)
	}
}

// startShCluster starts a three-master cluster and a Sharded store on a
// client set up as the handler sets it up.
func startShCluster(t *testing.T) *shCluster {
	cluster := redistest.StartCluster(t, 3)
	client := cluster.Client(t)
	client.AddHook(NoRetry{})
	return &shCluster{Cluster: cluster, client: client, store: Sharded{Client: client}, keyer: NewKeyer("rl:", "")}
}

// TestShardedConcurrency: concurrency limits on a Redis Cluster, with a
// request's limits on different slots.
func TestShardedConcurrency(t *testing.T) {
	c := startShCluster(t)
	ctx := context.Background()
	const lease = 60_000

	// The concurrency limit's group allows and takes the slot; the other
	// group's bucket denies; the refund removes the lease.
	t.Run("lease_refunded", func(t *testing.T) {
		kC := c.keyer.Key("user", "conc", "")
		kB := c.keyOn(t, "ip", "deny", c.NodeOf(t, kC))
		one := shSpec(t, 1)
		c.take(t, []string{kB}, []Take{{Spec: one, Cost: 1}})
		d := c.take(t, []string{kC, kB}, []Take{conc(2, lease, "q1"), {Spec: one, Cost: 1}})
		if d.Allowed || d.Reason != RateLimited || d.Deciding != 1 || d.Buckets[0] != (Result{Remaining: 2}) ||
			d.Buckets[1].Reason != RateLimited {
			t.Errorf("denied on the other slot: %+v; want denied by bucket 1, bucket 0 reporting 2 free", d)
		}
		if n := c.client.ZCard(ctx, kC).Val(); n != 0 {
			t.Errorf("%s holds %d leases after the refund, want 0", kC, n)
		}
		sameDecision(t, "a take after", c.take(t, []string{kC}, []Take{conc(2, lease, "q2")}), allowedWith(1))
		sameDecision(t, "and another", c.take(t, []string{kC}, []Take{conc(2, lease, "q3")}), allowedWith(0))
	})

	// The other way round: a full concurrency limit denies and the token
	// bucket on another slot is refunded (to full, so deleted).
	t.Run("bucket_refunded", func(t *testing.T) {
		kC := c.keyer.Key("user", "full", "")
		kA := c.keyOn(t, "ip", "refunded", c.NodeOf(t, kC))
		c.take(t, []string{kC}, []Take{conc(1, lease, "holder")})
		d := c.take(t, []string{kA, kC}, []Take{{Spec: shSpec(t, 10), Cost: 1}, conc(1, lease, "q")})
		sameDecision(t, "denied by the full limit", d, Decision{Reason: RateLimited, RetryAfterMS: ConcurrencyRetryMS, Deciding: 1,
			Buckets: []Result{{Remaining: 10, FullMS: 3_600_000}, full}})
		if v := c.raw(t, kA); v != "" {
			t.Errorf("%s left charged after the refund", kA)
		}
		if got := leases(t, c.client, kC); !slices.Equal(got, []string{"holder"}) {
			t.Errorf("leases %q, want holder", got)
		}
	})

	t.Run("renew_release_across_slots", func(t *testing.T) {
		k1 := c.keyer.Key("user", "across", "")
		k2 := c.keyOn(t, "ip", "across", c.NodeOf(t, k1))
		keys := []string{k1, k2}
		d := c.take(t, keys, []Take{conc(2, 10_000, "q"), conc(3, 10_000, "q")})
		sameDecision(t, "take on two slots", d, Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Remaining: 1}, {Remaining: 2}}})
		before := []float64{c.client.ZScore(ctx, k1, "q").Val(), c.client.ZScore(ctx, k2, "q").Val()}
		if n, err := c.store.Renew(ctx, keys, "q", lease); err != nil || n != 2 {
			t.Fatalf("Renew: %d, %v; want 2", n, err)
		}
		for i, k := range keys {
			if s := c.client.ZScore(ctx, k, "q").Val(); s < before[i]+lease-10_000 {
				t.Errorf("%s: renewed expiry %v, was %v", k, s, before[i])
			}
			if p := c.client.PTTL(ctx, k).Val().Milliseconds(); p < lease-ttlSlackMS || p > lease {
				t.Errorf("%s: PTTL %d ms after a renewal of %d", k, p, lease)
			}
		}
		if n, err := c.store.Release(ctx, keys, "q"); err != nil || n != 2 {
			t.Fatalf("Release: %d, %v; want 2", n, err)
		}
		if n, err := c.store.Release(ctx, keys, "q"); err != nil || n != 0 {
			t.Fatalf("second Release: %d, %v; want 0", n, err)
		}
		if n, err := c.store.Renew(ctx, keys, "q", lease); err != nil || n != 0 {
			t.Fatalf("Renew after the release: %d, %v; want 0", n, err)
		}
		for _, k := range keys {
			if n := c.client.ZCard(ctx, k).Val(); n != 0 {
				t.Errorf("%s holds %d leases, want 0", k, n)
			}
		}
		// Three limits on two slots, two of them on one: every key counts.
		k3 := c.keyer.Key("user", "across", "conc")
		three := []string{k1, k3, k2}
		c.take(t, three, []Take{conc(1, lease, "t"), conc(1, lease, "t"), conc(1, lease, "t")})
		if n, err := c.store.Renew(ctx, three, "t", 2*lease); err != nil || n != 3 {
			t.Fatalf("Renew on three keys: %d, %v; want 3", n, err)
		}
		if n, err := c.store.Release(ctx, three, "t"); err != nil || n != 3 {
			t.Fatalf("Release on three keys: %d, %v; want 3", n, err)
		}
		for _, k := range three {
			if n := c.client.ZCard(ctx, k).Val(); n != 0 {
				t.Errorf("%s holds %d leases after the release, want 0", k, n)
			}
		}
		// Two limits of one hash tag: one call, both counted.
		same := []string{c.keyer.Key("user", "same", ""), c.keyer.Key("user", "same", "conc")}
		c.take(t, same, []Take{conc(1, lease, "s"), conc(1, lease, "s")})
		if n, err := c.store.Release(ctx, same, "s"); err != nil || n != 2 {
			t.Fatalf("Release on one slot: %d, %v; want 2", n, err)
		}
	})
}
