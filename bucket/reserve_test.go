package bucket

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// perSecond is a bucket of capacity tokens refilled at one token a second:
// a token is 1e6 units, a millisecond refills 1000.
func perSecond(t *testing.T, capacity int64) Spec {
	t.Helper()
	rate, err := ParseRate("1/s")
	if err != nil {
		t.Fatal(err)
	}
	s, err := Limit{Capacity: capacity, Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	if s.Scale != 1_000_000 || s.Refill != 1 {
		t.Fatalf("1/s compiles to %+v", s)
	}
	return s
}

// reserved is the decision of a request on one bucket that it allows with
// a reservation of wait ms, leaving remaining tokens (floored).
func reserved(remaining, wait, full int64) Decision {
	return Decision{Allowed: true, Deciding: -1, WaitMS: wait,
		Buckets: []Result{{Remaining: remaining, RetryAfterMS: wait, FullMS: full}}}
}

// TestReservation: a token bucket of 10 at 1/s, Redis's clock driven,
// through the probe script (Redis.Take's call) and the model. Drained, and
// 250 ms later holding 0.25 token: a reservation of 2 waits exactly 1750
// ms and leaves the bucket 1.75 tokens below zero (the cost less what it
// held); a second waits exactly 2000 ms (cost / refill) more; a third,
// past MaxWaitMS, is denied, charges nothing and reports no WaitMS; at
// exactly MaxWaitMS it is allowed. Redis.Refund gives each charge back
// exactly: min(capacity, held + cost), and to full deletes the key. A
// bucket reserved and refunded holds what a twin never charged holds.
func TestReservation(t *testing.T) {
	g := newExactRig(t)
	ctx := context.Background()
	clock := &drivenClock{rdb: g.rdb}
	store := Redis{Client: clock}
	s := perSecond(t, 10)
	const key = "resv:{a}"
	k := []string{key}
	res := func(cost, maxWait int64) []Take { return []Take{{Spec: s, Cost: cost, MaxWaitMS: maxWait}} }
	refund := func(where string, at int64, keys []string, takes []Take, want int64) {
		t.Helper()
		clock.now = at
		n, err := store.Refund(ctx, keys, takes)
		if err != nil || n != want {
			t.Fatalf("%s: refunded %d (%v), want %d", where, n, err, want)
		}
	}
	t0 := baseTime
	sameDecision(t, "drain", g.step("drain", t0, k, res(10, 0)),
		Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Remaining: 0, FullMS: 10_000}}})

	t1 := t0 + 250_000
	// Without a reservation: denied as usual.
	sameDecision(t, "2 without max wait", g.step("no wait", t1, k, res(2, 0)), Decision{Reason: RateLimited, RetryAfterMS: 1750, Deciding: 0,
		Buckets: []Result{{Remaining: 0, Reason: RateLimited, RetryAfterMS: 1750, FullMS: 9750}}})
	// 0.25 token held, 2 wanted: 1.75 tokens short, 1750 ms.
	sameDecision(t, "first reservation", g.step("first", t1, k, res(2, 5000)), reserved(-2, 1750, 11_750))
	g.expect("first reservation", key, State{Units: -1_750_000, Scale: 1_000_000, Last: t1}, true)
	// 2 more: 2000 ms longer.
	sameDecision(t, "second reservation", g.step("second", t1, k, res(2, 5000)), reserved(-4, 3750, 13_750))
	g.expect("second reservation", key, State{Units: -3_750_000, Scale: 1_000_000, Last: t1}, true)
	// 2 more would wait 5750 ms > 5000: denied, nothing charged.
	d := g.step("third", t1, k, res(2, 5000))
	sameDecision(t, "third, past max wait", d, Decision{Reason: RateLimited, RetryAfterMS: 5750, Deciding: 0,
		Buckets: []Result{{Remaining: -4, Reason: RateLimited, RetryAfterMS: 5750, FullMS: 13_750}}})
	g.expect("third denied", key, State{Units: -3_750_000, Scale: 1_000_000, Last: t1}, true)
	// At exactly max wait: allowed; then refunded exactly.
	sameDecision(t, "third at max wait", g.step("third at bound", t1, k, res(2, 5750)), reserved(-6, 5750, 15_750))
	g.expect("third reserved", key, State{Units: -5_750_000, Scale: 1_000_000, Last: t1}, true)
	refund("third refunded", t1, k, res(2, 5750), 1)
	g.expect("third refunded", key, State{Units: -3_750_000, Scale: 1_000_000, Last: t1}, true)
	// The bound to the unit: drained at t0, a microsecond before t1 the
	// bucket is 1 unit (a millionth of a token) further from 2 tokens than
	// 1750 ms refills; that waits 1751 ms and a max wait of 1750 denies.
	// At t1 it is allowed.
	edge := []string{"resv:{edge}"}
	g.step("drain edge", t0, edge, res(10, 0))
	sameDecision(t, "1 unit past max wait", g.step("unit past", t1-1, edge, res(2, 1750)), Decision{Reason: RateLimited, RetryAfterMS: 1751, Deciding: 0,
		Buckets: []Result{{Remaining: 0, Reason: RateLimited, RetryAfterMS: 1751, FullMS: 9751}}})
	sameDecision(t, "at max wait", g.step("at bound", t1, edge, res(2, 1750)), reserved(-2, 1750, 11_750))

	// 3.75 s on the bucket is at 0: a peek waits for nothing, a token
	// waits exactly a second.
	t2 := t1 + 3_750_000
	sameDecision(t, "peek at 0", g.step("peek", t2, k, res(0, 0)), Decision{Allowed: true, Deciding: -1,
		Buckets: []Result{{Remaining: 0, FullMS: 10_000}}})
	sameDecision(t, "1 at 0", g.step("one", t2, k, res(1, 1000)), reserved(-1, 1000, 11_000))
	g.expect("one reserved", key, State{Units: -1_000_000, Scale: 1_000_000, Last: t2}, true)
	refund("one refunded", t2, k, res(1, 1000), 1)
	g.expect("one refunded", key, State{Units: 0, Scale: 1_000_000, Last: t2}, true)
	// Later refunds re-time the state: 300 ms of refill plus the cost.
	refund("two refunded", t2+300_000, k, res(2, 5000), 1)
	g.expect("two refunded", key, State{Units: 2_300_000, Scale: 1_000_000, Last: t2 + 300_000}, true)
	// Past full: the key is deleted.
	refund("past full", t2+300_000, k, res(8, 5000), 1)
	g.expect("past full", key, State{}, false)
	// Nothing to refund: no key.
	refund("no key", t2+300_000, k, res(8, 5000), 0)

	// A twin: one bucket reserved then refunded, one never charged, both
	// drained at t0: the same units at the refund's time.
	a, b := "resv:{twin}:a", "resv:{twin}:b"
	g.step("drain a", t0, []string{a}, res(10, 0))
	g.step("drain b", t0, []string{b}, res(10, 0))
	g.step("reserve a", t1, []string{a}, res(3, 5000))
	g.expect("a reserved", a, State{Units: 250_000 - 3_000_000, Scale: 1_000_000, Last: t1}, true)
	t3 := t1 + 700_000
	refund("a refunded", t3, []string{a}, res(3, 5000), 1)
	twin, _ := g.stored(b)
	g.expect("a as if never charged", a, State{Units: refill(t3, s, twin), Scale: 1_000_000, Last: t3}, true)
	if st, _ := g.stored(a); st.Units != 950_000 {
		t.Errorf("a holds %d units, want 950000", st.Units)
	}
}

