package tokenbucket

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/token-bucket/token_bucket/bucket"
)

// slots are the concurrency slots (limits of unit "concurrent") that an
// allowed request holds while the next handler writes its response: taken
// by the decision, in the same script call as its buckets; renewed every
// half lease while the response goes on, so that a stream of any length
// keeps them; released once when the response ends, however it ends (the
// stream's last byte, the client gone, an upstream error, a panic in
// next). A release that fails is tried again until their lease lapses.
type slots struct {
	h     *Handler
	keys  []string
	takes []bucket.Take      // with the local specs when local
	inUse []prometheus.Gauge // the concurrent_requests series counting the request
	id    string             // the lease id
	local bool               // taken from the in-process store (on_redis_error local)

	mu       sync.Mutex
	timer    *time.Timer // the next renewal; nil when local
	released bool
	failing  bool // the last renewal failed (logged once until one succeeds)
}

// holdSlots returns the concurrency slots the verdict took, nil when it
// took none: a denial takes none, nor does a shadow limit that was full.
func (h *Handler) holdSlots(v *verdict) *slots {
	req := v.req
	if !v.decided || !v.d.Allowed || req.leases == 0 {
		return nil
	}
	s := &slots{h: h, local: v.local}
	for i, l := range req.limits {
		if !l.concurrent || v.d.Buckets[i].Reason != bucket.Allowed {
			continue
		}
		t := req.takes[i]
		if v.local {
			t.Spec = l.local
		}
		s.keys, s.takes, s.id = append(s.keys, req.keys[i]), append(s.takes, t), t.LeaseID
		// One request in each series, however many of its limits share it.
		if lm := h.metrics.limit(l); lm.inUse != nil && req.leads(&v.d, i, v.local) {
			lm.inUse.Inc()
			s.inUse = append(s.inUse, lm.inUse)
		}
	}
	if len(s.keys) == 0 {
		return nil
	}
	if !s.local {
		// The lease runs from the decision: a request held by on_limit
		// wait has spent part of it already.
		first := h.renewEvery() - h.now().Sub(time.UnixMicro(req.decidedAt))
		s.mu.Lock() // renew reads the timer under the lock
		s.timer = time.AfterFunc(max(0, first), s.renew)
		s.mu.Unlock()
	}
	return s
}

// releaseLeases releases in Redis the concurrency slots that req's call
// may have taken under its lease id, for a request whose answer was lost
// (its client gone while the call was under way, or the call failed after
// it was sent). A slot that the call did not take is left alone: a
// release removes only this lease id. It only reads req.
func (h *Handler) releaseLeases(req *request) {
	if req.leases == 0 {
		return
	}
	s := slots{h: h} // no limits: no slot was counted in use
	for i, l := range req.limits {
		if l.concurrent {
			s.keys, s.id = append(s.keys, req.keys[i]), req.takes[i].LeaseID
		}
	}
	s.release()
}

// unsent reports whether err proves that a call never reached Redis, so
// took no slot: no connection could be made (a dial error, here or to
// every Sentinel), none was free in time (redis.ErrPoolTimeout), or the
// client was closed (redis.ErrClosed). An error joined from several calls
// (a request's slot groups, a Sentinel's tries) is unsent when each of
// them is.
func unsent(err error) bool {
	for err != nil {
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				if !unsent(e) {
					return false
				}
			}
			return len(j.Unwrap()) > 0
		}
		if op, ok := err.(*net.OpError); ok && op.Op == "dial" || err == redis.ErrPoolTimeout || err == redis.ErrClosed {
			return true
		}
		err = errors.Unwrap(err)
	}
	return false
}

// renewEvery is the time between renewals of a lease: half of it, so that
// one renewal may fail or come late without the lease lapsing.
func (h *Handler) renewEvery() time.Duration { return time.Duration(h.ConcurrencyLease) / 2 }

// retryEvery is the time before a failed renewal is tried again: the
// breaker's cooldown (the soonest a refused call can pass), at most a
// quarter of renewEvery, so that several tries fit in the half lease that
// is left.
func (h *Handler) retryEvery() time.Duration {
	return max(minRetry, min(h.conn.cooldown, h.renewEvery()/4))
}

// minRetry bounds how often a failed renewal or release is tried again,
// whatever breaker_cooldown and concurrency_lease are.
const minRetry = 10 * time.Millisecond

// renew extends the lease and arms the next renewal, unless the slots
// were released meanwhile. It holds s.mu throughout, so that release waits
// for a renewal under way rather than letting it run after the request is
// done.
func (s *slots) renew() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.released {
		return
	}
	h := s.h
	held, err := h.conn.lease(context.Background(), s.keys, s.id, h.leaseMS)
	switch {
	case err != nil:
		if !s.failing {
			h.logger.Warn("renewing concurrency slots failed; they lapse unless a later renewal succeeds",
				zap.Duration("concurrency_lease", time.Duration(h.ConcurrencyLease)), zap.Error(err))
		}
		s.failing = true
		s.timer.Reset(h.retryEvery()) // before the lease lapses, not a half lease later
		return
	case held < int64(len(s.keys)):
		h.logger.Warn("a concurrency slot lapsed while its response was still being written",
			zap.Int64("held", held), zap.Int("slots", len(s.keys)))
	}
	s.failing = false
	s.timer.Reset(h.renewEvery())
}

// release gives the slots back, once.
func (s *slots) release() {
	s.mu.Lock()
	if s.released {
		s.mu.Unlock()
		return
	}
	s.released = true
	if s.timer != nil {
		s.timer.Stop()
	}
	s.mu.Unlock()
	h := s.h
	for _, g := range s.inUse {
		g.Dec()
	}
	if s.local {
		h.local.Release(s.keys, s.takes)
		return
	}
	h.releaseLeased(s.keys, s.id)
}

// releaseLeased releases the lease id on keys in Redis. A release that
// fails (refused by the open breaker, or Redis slow or away) is tried
// again in the background: a slot not given back is lost to its identity
// for the rest of its lease.
func (h *Handler) releaseLeased(keys []string, id string) {
	_, err := h.conn.lease(context.Background(), keys, id, 0)
	if err == nil {
		return
	}
	if redisErrorKind(err) != errBreakerOpen {
		h.logger.Warn("releasing concurrency slots failed; trying again until their lease lapses",
			zap.Duration("concurrency_lease", time.Duration(h.ConcurrencyLease)), zap.Error(err))
	}
	if h.conn.hold() {
		go h.releaseLater(keys, id, time.Now().Add(time.Duration(h.ConcurrencyLease)))
	}
}

// releaseLater retries a failed release every quarter breaker_cooldown
// (a call the open breaker refuses costs nothing, and the first after the
// cooldown is its half-open probe), until one succeeds or the lease has
// lapsed by itself at deadline. The caller holds the client for it
// (conn.hold).
func (h *Handler) releaseLater(keys []string, id string, deadline time.Time) {
	defer h.conn.release()
	every := max(minRetry, h.conn.cooldown/4)
	t := time.NewTimer(every)
	defer t.Stop()
	for range t.C {
		if time.Now().After(deadline) {
			return // lapsed
		}
		if _, err := h.conn.lease(context.Background(), keys, id, 0); err == nil {
			return
		}
		t.Reset(every)
	}
}
