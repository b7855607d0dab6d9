package bucket

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// randomSpec draws a limit of the kinds operators write: whole and decimal
// amounts over periods from a second to a day.
func randomSpec(t *testing.T, r *rand.Rand) Spec {
	amounts := []string{"1", "3", "10", "25", "60", "1000", "0.5", "0.17", "2.5", "7"}
	periods := []string{"s", "1s", "2s", "7s", "m", "1m", "90s", "h", "1h", "d", "500ms"}
	text := amounts[r.IntN(len(amounts))] + "/" + periods[r.IntN(len(periods))]
	rate, err := ParseRate(text)
	if err != nil {
		t.Fatalf("rate %q: %v", text, err)
	}
	capacity := []int64{1, 2, 5, 10, 60, 1500, 100000}[r.IntN(7)]
	spec, err := Limit{Capacity: capacity, Rate: rate}.Spec()
	if err != nil {
		t.Fatalf("capacity %d, rate %q: %v", capacity, text, err)
	}
	return spec
}

// TestLuaMatchesModel drives the Lua script in a real Redis and the Go model
// through the same random steps (several buckets, random costs including
// peeks and costs above capacity, random clock steps including a clock that
// moves backwards, limits that change under existing state, and takes that
// are at random shadow limits) and requires the same decision (ShadowDenied
// and each result's Shadow included) and the same stored state of every
// key, charged or not, at every step.
func TestLuaMatchesModel(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	seed := uint64(20261129)
	r := rand.New(rand.NewPCG(seed, seed))

	const nBuckets, steps = 4, 4000
	specs := make([]Spec, nBuckets)
	keys := make([]string, nBuckets)
	model := make(map[string]State)
	for i := range specs {
		specs[i] = randomSpec(t, r)
		keys[i] = fmt.Sprintf("rnd:{x}:%d", i)
	}
	now := baseTime
	allowed, denied := 0, 0
	shadowDeniedAllowed, shadowCharged := 0, 0
	for step := 0; step < steps; step++ {
		switch x := r.IntN(100); {
		case x < 40: // same microsecond: bursts
		case x < 90:
			now += r.Int64N(2_000_000)
		case x < 97:
			now += r.Int64N(3_600_000_000)
		default: // the Redis clock stepped back (a failover to a skewed replica)
			now -= r.Int64N(5_000_000)
		}
		if r.IntN(200) == 0 { // an operator changed a limit
			specs[r.IntN(nBuckets)] = randomSpec(t, r)
		}
		if r.IntN(20) == 0 { // a settlement: more tokens used than estimated, or fewer
			settleBoth(t, rdb, now, step, keys, specs, model, r)
		}
		// A request uses one to all buckets, in a random order.
		perm := r.Perm(nBuckets)[:1+r.IntN(nBuckets)]
		var ks []string
		var takes []Take
		for _, i := range perm {
			cost := r.Int64N(4)
			if r.IntN(10) == 0 {
				cost = r.Int64N(specs[i].Capacity + 2)
			}
			ks = append(ks, keys[i])
			// A quarter of the takes are shadow limits.
			takes = append(takes, Take{Spec: specs[i], Cost: cost, Shadow: r.IntN(4) == 0})
		}

		got, vals, pttls, err := stepAt(ctx, rdb, now, ks, takes)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		states := make([]State, len(ks))
		for j, k := range ks {
			st, ok := model[k]
			if !ok {
				st = takes[j].Spec.Full()
			}
			states[j] = st
		}
		charged := make([]bool, len(ks))
		want := Decide(now, takes, states, charged)
		for j, k := range ks {
			if charged[j] {
				model[k] = states[j]
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("step %d at %d: takes %+v\nlua   %+v\nmodel %+v", step, now, takes, got, want)
		}
		if want.Allowed {
			allowed++
		} else {
			denied++
		}
		for j, res := range want.Buckets {
			if !takes[j].Shadow {
				continue
			}
			switch {
			case res.Reason != Allowed && want.Allowed:
				shadowDeniedAllowed++
			case res.Reason == Allowed && want.Allowed && charged[j]:
				shadowCharged++
			}
		}
		for j, k := range ks {
			if !charged[j] {
				// Not charged: the key holds what it held (a shadow bucket
				// that denied an allowed request is not charged).
				wantVal := ""
				if st, ok := model[k]; ok {
					wantVal = EncodeState(st)
				}
				if vals[j] != wantVal {
					got, _ := DecodeState(vals[j])
					t.Fatalf("step %d: %s uncharged (shadow %v) but holds %+v, model %+v", step, k, takes[j].Shadow, got, model[k])
				}
				continue
			}
			st := model[k]
			if pttls[j] > want.Buckets[j].FullMS || pttls[j] < want.Buckets[j].FullMS-ttlSlackMS {
				t.Fatalf("step %d: %s PTTL %d ms, want %d", step, k, pttls[j], want.Buckets[j].FullMS)
			}
			if got, err := DecodeState(vals[j]); err != nil || got != st {
				t.Fatalf("step %d: %s holds %+v (%v), model %+v", step, k, got, err, st)
			}
		}
	}
	// The draw must exercise both outcomes heavily, or the test proves little.
	if allowed < steps/5 || denied < steps/5 {
		t.Fatalf("%d allowed, %d denied: the random steps do not exercise both outcomes", allowed, denied)
	}
	// So must the shadow limits: denying an allowed request, and charged.
	if shadowDeniedAllowed < steps/20 || shadowCharged < steps/20 {
		t.Fatalf("%d shadow denials of allowed requests, %d shadow charges: the random steps do not exercise shadow limits",
			shadowDeniedAllowed, shadowCharged)
	}
	t.Logf("%d steps: %d allowed, %d denied; shadow: %d denied an allowed request, %d charged",
		steps, allowed, denied, shadowDeniedAllowed, shadowCharged)
}

func TestParseRate(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"10/1m", "1/6s"}, {"25/s", "25/s"}, {"600/1h", "1/6s"}, {"0.5/s", "1/2s"}, {"3", "3/s"},
		{"0.17/s", "17/100s"}, {"10/m", "1/6s"}, {"1/d", "1/86400s"}, {"5/500ms", "10/s"},
		{"1/1h30m", "1/5400s"}, {"2.5e3/h", "25/36s"}, {"7/2d", "7/172800s"}, {" 10 / 1m ", "1/6s"},
	} {
		r, err := ParseRate(c.in)
		if err != nil || r.String() != c.want {
			t.Errorf("ParseRate(%q) = %v, %v; want %s", c.in, r, err, c.want)
		}
	}
	for _, in := range []string{"", "0", "-1", "0/s", "10/", "/s", "10/0s", "10/-1s", "NaN", "Inf", "inf/s", "1/NaN",
		"10/xyz", "abc", "1/2/3", "10/1q", "0x10", "1e400/s"} {
		if r, err := ParseRate(in); err == nil {
			t.Errorf("ParseRate(%q) = %v, want an error", in, r)
		}
	}
}

