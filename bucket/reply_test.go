package bucket

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// TestReplyLengths checks that token_bucket.lua replies exactly three
// values per bucket for 0 to 5 buckets, allowed and denied (its reply
// table is sized by a constructor for up to three), and that demote.lua
// puts exactly its two values in front of the decision on either tier,
// also when the tier decided has no bucket.
func TestReplyLengths(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	spec := shSpec(t, 3) // 3 tokens, 1 an hour
	for n := 0; n <= 5; n++ {
		for _, cost := range []int64{1, 5} { // allowed, and denied: 5 > capacity
			keys, takes := make([]string, n), make([]Take, n)
			for i := range keys {
				keys[i] = fmt.Sprintf("len:{x}:%d:%d:%d", n, cost, i)
				takes[i] = Take{Spec: spec, Cost: cost}
			}
			vals, err := lua.TokenBucket.Run(ctx, rdb, keys, appendArgs(nil, takes)...).Int64Slice()
			if err != nil {
				t.Fatalf("%d buckets, cost %d: %v", n, cost, err)
			}
			want := make([]int64, 0, 3*n)
			for range n {
				if cost == 1 {
					want = append(want, 2, 0, 3_600_000) // 2 left, allowed, full in an hour
				} else {
					want = append(want, 3, -1, 0) // full, cost above capacity
				}
			}
			if fmt.Sprint(vals) != fmt.Sprint(want) {
				t.Errorf("%d buckets, cost %d: reply %v, want %v", n, cost, vals, want)
			}
		}
	}

	rule := DemoteRule{Denials: 1, Window: time.Minute, Span: time.Minute}
	run := func(marker string, own, penalty int) []int64 {
		keys := []string{marker, marker + ":denials"}
		var takes []Take
		for i := range own + penalty {
			keys = append(keys, fmt.Sprintf("%s:%d", marker, i))
			takes = append(takes, Take{Spec: spec, Cost: 1})
		}
		head := string(appendFloats(nil, int64(own), rule.Denials, rule.Window.Milliseconds(), rule.Span.Milliseconds()))
		vals, err := lua.Demote.Run(ctx, rdb, keys, appendArgs([]any{head}, takes)...).Int64Slice()
		if err != nil {
			t.Fatalf("demote %s: %v", marker, err)
		}
		return vals
	}
	for own := 1; own <= 4; own++ {
		for penalty := 0; penalty <= 4; penalty++ {
			marker := fmt.Sprintf("len:{d%d%d}", own, penalty)
			if got := run(marker, own, penalty); len(got) != 3+3*own || got[0] != 0 || got[1] != 0 || got[2] != 0 {
				t.Errorf("own tier, %d + %d buckets: reply %v, want 0, 0, 0 and %d values", own, penalty, got, 3*own)
			}
			if err := rdb.Set(ctx, marker, "1", time.Minute).Err(); err != nil {
				t.Fatal(err)
			}
			if got := run(marker, own, penalty); len(got) != 3+3*penalty || got[0] != 1 || got[2] != 0 {
				t.Errorf("penalty tier, %d + %d buckets: reply %v, want 1, the time left, 0 and %d values", own, penalty, got, 3*penalty)
			}
		}
	}
}

// TestMalformedStateWritesNothing checks that settle.lua and refund.lua
// read every bucket before writing any: a bucket whose value is not a
// state fails the call, and the buckets before it, and the settlement
// marker, are left as they were, so that a later call can still settle.
func TestMalformedStateWritesNothing(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	spec := shSpec(t, 100) // 100 tokens, 1 an hour
	st := Redis{Client: rdb}
	good, bad := "mal:{x}:good", "mal:{x}:bad"
	if _, err := st.Take(ctx, []string{good}, []Take{{Spec: spec, Cost: 40}}); err != nil {
		t.Fatal(err)
	}
	before, err := rdb.Get(ctx, good).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := rdb.Set(ctx, bad, "not a bucket", 0).Err(); err != nil {
		t.Fatal(err)
	}
	keys := []string{good, bad}
	adj := []Adjust{{Spec: spec, Delta: -30}, {Spec: spec, Delta: -30}}
	if _, err := st.Settle(ctx, "req-1", keys, adj); err == nil || !strings.Contains(err.Error(), "malformed bucket state at "+bad) {
		t.Fatalf("Settle over a malformed bucket: %v, want the malformed state error", err)
	}
	args := appendArgs(nil, []Take{{Spec: spec, Cost: 30}, {Spec: spec, Cost: 30}})
	if err := lua.Refund.Run(ctx, rdb, keys, args...).Err(); err == nil || !strings.Contains(err.Error(), "malformed bucket state at "+bad) {
		t.Fatalf("refund over a malformed bucket: %v, want the malformed state error", err)
	}
	if after, err := rdb.Get(ctx, good).Result(); err != nil || after != before {
		t.Fatalf("the good bucket changed: %q (%v), was %q", after, err, before)
	}
	if n, err := rdb.Exists(ctx, good+":settled:req-1").Result(); err != nil || n != 0 {
		t.Fatalf("settlement marker exists %d (%v) after a failed settlement", n, err)
	}
	if err := rdb.Del(ctx, bad).Err(); err != nil {
		t.Fatal(err)
	}
	settled, err := st.Settle(ctx, "req-1", keys, adj)
	if err != nil || !settled {
		t.Fatalf("Settle once the bad bucket is gone: %v, %v; want it settled", settled, err)
	}
	got, err := rdb.Get(ctx, good).Result()
	if err != nil {
		t.Fatal(err)
	}
	if s, err := DecodeState(got); err != nil || s.Units/s.Scale != 90 {
		t.Fatalf("good bucket after giving back 30 of 40: %+v (%v), want 90 whole tokens", s, err)
	}
}
