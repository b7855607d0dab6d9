package bucket

import (
	"context"
	"fmt"
	"reflect"
	"sync/atomic"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// hourTokens is the units of one token of shSpec (1/h): the scale.
const hourTokens = 3_600_000_000

// shadowRig is exactRig (quota_test.go): the Lua script and the model
// driven through the same requests, with the same decision, stored state
// and TTL required after each.
type shadowRig = exactRig

// tokens returns the whole tokens the model stores at key, -1 for no key.
func (g *shadowRig) tokens(key string) int64 {
	st, ok := g.model[key]
	if !ok {
		return -1
	}
	return floorDiv(st.Units, st.Scale)
}

func sameDecision(t *testing.T, where string, got, want Decision) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s:\ngot  %+v\nwant %+v", where, got, want)
	}
}

// TestShadowLua: a shadow limit is decided and charged like an enforced one
// while it allows an allowed request, but its denial (rate_limit_exceeded
// or cost_exceeds_capacity) never denies the request: the decision sets
// ShadowDenied, the shadow result keeps its reason and wait, and the
// shadow bucket is not charged. The Lua script (flag bit 1) and the model
// agree on every decision and stored state; the values are also given
// literally.
func TestShadowLua(t *testing.T) {
	srv := redistest.Start(t)
	g := &shadowRig{t: t, rdb: srv.Client(t), model: map[string]State{}}
	ten, two, one := shSpec(t, 10), shSpec(t, 2), shSpec(t, 1)
	now := baseTime

	t.Run("enforced_allows_shadow_denies", func(t *testing.T) {
		e, s := "sh:{1}:e", "sh:{1}:s"
		g.step("drain shadow bucket", now, []string{s}, []Take{{Spec: two, Cost: 2}})
		d := g.step("request", now, []string{e, s}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}})
		sameDecision(t, "enforced allows, shadow denies", d, Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
			{Remaining: 9, FullMS: 3_600_000},
			{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 7_200_000, Shadow: true},
		}})
		if got := g.tokens(e); got != 9 {
			t.Errorf("enforced bucket holds %d tokens, want 9 (charged)", got)
		}
		if st := g.model[s]; st.Units != 0 || st.Last != now {
			t.Errorf("shadow bucket %+v, want 0 units as drained (not charged)", st)
		}
	})

	t.Run("enforced_denies_nothing_charged", func(t *testing.T) {
		e, s := "sh:{2}:e", "sh:{2}:s"
		g.step("drain enforced bucket", now, []string{e}, []Take{{Spec: one, Cost: 1}})
		d := g.step("request", now, []string{e, s}, []Take{{Spec: one, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}})
		sameDecision(t, "enforced denies, shadow allows", d, Decision{Reason: RateLimited, RetryAfterMS: 3_600_000, Deciding: 0, Buckets: []Result{
			{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 3_600_000},
			{Remaining: 2, Shadow: true},
		}})
		if got := g.tokens(s); got != -1 {
			t.Errorf("shadow bucket of a denied request holds %d tokens, want no key", got)
		}
	})

	t.Run("shadow_cost_exceeds_capacity", func(t *testing.T) {
		e, s := "sh:{3}:e", "sh:{3}:s"
		d := g.step("request", now, []string{e, s}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 3, Shadow: true}})
		sameDecision(t, "shadow cost 3 of 2", d, Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
			{Remaining: 9, FullMS: 3_600_000},
			{Remaining: 2, Reason: CostExceedsCapacity, Shadow: true},
		}})
		if g.tokens(e) != 9 || g.tokens(s) != -1 {
			t.Errorf("enforced %d, shadow %d tokens; want 9 and no key", g.tokens(e), g.tokens(s))
		}
	})

	t.Run("shadow_allows_is_charged", func(t *testing.T) {
		e, s := "sh:{4}:e", "sh:{4}:s"
		d := g.step("request", now, []string{e, s}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}})
		sameDecision(t, "both allow", d, Decision{Allowed: true, Deciding: -1, Buckets: []Result{
			{Remaining: 9, FullMS: 3_600_000},
			{Remaining: 1, FullMS: 3_600_000, Shadow: true},
		}})
		if g.tokens(s) != 1 {
			t.Errorf("shadow bucket holds %d tokens, want 1 (charged as if enforced)", g.tokens(s))
		}
	})

	// Only shadow limits: the request is allowed; the one that allows is
	// charged, the one that denies is not.
	t.Run("all_shadow", func(t *testing.T) {
		a, b := "sh:{5}:a", "sh:{5}:b"
		g.step("drain b", now, []string{b}, []Take{{Spec: one, Cost: 1}})
		d := g.step("request", now, []string{a, b}, []Take{{Spec: two, Cost: 1, Shadow: true}, {Spec: one, Cost: 1, Shadow: true}})
		sameDecision(t, "two shadow limits", d, Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
			{Remaining: 1, FullMS: 3_600_000, Shadow: true},
			{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 3_600_000, Shadow: true},
		}})
	})

	// A shadow denial's longer wait neither decides nor lengthens the
	// request's Retry-After; the enforced one does.
	t.Run("shadow_wait_does_not_decide", func(t *testing.T) {
		s, e := "sh:{6}:s", "sh:{6}:e"
		five := shSpec(t, 5)
		g.step("drain", now, []string{s, e}, []Take{{Spec: five, Cost: 5}, {Spec: one, Cost: 1}})
		d := g.step("request", now, []string{s, e}, []Take{{Spec: five, Cost: 5, Shadow: true}, {Spec: one, Cost: 1}})
		sameDecision(t, "shadow waits 5 h, enforced 1 h", d, Decision{Reason: RateLimited, RetryAfterMS: 3_600_000, Deciding: 1, ShadowDenied: true, Buckets: []Result{
			{Remaining: 0, Reason: RateLimited, RetryAfterMS: 18_000_000, FullMS: 18_000_000, Shadow: true},
			{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 3_600_000},
		}})
	})

	// Time passes: the shadow bucket refills and allows again, and is then
	// charged.
	t.Run("shadow_refills", func(t *testing.T) {
		e, s := "sh:{1}:e", "sh:{1}:s"
		d := g.step("an hour later", now+3_600_000_000, []string{e, s}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}})
		sameDecision(t, "an hour later", d, Decision{Allowed: true, Deciding: -1, Buckets: []Result{
			{Remaining: 9, FullMS: 3_600_000},
			{Remaining: 0, FullMS: 7_200_000, Shadow: true},
		}})
	})

	// The production script through Redis.Take, on the real clock: the
	// same outcome (waits read the live clock, so they are bounded).
	t.Run("redis_take", func(t *testing.T) {
		ctx := context.Background()
		st := Redis{Client: g.rdb}
		e, s := "sh:{7}:e", "sh:{7}:s"
		if d, err := st.Take(ctx, []string{s}, []Take{{Spec: two, Cost: 2, Shadow: true}}); err != nil || !d.Allowed || d.ShadowDenied || d.Buckets[0].Remaining != 0 {
			t.Fatalf("draining a shadow bucket: %+v, %v", d, err)
		}
		before := g.rdb.Get(ctx, s).Val()
		d, err := st.Take(ctx, []string{e, s}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}})
		if err != nil {
			t.Fatal(err)
		}
		b := d.Buckets
		if !d.Allowed || d.Reason != Allowed || d.Deciding != -1 || d.RetryAfterMS != 0 || !d.ShadowDenied ||
			b[0].Remaining != 9 || b[0].Reason != Allowed || b[0].Shadow ||
			b[1].Remaining != 0 || b[1].Reason != RateLimited || !b[1].Shadow ||
			b[1].RetryAfterMS > 3_600_000 || b[1].RetryAfterMS < 3_600_000-5_000 {
			t.Errorf("Redis.Take: %+v; want allowed, shadow denied with a wait of an hour less a few ms", d)
		}
		if got := g.rdb.Get(ctx, s).Val(); got != before {
			t.Errorf("the shadow bucket that denied was written")
		}
		if st, err := DecodeState(g.rdb.Get(ctx, e).Val()); err != nil || st.Units != 9*hourTokens {
			t.Errorf("enforced bucket %+v (%v), want 9 tokens", st, err)
		}
	})
}

