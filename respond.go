package tokenbucket

import (
	"cmp"
	"context"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
)

// addHeaders adds to hs the rate-limit headers of a decision made by
// Redis or the deny cache: RateLimit-Policy and RateLimit (draft-ietf-
// httpapi-ratelimit-headers), and X-RateLimit-Limit/Remaining/Reset for the
// most constrained bucket. RateLimit has one item per bucket when allowed
// and one per denying bucket when denied, so that a denial by Redis and the
// same denial from the deny cache, which knows only the denying buckets,
// carry the same items. Their integers are RFC 9651 Integers, at most 15
// digits: see sfInteger. It appends their text to b and returns it;
// writeHeaders or denyHeaders sets them.
//
// policy lists the buckets for RateLimit-Policy: every applied bucket, also
// when limits (and d) hold only some of them, as for a cached denial. When
// it is all of t's limits, t's precomputed header is sent.
//
// Shadow limits are left out of every header: the client sees nothing of
// them. A request on shadow limits alone gets no rate-limit header.
func (h *Handler) addHeaders(hs *headerSet, b []byte, in *inputs, t *tier, policy, limits []*limit, d *bucket.Decision) []byte {
	i := constrained(limits, d)
	if i < 0 {
		return b
	}
	if t.policy != "" && t.appliesAll(policy) {
		b = append(b, t.policy...)
	} else {
		b = appendPolicy(b, policy, h, in)
	}
	hs.cut(hRateLimitPolicy, b)
	first := true
	for j, l := range limits {
		r := &d.Buckets[j]
		if l.shadow || (!d.Allowed && r.Reason == bucket.Allowed) {
			continue // a denial speaks of the buckets that deny
		}
		if !first {
			b = append(b, ", "...)
		}
		first = false
		b = append(b, '"')
		b = append(b, l.name...)
		b = append(b, `";r=`...)
		b = strconv.AppendInt(b, sfInteger(max(0, r.Remaining)), 10)
		b = append(b, ";t="...)
		b = strconv.AppendInt(b, sfInteger(resetSeconds(r)), 10)
	}
	hs.cut(hRateLimit, b)

	if h.OpenAIHeaders {
		b = appendOpenAIHeaders(hs, b, limits, d)
	}
	b = strconv.AppendInt(b, limits[i].spec.Capacity, 10)
	hs.cut(hXRateLimitLimit, b)
	b = strconv.AppendInt(b, max(0, d.Buckets[i].Remaining), 10)
	hs.cut(hXRateLimitRemaining, b)
	b = strconv.AppendInt(b, resetSeconds(&d.Buckets[i]), 10)
	hs.cut(hXRateLimitReset, b)
	return b
}

// writeHeaders sets the rate-limit headers of an allowed request, every
// applied bucket in limits (see addHeaders).
func (h *Handler) writeHeaders(hdr http.Header, in *inputs, t *tier, limits []*limit, d *bucket.Decision) {
	var hs headerSet
	var arr [headerBuf]byte
	hs.setIn(hdr, h.addHeaders(&hs, arr[:0], in, t, limits, limits, d))
}

// openAINames are the headers of openai_headers, by unit (requests,
// tokens): limit, remaining, reset.
var openAINames = [2][3]headerName{
	{hXRateLimitLimitRequests, hXRateLimitRemainingRequests, hXRateLimitResetRequests},
	{hXRateLimitLimitTokens, hXRateLimitRemainingTokens, hXRateLimitResetTokens},
}

// appendOpenAIHeaders adds x-ratelimit-{limit,remaining,reset}-{requests,
// tokens} for the most constrained bucket of each unit, as OpenAI's API
// sends them (reset as a Go duration such as "6m0s"). It appends the
// numbers to b and returns it.
func appendOpenAIHeaders(hs *headerSet, b []byte, limits []*limit, d *bucket.Decision) []byte {
	for u, unit := range [2]bool{false, true} {
		best := mostConstrained(limits, d, unit)
		if best < 0 {
			continue
		}
		r := &d.Buckets[best]
		reset := r.FullMS
		if r.Reason == bucket.RateLimited {
			reset = r.RetryAfterMS
		}
		b = strconv.AppendInt(b, limits[best].spec.Capacity, 10)
		hs.cut(openAINames[u][0], b)
		b = strconv.AppendInt(b, max(0, r.Remaining), 10)
		hs.cut(openAINames[u][1], b)
		b = append(b, (time.Duration(reset) * time.Millisecond).String()...)
		hs.cut(openAINames[u][2], b)
	}
	return b
}

