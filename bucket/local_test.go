package bucket

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestVectorsLocal runs every shared vector against the in-process store,
// with its clock driven by the test.
func TestVectorsLocal(t *testing.T) {
	for _, c := range loadVectors(t) {
		t.Run(c.Name, func(t *testing.T) {
			var now atomic.Int64
			l := NewLocal(100, func() time.Time { return time.UnixMicro(now.Load()) })
			specs := c.specs(t)
			keys := make([]string, len(specs))
			for i := range keys {
				keys[i] = fmt.Sprint("k", i)
			}
			for k, step := range c.Steps {
				now.Store(baseTime + micros(t, step.T))
				takes := make([]Take, len(specs))
				before := make([]State, len(specs))
				for i := range specs {
					takes[i] = Take{Spec: specs[i], Cost: step.Costs[i]}
					before[i], _ = l.lru.Peek(keys[i])
				}
				d, err := l.Take(context.Background(), keys, takes)
				if err != nil {
					t.Fatal(err)
				}
				charged := make([]bool, len(specs))
				for i := range specs {
					after, _ := l.lru.Peek(keys[i])
					charged[i] = after != before[i]
				}
				checkStep(t, fmt.Sprintf("step %d (t=%s)", k, step.T), c, k, d, charged)
			}
		})
	}
}

// TestLocalConcurrentExact: 64 goroutines spending one bucket of capacity
// 1000 with no refill to speak of get exactly 1000 grants between them.
func TestLocalConcurrentExact(t *testing.T) {
	rate, _ := ParseRate("1/d")
	spec, err := Limit{Capacity: 1000, Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	fixed := time.Unix(1_717_000_000, 0)
	l := NewLocal(10, func() time.Time { return fixed })
	var granted atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				d, _ := l.Take(context.Background(), []string{"a", "b"},
					[]Take{{Spec: spec, Cost: 1}, {Spec: spec, Cost: 0}})
				if d.Allowed {
					granted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if got := granted.Load(); got != 1000 {
		t.Fatalf("granted %d, want exactly 1000", got)
	}
}

// TestLocalBounded: the store never holds more buckets than its bound; the
// least recently used are forgotten.
func TestLocalBounded(t *testing.T) {
	rate, _ := ParseRate("1/h")
	spec, _ := Limit{Capacity: 5, Rate: rate}.Spec()
	l := NewLocal(1000, nil)
	for i := 0; i < 5000; i++ {
		if _, err := l.Take(context.Background(), []string{fmt.Sprint("id", i)}, []Take{{Spec: spec, Cost: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	if n := l.Len(); n != 1000 {
		t.Fatalf("holds %d buckets, want the bound 1000", n)
	}
}
