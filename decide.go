package tokenbucket

import (
	"context"
	"errors"
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
)

// exchange is one request on its way through the handler: what build
// resolved of it, read by decide, record and respond.
type exchange struct {
	inputs
	tier *tier    // the request's own tier
	req  *request // its buckets in that tier (tokens limits priced by decide)
}

// verdict is what decide made of a request. It says what the client gets;
// record and respond act on it, decide writes nothing.
type verdict struct {
	outcome outcome
	tier    *tier           // the tier that decided: the penalty tier for a demoted identity
	req     *request        // the buckets d speaks of: all, or those a cached denial knows
	policy  []*limit        // every applied bucket, for RateLimit-Policy
	d       bucket.Decision // valid when decided is set
	decided bool            // Redis, the deny cache or the local store decided d
	local   bool            // on_redis_error decided
	demoted bool            // decided on the penalty tier, or demoted by this denial
	gone    bool            // the client went away before Redis answered (err: errClientGone, before its body's end): nothing decided
	err     error           // invalid input (errInvalidBody, errBodyTimeout, errBodyTooLarge, errMixedModels, errInvalidCost)
}

// build resolves the request's tier and the buckets of its identities into
// x (the caller's, so that it stays on the stack).
func (h *Handler) build(x *exchange, w http.ResponseWriter, r *http.Request) {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	*x = exchange{inputs: inputs{w: w, r: r, repl: repl}}
	if h.modelFirst {
		_ = x.readCost(h) // an error is decide's to answer, before any bucket
	}
	x.tier = h.resolveTier(x.r, repl)
	x.req = h.bucketsOf(&x.inputs, x.tier)
}

// decide decides the request's buckets and returns the verdict, in this
// order: a body that cannot be read when the buckets depend on its model
// (invalid); no bucket (skipped); a requests limit the deny cache knows to deny
// (before the body is read, so a client retrying in a loop costs no
// parsing); the tokens cost (an invalid body or cost); a tokens limit the
// deny cache knows to deny; Redis, under the demotion rule when there is
// one; on_redis_error when Redis fails, into v. It never writes the
// response.
//
// v is the caller's and is written in place, not returned, so that the
// frames of a cached denial stay small: Caddy's own frames take most of
// the 8 KiB stack a connection's goroutine starts with (see denyHeaders).
func (h *Handler) decide(x *exchange, v *verdict) {
	t, req := x.tier, x.req
	if h.modelFirst && x.costErr != nil {
		// The buckets depend on the model, which a body that cannot be
		// read does not give: built without it, they would leave out
		// every limit scoped by models, and a dimension or tier named by
		// the model, while the upstream may read the body after all
		// ("max_tokens":"50" is 50 to a lenient parser). A form (an
		// audio or file upload) is no error: it has no model, as a body
		// without "model" has none.
		*v = invalidVerdict(t, x.costErr)
		return
	}
	if len(req.takes) == 0 {
		*v = verdict{outcome: outcomeSkipped, tier: t}
		return
	}
	if h.denials != nil && h.cachedDenial(v, x, false) {
		return
	}
	if err := h.price(&x.inputs, req); err != nil {
		*v = invalidVerdict(t, err)
		return
	}
	if h.denials != nil && req.hasTokens() && h.cachedDenial(v, x, true) {
		return
	}
	*v = h.decideRedis(x)
	if v.decided && !v.local && x.r.Context().Err() != nil {
		h.clientLeft(x, v)
	}
}

// clientLeft turns the verdict of a request whose client went away while
// Redis decided it into that of a request not decided, as for a call
// canceled before its reply (see decideDegraded): no answer will be read,
// so what the decision charged is given back (its tokens and slots), and
// the place it took among max_waiting.
func (h *Handler) clientLeft(x *exchange, v *verdict) {
	if v.d.Allowed {
		h.giveBack(x, v.req, &v.d)
	}
	if v.d.WaitMS > 0 {
		h.unwait()
	}
	countRedisError(context.Canceled)
	*v = verdict{tier: x.tier, gone: true}
}

