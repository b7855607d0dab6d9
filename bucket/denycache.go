package bucket

import (
	"hash/maphash"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// DefaultDenyCacheSize is the default bound of a DenyCache, in buckets.
const DefaultDenyCacheSize = 100_000

// DenyCache remembers, per bucket key, a cost that Redis denied under a
// Spec and until when that bucket cannot serve it, so that a client
// retrying in a tight loop is answered in-process, with a shrinking
// Retry-After, and costs Redis one call per bucket per Retry-After window
// instead of one per request.
//
// It never allows: a miss goes to Redis. It never denies what Redis would
// allow, because a bucket's tokens only grow with time except by charges,
// and a charge only lowers them further. The one exception is a refund
// (settlement of LLM usage below its estimate, or a Cluster refund): tokens
// given back while a denial is cached are seen only when it lapses, at most
// the Retry-After that Redis gave.
//
// That reasoning holds only under the Spec the denial was made under. Keys
// do not name the tier, so the same key is decided under other limits once
// an identity's tier changes, and a larger capacity or a faster refill may
// serve the cost at once. So a denial answers only under its own Spec, and
// a Check under another Spec drops it: that request goes to Redis, which
// refills the bucket at the other rate, so the denial no longer holds for
// the old Spec either.
//
// The deadline is measured from before the Redis call and shortened by one
// millisecond (Redis rounds waits up to whole milliseconds), so it never
// outlasts the real one. Times are on the gateway's monotonic clock; they
// never enter a Redis decision. It is safe for concurrent use.
type DenyCache struct {
	seed   maphash.Seed
	shards []denyShard // maxDenyShards, or size when smaller
	now    func() time.Time
}

// maxDenyShards is how many locks a DenyCache spreads its buckets over.
const maxDenyShards = 16

type denyShard struct {
	mu  sync.Mutex
	lru *simplelru.LRU[string, denial]
	// forgot is when Forget last ran on a key of the shard: a denial whose
	// Redis call started before then may have been decided before the
	// tokens came back (an admin reset, a refund), and is not remembered.
	forgot time.Time
}

type denial struct {
	spec      Spec
	cost      int64
	until     time.Time
	remaining int64
}

// NewDenyCache returns a cache of at most size buckets
// (DefaultDenyCacheSize when size ≤ 0), reading the time from now
// (time.Now when nil).
func NewDenyCache(size int, now func() time.Time) *DenyCache {
	if size <= 0 {
		size = DefaultDenyCacheSize
	}
	if now == nil {
		now = time.Now
	}
	n := min(size, maxDenyShards)
	c := &DenyCache{seed: maphash.MakeSeed(), shards: make([]denyShard, n), now: now}
	for i := range c.shards {
		per := size / n // the first size % n shards hold one more: size in all
		if i < size%n {
			per++
		}
		c.shards[i].lru, _ = simplelru.NewLRU[string, denial](per, nil) // errors only for size ≤ 0
	}
	return c
}

func (c *DenyCache) shard(key string) *denyShard {
	return &c.shards[maphash.String(c.seed, key)%uint64(len(c.shards))]
}

// Check reports whether key, decided under spec, is known to deny cost
// now, with the wait in milliseconds (rounded up, ≥ 1) and the whole tokens
// it held when Redis denied. A denial remembered under another spec is
// dropped (see DenyCache).
func (c *DenyCache) Check(key string, spec Spec, cost int64) (waitMS, remaining int64, ok bool) {
	s := c.shard(key)
	s.mu.Lock()
	d, found := s.lru.Get(key)
	if found && d.spec != spec {
		s.lru.Remove(key)
		found = false
	}
	s.mu.Unlock()
	if !found || d.cost != cost {
		return 0, 0, false
	}
	left := d.until.Sub(c.now())
	if left <= 0 {
		return 0, 0, false
	}
	return int64((left + time.Millisecond - 1) / time.Millisecond), d.remaining, true
}

// Remember records that Redis, called at start, denied cost on key under
// spec with a wait of waitMS milliseconds while the bucket held remaining
// whole tokens. A denial whose call started before the last Forget of a
// key of its shard is not recorded: it may have been decided before the
// tokens Forget speaks of came back, and recorded after Forget ran, it
// would deny them for its whole wait (a bucket reset by the admin API
// while its client's requests were in flight answered 429 for the hour).
// Forgets are rare beside denials, so few denials go unrecorded.
func (c *DenyCache) Remember(key string, spec Spec, cost int64, start time.Time, waitMS, remaining int64) {
	if waitMS <= 1 {
		return // lapses before it could serve anyone
	}
	d := denial{spec: spec, cost: cost, until: start.Add(time.Duration(waitMS-1) * time.Millisecond), remaining: remaining}
	s := c.shard(key)
	s.mu.Lock()
	if s.forgot.Before(start) {
		s.lru.Add(key, d)
	}
	s.mu.Unlock()
}

// Forget drops what is known of key, e.g. after tokens were given back,
// and what a denial in flight would tell of it (see Remember).
func (c *DenyCache) Forget(key string) {
	now := c.now()
	s := c.shard(key)
	s.mu.Lock()
	s.lru.Remove(key)
	s.forgot = now
	s.mu.Unlock()
}

// Len returns the number of buckets remembered.
func (c *DenyCache) Len() int {
	n := 0
	for i := range c.shards {
		c.shards[i].mu.Lock()
		n += c.shards[i].lru.Len()
		c.shards[i].mu.Unlock()
	}
	return n
}
