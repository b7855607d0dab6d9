package bucket

import (
	"context"
	"strconv"
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