// decideRedis decides the request in Redis, under the demotion rule when
// there is one, or by on_redis_error when Redis fails.
func (h *Handler) decideRedis(x *exchange) verdict {
	t, req := x.tier, x.req
	if h.demote != nil && t != h.demote.penalty {
		if id := x.identity(h, h.demote.dim); id != "" {
			if store, ok := h.conn.store.(bucket.Redis); ok {
				return h.decideDemote(x, store, id)
			}
		}
	}
	start := x.clock(h) // the one clock read of the request, which its quota windows used
	req.decidedAt = start.UnixMicro()
	held := h.reserve(x, req)
	d, err := h.conn.take(x.r.Context(), req.keys, req.takes)
	if held && (err != nil || d.WaitMS == 0) {
		h.unwait() // not held after all
	}
	if err == nil && !held && h.reservable(req, &d) && h.reserve(x, req) {
		// Every place was taken when the request came (by requests held,
		// or being decided, most of which are never held); one has freed
		// since, and a hold would serve this denial: decide it again,
		// offered. A denial wrote nothing, so nothing is charged twice.
		held = true
		d, err = h.conn.take(x.r.Context(), req.keys, req.takes)
		if err != nil || d.WaitMS == 0 {
			h.unwait()
		}
	}
	if err != nil && !errors.As(err, new(*bucket.RefundError)) {
		return h.decideDegraded(x, err, req)
	}
	if err != nil {
		// Denied by one slot, with the refund of the others failed: the
		// denial stands, their charge until it refills.
		h.logger.Warn("refunding a denied request on the other slots failed; their buckets stay charged",
			zap.Strings("keys", req.keys), zap.Error(err))
	}
	if held && d.Reason == bucket.RateLimited { // offered a reservation: see retryAfterWait
		d = h.retryAfterWait(req, d)
	}
	if h.denials != nil && d.Reason == bucket.RateLimited {
		for i, b := range d.Buckets {
			// A slot frees at no known time; a shadow denial denies nothing.
			if l := req.limits[i]; b.Reason == bucket.RateLimited && !b.Shadow && !l.concurrent {
				wait := b.RetryAfterMS
				if !held && h.maxWaitMS > 0 && l.period == 0 {
					// Refused a place among max_waiting, this request is told
					// its full wait; a later one may find a place and be held
					// (see retryAfterWait).
					wait -= h.maxWaitMS
				}
				h.denials.Remember(req.keys[i], req.takes[i].Spec, req.takes[i].Cost, start, wait, b.Remaining)
			}
		}
	}
	return decidedVerdict(t, req, d, false)
}

// decidedVerdict is the verdict of a decision d on req's buckets.
func decidedVerdict(t *tier, req *request, d bucket.Decision, local bool) verdict {
	v := verdict{outcome: outcomeAllowed, tier: t, req: req, policy: req.limits, d: d, decided: true, local: local}
	if !d.Allowed {
		v.outcome = outcomeDenied
	}
	return v
}

// invalidVerdict is the verdict of a request whose tokens cost cannot be
// had; of one whose client went away while it sent the body, that of a
// request not decided.
func invalidVerdict(t *tier, err error) verdict {
	if err == errClientGone {
		return verdict{tier: t, gone: true, err: err}
	}
	o := outcomeInvalidCost
	if err == errInvalidBody || err == errBodyTimeout || err == errBodyTooLarge || err == errMixedModels {
		o = outcomeInvalidBody
	}
	return verdict{outcome: o, tier: t, err: err}
}

// cachedDenial sets v to the deny cache's verdict and reports true when any
// of x's buckets of the unit asked for (tokens or requests) is known to
// deny its cost: a denial that speaks of those buckets. Under on_limit
// wait the cache keeps a token bucket's wait less max_wait, the time
// until a request can be held (see decideRedis); a request that cannot be
// held (see holdable) is told its whole wait.
func (h *Handler) cachedDenial(v *verdict, x *exchange, tokens bool) bool {
	req := x.req
	var found [4]cachedBucket // room on the stack for the usual few
	hits := found[:0]
	for i, k := range req.keys {
		if l := req.limits[i]; l.tokens != tokens || l.shadow || l.concurrent {
			continue
		}
		if wait, remaining, ok := h.denials.Check(k, req.takes[i].Spec, req.takes[i].Cost); ok {
			hits = append(hits, cachedBucket{i: i, waitMS: wait, remaining: remaining})
		}
	}
	if len(hits) == 0 {
		return false
	}
	if h.maxWaitMS > 0 && !h.holdable(x) {
		for j, c := range hits {
			if req.limits[c.i].period == 0 {
				hits[j].waitMS += h.maxWaitMS
			}
		}
	}
	cachedVerdict(v, x.tier, req, hits)
	return true
}

// cachedVerdict sets v to the denial of req's buckets that the deny cache
// knows to deny, hits: apart from cachedDenial, so that the frame under
// which the deny cache is read stays small.
func cachedVerdict(v *verdict, t *tier, req *request, hits []cachedBucket) {
	sub, results := newDenial(len(hits))
	sub.priced, sub.cost = req.priced, req.cost
	for j, c := range hits {
		sub.keys, sub.takes, sub.limits = append(sub.keys, req.keys[c.i]), append(sub.takes, req.takes[c.i]), append(sub.limits, req.limits[c.i])
		results[j] = bucket.Result{Remaining: c.remaining, Reason: bucket.RateLimited, RetryAfterMS: c.waitMS}
	}
	*v = decidedVerdict(t, sub, bucket.Summarize(results), false)
	v.policy = req.limits
}

// cachedBucket is a bucket of a request that the deny cache knows to
// deny: its index in the request, the wait in milliseconds and the whole
// tokens it held (see bucket.DenyCache.Check).
type cachedBucket struct {
	i                 int
	waitMS, remaining int64
}

