package tokenbucket

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/token-bucket/token_bucket/bucket"
)

// quotaWindows returns the windows of quotas of period p around now, in
// quota_timezone: computed once per window and shared by every request in
// it (the calendar arithmetic, with its time-zone rules, is not done per
// request).
func (h *Handler) quotaWindows(p bucket.Period, now time.Time) *bucket.Windows {
	slot := &h.windows[p]
	us := now.UnixMicro()
	if w := slot.Load(); w != nil && w[1] <= us && us < w[2] {
		return w
	}
	w := bucket.WindowsAt(p, h.quotaLoc, now)
	slot.Store(&w)
	return &w
}

// reserve prepares req for on_limit wait: when this gateway holds fewer
// than max_waiting requests, it takes a place among them and lets req's
// enforced token buckets make reservations of up to max_wait. It reports
// whether it took a place; the caller gives it back unless the decision
// holds the request (Decision.WaitMS > 0), and then after the wait. A
// place is taken before the decision, so that no more reservations are
// made than max_waiting requests can hold: a request being decided holds
// one, though most are never held (see decideRedis, which decides again a
// request that found every place taken and that a hold would serve). A
// request that cannot be held (see holdable) takes none.
func (h *Handler) reserve(x *exchange, reqs ...*request) bool {
	if h.maxWaitMS == 0 || !h.holdable(x) {
		return false
	}
	if h.waiting.Add(1) > int64(h.MaxWaiting) {
		h.waiting.Add(-1)
		return false
	}
	tbMetrics.waiting.Inc()
	for _, req := range reqs {
		for i, l := range req.limits {
			if !l.shadow && !l.concurrent && l.period == 0 {
				req.takes[i].MaxWaitMS = h.maxWaitMS
			}
		}
	}
	return true
}

// holdable reports whether x's request may be held by on_limit wait: its
// body has been read (by the estimate), or will be (see readsBody: the deny
// cache's first look comes before the estimate), or it will be read ahead
// whole (see readAhead). On an HTTP/2 or HTTP/3 connection a held stream whose
// body is not read stops the uploads of every other request on the
// connection: the client gets flow-control credit (RFC 9113, section
// 5.2) only for what the gateway reads, and Go's HTTP/2 server buffers at
// most 1 MiB per connection. So a request there whose body was not read
// and is longer than maxHeldBody, or of unknown length, is not held: it
// is denied as on_limit reject denies. On HTTP/3 a GET, HEAD, OPTIONS or
// DELETE of unknown length is held: quic-go gives every request without
// Content-Length an unknown one, and those methods send no body. (Go's
// HTTP/2 server gives a request without a body the length 0: one of
// unknown length there is sending a body.)
func (h *Handler) holdable(x *exchange) bool {
	r := x.r
	switch {
	case r.ProtoMajor < 2 || x.est.read:
		return true
	case r.ContentLength >= 0 && r.ContentLength <= maxHeldBody:
		return true
	case r.ContentLength < 0 && r.ProtoMajor == 3:
		switch r.Method {
		case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodDelete:
			return true
		}
	}
	return h.readsBody(x)
}

// readsBody reports whether the estimate is still to read x's body whole
// (its read is not yet done: the deny cache's first look, at the requests
// limits, comes before it): a request charged in tokens limits whose body
// is within max_body. A body of unknown length counts only without
// on_invalid <cost>: over max_body it is then refused, where on_invalid
// would price it unread and unholdable. (So such a body within max_body
// is told max_wait more by the cache than by Redis: a Retry-After too
// long, never one after which it is denied again.) Once the cost is set,
// the estimate has run, and x.est.read says what it read. An Ollama blob
// upload's body is never read (see uploadsBlob).
func (h *Handler) readsBody(x *exchange) bool {
	if x.costSet || h.Estimate == nil || !x.req.hasTokens() || uploadsBlob(x.r) {
		return false
	}
	if n := x.r.ContentLength; n >= 0 {
		return n <= h.Estimate.MaxBody
	}
	return h.Estimate.OnInvalid == nil || *h.Estimate.OnInvalid < 0
}

// reservable reports whether a reservation would have served denial d of
// req: on_limit wait is on, and every bucket that denies it is an
// enforced token bucket (not a concurrency limit or a quota, which are
// never held) whose wait is within max_wait.
func (h *Handler) reservable(req *request, d *bucket.Decision) bool {
	if h.maxWaitMS == 0 || d.Reason != bucket.RateLimited {
		return false
	}
	for i, b := range d.Buckets {
		if b.Reason == bucket.Allowed || b.Shadow {
			continue
		}
		if l := req.limits[i]; b.Reason != bucket.RateLimited || l.concurrent || l.period != 0 || b.RetryAfterMS > h.maxWaitMS {
			return false
		}
	}
	return true
}

