package bucket

import (
	"context"
	"fmt"
	"strconv"

	"github.com/token-bucket/token_bucket/lua"
)

// Renew extends the lease id on the concurrency limits at keys to expire
// lease milliseconds from now (Redis clock), in one script call. A lease
// that is gone (released, or lapsed) is not taken again. It returns the
// number of keys that still held the lease.
func (s Redis) Renew(ctx context.Context, keys []string, id string, lease int64) (int64, error) {
	if lease <= 0 {
		return 0, fmt.Errorf("renewing a lease of %d ms", lease)
	}
	return s.lease(ctx, keys, id, lease)
}

// Release gives back the slots that the lease id holds on the concurrency
// limits at keys, in one script call. It returns the number of slots given
// back: 0 for a lease released before or lapsed, so a release made twice
// gives back nothing more.
func (s Redis) Release(ctx context.Context, keys []string, id string) (int64, error) {
	return s.lease(ctx, keys, id, 0)
}

func (s Redis) lease(ctx context.Context, keys []string, id string, lease int64) (int64, error) {
	if len(keys) == 0 {
		return 0, nil
	}
	n, err := run(ctx, s.Client, lua.Lease, keys, id, strconv.FormatInt(lease, 10)).Int64()
	if err != nil {
		return 0, fmt.Errorf("running lease script: %w", err)
	}
	return n, nil
}

// Renew renews a lease like Redis.Renew, one call per hash-tag group.
func (s Sharded) Renew(ctx context.Context, keys []string, id string, lease int64) (int64, error) {
	return s.eachGroup(keys, func(gk []string) (int64, error) { return Redis{Client: s.Client}.Renew(ctx, gk, id, lease) })
}

// Release releases a lease like Redis.Release, one call per hash-tag
// group.
func (s Sharded) Release(ctx context.Context, keys []string, id string) (int64, error) {
	return s.eachGroup(keys, func(gk []string) (int64, error) { return Redis{Client: s.Client}.Release(ctx, gk, id) })
}

// eachGroup calls fn with the keys of each hash-tag group (one slot each)
// and sums what it returns; it stops at the first error.
func (s Sharded) eachGroup(keys []string, fn func([]string) (int64, error)) (int64, error) {
	groups := groupByTag(keys)
	if len(groups) == 1 {
		return fn(keys)
	}
	var total int64
	for _, idx := range groups {
		gk := make([]string, len(idx))
		for j, i := range idx {
			gk[j] = keys[i]
		}
		n, err := fn(gk)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// Release gives back one slot of each concurrency limit at keys (whose
// takes are given), taken by an allowed Take of this store. A limit back
// at full capacity is forgotten.
func (l *Local) Release(keys []string, takes []Take) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, k := range keys {
		st, ok := l.lru.Peek(k)
		if !ok {
			continue // forgotten: it counts as full already
		}
		if st.Units+1 >= takes[i].Spec.Capacity {
			l.lru.Remove(k)
			continue
		}
		st.Units++
		l.lru.Add(k, st)
	}
}

// Refund gives back what an allowed Take charged, for a request that will
// not be served after all (its client left while it waited on a
// reservation): each charged bucket its cost (up to full), each quota its
// cost in the window that holds now, each concurrency slot its lease. It
// is one script call; takes must be the charged ones. It returns the
// buckets refunded.
func (s Redis) Refund(ctx context.Context, keys []string, takes []Take) (int64, error) {
	if err := checkTakes(keys, takes); err != nil || len(keys) == 0 {
		return 0, err
	}
	n, err := run(ctx, s.Client, lua.Refund, keys, appendArgs(nil, takes)...).Int64()
	if err != nil {
		return 0, fmt.Errorf("running refund script: %w", err)
	}
	return n, nil
}

// Refund refunds like Redis.Refund, one call per hash-tag group.
func (s Sharded) Refund(ctx context.Context, keys []string, takes []Take) (int64, error) {
	if err := checkTakes(keys, takes); err != nil {
		return 0, err
	}
	var total int64
	for _, idx := range groupByTag(keys) {
		gk, gt := make([]string, len(idx)), make([]Take, len(idx))
		for j, i := range idx {
			gk[j], gt[j] = keys[i], takes[i]
		}
		n, err := Redis{Client: s.Client}.Refund(ctx, gk, gt)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}