// denialOf1 holds the request and the result of a cached denial by one
// bucket, the usual case, so that it is one allocation.
type denialOf1 struct {
	requestOf1
	results [1]bucket.Result
}

// newDenial returns an empty request with room for n buckets and their n
// results, for a cached denial.
func newDenial(n int) (*request, []bucket.Result) {
	if n == 1 {
		b := new(denialOf1)
		b.req = request{keys: b.keys[:0], takes: b.takes[:0], limits: b.limits[:0]}
		return &b.req, b.results[:]
	}
	return newRequest(n), make([]bucket.Result, n)
}

// decideDemote decides the request under the demotion rule, in one round
// trip: on the penalty tier's limits while the identity id is demoted,
// else on its own tier's, counting a denial.
func (h *Handler) decideDemote(x *exchange, store bucket.Redis, id string) verdict {
	t, req := x.tier, x.req
	preq, err := h.buildRequest(&x.inputs, h.demote.penalty)
	if err != nil {
		return invalidVerdict(t, err)
	}
	base := h.keyer.KeyOf(h.demote.name, x.hash(h, h.demote.dim, id), "", "")
	var state bucket.Demotion
	var d bucket.Decision
	var left time.Duration // what is left of the demotion
	req.decidedAt = x.clock(h).UnixMicro()
	preq.decidedAt = req.decidedAt
	held := h.reserve(x, req, preq)
	err = h.conn.call(x.r.Context(), func(ctx context.Context) error {
		var err error
		d, state, left, err = store.TakeDemote(ctx, base+":demoted", base+":denials", h.demote.rule,
			req.keys, req.takes, preq.keys, preq.takes)
		return err
	})
	if held && (err != nil || d.WaitMS == 0) {
		h.unwait() // not held after all
	}
	if err != nil {
		return h.decideDegraded(x, err, req, preq)
	}
	if state == bucket.Demoted {
		t, req = h.demote.penalty, preq
	}
	// Offered a reservation: see retryAfterWait. Not when the wait runs to
	// the demotion's end or past it (see bucket.TakeDemote): a retry before
	// then would be decided on the penalty tier, which cannot hold it.
	if held && d.Reason == bucket.RateLimited && (state == bucket.NotDemoted || d.RetryAfterMS < left.Milliseconds()) {
		d = h.retryAfterWait(req, d)
	}
	v := decidedVerdict(t, req, d, false)
	if state != bucket.NotDemoted {
		v.demoted, req.demoted = true, true
	}
	return v
}

// decideDegraded decides a request that Redis could not, by
// on_redis_error: allow, deny (503), or the local store's decision with
// the local_share limits.
//
// A call canceled because the client went away is not Redis failing: no
// policy applies, as no answer will be read. The request is not decided
// (not counted in decisions_total, not passed on to next, not charged to
// the local store); it counts in redis_errors_total{kind="canceled"}. A
// call written before the client left may still run in Redis: its
// buckets' charges stand (the gateway cannot tell whether it ran), and
// the concurrency slots it may have taken, reqs' (the request's, and on
// the demotion path the penalty tier's), are released at once rather
// than held till their lease lapses.
//
// So are they after any other failure of a call that was sent (all but
// breaker_open): a call that timed out, or whose connection broke after
// its write, may have run too, and its slots would otherwise stay taken
// for the whole concurrency_lease while the policy decides the request.
// That release runs in the background, so that it does not add its own
// wait to a request already kept waiting by Redis.
func (h *Handler) decideDegraded(x *exchange, cause error, reqs ...*request) verdict {
	kind := redisErrorKind(cause) // counted by conn.call
	if kind == errCanceled && x.r.Context().Err() != nil {
		for _, req := range reqs {
			h.releaseLeases(req)
		}
		return verdict{tier: x.tier, gone: true}
	}
	// While the breaker is open every call fails at once, unsent; the
	// breaker logged its opening, so only calls that reached Redis are
	// logged, and only they may have taken slots.
	if kind != errBreakerOpen {
		for _, req := range reqs {
			// Held for the release, which can outlive the request and its
			// config (a reload closes the client after the last hold).
			if req.leases > 0 && !unsent(cause) && h.conn.hold() {
				go func() {
					defer h.conn.release()
					h.releaseLeases(req)
				}()
			}
		}
		if c := h.logger.Check(zap.WarnLevel, "redis call failed; on_redis_error applies"); c != nil {
			c.Write(zap.String("on_redis_error", h.OnRedisError), zap.String("kind", kind), zap.Error(cause))
		}
	}
	t, req := x.tier, x.req
	switch h.OnRedisError {
	case PolicyAllow:
		return verdict{outcome: outcomeAllowed, tier: t, local: true}
	case PolicyDeny:
		return verdict{outcome: outcomeUnavailable, tier: t, local: true}
	}
	d, _ := h.local.Take(x.r.Context(), req.keys, req.localTakes()) // never fails
	return decidedVerdict(t, req, d, true)
}