func TestRateFromFloatRoundTrips(t *testing.T) {
	for _, in := range []string{"10/1m", "0.17/s", "3/h", "1000/60s", "10/7s", "1/d", "25/s", "1/3s", "123456/1h"} {
		r, err := ParseRate(in)
		if err != nil {
			t.Fatal(err)
		}
		back, err := RateFromFloat(r.Float64())
		if err != nil || back != r {
			t.Errorf("%s: RateFromFloat(%v) = %v, %v; want %v", in, r.Float64(), back, err, r)
		}
	}
}

// TestSpecRejectsInexact: a capacity so large, at a rate so fine, that the
// units would pass 2^53 is a config error, not a silent rounding.
func TestSpecRejectsInexact(t *testing.T) {
	rate, _ := ParseRate("0.17/d")
	_, err := Limit{Capacity: 1_000_000_000, Rate: rate}.Spec()
	if err == nil || !strings.Contains(err.Error(), "2^53") {
		t.Fatalf("err = %v, want the 2^53 bound", err)
	}
	if _, err := (Limit{Capacity: 0, Rate: rate}).Spec(); err == nil {
		t.Fatal("capacity 0 accepted")
	}
}

// TestLimitChangedUnderState: when an operator lowers a capacity, or changes
// a rate (and so the scale) under existing state, the script and the model
// read the old state the same way: clamped to the new capacity, whole
// tokens kept, never a token granted that was not there.
func TestLimitChangedUnderState(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	spec := func(capacity int64, rate string) Spec {
		r, _ := ParseRate(rate)
		s, err := Limit{Capacity: capacity, Rate: r}.Spec()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	steps := []struct {
		spec      Spec
		cost      int64
		remaining int64
	}{
		{spec(100, "1/h"), 1, 99},  // 99 left
		{spec(10, "1/h"), 1, 9},    // capacity lowered: 10 held, 9 left
		{spec(10, "0.17/s"), 2, 7}, // new scale: 9 whole tokens, 7 left
		{spec(10, "0.17/s"), 0, 7}, // peek
		{spec(1000, "1/h"), 7, 0},  // capacity raised: no tokens appear
		{spec(1000, "1/h"), 1, 0},  // denied
	}
	model := State{}
	for i, s := range steps {
		if i == 0 {
			model = s.spec.Full()
		}
		takes := []Take{{Spec: s.spec, Cost: s.cost}}
		got, _, _, err := stepAt(ctx, rdb, baseTime, []string{"chg:{x}"}, takes)
		if err != nil {
			t.Fatal(err)
		}
		states, charged := []State{model}, []bool{false}
		want := Decide(baseTime, takes, states, charged)
		if charged[0] {
			model = states[0]
		}
		if fmt.Sprint(got) != fmt.Sprint(want) || got.Buckets[0].Remaining != s.remaining {
			t.Fatalf("step %d: lua %+v, model %+v, want remaining %d", i, got, want, s.remaining)
		}
	}
}

// settleBoth settles a random delta on one bucket in Redis (settle.lua, at
// the driven time) and in the model, and checks the stored states agree.
func settleBoth(t *testing.T, rdb *redis.Client, now int64, step int, keys []string, specs []Spec, model map[string]State, r *rand.Rand) {
	t.Helper()
	ctx := context.Background()
	i := r.IntN(len(keys))
	s := specs[i]
	delta := r.Int64N(6*s.Capacity+3) - 3*s.Capacity - 1 // past both bounds
	args := []any{"3600000", string(appendFloats(nil, s.CapacityUnits(), s.Refill, s.Scale, clampDelta(Adjust{Spec: s, Delta: delta}))),
		now / 1_000_000, now % 1_000_000}
	marker := fmt.Sprintf("rnd:{x}:settled:%d", step)
	if err := settleClock.Run(ctx, rdb, []string{marker, keys[i]}, args...).Err(); err != nil {
		t.Fatalf("step %d: settle: %v", step, err)
	}
	st, ok := model[keys[i]]
	if !ok {
		st = s.Full()
	}
	st, keep := SettleState(now, s, st, delta)
	v, err := rdb.Get(ctx, keys[i]).Result()
	switch {
	case !keep:
		delete(model, keys[i])
		if err != redis.Nil {
			t.Fatalf("step %d: settled bucket is full but its key holds %q (%v)", step, v, err)
		}
	default:
		model[keys[i]] = st
		got, derr := DecodeState(v)
		if err != nil || derr != nil || got != st {
			t.Fatalf("step %d: settle of %d: redis %+v (%v %v), model %+v", step, delta, got, err, derr, st)
		}
		rdb.Persist(ctx, keys[i])
	}
}

// settleClock is settle.lua with its clock driven by the last two ARGV.
var settleClock = redis.NewScript(strings.Replace(lua.SettleSource, lua.ClockLine,
	"local clock = {ARGV[#ARGV - 1], ARGV[#ARGV]}", 1))

// reserveSpec draws a limit that refills within seconds to hours, often
// fast enough for a reservation of at most a minute, sometimes not.
func reserveSpec(t *testing.T, r *rand.Rand) Spec {
	rates := []string{"1/s", "10/s", "5/500ms", "2.5/s", "0.5/s", "60/m", "7/2s", "0.17/s", "1/m", "1/h"}
	text := rates[r.IntN(len(rates))]
	rate, err := ParseRate(text)
	if err != nil {
		t.Fatalf("rate %q: %v", text, err)
	}
	capacity := []int64{1, 2, 5, 10}[r.IntN(4)]
	spec, err := Limit{Capacity: capacity, Rate: rate}.Spec()
	if err != nil {
		t.Fatalf("capacity %d, rate %q: %v", capacity, text, err)
	}
	return spec
}

// TestLuaMatchesModelQuotaReserve drives the Lua scripts in a real Redis,
// the Go model and the Local store through the same random steps with
// calendar quotas (a UTC day, a New York day, a New York week and a
// Berlin month, of random amounts that an operator changes now and then)
// and token buckets taken with reservations (random MaxWaitMS, shadow at
// random, quotas given a MaxWaitMS too, which they must ignore). Each of
// seven episodes starts a few hours before a month's end, a leap day or a
// daylight-saving change, with fresh keys; the clock moves by
// microseconds to days, jumps to a millisecond either side of a window's
// end, and steps back; the gateway that computes the windows has a clock
// off by up to two hours, and now and then by up to 40 days (Redis's
// clock outside its windows). Between requests come settlements
// (Redis.Settle) of quotas, in a random window, and of buckets, and
// refunds (Redis.Refund) of random takes; these run the production
// scripts with the clock driven, and PERSIST what they write so that no
// TTL lapses in real time. At every step the decision (WaitMS,
// ShadowDenied and each result's Shadow included) and the stored state of
// every key agree, a charged key is written with a TTL of exactly its
// FullMS (pxProbe) and an uncharged one not at all, and the Local store
// decides and stores the same.
func TestLuaMatchesModelQuotaReserve(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	seed := uint64(20261201)
	r := rand.New(rand.NewPCG(seed, seed))
	clock := &drivenClock{rdb: rdb, persist: true}
	store := Redis{Client: clock}
	local := NewLocal(1000, func() time.Time { return time.UnixMicro(clock.now) })
	ny, berlin := zone(t, "America/New_York"), zone(t, "Europe/Berlin")

	type quota struct {
		p      Period
		loc    *time.Location
		amount int64
	}
	amounts := []int64{1, 3, 10, 100, 1000}
	episodes := []string{
		"2026-01-31T20:00:00Z",      // January's end, February of 28 days
		"2026-03-07T18:00:00-05:00", // New York's 23-hour day
		"2026-03-28T18:00:00+01:00", // Berlin's change, in its March of 743 hours
		"2026-10-24T18:00:00+02:00", // Berlin's change, in its October of 745 hours
		"2026-10-31T18:00:00-04:00", // New York's 25-hour day, the 169-hour week
		"2027-12-31T18:00:00Z",      // a new year
		"2028-02-28T18:00:00Z",      // a leap day
	}
	const stepsPer = 800
	var allowed, denied, quotaCharged, quotaDenied, quotaNewWindow, quotaOver int
	var reservations, reservationsDenied, refunded, quotaSettled, quotaSettleSkipped, quotaDST, quotaOutside int
	step := 0
	for e, start := range episodes {
		quotas := []quota{{Day, time.UTC, 0}, {Day, ny, 0}, {Week, ny, 0}, {Month, berlin, 0}}
		for i := range quotas {
			quotas[i].amount = amounts[r.IntN(len(amounts))]
		}
		specs := []Spec{reserveSpec(t, r), reserveSpec(t, r)}
		var keys []string
		for i := 0; i < len(specs)+len(quotas); i++ {
			keys = append(keys, fmt.Sprintf("rq:{x}:%d:%d", e, i))
		}
		model := map[string]State{}
		syncLocal := func(ks ...string) {
			for _, k := range ks {
				if st, ok := model[k]; ok {
					local.lru.Add(k, st)
				} else {
					local.lru.Remove(k)
				}
			}
		}
		// checkKeys requires every key in ks to hold the model's state.
		checkKeys := func(where string, ks []string) {
			t.Helper()
			for _, k := range ks {
				v, err := rdb.Get(ctx, k).Result()
				if err != nil && err != redis.Nil {
					t.Fatal(err)
				}
				wantVal := ""
				if st, ok := model[k]; ok {
					wantVal = EncodeState(st)
				}
				if v != wantVal {
					got, _ := DecodeState(v)
					t.Fatalf("%s: %s holds %+v, model %+v", where, k, got, model[k])
				}
			}
		}
		now := instant(t, start).UnixMicro()
		for n := 0; n < stepsPer; n, step = n+1, step+1 {
			switch x := r.IntN(100); {
			case x < 25: // same microsecond
			case x < 65:
				now += r.Int64N(300_000)
			case x < 75:
				now += r.Int64N(5_000_000)
			case x < 80:
				now += r.Int64N(3_600_000_000)
			case x < 84:
				now += r.Int64N(2 * 86_400_000_000)
			case x < 96: // a millisecond either side of a window's end
				q := quotas[r.IntN(len(quotas))]
				w := WindowsAt(q.p, q.loc, time.UnixMicro(now))
				now = w[2] + r.Int64N(2001) - 1000
			case x < 99: // the Redis clock stepped back
				now -= r.Int64N(5_000_000)
			default: // far back, across a window's start
				now -= r.Int64N(3_600_000_000)
			}
			if r.IntN(200) == 0 {
				specs[r.IntN(len(specs))] = reserveSpec(t, r)
			}
			if r.IntN(200) == 0 {
				quotas[r.IntN(len(quotas))].amount = amounts[r.IntN(len(amounts))]
			}
			gw := now
			switch x := r.IntN(10); {
			case x >= 9 && r.IntN(5) == 0: // off by up to 40 days: Redis's clock outside the windows
				gw += r.Int64N(80*86_400_000_001) - 40*86_400_000_000
			case x >= 9:
				gw += r.Int64N(4*3_600_000_001) - 2*3_600_000_000
			case x >= 7:
				gw += r.Int64N(2_000_001) - 1_000_000
			}
			clock.now = now
			where := fmt.Sprintf("episode %d step %d at %s (gateway %s)", e, n,
				time.UnixMicro(now).UTC().Format(time.RFC3339Nano), time.UnixMicro(gw).UTC().Format(time.RFC3339Nano))

			// A request's takes on a random subset of the keys.
			draw := func() ([]string, []Take) {
				var ks []string
				var takes []Take
				for _, i := range r.Perm(len(keys))[:1+r.IntN(len(keys))] {
					var tk Take
					if i < len(specs) {
						s := specs[i]
						tk = Take{Spec: s, Cost: r.Int64N(min(s.Capacity, 3) + 1)}
						if x := r.IntN(10); x < 4 {
							tk.Cost = r.Int64N(s.Capacity + 1)
						} else if x == 4 {
							tk.Cost = r.Int64N(s.Capacity + 2)
						}
						switch x := r.IntN(10); {
						case x < 4:
						case x < 6:
							tk.MaxWaitMS = []int64{1, 100, 1000, 10_000, 60_000}[r.IntN(5)]
						default:
							tk.MaxWaitMS = 1 + r.Int64N(60_000)
						}
					} else {
						q := quotas[i-len(specs)]
						w := WindowsAt(q.p, q.loc, time.UnixMicro(gw))
						tk = Take{Spec: QuotaSpec(q.amount), Cost: r.Int64N(min(q.amount, 3) + 1), Window: &w}
						if r.IntN(10) == 0 {
							tk.Cost = r.Int64N(q.amount + 2)
						}
						if r.IntN(5) == 0 {
							tk.MaxWaitMS = 1 + r.Int64N(100_000_000)
						}
					}
					tk.Shadow = r.IntN(6) == 0
					ks, takes = append(ks, keys[i]), append(takes, tk)
				}
				return ks, takes
			}

			switch op := r.IntN(100); {
			case op < 4: // a quota's settlement, in a random window
				i := r.IntN(len(quotas))
				q, k := quotas[i], keys[len(specs)+i]
				st, ok := model[k]
				w := WindowsAt(q.p, q.loc, time.UnixMicro(gw))
				wi := r.IntN(3)
				if ok && r.IntN(3) != 0 {
					if j := slices.Index(w[:3], st.Last); j >= 0 {
						wi = j
					}
				}
				window, end := w[wi], w[wi+1]
				adj := Adjust{Spec: QuotaSpec(q.amount), Delta: r.Int64N(6*q.amount+3) - 3*q.amount - 1, Window: window, WindowEnd: end}
				settled, err := store.Settle(ctx, fmt.Sprint("q", step), []string{k}, []Adjust{adj})
				if err != nil || !settled {
					t.Fatalf("%s: settle: %v %v", where, settled, err)
				}
				if (!ok || st.Last < window) && adj.Delta > 0 && now < end {
					// Nothing counted in the window yet: the charge starts it.
					st, ok = State{Scale: 1, Last: window}, true
				}
				if ok && st.Last == window {
					st.Units = max(0, min(st.Units+clampDelta(adj), 2*q.amount))
					model[k] = st
					quotaSettled++
				} else {
					quotaSettleSkipped++
				}
				checkKeys(where+": quota settlement", []string{k})
				syncLocal(k)
				continue
			case op < 8: // a token bucket's settlement
				i := r.IntN(len(specs))
				s, k := specs[i], keys[i]
				delta := r.Int64N(6*s.Capacity+3) - 3*s.Capacity - 1 // past both bounds
				settled, err := store.Settle(ctx, fmt.Sprint("b", step), []string{k}, []Adjust{{Spec: s, Delta: delta}})
				if err != nil || !settled {
					t.Fatalf("%s: settle: %v %v", where, settled, err)
				}
				st, ok := model[k]
				if !ok {
					st = s.Full()
				}
				if st, keep := SettleState(now, s, st, delta); keep {
					model[k] = st
				} else {
					delete(model, k)
				}
				checkKeys(where+": bucket settlement", []string{k})
				syncLocal(k)
				continue
			case op < 15: // a refund
				ks, takes := draw()
				got, err := store.Refund(ctx, ks, takes)
				if err != nil {
					t.Fatalf("%s: refund: %v", where, err)
				}
				var want int64
				for j, k := range ks {
					tk := takes[j]
					st, ok := model[k]
					if !ok || tk.Cost == 0 {
						continue
					}
					if tk.Window != nil {
						if start, _ := tk.Window.At(now); st.Last == start {
							st.Units = max(0, st.Units-tk.costUnits())
							model[k] = st
							want++
						}
						continue
					}
					u := min(refill(now, tk.Spec, st)+tk.costUnits(), tk.Spec.CapacityUnits())
					if u >= tk.Spec.CapacityUnits() {
						delete(model, k)
					} else {
						model[k] = State{Units: u, Scale: tk.Spec.Scale, Last: max(now, st.Last)}
					}
					want++
				}
				if got != want {
					t.Fatalf("%s: refund of %+v: %d refunded, model %d", where, takes, got, want)
				}
				refunded += int(want)
				checkKeys(where+": refund", ks)
				syncLocal(ks...)
				continue
			}

			ks, takes := draw()
			got, vals, px, err := stepPX(ctx, rdb, now, ks, takes)
			if err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			states := make([]State, len(ks))
			prior := make([]State, len(ks))
			had := make([]bool, len(ks))
			for j, k := range ks {
				st, ok := model[k]
				if !ok {
					st = takes[j].Spec.Full()
				}
				states[j], prior[j], had[j] = st, st, ok
			}
			charged := make([]bool, len(ks))
			want := Decide(now, takes, states, charged)
			for j, k := range ks {
				if charged[j] {
					model[k] = states[j]
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("%s: takes %+v\nlua   %+v\nmodel %+v", where, takes, got, want)
			}
			loc, err := local.Take(ctx, ks, takes)
			if err != nil || fmt.Sprint(loc) != fmt.Sprint(want) {
				t.Fatalf("%s: takes %+v\nlocal %+v (%v)\nmodel %+v", where, takes, loc, err, want)
			}
			for j, k := range ks {
				wantVal := ""
				if st, ok := model[k]; ok {
					wantVal = EncodeState(st)
				}
				if vals[j] != wantVal {
					st, _ := DecodeState(vals[j])
					t.Fatalf("%s: %s (charged %v) holds %+v, model %+v", where, k, charged[j], st, model[k])
				}
				if st, ok := local.lru.Peek(k); ok != (wantVal != "") || (ok && st != model[k]) {
					t.Fatalf("%s: local %s holds %+v (%v), model %+v", where, k, st, ok, model[k])
				}
				checkPX(t, where, k, charged[j], px[j], want.Buckets[j].FullMS)
			}
			if want.Allowed {
				allowed++
			} else {
				denied++
			}
			for j, res := range want.Buckets {
				tk := takes[j]
				if tk.Window != nil && (now < tk.Window[0] || now >= tk.Window[3]) {
					quotaOutside++
				}
				switch {
				case tk.Window != nil && charged[j]:
					quotaCharged++
					start, end := tk.Window.At(now)
					if had[j] && prior[j].Last != start {
						quotaNewWindow++
					}
					if (end-start)%86_400_000_000 != 0 {
						quotaDST++ // a 23- or 25-hour day, a 167- or 169-hour week, ...
					}
				case tk.Window != nil && res.Reason == RateLimited:
					quotaDenied++
					if res.Remaining < 0 {
						quotaOver++
					}
				case tk.Window == nil && charged[j] && res.RetryAfterMS > 0:
					reservations++
				case tk.Window == nil && tk.MaxWaitMS > 0 && res.Reason == RateLimited:
					reservationsDenied++
				}
			}
		}
	}
	t.Logf("%d steps: %d allowed, %d denied; quotas: %d charged (%d in a new window, %d in a window with a daylight-saving change), %d denied (%d over the amount), %d outside the windows, %d settled, %d settlements skipped; %d reservations, %d denied past max wait; %d refunded",
		step, allowed, denied, quotaCharged, quotaNewWindow, quotaDST, quotaDenied, quotaOver, quotaOutside, quotaSettled, quotaSettleSkipped, reservations, reservationsDenied, refunded)
	// The draw must exercise every path, or the test proves little.
	for _, c := range []struct {
		what     string
		got, min int
	}{
		{"allowed requests", allowed, step / 5}, {"denied requests", denied, step / 10},
		{"quota charges", quotaCharged, step / 10}, {"quota charges in a new window", quotaNewWindow, step / 100},
		{"quota charges in a window with a daylight-saving change", quotaDST, step / 50},
		{"quota denials", quotaDenied, step / 20}, {"quotas over their amount", quotaOver, 10},
		{"quota takes outside the windows", quotaOutside, 20},
		{"quota settlements", quotaSettled, 20}, {"skipped quota settlements", quotaSettleSkipped, 20},
		{"reservations", reservations, step / 40}, {"reservations past max wait", reservationsDenied, step / 50},
		{"refunds", refunded, step / 20},
	} {
		if c.got < c.min {
			t.Errorf("%d %s, want at least %d: the random steps do not exercise them", c.got, c.what, c.min)
		}
	}
}
