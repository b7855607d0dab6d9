package bucket

import (
	"context"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// DefaultLocalBuckets is the default bound of a Local store. Measured at
// about 185 bytes a bucket (key, state and LRU links; TestLocalStoreMillionIdentities),
// 500000 buckets take about 90 MB.
const DefaultLocalBuckets = 500_000

// Local is an in-process store with the same semantics as Redis, used while
// Redis cannot answer. It holds at most a fixed number of buckets; when
// full, it forgets the least recently used one, which makes that bucket full
// again: an over-admission bounded by one capacity per forgotten bucket,
// never a false denial. It is safe for concurrent use.
type Local struct {
	mu    sync.Mutex
	lru   *simplelru.LRU[string, State]
	now   func() time.Time
	state []State // scratch, under mu
	done  []bool  // scratch, under mu
}

// NewLocal returns a Local store of at most size buckets (DefaultLocalBuckets
// when size ≤ 0) that reads the time from now (time.Now when nil).
func NewLocal(size int, now func() time.Time) *Local {
	if size <= 0 {
		size = DefaultLocalBuckets
	}
	if now == nil {
		now = time.Now
	}
	l, _ := simplelru.NewLRU[string, State](size, nil) // errors only for size ≤ 0
	return &Local{lru: l, now: now}
}

// Take decides a request like Redis.Take, on this process's buckets.
func (l *Local) Take(_ context.Context, keys []string, takes []Take) (Decision, error) {
	now := l.now().UnixMicro()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.state, l.done = l.state[:0], l.done[:0]
	for i, k := range keys {
		st, ok := l.lru.Get(k)
		if !ok {
			st = takes[i].Spec.Full()
		}
		l.state, l.done = append(l.state, st), append(l.done, false)
	}
	d := Decide(now, takes, l.state, l.done)
	for i, k := range keys {
		if l.done[i] {
			l.lru.Add(k, l.state[i])
		}
	}
	return d, nil
}

// Settle charges or gives back each bucket's delta as Redis.Settle does: a
// token bucket by SettleState (a bucket it no longer holds settles from
// full), a calendar quota's used units in the window it was charged in
// (nothing when it holds a later window; a charge before the window ends
// to a quota that holds no count of it starts one). Unlike Redis.Settle it
// keeps no marker: the caller settles a request at most once, in this
// process.
func (l *Local) Settle(keys []string, adj []Adjust) {
	now := l.now().UnixMicro()
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, k := range keys {
		a := adj[i]
		st, ok := l.lru.Get(k)
		if a.Window != 0 {
			if (!ok || st.Last < a.Window) && a.Delta > 0 && now < a.WindowEnd {
				st, ok = State{Last: a.Window}, true // nothing counted in the window yet
			}
			if ok && st.Last == a.Window {
				st.Units = max(0, min(st.Units+clampDelta(a), 2*a.Spec.CapacityUnits()))
				l.lru.Add(k, st)
			}
			continue
		}
		if !ok {
			st = a.Spec.Full()
		}
		if st, keep := SettleState(now, a.Spec, st, a.Delta); keep {
			l.lru.Add(k, st)
		} else {
			l.lru.Remove(k)
		}
	}
}

// Len returns the number of buckets held.
func (l *Local) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lru.Len()
}
