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

// TestDenyCacheShrinks: a denial with a 1500 ms wait is served for the same
// cost with a Retry-After that shrinks with the clock, lapses one
// millisecond early (never outlasting Redis's own wait), and never covers
// another cost.
func TestDenyCacheShrinks(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_717_000_000, 0)}
	c := NewDenyCache(100, clock.now)
	start := clock.now()
	c.Remember("k", 1, start, 1500, 0)
	for _, step := range []struct {
		at   time.Duration
		wait int64
		ok   bool
	}{
		{0, 1499, true}, {400 * time.Millisecond, 1099, true}, {1498*time.Millisecond + 500*time.Microsecond, 1, true},
		{1499 * time.Millisecond, 0, false}, {2 * time.Second, 0, false},
	} {
		clock.t = start.Add(step.at)
		wait, rem, ok := c.Check("k", 1)
		if ok != step.ok || wait != step.wait || rem != 0 {
			t.Errorf("at %v: Check = %d, %d, %v; want %d, 0, %v", step.at, wait, rem, ok, step.wait, step.ok)
		}
	}
	clock.t = start
	if _, _, ok := c.Check("k", 2); ok {
		t.Error("a denial of cost 1 covered cost 2")
	}
	if _, _, ok := c.Check("other", 1); ok {
		t.Error("a denial covered another bucket")
	}
	c.Forget("k")
	if _, _, ok := c.Check("k", 1); ok {
		t.Error("Forget kept the denial")
	}
}

// TestDenyCacheBounded: the cache holds at most its size, spread over its
// shards.
func TestDenyCacheBounded(t *testing.T) {
	c := NewDenyCache(1600, nil)
	for i := 0; i < 100_000; i++ {
		c.Remember(fmt.Sprint("k", i), 1, time.Now(), 60_000, 0)
	}
	if n := c.Len(); n > 1600 || n < 1500 {
		t.Fatalf("holds %d, want at most 1600 (and near it)", n)
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
				c.Remember(k, 1, time.Now(), 5000, 0)
				c.Check(k, 1)
			}
		}(g)
	}
	wg.Wait()
}
