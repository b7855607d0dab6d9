package bucket

import (
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// TestSettleDebtFloorsAtMinusCapacity: a settlement moves a bucket by the
// whole difference, floored at minus one capacity and capped at full. A
// request that used 50 times the capacity leaves its bucket at exactly
// minus one capacity, not "one capacity below where it was" (the charge
// used to be clamped to one capacity before the floor was applied, so such
// a request left the bucket barely below zero).
func TestSettleDebtFloorsAtMinusCapacity(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	rate, err := ParseRate("1/1h")
	if err != nil {
		t.Fatal(err)
	}
	spec, err := Limit{Capacity: 1000, Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	store := Redis{Client: rdb}
	key := NewKeyer("rl:", "").Key("user", "bob", "tokens")
	if d, err := store.Take(ctx, []string{key}, []Take{{Spec: spec, Cost: 100}}); err != nil || !d.Allowed {
		t.Fatalf("take: %+v %v", d, err)
	}
	for i, step := range []struct {
		delta, want int64 // want: whole tokens after; 1000 means deleted as full
	}{
		{50_000 - 100, -1000}, // 900 − 49,900: the floor
		{1, -1000},            // −1001 stops at −1000
		{-700, -300},          // a refund gives back exactly what it says
		{900, -1000},          // −1200 stops at −1000
		{-1500, 500},          // one refund larger than a capacity, exactly
		{-5_000_000, 1000},    // past full: deleted
		{3_000, -1000},        // a full bucket (no key) charged 3 capacities
	} {
		v, _ := rdb.Get(ctx, key).Result()
		before := spec.Full()
		if v != "" {
			if before, err = DecodeState(v); err != nil {
				t.Fatal(err)
			}
		}
		if ok, err := store.Settle(ctx, "req-"+strconv.Itoa(i), []string{key}, []Adjust{{Spec: spec, Delta: step.delta}}); err != nil || !ok {
			t.Fatalf("settle %d: %v %v", step.delta, ok, err)
		}
		v, err = rdb.Get(ctx, key).Result()
		if step.want == 1000 {
			if err != redis.Nil {
				t.Errorf("settle %d: bucket still stored (%x, %v), want it deleted as full", step.delta, v, err)
			}
			continue
		}
		after, err := DecodeState(v)
		if err != nil {
			t.Fatalf("settle %d: %v", step.delta, err)
		}
		if whole := floorDiv(after.Units, after.Scale); whole != step.want {
			t.Errorf("settle %d: %d whole tokens, want %d", step.delta, whole, step.want)
		}
		if model, kept := SettleState(after.Last, spec, before, step.delta); !kept || model != after {
			t.Errorf("settle %d: stored %+v, model %+v (kept %v)", step.delta, after, model, kept)
		}
	}
}

// downFor is a client whose node for keys of one hash tag cannot be
// dialled, as a Cluster node that is down.
type downFor struct {
	*redis.Client
	tag string
}

func (c downFor) fail(keys []string) (*redis.Cmd, bool) {
	if !strings.Contains(keys[0], c.tag) {
		return nil, false
	}
	cmd := redis.NewCmd(context.Background())
	cmd.SetErr(&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED})
	return cmd, true
}

func (c downFor) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	if cmd, ok := c.fail(keys); ok {
		return cmd
	}
	return c.Client.EvalSha(ctx, sha, keys, args...)
}

func (c downFor) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	if cmd, ok := c.fail(keys); ok {
		return cmd
	}
	return c.Client.Eval(ctx, script, keys, args...)
}

// TestShardedSettleInPart: a settlement of two hash-tag groups whose
// second group's node cannot be dialled settles the first and fails with
// a *PartialSettleError around the dial error (not the dial error alone,
// which would say that nothing was sent); retried once the node is back,
// it settles the second group and leaves the first as it was. A failure
// of the first group is its own error.
func TestShardedSettleInPart(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	spec := shSpec(t, 1000)
	keyer := NewKeyer("rl:", "")
	user, org := keyer.Key("user", "u", "tokens"), keyer.Key("org", "o", "tokens")
	if d, err := (Redis{Client: rdb}).Take(ctx, []string{user, org}, []Take{{Spec: spec, Cost: 500}, {Spec: spec, Cost: 500}}); err != nil || !d.Allowed {
		t.Fatalf("take: %+v %v", d, err)
	}
	tokens := func(key string) int64 {
		t.Helper()
		st, err := DecodeState(rdb.Get(ctx, key).Val())
		if err != nil {
			t.Fatal(err)
		}
		return st.Units / st.Scale
	}
	adj := []Adjust{{Spec: spec, Delta: -400}, {Spec: spec, Delta: -400}}
	ok, err := Sharded{Client: downFor{rdb, "{org:"}}.Settle(ctx, "req-1", []string{user, org}, adj)
	var partial *PartialSettleError
	if !ok || !errors.As(err, &partial) || !errors.As(err, new(*net.OpError)) {
		t.Fatalf("settled %v, error %v; want settled, a *PartialSettleError around the dial error", ok, err)
	}
	if !slices.Equal(partial.Settled, []int{0}) {
		t.Fatalf("settled buckets %v, want [0] (the user's)", partial.Settled)
	}
	if u, o := tokens(user), tokens(org); u != 900 || o != 500 {
		t.Fatalf("after the partial settlement: user %d, org %d tokens; want 900 and 500", u, o)
	}
	if ok, err := (Sharded{Client: rdb}).Settle(ctx, "req-1", []string{user, org}, adj); !ok || err != nil {
		t.Fatalf("the retry: settled %v, %v", ok, err)
	}
	if u, o := tokens(user), tokens(org); u != 900 || o != 900 {
		t.Errorf("after the retry: user %d, org %d tokens; want 900 each (the user group settled once)", u, o)
	}
	// The first group failing, the second is settled all the same.
	adj = []Adjust{{Spec: spec, Delta: -50}, {Spec: spec, Delta: -50}}
	ok, err = Sharded{Client: downFor{rdb, "{user:"}}.Settle(ctx, "req-2", []string{user, org}, adj)
	if !ok || !errors.As(err, &partial) || !slices.Equal(partial.Settled, []int{1}) {
		t.Fatalf("the first group failing: settled %v, %v; want settled, the org's bucket alone", ok, err)
	}
	if u, o := tokens(user), tokens(org); u != 900 || o != 950 {
		t.Errorf("after the second partial settlement: user %d, org %d tokens; want 900 and 950", u, o)
	}
	// Every group failing is the first group's error alone.
	ok, err = Sharded{Client: downFor{rdb, "{"}}.Settle(ctx, "req-3", []string{user, org}, adj)
	if ok || err == nil || errors.As(err, &partial) || !errors.As(err, new(*net.OpError)) {
		t.Errorf("every group failing: settled %v, %v; want its dial error alone", ok, err)
	}
}
