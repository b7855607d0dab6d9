package tokenbucket

import (
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
)

// writeHeaders sets the rate-limit headers of a decision made by Redis:
// RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers), one
// item per bucket, and X-RateLimit-Limit/Remaining/Reset for the most
// constrained bucket.
//
// policy lists the buckets for RateLimit-Policy: every applied bucket, also
// when limits (and d) hold only some of them, as for a cached denial.
func (h *Handler) writeHeaders(hdr http.Header, policy, limits []*limit, d *bucket.Decision) {
	hdr["Ratelimit-Policy"] = []string{policyHeader(policy)}
	state := make([]byte, 0, 32*len(limits))
	for i, l := range limits {
		if i > 0 {
			state = append(state, ", "...)
		}
		b := &d.Buckets[i]
		state = append(state, '"')
		state = append(state, l.name...)
		state = append(state, `";r=`...)
		state = strconv.AppendInt(state, max(0, b.Remaining), 10)
		state = append(state, ";t="...)
		state = strconv.AppendInt(state, resetSeconds(b), 10)
	}
	hdr["Ratelimit"] = []string{string(state)}

	if h.OpenAIHeaders {
		openAIHeaders(hdr, limits, d)
	}
	i := constrained(limits, d)
	hdr["X-Ratelimit-Limit"] = []string{strconv.FormatInt(limits[i].spec.Capacity, 10)}
	hdr["X-Ratelimit-Remaining"] = []string{strconv.FormatInt(max(0, d.Buckets[i].Remaining), 10)}
	hdr["X-Ratelimit-Reset"] = []string{strconv.FormatInt(resetSeconds(&d.Buckets[i]), 10)}
}

// openAIHeaders sets x-ratelimit-{limit,remaining,reset}-{requests,tokens}
// for the most constrained bucket of each unit, as OpenAI's API sends them
// (reset as a Go duration such as "6m0s"), and x-should-retry: false when a
// cost can never fit.
func openAIHeaders(hdr http.Header, limits []*limit, d *bucket.Decision) {
	for _, unit := range [2]bool{false, true} {
		best, share := -1, 2.0
		for i, l := range limits {
			if l.tokens != unit {
				continue
			}
			b := &d.Buckets[i]
			s := float64(b.Remaining) / float64(l.spec.Capacity)
			switch b.Reason { // a denying bucket is the constraint:
			case bucket.RateLimited:
				s = -1 - float64(b.RetryAfterMS) // the longest wait, as Retry-After
			case bucket.CostExceedsCapacity:
				s = math.Inf(-1) // no wait helps
			}
			if s < share {
				best, share = i, s
			}
		}
		if best < 0 {
			continue
		}
		suffix := "-Requests"
		if unit {
			suffix = "-Tokens"
		}
		b := &d.Buckets[best]
		reset := b.FullMS
		if b.Reason == bucket.RateLimited {
			reset = b.RetryAfterMS
		}
		hdr["X-Ratelimit-Limit"+suffix] = []string{strconv.FormatInt(limits[best].spec.Capacity, 10)}
		hdr["X-Ratelimit-Remaining"+suffix] = []string{strconv.FormatInt(max(0, b.Remaining), 10)}
		hdr["X-Ratelimit-Reset"+suffix] = []string{(time.Duration(reset) * time.Millisecond).String()}
	}
	if d.Reason == bucket.CostExceedsCapacity {
		hdr["X-Should-Retry"] = []string{"false"}
	}
}

// policyHeader formats RateLimit-Policy: one item per applied bucket.
func policyHeader(limits []*limit) string {
	policy := make([]byte, 0, 40*len(limits))
	for i, l := range limits {
		if i > 0 {
			policy = append(policy, ", "...)
		}
		policy = append(policy, l.policy...)
	}
	return string(policy)
}

// resetSeconds is a bucket's t: the seconds until it can serve the request
// when it denies, else until it is full again; rounded up.
func resetSeconds(b *bucket.Result) int64 {
	if b.Reason == bucket.RateLimited {
		return (b.RetryAfterMS + 999) / 1000
	}
	return (b.FullMS + 999) / 1000
}

// constrained returns the index of the most constrained bucket: the one
// that decided a denial, else the one with the smallest share of its
// capacity left (the first on a tie).
func constrained(limits []*limit, d *bucket.Decision) int {
	if d.Deciding >= 0 {
		return d.Deciding
	}
	best, share := 0, 2.0
	for i, b := range d.Buckets {
		if s := float64(b.Remaining) / float64(limits[i].spec.Capacity); s < share {
			best, share = i, s
		}
	}
	return best
}

