//go:build !race

// The race detector allocates: allocation counts are read without it.

package bucket

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
)

// cannedScripter answers every script call with one reply, and records
// the ARGV of the last one.
type cannedScripter struct {
	redis.Scripter
	reply any // a []any, held as an interface value that SetVal takes without allocating
	args  []any
}

func (c *cannedScripter) EvalSha(ctx context.Context, _ string, _ []string, args ...any) *redis.Cmd {
	c.args = args
	cmd := redis.NewCmd(ctx)
	cmd.SetVal(c.reply)
	return cmd
}

// TestRedisTakeAllocations: Redis.Take of a token bucket and a
// concurrency limit builds its ARGV, the lease id after the buckets, in
// one slice of the size it needs. Besides that slice, it allocates the
// buckets' encoded values, the lease id as an interface value, go-redis's
// command, the reply's []int64 and the decision's results: 6 in all.
func TestRedisTakeAllocations(t *testing.T) {
	spec, err := Limit{Capacity: 100, Rate: Rate{num: 10, den: 1}}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	takes := []Take{{Spec: spec, Cost: 1}, {Spec: ConcurrencySpec(5), Cost: 1, Lease: 60_000, LeaseID: "lease-1"}}
	keys := []string{"{user:1}", "{user:1}:c"}
	c := &cannedScripter{reply: []any{int64(99), int64(0), int64(100), int64(4), int64(0), int64(0)}}
	s := Redis{Client: c}
	if _, err := s.Take(context.Background(), keys, takes); err != nil {
		t.Fatal(err)
	}
	if len(c.args) != 3 || cap(c.args) != 3 || c.args[2] != "lease-1" {
		t.Errorf("%d ARGV values of capacity %d, want the two buckets and the lease id in a slice of capacity 3", len(c.args), cap(c.args))
	}
	n := testing.AllocsPerRun(100, func() {
		if _, err := s.Take(context.Background(), keys, takes); err != nil {
			t.Fatal(err)
		}
	})
	if n != 6 {
		t.Errorf("%v allocations a Take, want 6", n)
	}
}
