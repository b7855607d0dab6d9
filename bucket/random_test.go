package bucket

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

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
