package bucket

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// fakeClock is a gateway clock the test moves by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

// denySpec is the Spec the denials of these tests are made under: 10
// tokens, one a second back.
var denySpec = Spec{Capacity: 10, Scale: 1, Refill: 1}

// TestDenyCacheShrinks: a denial with a 1500 ms wait is served for the same
// cost with a Retry-After that shrinks with the clock, lapses one
// millisecond early (never outlasting Redis's own wait), and never covers
// another cost.
func TestDenyCacheShrinks(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_717_000_000, 0)}
	c := NewDenyCache(100, clock.now)
	start := clock.now()
	c.Remember("k", denySpec, 1, start, 1500, 0)
	for _, step := range []struct {
		at   time.Duration
		wait int64
		ok   bool
	}{
		{0, 1499, true}, {400 * time.Millisecond, 1099, true}, {1498*time.Millisecond + 500*time.Microsecond, 1, true},
		{1499 * time.Millisecond, 0, false}, {2 * time.Second, 0, false},
	} {
		clock.t = start.Add(step.at)
		wait, rem, ok := c.Check("k", denySpec, 1)
		if ok != step.ok || wait != step.wait || rem != 0 {
			t.Errorf("at %v: Check = %d, %d, %v; want %d, 0, %v", step.at, wait, rem, ok, step.wait, step.ok)
		}
	}
	clock.t = start
	if _, _, ok := c.Check("k", denySpec, 2); ok {
		t.Error("a denial of cost 1 covered cost 2")
	}
	if _, _, ok := c.Check("other", denySpec, 1); ok {
		t.Error("a denial covered another bucket")
	}
	c.Forget("k")
	if _, _, ok := c.Check("k", denySpec, 1); ok {
		t.Error("Forget kept the denial")
	}
}

// TestDenyCacheBounded: the cache holds exactly its size once full, spread
// over its shards, also a size smaller than the number of shards.
func TestDenyCacheBounded(t *testing.T) {
	for _, size := range []int{1, 5, 16, 17, 1600, 1615} {
		c := NewDenyCache(size, nil)
		for i := range 100_000 {
			c.Remember(fmt.Sprint("k", i), denySpec, 1, time.Now(), 60_000, 0)
		}
		if n := c.Len(); n != size {
			t.Errorf("size %d: holds %d", size, n)
		}
	}
}

// TestDenyCacheOtherSpec: a denial answers only under the Spec it was made
// under. The same key checked under another one (the identity's tier
// changed: keys do not name the tier) misses, and the denial is dropped,
// since Redis then refills the bucket at that Spec's rate.
func TestDenyCacheOtherSpec(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_717_000_000, 0)}
	c := NewDenyCache(100, clock.now)
	c.Remember("k", denySpec, 1, clock.now(), 60_000, 0)
	for _, other := range []Spec{
		{Capacity: 1000, Scale: 1, Refill: 1},  // a larger capacity
		{Capacity: 10, Scale: 1, Refill: 100},  // a faster refill
		{Capacity: 10, Scale: 1000, Refill: 1}, // a finer scale
	} {
		c.Remember("k", denySpec, 1, clock.now(), 60_000, 0)
		if _, _, ok := c.Check("k", other, 1); ok {
			t.Errorf("a denial under %+v answered under %+v", denySpec, other)
		}
		if _, _, ok := c.Check("k", denySpec, 1); ok {
			t.Errorf("a denial under %+v was kept after a check under %+v", denySpec, other)
		}
	}
	c.Remember("k", denySpec, 1, clock.now(), 60_000, 0)
	if wait, _, ok := c.Check("k", denySpec, 1); !ok || wait != 59_999 {
		t.Errorf("Check under its own Spec = %d, %v; want 59999, true", wait, ok)
	}
}

// TestDenyCacheConcurrent is for -race.
func TestDenyCacheConcurrent(t *testing.T) {
	c := NewDenyCache(1000, nil)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				k := fmt.Sprint("k", (g*i)%300)
				c.Remember(k, denySpec, 1, time.Now(), 5000, 0)
				c.Check(k, denySpec, 1)
			}
		}(g)
	}
	wg.Wait()
}

// TestDenyCacheForgetInFlight: a denial whose Redis call started before a
// Forget of its key (an admin reset while the client's requests were in
// flight) is not remembered, since Redis may have decided it before the
// reset; one whose call started after the Forget is.
func TestDenyCacheForgetInFlight(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_717_000_000, 0)}
	c := NewDenyCache(1, clock.now) // one shard
	start := clock.now()
	clock.t = start.Add(time.Millisecond)
	c.Forget("k") // the reset, while the call that started at start was in flight
	clock.t = start.Add(2 * time.Millisecond)
	c.Remember("k", denySpec, 1, start, 3_600_000, 0)
	if _, _, ok := c.Check("k", denySpec, 1); ok {
		t.Fatal("a denial decided before the reset was remembered after it")
	}
	c.Remember("k", denySpec, 1, clock.now(), 3_600_000, 0)
	if wait, _, ok := c.Check("k", denySpec, 1); !ok || wait != 3_599_999 {
		t.Fatalf("a denial decided after the reset: Check = %d, %v; want 3599999, true", wait, ok)
	}
}