// TestShadowModel: the same outcomes from Decide alone, with the states it
// leaves to store.
func TestShadowModel(t *testing.T) {
	ten, two := shSpec(t, 10), shSpec(t, 2)
	drained := State{Units: 0, Scale: hourTokens, Last: baseTime}
	for _, c := range []struct {
		name    string
		takes   []Take
		states  []State
		want    Decision
		charged []bool
	}{
		{"shadow_denies", []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}}, []State{ten.Full(), drained},
			Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
				{Remaining: 9, FullMS: 3_600_000},
				{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 7_200_000, Shadow: true}}},
			[]bool{true, false}},
		{"enforced_denies", []Take{{Spec: two, Cost: 1}, {Spec: ten, Cost: 1, Shadow: true}}, []State{drained, ten.Full()},
			Decision{Reason: RateLimited, RetryAfterMS: 3_600_000, Deciding: 0, Buckets: []Result{
				{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 7_200_000},
				{Remaining: 10, Shadow: true}}},
			[]bool{false, false}},
		{"shadow_cost_exceeds_capacity", []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 3, Shadow: true}}, []State{ten.Full(), two.Full()},
			Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
				{Remaining: 9, FullMS: 3_600_000},
				{Remaining: 2, Reason: CostExceedsCapacity, Shadow: true}}},
			[]bool{true, false}},
		{"shadow_denies_before_shadow_allows", []Take{{Spec: two, Cost: 1, Shadow: true}, {Spec: ten, Cost: 1, Shadow: true}}, []State{drained, ten.Full()},
			Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
				{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 7_200_000, Shadow: true},
				{Remaining: 9, FullMS: 3_600_000, Shadow: true}}},
			[]bool{false, true}},
		{"shadow_charged", []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 2, Shadow: true}}, []State{ten.Full(), two.Full()},
			Decision{Allowed: true, Deciding: -1, Buckets: []Result{
				{Remaining: 9, FullMS: 3_600_000},
				{Remaining: 0, FullMS: 7_200_000, Shadow: true}}},
			[]bool{true, true}},
	} {
		t.Run(c.name, func(t *testing.T) {
			states := append([]State(nil), c.states...)
			charged := make([]bool, len(states))
			d := Decide(baseTime, c.takes, states, charged)
			sameDecision(t, "Decide", d, c.want)
			if !reflect.DeepEqual(charged, c.charged) {
				t.Errorf("charged %v, want %v", charged, c.charged)
			}
			// The Summarize of the results is the same decision.
			if s := Summarize(append([]Result(nil), d.Buckets...)); !reflect.DeepEqual(s, d) {
				t.Errorf("Summarize %+v, Decide %+v", s, d)
			}
		})
	}
}

