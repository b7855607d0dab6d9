package bucket

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// shSpec is a limit of capacity tokens refilled at one token per hour: no
// whole token comes back during a test.
func shSpec(t *testing.T, capacity int64) Spec {
	t.Helper()
	rate, err := ParseRate("1/h")
	if err != nil {
		t.Fatal(err)
	}
	spec, err := Limit{Capacity: capacity, Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// shCluster is a three-master Redis Cluster and a Sharded store on a
// cluster client set up as the handler sets it up: no retries, and the
// NoRetry hook.
type shCluster struct {
	*redistest.Cluster
	client *redis.ClusterClient
	store  Sharded
	keyer  Keyer
	errs   *shErrors
}

// shErrors counts the MOVED, NOSCRIPT and TRYAGAIN replies the nodes sent the
// cluster client.
type shErrors struct {
	mu     sync.Mutex
	counts map[string]int
}

func (e *shErrors) note(errs ...error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, err := range errs {
		for _, prefix := range []string{"MOVED", "NOSCRIPT", "TRYAGAIN"} {
			if redis.HasErrorPrefix(err, prefix) {
				e.counts[prefix]++
			}
		}
	}
}

func (e *shErrors) count(prefix string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.counts[prefix]
}

func (e *shErrors) DialHook(next redis.DialHook) redis.DialHook { return next }

func (e *shErrors) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd) // the command's own error is set after the hooks
		e.note(err)
		return err
	}
}

func (e *shErrors) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			e.note(cmd.Err())
		}
		return err
	}
}

func (c *shCluster) take(t *testing.T, keys []string, takes []Take) Decision {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d, err := c.store.Take(ctx, keys, takes)
	if err != nil {
		t.Fatalf("Take(%q): %v", keys, err)
	}
	return d
}

// raw returns the stored value at key, "" when there is none.
func (c *shCluster) raw(t *testing.T, key string) string {
	t.Helper()
	v, err := c.client.Get(context.Background(), key).Result()
	if err == redis.Nil {
		return ""
	}
	if err != nil {
		t.Fatalf("GET %s: %v", key, err)
	}
	return v
}

func (c *shCluster) state(t *testing.T, key string) State {
	t.Helper()
	st, err := DecodeState(c.raw(t, key))
	if err != nil {
		t.Fatalf("%s: %v", key, err)
	}
	return st
}

// keyOn returns the key of the first identity of dimension, among
// prefix0, prefix1, ..., whose slot is served by a node other than avoid.
func (c *shCluster) keyOn(t *testing.T, dimension, prefix string, avoid *redistest.Server) string {
	t.Helper()
	for i := 0; i < 32; i++ {
		if k := c.keyer.Key(dimension, prefix+strconv.Itoa(i), ""); c.NodeOf(t, k) != avoid {
			return k
		}
	}
	t.Fatalf("no %s identity on another node than %s", dimension, avoid.Addr)
	return ""
}