// mostConstrained returns the index of the most constrained of the
// buckets of a unit (tokens or requests) for openai_headers, -1 when there
// is none: a denying bucket first, the longest wait among them, else the
// smallest share of its capacity left (the first on a tie).
func mostConstrained(limits []*limit, d *bucket.Decision, tokens bool) int {
	best, share := -1, 2.0
	for i, l := range limits {
		if l.tokens != tokens || l.shadow || l.concurrent {
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
	return best
}

// appendPolicy appends RateLimit-Policy: one item per applied bucket that
// is not in shadow. A quota's w is the length in seconds of the window that
// holds the request's time (in's clock, read once per request, so that w is
// the window its charge was made in, also across a window's end): a day of
// 23 to 25 hours, a month of 28 to 31 days. h and in are used only for a
// quota.
func appendPolicy(b []byte, limits []*limit, h *Handler, in *inputs) []byte {
	first := true
	for _, l := range limits {
		if l.shadow {
			continue
		}
		if !first {
			b = append(b, ", "...)
		}
		first = false
		b = append(b, l.policy...)
		if l.period != 0 {
			w := h.quotaWindows(l.period, in.clock(h))
			b = strconv.AppendInt(b, (w[2]-w[1])/1e6, 10)
		}
	}
	return b
}

// appliesAll reports whether limits are all of t's limits, in order.
func (t *tier) appliesAll(limits []*limit) bool {
	if len(limits) != len(t.limits) {
		return false
	}
	for i, l := range limits {
		if l != &t.limits[i] {
			return false
		}
	}
	return true
}

// headerName is a header that a headerSet sets: an index in headerNames.
type headerName uint8

// The headers of the answers, each set at most once per answer.
const (
	hRateLimitPolicy headerName = iota
	hRateLimit
	hXRateLimitLimit
	hXRateLimitRemaining
	hXRateLimitReset
	hXRateLimitLimitRequests
	hXRateLimitRemainingRequests
	hXRateLimitResetRequests
	hXRateLimitLimitTokens
	hXRateLimitRemainingTokens
	hXRateLimitResetTokens
	hXShouldRetry
	hCacheControl
	hRetryAfter
	hRetryAfterMs
	hContentType
	hContentLength
	maxHeaders // bounds the headers of one headerSet
)

// headerNames are the headers' names, in canonical form (textproto).
var headerNames = [maxHeaders]string{
	hRateLimitPolicy:             "Ratelimit-Policy",
	hRateLimit:                   "Ratelimit",
	hXRateLimitLimit:             "X-Ratelimit-Limit",
	hXRateLimitRemaining:         "X-Ratelimit-Remaining",
	hXRateLimitReset:             "X-Ratelimit-Reset",
	hXRateLimitLimitRequests:     "X-Ratelimit-Limit-Requests",
	hXRateLimitRemainingRequests: "X-Ratelimit-Remaining-Requests",
	hXRateLimitResetRequests:     "X-Ratelimit-Reset-Requests",
	hXRateLimitLimitTokens:       "X-Ratelimit-Limit-Tokens",
	hXRateLimitRemainingTokens:   "X-Ratelimit-Remaining-Tokens",
	hXRateLimitResetTokens:       "X-Ratelimit-Reset-Tokens",
	hXShouldRetry:                "X-Should-Retry",
	hCacheControl:                "Cache-Control",
	hRetryAfter:                  "Retry-After",
	hRetryAfterMs:                "Retry-After-Ms",
	hContentType:                 "Content-Type",
	hContentLength:               "Content-Length",
}

// headerBuf is the size of the stack buffer for a headerSet's text: the
// numbers, lists and fixed values of the headers of a few buckets. More
// text moves it to the heap.
const headerBuf = 256

// headerSet collects a response's header values so that two allocations
// set them all: every value is appended to one buffer (numbers and lists
// built there, fixed strings copied), which becomes one string, sliced.
// Every header's []string is a sub-slice of one backing array with length
// and capacity 1, so that an append to one header (Header.Add) copies
// instead of writing into the next. The array is this response's own:
// Caddy's header replace writes into value slices in place, so a slice
// shared between responses would carry one response's edit into the next.
//
// The buffer is the caller's, passed in, so that it can live on the stack;
// the set is small for the same reason (see denyHeaders).
type headerSet struct {
	n     int
	names [maxHeaders]headerName
	ends  [maxHeaders]uint32 // where each value ends in the buffer
}

// cut adds header name with the bytes appended to buf since the last cut.
func (s *headerSet) cut(name headerName, buf []byte) {
	s.names[s.n], s.ends[s.n] = name, uint32(len(buf))
	s.n++
}

// cutJSON adds the Content-Type and Content-Length of a JSON body of n
// bytes, their text appended to buf, and returns buf.
func (s *headerSet) cutJSON(buf []byte, n int) []byte {
	buf = append(buf, "application/json"...)
	s.cut(hContentType, buf)
	buf = strconv.AppendInt(buf, int64(n), 10)
	s.cut(hContentLength, buf)
	return buf
}

// setIn sets the headers in hdr; buf is the buffer the cuts were made in.
func (s *headerSet) setIn(hdr http.Header, buf []byte) {
	all := string(buf)
	vals := make([]string, s.n)
	start := uint32(0)
	for i := range s.n {
		vals[i] = all[start:s.ends[i]]
		start = s.ends[i]
		hdr[headerNames[s.names[i]]] = vals[i : i+1 : i+1]
	}
}

// maxSFInteger is the largest Integer of a structured field: RFC 9651
// section 3.3.1 allows at most 15 decimal digits.
const maxSFInteger = 999_999_999_999_999

// sfInteger clamps n, ≥ 0, to a structured-field Integer. Capacities go up
// to 2^53 − 1 (16 digits) and a window or wait can be longer still; a
// larger number would make the whole RateLimit or RateLimit-Policy field
// unparsable, so it is sent as 999999999999999, still more than any client
// will wait for or spend.
func sfInteger(n int64) int64 { return min(n, maxSFInteger) }

// resetSeconds is a bucket's t: the seconds until it can serve the request
// when it denies, else until it is full again; rounded up.
func resetSeconds(b *bucket.Result) int64 {
	if b.Reason == bucket.RateLimited {
		return (b.RetryAfterMS + 999) / 1000
	}
	return (b.FullMS + 999) / 1000
}

// constrained returns the index of the most constrained bucket not in
// shadow: the one that decided a denial, else the one with the smallest
// share of its capacity left (the first on a tie); -1 when every bucket
// is in shadow.
func constrained(limits []*limit, d *bucket.Decision) int {
	if d.Deciding >= 0 {
		return d.Deciding
	}
	best, share := -1, 2.0
	for i, b := range d.Buckets {
		if limits[i].shadow {
			continue
		}
		if s := float64(b.Remaining) / float64(limits[i].spec.Capacity); s < share {
			best, share = i, s
		}
	}
	return best
}

// setPlaceholders sets {http.token_bucket.*} for later handlers and logs.
func setPlaceholders(repl *caddy.Replacer, limits []*limit, d *bucket.Decision) {
	if d.ShadowDenied {
		repl.Set("http.token_bucket.shadow_denied", shadowDenied(limits, d))
	}
	i := constrained(limits, d)
	if i >= 0 {
		repl.Set("http.token_bucket.remaining", max(0, d.Buckets[i].Remaining))
	}
	if d.Allowed {
		repl.Set("http.token_bucket.decision", "allowed")
		return
	}
	repl.Set("http.token_bucket.decision", "denied")
	repl.Set("http.token_bucket.dimension", limits[i].dimValue)
	if d.Reason == bucket.RateLimited {
		repl.Set("http.token_bucket.retry_after", d.RetryAfterSeconds())
	}
}

// shadowDenied returns the names of the shadow limits that would have
// denied the request (their RateLimit item names), comma-separated.
func shadowDenied(limits []*limit, d *bucket.Decision) string {
	var b strings.Builder
	for i, r := range d.Buckets {
		if r.Shadow && r.Reason != bucket.Allowed {
			if b.Len() > 0 {
				b.WriteByte(',')
			}
			b.WriteString(limits[i].name)
		}
	}
	return b.String()
}

// denyHeaders sets the headers of a denied request: the rate-limit headers
// of a decision made by Redis or the deny cache (not of one made by
// on_redis_error), Retry-After and retry-after-ms, Cache-Control: no-store,
// and for a body (nil when on_deny is "error") its Content-Type and
// Content-Length. A cost that can never fit carries x-should-retry: false,
// which the OpenAI and Anthropic SDKs obey instead of retrying twice.
//
// The caller writes the answer once this frame, which holds the headers'
// text, has returned. Caddy's frames take about 5.7 KiB of the 8 KiB stack a
// connection's goroutine starts with, and a deeper request makes the
// runtime copy the stack to a larger one (again after each GC shrinks it):
// on a cached 429 the handler's frames are kept within what is left.
func (h *Handler) denyHeaders(w http.ResponseWriter, in *inputs, v *verdict, body []byte) {
	var hs headerSet
	var arr [headerBuf]byte
	b := arr[:0]
	if !v.local {
		b = h.addHeaders(&hs, b, in, v.tier, v.policy, v.req.limits, &v.d)
	}
	d := &v.d
	b = append(b, "no-store"...)
	hs.cut(hCacheControl, b)
	if d.Reason == bucket.RateLimited {
		b = strconv.AppendInt(b, d.RetryAfterSeconds(), 10)
		hs.cut(hRetryAfter, b)
		b = strconv.AppendInt(b, d.RetryAfterMS, 10)
		hs.cut(hRetryAfterMs, b)
	} else {
		b = append(b, "false"...)
		hs.cut(hXShouldRetry, b)
	}
	if body != nil {
		b = hs.cutJSON(b, len(body))
	}
	hs.setIn(w.Header(), b)
}

// denialBody returns the JSON body of a denial in the error_format.
func (h *Handler) denialBody(v *verdict) []byte {
	if h.ErrorFormat == FormatOpenAI || h.ErrorFormat == FormatAnthropic {
		e := denialError(v.tier, v.req, &v.d)
		return appendErrorBody(make([]byte, 0, 256), h.ErrorFormat, &e)
	}
	return denyBody(v.tier, v.req, &v.d)
}

// denyBody returns the body of a denial in the json format.
func denyBody(t *tier, req *request, d *bucket.Decision) []byte {
	l := req.limits[d.Deciding]
	body := make([]byte, 0, 160)
	body = append(body, `{"error":"`...)
	body = append(body, d.Reason.String()...)
	body = append(body, '"')
	if d.Reason == bucket.RateLimited {
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
	return append(body, "}\n"...)
}

// rejectInput answers a request whose tokens cost cannot be had: with
// errInvalidBody, a body the estimator cannot read (not JSON, or larger than
// estimate.max_body), 400 invalid_body; with errBodyTimeout, a body that did
// not arrive within estimate.read_timeout, 408 request_timeout; with
// errBodyTooLarge, the Caddy error 413, as request_body gives it; else a cost
// that is not an integer from 0 to MaxCost, 400 invalid_cost. With on_deny
// error it returns a Caddy error for handle_errors instead. The bad value
// is not echoed.
func (h *Handler) rejectInput(w http.ResponseWriter, err error) error {
	if err == errBodyTooLarge {
		// As Caddy answers it without this handler (reverse_proxy).
		return caddyhttp.Error(http.StatusRequestEntityTooLarge, err)
	}
	status, e := inputError(err)
	if h.OnDeny == DenyError {
		return caddyhttp.Error(status, err)
	}
	return writeJSON(w, status, e.body(h.ErrorFormat))
}

// inputError returns the status and answer of an input error.
func inputError(err error) (int, *errorAnswer) {
	switch err {
	case errInvalidBody:
		return http.StatusBadRequest, &invalidBodyError
	case errBodyTooLarge: // answered by Caddy: see rejectInput
		return http.StatusRequestEntityTooLarge, &invalidBodyError
	case errBodyTimeout:
		return http.StatusRequestTimeout, &bodyTimeoutError
	case errMixedModels:
		return http.StatusBadRequest, &mixedModelsError
	}
	return http.StatusBadRequest, &invalidCostError
}

// record sets the placeholders of a verdict and counts it in the metrics
// and, for a denial, the audit log: every request is recorded here, once;
// of one whose client went away before it was decided, only the tier.
func (h *Handler) record(x *exchange, v *verdict) {
	repl := x.repl
	repl.Set("http.token_bucket.tier", v.tier.nameValue)
	if v.gone {
		return
	}
	// The price in the tier that decided, not in another the request was
	// priced in (demote prices both): none when that tier has no tokens
	// limit. A verdict without buckets (on_redis_error allow or deny) is
	// the request's own tier's.
	req := v.req
	if req == nil {
		req = x.req
	}
	if req != nil && req.priced {
		repl.Set("http.token_bucket.cost", req.cost)
	}
	if v.local {
		repl.Set("http.token_bucket.degraded", "true")
	}
	if v.demoted {
		repl.Set("http.token_bucket.demoted", "true")
	}
	if v.decided && v.d.WaitMS > 0 {
		repl.Set("http.token_bucket.wait_ms", v.d.WaitMS)
	}
	if v.decided {
		setPlaceholders(repl, v.req.limits, &v.d)
		h.observe(x.r, v.tier, v.req, &v.d, v.local)
		return
	}
	h.metrics.count(v.tier, v.outcome, v.local)
	decision := "allowed" // skipped, or on_redis_error allow
	switch {
	case v.outcome == outcomeUnavailable:
		decision = "unavailable"
	case v.err != nil:
		_, e := inputError(v.err)
		decision = e.code
	}
	repl.Set("http.token_bucket.decision", decision)
}

// respond answers a verdict: next (settling the usage after it when
// configured), the 429 with its headers, the 400 or 408 of an input error,
// the 503 of on_redis_error deny, or the 499 logged
// for a client that went away before Redis answered. Decisions made
// by on_redis_error carry no rate-limit headers: one node's numbers would
// mislead.
func (h *Handler) respond(x *exchange, v *verdict, next caddyhttp.Handler) error {
	w := x.w
	switch {
	case v.gone:
		// As reverse_proxy reports a client that closed its request.
		return caddyhttp.Error(statusClientClosedRequest, cmp.Or(context.Cause(x.r.Context()), v.err))
	case v.outcome == outcomeUnavailable:
		return h.unavailable(w)
	case v.err != nil:
		return h.rejectInput(w, v.err)
	case !v.decided: // skipped, or on_redis_error allow
		return h.serveNext(x, v, next)
	case v.local && v.d.Allowed:
		return h.serveNext(x, v, next)
	case !v.d.Allowed && h.OnDeny == DenyError:
		h.denyHeaders(w, &x.inputs, v, nil)
		return caddyhttp.Error(http.StatusTooManyRequests, errDenied)
	case !v.d.Allowed:
		body := h.denialBody(v)
		h.denyHeaders(w, &x.inputs, v, body)
		return writeBody(w, http.StatusTooManyRequests, body)
	}
	h.writeHeaders(w.Header(), &x.inputs, v.tier, v.req.limits, &v.d)
	if v.d.WaitMS > 0 && !h.await(x, v) {
		// As reverse_proxy reports a client that closed its request.
		return caddyhttp.Error(statusClientClosedRequest, context.Cause(x.r.Context()))
	}
	return h.serveNext(x, v, next)
}

// statusClientClosedRequest is the status logged for a client that went
// away before its answer (nginx's 499, which Caddy's reverse_proxy uses).
const statusClientClosedRequest = 499

// unavailable answers 503 for on_redis_error deny; never 429, which would
// tell the client it was over a limit it may not be over.
func (h *Handler) unavailable(w http.ResponseWriter) error {
	w.Header()["Retry-After"] = []string{"1"}
	return writeJSON(w, http.StatusServiceUnavailable, unavailableError.body(h.ErrorFormat))
}

// writeJSON answers with status and a JSON body.
func writeJSON(w http.ResponseWriter, status int, body []byte) error {
	var hs headerSet
	var arr [40]byte
	hs.setIn(w.Header(), hs.cutJSON(arr[:0], len(body)))
	return writeBody(w, status, body)
}

// writeBody writes the status and body; the headers are set.
func writeBody(w http.ResponseWriter, status int, body []byte) error {
	w.WriteHeader(status)
	_, err := w.Write(body)
	return err
}