// TestLocalShadow: the in-process store decides shadow limits as the
// model does, and stores nothing for a shadow limit that denied.
func TestLocalShadow(t *testing.T) {
	var now atomic.Int64
	now.Store(baseTime)
	l := NewLocal(100, func() time.Time { return time.UnixMicro(now.Load()) })
	ctx := context.Background()
	ten, two := shSpec(t, 10), shSpec(t, 2)
	model := map[string]State{}
	step := func(where string, keys []string, takes []Take) Decision {
		t.Helper()
		got, err := l.Take(ctx, keys, takes)
		if err != nil {
			t.Fatal(err)
		}
		states := make([]State, len(keys))
		for i, k := range keys {
			st, ok := model[k]
			if !ok {
				st = takes[i].Spec.Full()
			}
			states[i] = st
		}
		charged := make([]bool, len(keys))
		want := Decide(now.Load(), takes, states, charged)
		for i, k := range keys {
			if charged[i] {
				model[k] = states[i]
			}
		}
		sameDecision(t, where, got, want)
		for _, k := range keys {
			st, ok := l.lru.Peek(k)
			if wst, wok := model[k]; ok != wok || st != wst {
				t.Errorf("%s: %s holds %+v (%v), model %+v (%v)", where, k, st, ok, wst, wok)
			}
		}
		return got
	}
	step("drain shadow", []string{"s"}, []Take{{Spec: two, Cost: 2, Shadow: true}})
	d := step("shadow denies", []string{"e", "s"}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}})
	sameDecision(t, "literal", d, Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
		{Remaining: 9, FullMS: 3_600_000},
		{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 7_200_000, Shadow: true}}})
	d = step("shadow too big", []string{"e", "t"}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 3, Shadow: true}})
	if !d.Allowed || !d.ShadowDenied || d.Buckets[1].Reason != CostExceedsCapacity {
		t.Errorf("shadow cost above capacity: %+v", d)
	}
	if _, ok := l.lru.Peek("t"); ok {
		t.Error("a shadow bucket whose cost exceeds its capacity was stored")
	}
	step("drain enforced", []string{"f"}, []Take{{Spec: two, Cost: 2}})
	d = step("enforced denies", []string{"f", "u"}, []Take{{Spec: two, Cost: 1}, {Spec: ten, Cost: 1, Shadow: true}})
	if d.Allowed || d.ShadowDenied || d.Deciding != 0 {
		t.Errorf("enforced denial: %+v", d)
	}
	if _, ok := l.lru.Peek("u"); ok {
		t.Error("a shadow bucket of a denied request was charged")
	}
	now.Add(3_600_000_000)
	d = step("an hour later", []string{"e", "s"}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}})
	if !d.Allowed || d.ShadowDenied || d.Buckets[1].Remaining != 0 || d.Buckets[0].Remaining != 8 {
		t.Errorf("an hour later: %+v; want allowed, shadow charged its refilled token, 8 left", d)
	}
}