// TestShardedOnCluster runs the Sharded store on a real three-master
// Redis Cluster with the buckets of one request on different nodes.
func TestShardedOnCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	client := cluster.Client(t)
	client.AddHook(NoRetry{})
	errs := &shErrors{counts: map[string]int{}}
	client.OnNewNode(func(node *redis.Client) { node.AddHook(errs) })
	c := &shCluster{Cluster: cluster, client: client, store: Sharded{Client: client}, keyer: NewKeyer("rl:", ""), errs: errs}
	ctx := context.Background()
	a, b := shSpec(t, 10), shSpec(t, 2)

	// A request denied on one node leaves the bucket charged on the other
	// node exactly as it would be had the request never come: the refund
	// re-times the state to the refund's clock, holding the refill up to
	// then plus the cost.
	t.Run("denial_refunds_the_other_node", func(t *testing.T) {
		kA := c.keyer.Key("user", "a", "")
		kB := c.keyOn(t, "ip", "refund", c.NodeOf(t, kA))
		slotA, _ := client.ClusterKeySlot(ctx, kA).Result()
		slotB, _ := client.ClusterKeySlot(ctx, kB).Result()
		if slotA == slotB || c.NodeOf(t, kA) == c.NodeOf(t, kB) {
			t.Fatalf("%s (slot %d) and %s (slot %d) are on one node", kA, slotA, kB, slotB)
		}
		if d := c.take(t, []string{kA}, []Take{{Spec: a, Cost: 3}}); !d.Allowed || d.Buckets[0].Remaining != 7 {
			t.Fatalf("charging 3 of 10: %+v", d)
		}
		if d := c.take(t, []string{kB}, []Take{{Spec: b, Cost: 2}}); !d.Allowed || d.Buckets[0].Remaining != 0 {
			t.Fatalf("charging 2 of 2: %+v", d)
		}
		before, rawB := c.state(t, kA), c.raw(t, kB)

		d := c.take(t, []string{kA, kB}, []Take{{Spec: a, Cost: 1}, {Spec: b, Cost: 1}})
		if d.Allowed || d.Reason != RateLimited || d.Deciding != 1 || d.Buckets[0].Remaining != 7 ||
			d.Buckets[1].Remaining != 0 || d.Buckets[1].Reason != RateLimited {
			t.Errorf("request denied by %s: %+v; want denied by bucket 1, bucket 0 reporting 7 left", kB, d)
		}
		after := c.state(t, kA)
		want := min(a.CapacityUnits(), before.Units+(after.Last-before.Last)*a.Refill)
		if after.Scale != before.Scale || after.Last < before.Last || after.Units != want {
			t.Errorf("%s after the refund: %+v; was %+v, want %d units at its last time (the refill since, nothing charged)",
				kA, after, before, want)
		}
		if got := after.Units / after.Scale; got != 7 {
			t.Errorf("%s holds %d tokens after the refund, want 7", kA, got)
		}
		if got := c.raw(t, kB); got != rawB {
			t.Errorf("%s was written by a request it denied", kB)
		}
	})

	// A full bucket charged and refunded is full again, which is no key.
	t.Run("refund_of_a_full_bucket_deletes_it", func(t *testing.T) {
		kA := c.keyer.Key("user", "full", "")
		kB := c.keyOn(t, "ip", "full", c.NodeOf(t, kA))
		c.take(t, []string{kB}, []Take{{Spec: b, Cost: 2}})
		d := c.take(t, []string{kA, kB}, []Take{{Spec: a, Cost: 1}, {Spec: b, Cost: 1}})
		if d.Allowed || d.Buckets[0].Remaining != 10 {
			t.Errorf("request denied by %s: %+v; want denied, bucket 0 reporting 10 left", kB, d)
		}
		if v := c.raw(t, kA); v != "" {
			st, _ := DecodeState(v)
			t.Errorf("%s after refunding a full bucket: %+v, want no key", kA, st)
		}
	})

	// A cost above another bucket's capacity is refunded the same way.
	t.Run("cost_exceeds_capacity_on_the_other_node", func(t *testing.T) {
		kA := c.keyer.Key("user", "big", "")
		kB := c.keyOn(t, "ip", "big", c.NodeOf(t, kA))
		d := c.take(t, []string{kA, kB}, []Take{{Spec: a, Cost: 3}, {Spec: b, Cost: 3}})
		if d.Allowed || d.Reason != CostExceedsCapacity || d.Deciding != 1 || d.RetryAfterMS != 0 || d.Buckets[0].Remaining != 10 {
			t.Errorf("cost 3 on a bucket of 2: %+v", d)
		}
		if v := c.raw(t, kA); v != "" {
			t.Errorf("%s was left charged", kA)
		}
	})

	// After the slot of a bucket moves to another node (as redis-cli
	// --cluster reshard moves it), the client's stale slot map gets MOVED,
	// follows it to a node that has never run the script (NOSCRIPT), and
	// the bucket continues from the state it had on the old node; alone or
	// in a pipeline with a bucket on another node.
	t.Run("moved_after_slot_migration", func(t *testing.T) {
		kM := c.keyer.Key("user", "migrating", "")
		from := c.NodeOf(t, kM)
		kO := c.keyOn(t, "ip", "other", from)
		var to *redistest.Server
		for _, n := range c.Nodes {
			if n != from {
				to = n
				break
			}
		}
		for i := int64(1); i <= 3; i++ {
			if d := c.take(t, []string{kM}, []Take{{Spec: a, Cost: 1}}); !d.Allowed || d.Buckets[0].Remaining != 10-i {
				t.Fatalf("request %d before the migration: %+v", i, d)
			}
		}
		before := c.raw(t, kM)
		slot, _ := client.ClusterKeySlot(ctx, kM).Result()
		c.MigrateSlot(t, slot, from, to)
		for _, n := range c.Nodes {
			if err := n.Client(t).ScriptFlush(ctx).Err(); err != nil {
				t.Fatal(err)
			}
		}
		if v, err := to.Client(t).Get(ctx, kM).Result(); err != nil || v != before {
			t.Fatalf("%s on the new node: %v; want the migrated state", kM, err)
		}
		if err := from.Client(t).Get(ctx, kM).Err(); !redis.HasErrorPrefix(err, "MOVED") {
			t.Fatalf("GET %s on the old node: %v, want MOVED", kM, err)
		}

		moved, noscript := c.errs.count("MOVED"), c.errs.count("NOSCRIPT")
		if d := c.take(t, []string{kM}, []Take{{Spec: a, Cost: 1}}); !d.Allowed || d.Buckets[0].Remaining != 6 {
			t.Errorf("first request after the migration: %+v; want allowed with 6 left", d)
		}
		if c.errs.count("MOVED") == moved || c.errs.count("NOSCRIPT") == noscript {
			t.Errorf("the request after the migration met %d MOVED and %d NOSCRIPT, want at least one of each",
				c.errs.count("MOVED")-moved, c.errs.count("NOSCRIPT")-noscript)
		}
		if d := c.take(t, []string{kM, kO}, []Take{{Spec: a, Cost: 1}, {Spec: a, Cost: 1}}); !d.Allowed || d.Buckets[0].Remaining != 5 || d.Buckets[1].Remaining != 9 {
			t.Errorf("pipelined request after the migration: %+v; want allowed with 5 and 9 left", d)
		}
		if got := c.state(t, kM); got.Units/got.Scale != 5 {
			t.Errorf("%s holds %d tokens, want 5", kM, got.Units/got.Scale)
		}
		if n := c.NodeOf(t, kM); n != to {
			t.Errorf("%s is served by %s, want %s", kM, n.Addr, to.Addr)
		}
	})

	// While a slot is being migrated, a script on two keys of the slot
	// that are on neither node yet (a new identity) is sent on from the
	// old node (ASK) and refused by the new one with TRYAGAIN: it did not
	// run. The store runs it again until the migration ends, then charges
	// each bucket once: alone, and in a pipeline with a slot on another
	// node.
	for _, tc := range []struct {
		name  string
		other bool
	}{{"tryagain_during_migration", false}, {"tryagain_in_a_pipeline", true}} {
		t.Run(tc.name, func(t *testing.T) {
			kR, kT := c.keyer.Key("user", tc.name, ""), c.keyer.Key("user", tc.name, "tokens")
			from := c.NodeOf(t, kR)
			kO := c.keyOn(t, "ip", tc.name, from)
			to := c.NodeOf(t, kO)
			slot, _ := client.ClusterKeySlot(ctx, kR).Result()
			keys, takes := []string{kR, kT}, []Take{{Spec: a, Cost: 1}, {Spec: b, Cost: 2}}
			if tc.other {
				keys, takes = append(keys, kO), append(takes, Take{Spec: a, Cost: 3})
			}
			must := func(err error) {
				t.Helper()
				if err != nil {
					t.Fatal(err)
				}
			}
			must(to.Client(t).Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", redistest.NodeID(t, from)).Err())
			must(from.Client(t).Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", redistest.NodeID(t, to)).Err())

			refused := c.errs.count("TRYAGAIN")
			type result struct {
				d   Decision
				err error
			}
			done := make(chan result, 1)
			go func() {
				ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				d, err := c.store.Take(ctx, keys, takes)
				done <- result{d, err}
			}()
			redistest.WaitFor(t, 5*time.Second, "a TRYAGAIN", func() error {
				if c.errs.count("TRYAGAIN") == refused {
					return errors.New("none yet")
				}
				return nil
			})
			// The new owner first, then the old one, as redis-cli does: the
			// other order has the two send the call to each other (MOVED).
			for _, n := range append([]*redistest.Server{to, from}, c.Nodes...) {
				must(n.Client(t).Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", redistest.NodeID(t, to)).Err())
			}
			r := <-done
			if r.err != nil || !r.d.Allowed || r.d.Buckets[0].Remaining != 9 || r.d.Buckets[1].Remaining != 0 {
				t.Fatalf("Take during the migration: %+v, %v; want allowed with 9 and 0 left", r.d, r.err)
			}
			if tc.other && r.d.Buckets[2].Remaining != 7 {
				t.Errorf("the bucket on the other node: %d left, want 7", r.d.Buckets[2].Remaining)
			}
			for i, k := range keys {
				if got := c.state(t, k); got.Units/got.Scale != r.d.Buckets[i].Remaining {
					t.Errorf("%s holds %d tokens, want %d (charged once)", k, got.Units/got.Scale, r.d.Buckets[i].Remaining)
				}
			}
		})
	}
}
