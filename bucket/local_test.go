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

// TestLocalSettle: the local store settles as settle.lua does. A token
// bucket of 100 tokens, one back a second, charged 60: a refund of 40
// leaves 80 (and the state SettleState computes); a refund past full
// drops the bucket (full); a charge of 500 from 100 stops at the debt
// floor of −100; a bucket the store no longer holds settles from full. A
// daily quota of 100 charged 60 in today's window: a refund of 50 leaves
// 10 used, a charge of 1000 stops at 200 used (two amounts), and a
// settlement for another window changes nothing.
func TestLocalSettle(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	l := NewLocal(100, func() time.Time { return t0 })
	spec := Spec{Capacity: 100, Scale: 1_000_000, Refill: 1} // 1 token a second
	take := func(key string, tk Take) {
		t.Helper()
		if d, _ := l.Take(context.Background(), []string{key}, []Take{tk}); !d.Allowed {
			t.Fatalf("%s: %+v denied", key, tk)
		}
	}
	units := func(key string) (int64, bool) {
		st, ok := l.lru.Peek(key)
		return st.Units, ok
	}

	take("b", Take{Spec: spec, Cost: 60})
	before, _ := l.lru.Peek("b")
	l.Settle([]string{"b"}, []Adjust{{Spec: spec, Delta: -40}})
	want, _ := SettleState(t0.UnixMicro(), spec, before, -40)
	if st, _ := l.lru.Peek("b"); st != want || st.Units != 80*spec.Scale {
		t.Errorf("refund of 40: %+v, want %+v (80 tokens)", st, want)
	}
	l.Settle([]string{"b"}, []Adjust{{Spec: spec, Delta: -30}})
	if _, ok := units("b"); ok {
		t.Error("a refund past full kept the bucket")
	}
	l.Settle([]string{"b"}, []Adjust{{Spec: spec, Delta: 500}})
	if u, _ := units("b"); u != -100*spec.Scale {
		t.Errorf("a charge of 500 on a full bucket: %d units, want the floor %d", u, -100*spec.Scale)
	}

	windows := WindowsAt(Day, time.UTC, t0)
	start, end := windows.At(t0.UnixMicro())
	quota := Spec{Capacity: 100, Scale: 1}
	take("q", Take{Spec: quota, Cost: 60, Window: &windows})
	for _, step := range []struct {
		adj  Adjust
		used int64
	}{
		{Adjust{Spec: quota, Delta: -50, Window: start, WindowEnd: end}, 10},
		{Adjust{Spec: quota, Delta: 1000, Window: start, WindowEnd: end}, 200},
		{Adjust{Spec: quota, Delta: -50, Window: start - 86_400_000_000, WindowEnd: start}, 200}, // yesterday's
	} {
		l.Settle([]string{"q"}, []Adjust{step.adj})
		if st, _ := l.lru.Peek("q"); st.Units != step.used || st.Last != start {
			t.Errorf("after %+v: %+v, want %d used in the window at %d", step.adj, st, step.used, start)
		}
	}
	// A quota that holds no count of the window (its request was charged
	// nothing): a refund leaves it so, a charge starts the count, and one
	// for a window that has ended does not.
	l.Settle([]string{"q0"}, []Adjust{{Spec: quota, Delta: -5, Window: start, WindowEnd: end}})
	if _, ok := l.lru.Peek("q0"); ok {
		t.Error("a refund created a quota's count")
	}
	l.Settle([]string{"q0"}, []Adjust{{Spec: quota, Delta: 30, Window: start, WindowEnd: end}})
	if st, _ := l.lru.Peek("q0"); st.Units != 30 || st.Last != start {
		t.Errorf("a charge to a quota with no count: %+v, want 30 used in the window at %d", st, start)
	}
	l.Settle([]string{"q1"}, []Adjust{{Spec: quota, Delta: 30, Window: start - 86_400_000_000, WindowEnd: start}})
	if _, ok := l.lru.Peek("q1"); ok {
		t.Error("a charge for yesterday's window created a count")
	}
}