// TestShadowDemote: a shadow limit's denials, rate-limited or above
// capacity, and a full shadow concurrency limit, never count toward
// demotion; the enforced denials of the same identity still do, one per
// request.
func TestShadowDemote(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	st := Redis{Client: rdb}
	const marker, counter = "dm:{u}:demoted", "dm:{u}:denials"
	rule := DemoteRule{Denials: 2, Window: time.Minute, Span: time.Minute}
	ten, one := shSpec(t, 10), shSpec(t, 1)
	take := func(where string, keys []string, takes []Take) (Decision, Demotion) {
		t.Helper()
		d, state, _, err := st.TakeDemote(ctx, marker, counter, rule, keys, takes, keys, takes)
		if err != nil {
			t.Fatalf("%s: %v", where, err)
		}
		return d, state
	}
	noCount := func(where string) {
		t.Helper()
		if n := rdb.Exists(ctx, marker, counter).Val(); n != 0 {
			t.Fatalf("%s: %d of the demotion marker and denial counter exist, want none: a shadow denial counted", where, n)
		}
	}
	keys := []string{"dm:{u}:e", "dm:{u}:s"}
	shadowed := []Take{{Spec: ten, Cost: 1}, {Spec: one, Cost: 1, Shadow: true}}
	if d, state := take("first", keys, shadowed); !d.Allowed || d.ShadowDenied || state != NotDemoted {
		t.Fatalf("first request: %+v, state %d", d, state)
	}
	for i := 0; i < 5; i++ {
		d, state := take("shadow denies", keys, shadowed)
		if !d.Allowed || !d.ShadowDenied || d.Buckets[1].Reason != RateLimited || state != NotDemoted || d.Buckets[0].Remaining != int64(8-i) {
			t.Fatalf("shadow denial %d: %+v, state %d; want allowed, shadow denied, not demoted", i, d, state)
		}
		noCount(fmt.Sprint("shadow denial ", i))
	}
	for i := 0; i < 3; i++ {
		d, state := take("shadow too big", keys, []Take{{Spec: ten, Cost: 0}, {Spec: one, Cost: 2, Shadow: true}})
		if !d.Allowed || !d.ShadowDenied || d.Buckets[1].Reason != CostExceedsCapacity || state != NotDemoted {
			t.Fatalf("shadow cost above capacity %d: %+v, state %d", i, d, state)
		}
		noCount("shadow cost above capacity")
	}
	// A full shadow concurrency limit waits 1000 ms: it does not count either.
	conc := "dm:{u}:c"
	if d, state := take("fill", []string{conc}, []Take{{Spec: ConcurrencySpec(1), Cost: 1, Lease: 60_000, LeaseID: "holder"}}); !d.Allowed || state != NotDemoted {
		t.Fatalf("taking the one slot: %+v, state %d", d, state)
	}
	for i := 0; i < 3; i++ {
		d, state := take("shadow full", []string{keys[0], conc},
			[]Take{{Spec: ten, Cost: 0}, {Spec: ConcurrencySpec(1), Cost: 1, Shadow: true, Lease: 60_000, LeaseID: fmt.Sprint("r", i)}})
		if !d.Allowed || !d.ShadowDenied || d.Buckets[1] != (Result{Reason: RateLimited, RetryAfterMS: ConcurrencyRetryMS, Shadow: true}) || state != NotDemoted {
			t.Fatalf("full shadow concurrency limit %d: %+v, state %d", i, d, state)
		}
		noCount("full shadow concurrency limit")
	}
	if n := rdb.ZCard(ctx, conc).Val(); n != 1 {
		t.Fatalf("%s holds %d leases, want the holder's alone", conc, n)
	}
	// Enforced denials (with a shadow denial beside them) count, once per
	// request: the first leaves the count at 1, the second demotes.
	enforced := []string{"dm:{u}:e2", "dm:{u}:s"}
	if d, state := take("drain", enforced[:1], []Take{{Spec: one, Cost: 1}}); !d.Allowed || state != NotDemoted {
		t.Fatalf("draining the enforced bucket: %+v, state %d", d, state)
	}
	noCount("an allowed request")
	both := []Take{{Spec: one, Cost: 1}, {Spec: one, Cost: 1, Shadow: true}}
	if d, state := take("enforced denial 1", enforced, both); d.Allowed || !d.ShadowDenied || d.Deciding != 0 || state != NotDemoted {
		t.Fatalf("first enforced denial: %+v, state %d", d, state)
	}
	if n, err := rdb.Get(ctx, counter).Int64(); err != nil || n != 1 {
		t.Fatalf("denial counter %d (%v), want 1", n, err)
	}
	if d, state := take("enforced denial 2", enforced, both); d.Allowed || state != DemotedNow {
		t.Fatalf("second enforced denial: %+v, state %d; want demoted now", d, state)
	}
}