// TestReservationRequest: a request on several buckets. Decision.WaitMS is
// the longest reservation, each bucket's RetryAfterMS its own (0 for one
// that holds its cost); one bucket past its max wait denies the request
// and nothing is charged, a reservation included; quotas and concurrency
// limits never reserve, whatever their MaxWaitMS, and a request they deny
// charges no reserving bucket.
func TestReservationRequest(t *testing.T) {
	g := newExactRig(t)
	s := perSecond(t, 10)
	t0 := baseTime
	keys := []string{"rreq:{1}:a", "rreq:{1}:b", "rreq:{1}:c"}
	g.step("drain a", t0, keys[:1], []Take{{Spec: s, Cost: 10}})
	g.step("drain b", t0, keys[1:2], []Take{{Spec: s, Cost: 10}})
	take := func(ca, cb, cc, maxWait int64) []Take {
		return []Take{{Spec: s, Cost: ca, MaxWaitMS: maxWait}, {Spec: s, Cost: cb, MaxWaitMS: maxWait}, {Spec: s, Cost: cc, MaxWaitMS: maxWait}}
	}
	d := g.step("three", t0, keys, take(1, 3, 2, 5000))
	sameDecision(t, "longest wait", d, Decision{Allowed: true, Deciding: -1, WaitMS: 3000, Buckets: []Result{
		{Remaining: -1, RetryAfterMS: 1000, FullMS: 11_000},
		{Remaining: -3, RetryAfterMS: 3000, FullMS: 13_000},
		{Remaining: 8, FullMS: 2000},
	}})
	// b would wait 3000 + 3000 > 5000: denied; a (1000 + 1000) and c not charged.
	before := []State{g.model[keys[0]], g.model[keys[1]], g.model[keys[2]]}
	d = g.step("b past", t0, keys, take(1, 3, 2, 5000))
	sameDecision(t, "one past max wait", d, Decision{Reason: RateLimited, RetryAfterMS: 6000, Deciding: 1, Buckets: []Result{
		{Remaining: -1, RetryAfterMS: 2000, FullMS: 11_000},
		{Remaining: -3, Reason: RateLimited, RetryAfterMS: 6000, FullMS: 13_000},
		{Remaining: 8, FullMS: 2000},
	}})
	for i, k := range keys {
		g.expect("denied: "+k, k, before[i], true)
	}

	// A full quota with a max wait longer than its window's remainder:
	// denied (quotas never reserve), and the reserving bucket uncharged.
	end := us(t, "2026-06-01T00:00:00Z")
	now := end - 100_000 // 100 ms before the window ends
	w := WindowsAt(Day, time.UTC, time.UnixMicro(now))
	qk := []string{"rreq:{2}:a", "rreq:{2}:q"}
	g.step("drain", now, qk[:1], []Take{{Spec: s, Cost: 10}})
	g.step("fill quota", now, qk[1:], []Take{quotaTake(3, 3, w)})
	d = g.step("quota full", now, qk, []Take{{Spec: s, Cost: 1, MaxWaitMS: 5000}, {Spec: QuotaSpec(3), Cost: 1, Window: &w, MaxWaitMS: 60_000}})
	sameDecision(t, "quota denies", d, Decision{Reason: RateLimited, RetryAfterMS: 100, Deciding: 1, Buckets: []Result{
		{Remaining: 0, RetryAfterMS: 1000, FullMS: 10_000},
		{Remaining: 0, Reason: RateLimited, RetryAfterMS: 100, FullMS: 100},
	}})
	g.expect("bucket uncharged", qk[0], State{Units: 0, Scale: 1_000_000, Last: now}, true)
	if b := appendArgs(nil, quotaWithWait(QuotaSpec(3), &w))[0].(*argv); b.n != 72 {
		t.Errorf("a quota with MaxWaitMS sends %d bytes, want 72 (no max wait)", b.n)
	}

	// A full concurrency limit with a max wait: denied after 1000 ms as
	// always, and the bucket uncharged.
	ck := []string{"rreq:{3}:a", "rreq:{3}:c"}
	g.step("drain", now, ck[:1], []Take{{Spec: s, Cost: 10}})
	if d := takeAt(t, g.rdb, now, ck[1:], []Take{conc(1, 60_000, "holder")}); !d.Allowed {
		t.Fatalf("taking the slot: %+v", d)
	}
	cw := conc(1, 60_000, "q")
	cw.MaxWaitMS = 5000
	d = takeAt(t, g.rdb, now, ck, []Take{{Spec: s, Cost: 1, MaxWaitMS: 5000}, cw})
	sameDecision(t, "concurrency denies", d, Decision{Reason: RateLimited, RetryAfterMS: ConcurrencyRetryMS, Deciding: 1, Buckets: []Result{
		{Remaining: 0, RetryAfterMS: 1000, FullMS: 10_000},
		full,
	}})
	g.expect("bucket uncharged", ck[0], State{Units: 0, Scale: 1_000_000, Last: now}, true)
	if b := appendArgs(nil, []Take{cw})[0].(*argv); b.n != 40 {
		t.Errorf("a concurrency limit with MaxWaitMS sends %d bytes, want 40 (no max wait)", b.n)
	}
}

