package bucket

import (
	"context"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// batchClock is lua.Batch with the clock driven by the test (the last two
// ARGV, as takeClock's).
var batchClock = redis.NewScript(drive(lua.BatchSource))

// TestBatchMatchesTokenBucket drives lua.Batch and lua.TokenBucket through
// the same random rounds: each round, several requests at one clock reading
// (most of them sharing a key, which lua.Batch then reads and writes once)
// (token buckets with random costs, shadow limits and reservations, calendar
// quotas, concurrency slots with leases, limits that change under existing
// state, a clock that steps back), decided one by one with lua.TokenBucket
// on one set of keys and in one lua.Batch call, built by mergeDecisions,
// on a copy. Each request must get the same reply, and the two sets of keys
// must hold the same state after every round.
func TestBatchMatchesTokenBucket(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	for _, s := range []*redis.Script{takeClock, batchClock} {
		if err := s.Load(ctx, rdb).Err(); err != nil {
			t.Fatal(err)
		}
	}
	seed := uint64(20261201)
	r := rand.New(rand.NewPCG(seed, seed))
	names := []string{"tb0", "tb1", "tb2", "tb3", "q0", "q1", "c0", "c1"}
	specs := map[string]Spec{"q0": QuotaSpec(3), "q1": QuotaSpec(10), "c0": ConcurrencySpec(1), "c1": ConcurrencySpec(3)}
	for _, n := range names[:4] {
		specs[n] = slowSpec(t, r)
	}
	key := func(set, name string) string { return "m" + set + ":{x}:" + name }

	const rounds = 400
	const window = 10_000_000 // µs: the quotas' windows are 10 s long, now in the middle of one
	now := baseTime
	var count struct {
		allowed, denied, reserved, shadowDenied, quotaDenied, slotDenied int
		merged, repeated                                                 int // lua.Batch calls, those with a key repeated
	}
	for round := range rounds {
		switch x := r.IntN(100); {
		case x < 40: // the same microsecond
		case x < 90:
			now += r.Int64N(2_000_000)
		case x < 95:
			now += r.Int64N(60_000_000)
		case x < 97:
			now += r.Int64N(3_600_000_000)
		default: // the clock stepped back
			now -= r.Int64N(5_000_000)
		}
		if r.IntN(50) == 0 { // an operator changed a limit
			specs[names[r.IntN(4)]] = slowSpec(t, r)
		}
		// Windows around now, so that a quota's TTL (to its window's end)
		// is 5 s; a window is new when now moved.
		w := Windows{now - 3*window/2, now - window/2, now + window/2, now + 3*window/2}

		n := 1 + r.IntN(8)
		type request struct {
			names []string
			takes []Take
		}
		reqs := make([]request, n)
		for i := range reqs {
			lease := fmt.Sprintf("r%d-%d", round, i)
			for _, j := range r.Perm(len(names))[:1+r.IntN(4)] {
				name := names[j]
				take := Take{Spec: specs[name], Cost: r.Int64N(4), Shadow: r.IntN(5) == 0}
				switch name[0] {
				case 't':
					if r.IntN(10) == 0 {
						take.Cost = r.Int64N(take.Spec.Capacity + 2)
					}
					if !take.Shadow && r.IntN(3) == 0 {
						take.MaxWaitMS = 1 + r.Int64N(600_000)
					}
				case 'q':
					take.Window = &w
				case 'c':
					take.Cost = r.Int64N(2)
					take.Lease = []int64{1000, 60_000}[r.IntN(2)]
					take.LeaseID = lease
				}
				reqs[i].names = append(reqs[i].names, name)
				reqs[i].takes = append(reqs[i].takes, take)
			}
		}

		// One by one, on set a. ttls holds the TTL (ms) that the round's
		// last write of each bucket or quota set.
		want := make([]any, n)
		ttls := map[string]int64{}
		for i, q := range reqs {
			keys := make([]string, len(q.names))
			for j, name := range q.names {
				keys[j] = key("a", name)
			}
			args := append(appendArgs(nil, q.takes), now/1_000_000, now%1_000_000)
			v, err := takeClock.Run(ctx, rdb, keys, args...).Result()
			if err != nil {
				t.Fatalf("round %d, request %d: %v", round, i, err)
			}
			want[i] = v
			// Redis's clock stands still inside the one lua.Batch call, so
			// nothing expires between its requests; between these calls
			// a short TTL could lapse in real time.
			for j, k := range keys {
				if ms := pttl(t, rdb, k); ms >= 0 && q.takes[j].Lease == 0 {
					ttls[q.names[j]] = ms
				}
				if err := rdb.Persist(ctx, k).Err(); err != nil {
					t.Fatal(err)
				}
			}
			d, err := ParseReply(int64s(t, v), q.takes)
			if err != nil {
				t.Fatalf("round %d, request %d: %v", round, i, err)
			}
			switch {
			case d.Allowed && d.WaitMS > 0:
				count.reserved++
			case d.Allowed:
				count.allowed++
			default:
				count.denied++
			}
			for j, b := range d.Buckets {
				switch {
				case b.Reason == Allowed:
				case b.Shadow:
					count.shadowDenied++
				case q.takes[j].Window != nil:
					count.quotaDenied++
				case q.takes[j].Lease > 0:
					count.slotDenied++
				}
			}
		}

		// In one lua.Batch call, on set b.
		cmds := make([]redis.Cmder, n)
		calls := make([]*batchCmd, n)
		for i, q := range reqs {
			keys := make([]string, len(q.names))
			for j, name := range q.names {
				keys[j] = key("b", name)
			}
			calls[i] = newBatchCmd(ctx, "evalsha", lua.TokenBucket.Hash(), keys, appendArgs(nil, q.takes))
			cmds[i] = calls[i]
		}
		if n == 1 {
			// A batch of one call is sent as it is.
			if m := mergeDecisions(ctx, cmds); m != nil {
				t.Fatalf("round %d: one call merged", round)
			}
			args := append(calls[0].Args(), now/1_000_000, now%1_000_000)
			args[1] = takeClock.Hash()
			one := redis.NewCmd(ctx, args...)
			_ = rdb.Process(ctx, one)
			calls[0].SetVal(one.Val())
			calls[0].SetErr(one.Err())
		} else {
			m := mergeDecisions(ctx, cmds)
			if m == nil || len(m.calls) != n || len(m.cmds) != 1 {
				t.Fatalf("round %d: %d calls not merged into one", round, n)
			}
			args := append(m.call.Args(), now/1_000_000, now%1_000_000)
			args[1] = batchClock.Hash()
			if heads := args[3+args[2].(int)].([]byte); heads[0] == 1 {
				count.repeated++
			}
			m.call = &batchCmd{Cmd: redis.NewCmd(ctx, args...)}
			_ = rdb.Process(ctx, m.call)
			m.answer()
			count.merged++
		}
		for i, c := range calls {
			got, err := c.Result()
			if err != nil || !reflect.DeepEqual(got, want[i]) {
				t.Fatalf("round %d, request %d of %d (%v): lua.Batch replied %v, %v; lua.TokenBucket %v",
					round, i, n, reqs[i].names, got, err, want[i])
			}
		}

		// The same TTLs: lua.Batch writes a key once, with the TTL of its
		// last write one by one (real time ran on between the calls).
		for _, name := range names[:6] {
			got := pttl(t, rdb, key("b", name))
			if ms, set := ttls[name]; (set && (got < 0 || got > ms+ttlSlackMS || got < ms-ttlSlackMS)) || (!set && got >= 0) {
				t.Fatalf("round %d: %s expires in %d ms batched; one by one %d ms (set %v)", round, name, got, ms, set)
			}
		}

		// The same state, kept: keys expire in real time while the test
		// drives the scripts' clock.
		for _, name := range names {
			a, b := keyState(t, rdb, key("a", name)), keyState(t, rdb, key("b", name))
			if a != b {
				t.Fatalf("round %d: %s holds %q one by one, %q batched", round, name, a, b)
			}
			for _, set := range []string{"a", "b"} {
				if err := rdb.Persist(ctx, key(set, name)).Err(); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	t.Logf("%+v", count)
	if count.allowed < 100 || count.denied < 100 || count.reserved < 10 || count.shadowDenied < 10 ||
		count.quotaDenied < 10 || count.slotDenied < 10 || count.merged < rounds*3/4 ||
		count.repeated < count.merged/2 || count.merged-count.repeated < 10 {
		t.Errorf("too few of an outcome to compare: %+v", count)
	}
}

// pttl is key's PTTL in milliseconds: -1 without a TTL, -2 when missing.
func pttl(t *testing.T, rdb *redis.Client, key string) int64 {
	t.Helper()
	ms, err := rdb.Do(context.Background(), "PTTL", key).Int64()
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

// slowSpec is a random token bucket that refills at most 10 tokens a
// minute: a charged bucket's TTL, the time until it is full again, is at
// least 6 s, so no key expires in real time during a round (the rounds
// take milliseconds; keys are persisted between them), while the test's
// clock jumps seconds to hours.
func slowSpec(t *testing.T, r *rand.Rand) Spec {
	amounts := []string{"1", "3", "10", "0.5", "0.17"}
	periods := []string{"m", "90s", "h", "d"}
	rate, err := ParseRate(amounts[r.IntN(len(amounts))] + "/" + periods[r.IntN(len(periods))])
	if err != nil {
		t.Fatal(err)
	}
	spec, err := Limit{Capacity: []int64{1, 2, 5, 10, 60, 1500}[r.IntN(6)], Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// int64s is a script reply as integers.
func int64s(t *testing.T, v any) []int64 {
	t.Helper()
	vals, err := redis.NewCmdResult(v, nil).Int64Slice()
	if err != nil {
		t.Fatalf("reply %v: %v", v, err)
	}
	return vals
}

// keyState is what key holds, as text: its type and value (a sorted set's
// members and scores).
func keyState(t *testing.T, rdb *redis.Client, key string) string {
	t.Helper()
	ctx := context.Background()
	typ, err := rdb.Type(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	switch typ {
	case "none":
		return typ
	case "string":
		v, err := rdb.Get(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%s %x", typ, v)
	case "zset":
		zs, err := rdb.ZRangeWithScores(ctx, key, 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%s %v", typ, zs)
	}
	t.Fatalf("%s is a %s", key, typ)
	return ""
}

// TestBatchedMergedFailsAlone: in a merged batch, a call whose bucket holds
// a malformed state, or whose key is of another type, gets the error
// lua.TokenBucket would give it alone and changes nothing; the calls before
// and after it are decided and charged once.
func TestBatchedMergedFailsAlone(t *testing.T) {
	e := newBTEnv(t, 5*time.Second, BatchOptions{})
	ctx := context.Background()
	if err := e.admin.Set(ctx, e.key("malformed"), "not a bucket", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.admin.HSet(ctx, e.key("hash"), "f", "v").Err(); err != nil {
		t.Fatal(err)
	}
	args := appendArgs(nil, []Take{{Spec: e.spec, Cost: 1}})
	call := func(name string) *batchCmd {
		return newBatchCmd(ctx, "evalsha", lua.TokenBucket.Hash(), []string{e.key(name)}, args)
	}
	// What lua.TokenBucket replies to each alone.
	wantErr := map[string]string{}
	for _, name := range []string{"malformed", "hash"} {
		_, err := e.store.Take(ctx, []string{e.key(name)}, []Take{{Spec: e.spec, Cost: 1}})
		if err == nil {
			t.Fatalf("%s alone: no error", name)
		}
		wantErr[name] = err.Error()
	}
	e.sent.reset()
	order := []string{"first", "malformed", "middle", "hash", "last"}
	calls := make([]*batchCmd, len(order))
	pipe := e.client.Pipeline()
	for i, name := range order {
		calls[i] = call(name)
		_ = pipe.Process(ctx, calls[i])
	}
	_, _ = pipe.Exec(ctx)
	if m := e.sent.mergedCalls(); m != 1 {
		t.Fatalf("sent %d lua.Batch calls, want 1", m)
	}
	for i, name := range order {
		c := calls[i]
		if msg, bad := wantErr[name]; bad {
			// Redis names the script that failed; the rest is the same.
			if err := c.Err(); err == nil || !strings.Contains(msg, firstLine(err.Error())) {
				t.Errorf("%s: %v; want the error it gets alone, %q", name, err, msg)
			}
			continue
		}
		if vals, err := c.Int64Slice(); err != nil || len(vals) != 3 || vals[0] != btCapacity-1 || e.charges(t, name) != 1 {
			t.Errorf("%s: %v, %v, charged %d; want %d left, charged once", name, vals, err, e.charges(t, name), btCapacity-1)
		}
	}
	if v, err := e.admin.Get(ctx, e.key("malformed")).Result(); err != nil || v != "not a bucket" {
		t.Errorf("the malformed state became %q, %v", v, err)
	}
	if v, err := e.admin.HGetAll(ctx, e.key("hash")).Result(); err != nil || !reflect.DeepEqual(v, map[string]string{"f": "v"}) {
		t.Errorf("the hash became %v, %v", v, err)
	}
}

// firstLine is an error text up to the script's location that Redis adds
// (" script: ..."), if any.
func firstLine(s string) string {
	s, _, _ = strings.Cut(s, " script:")
	return s
}

// TestMergeable: lua.Batch carries EVALSHA calls of lua.TokenBucket with 1
// to 127 buckets and at most a lease id after their parameters; any other
// call stays a command of its own, in its place, and fewer than two calls
// are not merged.
func TestMergeable(t *testing.T) {
	ctx := context.Background()
	spec := Spec{Capacity: 10, Refill: 1, Scale: 1}
	tb := func(n int, lease bool) *batchCmd {
		keys := make([]string, n)
		takes := make([]Take, n)
		for i := range keys {
			keys[i], takes[i] = fmt.Sprint("k", i), Take{Spec: spec, Cost: 1}
		}
		if lease {
			takes[0] = Take{Spec: ConcurrencySpec(1), Cost: 1, Lease: 1000, LeaseID: "id"}
		}
		return newBatchCmd(ctx, "evalsha", lua.TokenBucket.Hash(), keys, appendArgs(nil, takes))
	}
	for _, c := range []struct {
		name string
		cmd  redis.Cmder
		want bool
	}{
		{"one bucket", tb(1, false), true},
		{"127 buckets", tb(127, false), true},
		{"a lease id", tb(3, true), true},
		{"128 buckets", tb(128, false), false},
		{"EVAL", newBatchCmd(ctx, "eval", lua.Source, []string{"k"}, []any{"x"}), false},
		{"another script", newBatchCmd(ctx, "evalsha", lua.Settle.Hash(), []string{"k", "l"}, []any{"1", "x"}), false},
		{"two arguments more", newBatchCmd(ctx, "evalsha", lua.TokenBucket.Hash(), []string{"k"}, []any{"x", "y", "z"}), false},
		{"not a batch call", redis.NewCmd(ctx, "evalsha", lua.TokenBucket.Hash(), 1, "k", "x"), false},
	} {
		if _, _, ok := mergeable(c.cmd); ok != c.want {
			t.Errorf("%s: mergeable %v, want %v", c.name, ok, c.want)
		}
	}

	ping := redis.NewStatusCmd(ctx, "ping")
	a, b, big := tb(2, false), tb(1, true), tb(128, false)
	if m := mergeDecisions(ctx, []redis.Cmder{ping, a, big}); m != nil {
		t.Errorf("one mergeable call merged: %v", m.call.Args())
	}
	m := mergeDecisions(ctx, []redis.Cmder{ping, a, big, b})
	if m == nil || len(m.calls) != 2 || m.calls[0] != a || m.calls[1] != b {
		t.Fatalf("merged %+v, want a and b", m)
	}
	if len(m.cmds) != 3 || m.cmds[0] != ping || m.cmds[1] != m.call || m.cmds[2] != big {
		t.Errorf("sent %v, want ping, the merged call in a's place, then the call of 128 buckets", m.cmds)
	}
	// EVALSHA sha 3 a's keys, b's key, flags (k0 twice: 1) and heads, a's
	// parameters, b's parameters and lease id.
	args := m.call.Args()
	want := []any{"evalsha", lua.Batch.Hash(), 3, "k0", "k1", "k0", []byte{1, 2, 1 | 128}}
	if !reflect.DeepEqual(args[:7], want) || len(args) != 7+2+2 || args[len(args)-1] != "id" {
		t.Errorf("merged call %v, want %v, then 3 parameters and the lease id", args, want)
	}
}