// TestShardedShadowRefund: on a Redis Cluster, a request is denied by a
// bucket on one slot while the group on another slot allowed it, with a
// shadow bucket there that denied. The refund gives back what that group
// charged: the enforced bucket's token, not a token to the shadow bucket,
// which was never charged; and the decision reports the shadow bucket as
// it stands.
func TestShardedShadowRefund(t *testing.T) {
	c := startShCluster(t)
	ten, two, one := shSpec(t, 10), shSpec(t, 2), shSpec(t, 1)
	kE := c.keyer.Key("user", "shadow", "")
	kS := c.keyer.Key("user", "shadow", "tokens") // kE's slot
	kD := c.keyOn(t, "ip", "shadow", c.NodeOf(t, kE))
	c.take(t, []string{kS}, []Take{{Spec: two, Cost: 2}})
	c.take(t, []string{kD}, []Take{{Spec: one, Cost: 1}})
	rawS := c.raw(t, kS)

	for i := 0; i < 3; i++ {
		d := c.take(t, []string{kE, kS, kD}, []Take{{Spec: ten, Cost: 1}, {Spec: two, Cost: 1, Shadow: true}, {Spec: one, Cost: 1}})
		b := d.Buckets
		if d.Allowed || d.Reason != RateLimited || d.Deciding != 2 || !d.ShadowDenied ||
			b[0].Remaining != 10 || b[0].Reason != Allowed ||
			b[1].Remaining != 0 || b[1].Reason != RateLimited || !b[1].Shadow || b[2].Reason != RateLimited {
			t.Errorf("request %d: %+v; want denied by bucket 2, shadow bucket 1 denying with 0 left, bucket 0 with 10", i, d)
		}
		if v := c.raw(t, kE); v != "" {
			t.Errorf("request %d: %s left charged after the refund", i, kE)
		}
		if got := c.raw(t, kS); got != rawS {
			st, _ := DecodeState(got)
			t.Fatalf("request %d: the shadow bucket, never charged, was refunded: it holds %+v (%d tokens), want 0 tokens as drained",
				i, st, st.Units/st.Scale)
		}
	}
}