// quotaWithWait is one quota take with a MaxWaitMS.
func quotaWithWait(s Spec, w *Windows) []Take {
	return []Take{{Spec: s, Cost: 1, Window: w, MaxWaitMS: 60_000}}
}

// TestReservationLocal: the Local store decides reservations as the
// model does (it is the model), to the same exact values as Redis above.
func TestReservationLocal(t *testing.T) {
	now := baseTime
	l := NewLocal(10, func() time.Time { return time.UnixMicro(now) })
	ctx := context.Background()
	s := perSecond(t, 10)
	k := []string{"a"}
	if d, _ := l.Take(ctx, k, []Take{{Spec: s, Cost: 10}}); !d.Allowed {
		t.Fatalf("drain: %+v", d)
	}
	now += 250_000
	d, _ := l.Take(ctx, k, []Take{{Spec: s, Cost: 2, MaxWaitMS: 5000}})
	sameDecision(t, "first", d, reserved(-2, 1750, 11_750))
	d, _ = l.Take(ctx, k, []Take{{Spec: s, Cost: 2, MaxWaitMS: 5000}})
	sameDecision(t, "second", d, reserved(-4, 3750, 13_750))
	d, _ = l.Take(ctx, k, []Take{{Spec: s, Cost: 2, MaxWaitMS: 5000}})
	sameDecision(t, "third", d, Decision{Reason: RateLimited, RetryAfterMS: 5750, Deciding: 0,
		Buckets: []Result{{Remaining: -4, Reason: RateLimited, RetryAfterMS: 5750, FullMS: 13_750}}})
	if st, _ := l.lru.Peek("a"); st != (State{Units: -3_750_000, Scale: 1_000_000, Last: now}) {
		t.Errorf("local state %+v", st)
	}
}