// retryAfterWait returns the denial of a request that was offered a
// reservation (on_limit wait, with a place free among max_waiting) with
// each token bucket's wait shortened by max_wait: a retry after that long
// is held for at most max_wait and then served, so that is what
// Retry-After says (and what the deny cache keeps, which so never denies
// a request that Redis would hold). A request refused a place is answered
// as with reject, its full wait, but the deny cache keeps that less
// max_wait too (decideRedis): a later request may find a place.
func (h *Handler) retryAfterWait(req *request, d bucket.Decision) bucket.Decision {
	for i := range d.Buckets {
		r, l := &d.Buckets[i], req.limits[i]
		if r.Reason == bucket.RateLimited && !l.concurrent && l.period == 0 {
			r.RetryAfterMS = max(1, r.RetryAfterMS-h.maxWaitMS)
		}
	}
	return bucket.Summarize(d.Buckets)
}

// await holds an allowed request for its reservation's wait. It returns
// false when the client went away meanwhile: then what the decision
// charged is given back, once, and the request goes no further.
func (h *Handler) await(x *exchange, v *verdict) bool {
	defer h.unwait()
	t := time.NewTimer(time.Duration(v.d.WaitMS) * time.Millisecond)
	defer t.Stop()
	if !x.est.read {
		readAhead(x.r)
	}
	select {
	case <-t.C:
		return true
	case <-x.r.Context().Done():
	}
	if h.giveBack(x, v.req, &v.d) {
		h.metrics.charges(v.req, &v.d, false, true) // recorded as charged when it was decided
	}
	return false
}

// maxHeldBody is the most of a held request's body that readAhead reads
// into memory: 1 MiB, the estimate's default max_body.
const maxHeldBody = DefaultEstimateMaxBody

// heldBody is a held request's body, read ahead by a goroutine of its own
// while the request waits. On HTTP/1.x, so that a client that leaves is
// noticed: net/http watches an HTTP/1.x connection for its close only once
// the request's body has been read to its end (or a read of it failed,
// which a client that leaves mid-body makes), and a requests limit never
// reads it. On HTTP/2 and HTTP/3 (which see a stream's reset at any time),
// so that the held stream's body does not take the connection's
// flow-control window from its other requests (see holdable). The hold
// does not wait for the body: a slow one keeps its place among
// max_waiting no longer than the hold. The request's reader gets the bytes
// read ahead, then, past maxHeldBody, the rest from the body itself.
type heldBody struct {
	src  io.ReadCloser
	mu   sync.Mutex
	more sync.Cond
	buf  []byte // read ahead, not yet read by the request's reader
	end  error  // why the read-ahead stopped; nil while it runs
}

// errHeldBodyFull stops the read-ahead at maxHeldBody.
var errHeldBodyFull = errors.New("token_bucket: a held body's read-ahead is full")

// readAhead starts reading r's body ahead, unless there is nothing to
// read, and makes r read it through a heldBody.
func readAhead(r *http.Request) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return
	}
	b := &heldBody{src: r.Body}
	b.more.L = &b.mu
	r.Body = b
	go b.run()
}

func (b *heldBody) run() {
	chunk := make([]byte, 32<<10)
	total := 0
	for {
		n, err := b.src.Read(chunk)
		if total += n; err == nil && total >= maxHeldBody {
			err = errHeldBodyFull
		}
		b.mu.Lock()
		b.buf = append(b.buf, chunk[:n]...)
		b.end = err
		b.mu.Unlock()
		b.more.Broadcast()
		if err != nil {
			return
		}
	}
}

// Read gives the bytes read ahead, waiting for them while the read-ahead
// runs; then the read-ahead's end (EOF, or its error), or past maxHeldBody
// the rest of the body.
func (b *heldBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	for len(b.buf) == 0 && b.end == nil {
		b.more.Wait()
	}
	if len(b.buf) > 0 {
		n := copy(p, b.buf)
		b.buf = b.buf[n:]
		b.mu.Unlock()
		return n, nil
	}
	end := b.end
	b.mu.Unlock()
	if end == errHeldBodyFull {
		return b.src.Read(p) // the read-ahead has returned: one reader
	}
	return 0, end
}

func (b *heldBody) Close() error { return b.src.Close() }

// giveBack refunds what an allowed decision d charged req, for a client
// that went away before it was served: each bucket's cost, each slot. It
// reports whether the refund was made.
func (h *Handler) giveBack(x *exchange, req *request, d *bucket.Decision) bool {
	var keys []string
	var takes []bucket.Take
	for i, r := range d.Buckets {
		if r.Reason == bucket.Allowed && req.takes[i].Cost > 0 {
			keys, takes = append(keys, req.keys[i]), append(takes, req.takes[i])
		}
	}
	if len(keys) == 0 {
		return true // charged nothing (costs of 0): no call
	}
	// The client is gone: the refund is the gateway's own call.
	if err := h.conn.refund(context.WithoutCancel(x.r.Context()), keys, takes); err != nil {
		h.logger.Warn("giving back what a client that left was charged failed; it stays charged", zap.Error(err))
		return false
	}
	return true
}

// unwait gives back a place among the requests held by on_limit wait. The
// gauge goes down before the place is free, as reserve takes a place
// before the gauge goes up, so that the gauge never reads more than the
// places taken (a request taking the freed place could otherwise raise it
// before this one lowers it: max_waiting + 1 for a moment).
func (h *Handler) unwait() {
	tbMetrics.waiting.Dec()
	h.waiting.Add(-1)
}