// setPlaceholders sets {http.token_bucket.*} for later handlers and logs.
func setPlaceholders(repl *caddy.Replacer, limits []*limit, d *bucket.Decision) {
	i := constrained(limits, d)
	repl.Set("http.token_bucket.remaining", max(0, d.Buckets[i].Remaining))
	if d.Allowed {
		repl.Set("http.token_bucket.decision", "allowed")
		return
	}
	repl.Set("http.token_bucket.decision", "denied")
	repl.Set("http.token_bucket.dimension", limits[i].dimension)
	if d.Reason == bucket.RateLimited {
		repl.Set("http.token_bucket.retry_after", d.RetryAfterSeconds())
	}
}

// deny answers a denied request: 429 with Retry-After, retry-after-ms and a
// JSON body, or a Caddy error for handle_errors when on_deny is "error".
func (h *Handler) deny(w http.ResponseWriter, t *tier, req *request, d *bucket.Decision) error {
	hdr := w.Header()
	hdr["Cache-Control"] = []string{"no-store"}
	l := req.limits[d.Deciding]
	body := make([]byte, 0, 160)
	body = append(body, `{"error":"`...)
	body = append(body, d.Reason.String()...)
	body = append(body, '"')
	if d.Reason == bucket.RateLimited {
		hdr["Retry-After"] = []string{strconv.FormatInt(d.RetryAfterSeconds(), 10)}
		hdr["Retry-After-Ms"] = []string{strconv.FormatInt(d.RetryAfterMS, 10)}
		body = append(body, `,"retry_after":`...)
		body = strconv.AppendInt(body, d.RetryAfterSeconds(), 10)
		body = append(body, `,"retry_after_ms":`...)
		body = strconv.AppendInt(body, d.RetryAfterMS, 10)
	} else {
		body = append(body, `,"cost":`...)
		body = strconv.AppendInt(body, req.takes[d.Deciding].Cost, 10)
		body = append(body, `,"capacity":`...)
		body = strconv.AppendInt(body, l.spec.Capacity, 10)
	}
	// Tier and dimension names are validated to [A-Za-z0-9_-]: no escaping.
	body = append(body, `,"tier":"`...)
	body = append(body, t.name...)
	body = append(body, `","dimension":"`...)
	body = append(body, l.dimension...)
	body = append(body, '"')
	if req.demoted {
		body = append(body, `,"demoted":true`...)
	}
	body = append(body, "}\n"...)
	if h.OnDeny == DenyError {
		return caddyhttp.Error(http.StatusTooManyRequests, errDenied)
	}
	return writeJSON(w, http.StatusTooManyRequests, body)
}

// invalidCost answers a request whose cost is not an integer from 0 to
// MaxCost with 400 invalid_cost. The bad value is not echoed.
func (h *Handler) invalidCost(w http.ResponseWriter, repl *caddy.Replacer) error {
	repl.Set("http.token_bucket.decision", "invalid_cost")
	if h.OnDeny == DenyError {
		return caddyhttp.Error(http.StatusBadRequest, errInvalidCost)
	}
	return writeJSON(w, http.StatusBadRequest,
		[]byte(`{"error":"invalid_cost","message":"the request's cost must be an integer from 0 to 9007199254740991"}`+"\n"))
}

// invalidBody answers a request whose body the estimator cannot read
// (not JSON, or larger than estimate.max_body) with 400 invalid_body, unless
// estimate.on_invalid gives a fallback cost.
func (h *Handler) invalidBody(w http.ResponseWriter, repl *caddy.Replacer) error {
	repl.Set("http.token_bucket.decision", "invalid_body")
	if h.OnDeny == DenyError {
		return caddyhttp.Error(http.StatusBadRequest, errInvalidBody)
	}
	return writeJSON(w, http.StatusBadRequest,
		[]byte(`{"error":"invalid_body","message":"the request body must be a JSON chat or completion request within the size limit"}`+"\n"))
}

// unavailable answers 503 for on_redis_error deny; never 429, which would
// tell the client it was over a limit it may not be over.
func (h *Handler) unavailable(w http.ResponseWriter) error {
	w.Header()["Retry-After"] = []string{"1"}
	return writeJSON(w, http.StatusServiceUnavailable,
		[]byte(`{"error":"rate_limiter_unavailable","message":"the rate limiter cannot reach its store; retry shortly"}`+"\n"))
}

func writeJSON(w http.ResponseWriter, status int, body []byte) error {
	hdr := w.Header()
	hdr["Content-Type"] = []string{"application/json"}
	hdr["Content-Length"] = []string{strconv.Itoa(len(body))}
	w.WriteHeader(status)
	_, err := w.Write(body)
	return err
}