// TestShardedReservation: on a three-master Redis Cluster (its real
// clock), with a request's buckets on two nodes. A reservation allowed
// across slots is charged (its wait is exactly the deficit over the
// refill), and Sharded.Refund, one call per slot, gives every bucket back
// exactly what it would hold had the request never come; a reservation
// in a group that allowed is refunded when the other group denies; a
// quota and a reservation on two slots are refunded together.
func TestShardedReservation(t *testing.T) {
	c := startShCluster(t)
	ctx := context.Background()
	two, ten := shSpec(t, 2), shSpec(t, 10) // 1/h: a token is 3_600_000 ms
	const hourMS = 3_600_000
	per := two.Refill * 1000 // units a millisecond

	t.Run("allowed_then_refunded", func(t *testing.T) {
		kA := c.keyer.Key("user", "resv", "")
		kB := c.keyOn(t, "ip", "resv", c.NodeOf(t, kA))
		c.take(t, []string{kA}, []Take{{Spec: two, Cost: 2}})
		drained := c.state(t, kA)
		takes := []Take{{Spec: two, Cost: 1, MaxWaitMS: 2 * hourMS}, {Spec: ten, Cost: 1}}
		d := c.take(t, []string{kA, kB}, takes)
		after := c.state(t, kA)
		// Charged at after.Last: what it held then (the refill since the
		// drain) less one token.
		if want := (after.Last-drained.Last)*two.Refill - two.Scale; after.Units != want || after.Scale != two.Scale {
			t.Fatalf("%s after the reservation: %+v, want %d units", kA, after, want)
		}
		wait := ceilDiv(-after.Units, per)
		if wait <= hourMS-1000 || wait > hourMS {
			t.Fatalf("wait %d ms, want just under an hour", wait)
		}
		sameDecision(t, "reservation across slots", d, Decision{Allowed: true, Deciding: -1, WaitMS: wait, Buckets: []Result{
			{Remaining: -1, RetryAfterMS: wait, FullMS: ceilDiv(two.CapacityUnits()-after.Units, per)},
			{Remaining: 9, FullMS: hourMS},
		}})
		n, err := c.store.Refund(ctx, []string{kA, kB}, takes)
		if err != nil || n != 2 {
			t.Fatalf("Refund: %d, %v; want 2", n, err)
		}
		back := c.state(t, kA)
		if back.Last < after.Last || back != (State{Units: refill(back.Last, two, drained), Scale: two.Scale, Last: back.Last}) {
			t.Errorf("%s after the refund: %+v, want the refill since the drain (%+v)", kA, back, drained)
		}
		if v := c.raw(t, kB); v != "" {
			t.Errorf("%s refunded to full still has a key", kB)
		}
	})

	t.Run("denied_on_the_other_slot", func(t *testing.T) {
		kA := c.keyer.Key("user", "resv2", "")
		kB := c.keyOn(t, "ip", "resv2", c.NodeOf(t, kA))
		one := shSpec(t, 1)
		c.take(t, []string{kA}, []Take{{Spec: two, Cost: 2}})
		c.take(t, []string{kB}, []Take{{Spec: one, Cost: 1}})
		drained, rawB := c.state(t, kA), c.raw(t, kB)
		// kB's wait (about an hour) is past its max wait of a minute.
		d := c.take(t, []string{kA, kB}, []Take{{Spec: two, Cost: 1, MaxWaitMS: 2 * hourMS}, {Spec: one, Cost: 1, MaxWaitMS: 60_000}})
		if d.Allowed || d.Reason != RateLimited || d.Deciding != 1 || d.WaitMS != 0 {
			t.Fatalf("denied by %s: %+v", kB, d)
		}
		if r := d.Buckets[0]; r.Reason != Allowed || r.RetryAfterMS <= hourMS-1000 || r.RetryAfterMS > hourMS || r.Remaining != 0 {
			t.Errorf("the reserving bucket's result %+v: want allowed with its wait, and 0 left after the refund", r)
		}
		back := c.state(t, kA)
		if back != (State{Units: refill(back.Last, two, drained), Scale: two.Scale, Last: back.Last}) {
			t.Errorf("%s after the refund: %+v, want the refill since the drain (%+v)", kA, back, drained)
		}
		if c.raw(t, kB) != rawB {
			t.Errorf("%s was written by a request it denied", kB)
		}
	})

	t.Run("quota_and_reservation_refunded", func(t *testing.T) {
		kQ := c.keyer.Key("user", "resvq", "quota")
		kA := c.keyOn(t, "ip", "resvq", c.NodeOf(t, kQ))
		tm, err := c.client.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		// Windows of a day around Redis's clock, far from their bounds.
		now := tm.UnixMicro()
		const day = 86_400_000_000
		w := Windows{now - day - day/2, now - day/2, now + day/2, now + day + day/2}
		c.take(t, []string{kA}, []Take{{Spec: two, Cost: 2}})
		drained := c.state(t, kA)
		takes := []Take{quotaTake(5, 3, w), {Spec: two, Cost: 1, MaxWaitMS: 2 * hourMS}}
		d := c.take(t, []string{kQ, kA}, takes)
		if !d.Allowed || d.Buckets[0].Remaining != 2 || d.Buckets[1].Remaining != -1 || d.WaitMS != d.Buckets[1].RetryAfterMS || d.WaitMS <= 0 {
			t.Fatalf("quota and reservation: %+v", d)
		}
		if st := c.state(t, kQ); st != (State{Units: 3, Scale: 1, Last: w[1]}) {
			t.Fatalf("quota %+v, want 3 used in its window", st)
		}
		n, err := c.store.Refund(ctx, []string{kQ, kA}, takes)
		if err != nil || n != 2 {
			t.Fatalf("Refund: %d, %v; want 2", n, err)
		}
		if st := c.state(t, kQ); st != (State{Units: 0, Scale: 1, Last: w[1]}) {
			t.Errorf("quota after the refund %+v, want 0 used", st)
		}
		back := c.state(t, kA)
		if back != (State{Units: refill(back.Last, two, drained), Scale: two.Scale, Last: back.Last}) {
			t.Errorf("%s after the refund: %+v, want the refill since the drain (%+v)", kA, back, drained)
		}
	})
}

// TestReservationSettleKeepsDebt: reservations can take a bucket deeper
// than minus one capacity (by what refills in max_wait); a settlement
// must not then forgive that debt. A bucket of 1 at 10/s (a token is 100
// ms) reserved ten times over is 10 tokens below zero; giving back 2
// tokens leaves it 8 below, and charging 1 more never raises it. The
// script (Redis.Settle, clock driven) and SettleState agree on it.
func TestReservationSettleKeepsDebt(t *testing.T) {
	g := newExactRig(t)
	ctx := context.Background()
	rate, err := ParseRate("10/s")
	if err != nil {
		t.Fatal(err)
	}
	s, err := Limit{Capacity: 1, Rate: rate}.Spec()
	if err != nil || s.Scale != 100_000 || s.Refill != 1 {
		t.Fatalf("10/s compiles to %+v (%v)", s, err)
	}
	const key = "resv:{debt}"
	now := baseTime
	g.step("drain", now, []string{key}, []Take{{Spec: s, Cost: 1}})
	for i := int64(1); i <= 10; i++ {
		sameDecision(t, "reservation", g.step("reserve", now, []string{key}, []Take{{Spec: s, Cost: 1, MaxWaitMS: 1000}}),
			reserved(-i, 100*i, 100*(i+1)))
	}
	g.expect("10 reserved", key, State{Units: -1_000_000, Scale: 100_000, Last: now}, true)
	store := Redis{Client: &drivenClock{rdb: g.rdb, now: now, persist: true}}
	for i, c := range []struct{ delta, want int64 }{
		{-2, -800_000}, // 2 tokens back: 8 below zero
		{1, -800_000},  // a charge: never fewer tokens than before... nor more
	} {
		before := g.model[key]
		if ok, err := store.Settle(ctx, fmt.Sprint("debt", i), []string{key}, []Adjust{{Spec: s, Delta: c.delta}}); err != nil || !ok {
			t.Fatalf("settle %+d: %v %v", c.delta, ok, err)
		}
		model, _ := SettleState(now, s, before, c.delta)
		if model.Units != c.want {
			t.Errorf("SettleState %+d from %d units: %d, want %d", c.delta, before.Units, model.Units, c.want)
		}
		g.expect(fmt.Sprintf("settle %+d", c.delta), key, State{Units: c.want, Scale: 100_000, Last: now}, true)
	}
	// The next token waits for the 8 owed and itself: 900 ms.
	sameDecision(t, "after the settlements", g.step("next", now, []string{key}, []Take{{Spec: s, Cost: 1, MaxWaitMS: 1000}}),
		reserved(-9, 900, 1000))
}
