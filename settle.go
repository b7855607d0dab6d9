package tokenbucket

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/llm"
)

// Settle reads a response's actual LLM token usage and charges or gives
// back the difference from the request's estimated cost against the same
// tokens buckets, in one script call, once per request. Usage is read from
// the configured response header, else from the body by package llm: the
// provider's own top-level usage object of a JSON answer (OpenAI chat
// completions, Responses API, embeddings; Anthropic messages, whose cache
// tokens count as input), or the usage events of a text/event-stream
// (OpenAI's final usage chunk, the Responses API's response.completed,
// Anthropic's message_start and message_delta), whatever the
// Content-Encoding the answer comes in (identity, gzip, deflate, br, zstd;
// Caddy's encode directive, which runs inside this handler, included).
// The response passes through to the client unchanged: the usage is read
// from a copy as it streams (a compressed body is kept, up to
// llm.MaxEncodedBody, and decoded once at the end; a longer one is decoded
// as it passes). Usage that reached the gateway is settled however the
// response ends: a client that goes away or an upstream that aborts after
// the usage does not keep the estimate in place. A settlement whose Redis
// call fails is tried again (see settleRetryWaits). A response without
// usage settles at the estimate (nothing changes), but for a request that
// reached no model (an error answer that says so: see notRun), which
// settles at 0; usage with a negative, fractional or overflowing number
// keeps the estimate too, and is logged and counted (settlements_total{
// outcome="invalid"}). A request is never given back more than it was
// charged.
type Settle struct {
	// Header names a response header that carries the total tokens used,
	// a decimal integer from 0 to 2^53-1; when set, the body is not
	// parsed. It is read as the upstream sent it (or as a trailer), so
	// that header -<name> around this handler keeps it from clients and
	// not from the settlement. A response without it keeps its estimate
	// (counted as settlements_total{outcome="not_reported"}), as does one
	// with another value (outcome "invalid", logged).
	Header string `json:"header,omitempty"`
	// IncludeUsage makes OpenAI-style streams report their usage: a request
	// with "stream": true that does not ask for usage reaches the upstream
	// with "stream_options":{"include_usage":true} added (every other byte
	// unchanged) and without the client's Accept-Encoding (so that neither
	// the upstream nor Caddy's encode compresses the stream for the
	// client; reverse_proxy's transport asks for gzip itself unless its
	// compression is off, and decodes the answer before this handler sees
	// it), and the client receives
	// the stream it asked for: the usage-only final chunk ("choices":[])
	// and the "usage":null member of the other chunks are taken out.
	// Without it such a stream reports no usage and settles at the
	// estimate. Needs estimate, which reads the body.
	IncludeUsage bool `json:"include_usage,omitempty"`
	// KeepFailed keeps the estimate of every error answer without usage,
	// for an upstream that may answer an error after the model ran in the
	// providers' own error shape (LiteLLM's proxy answers its output
	// guardrails' 400, after generating, and its failures in OpenAI's
	// shape). Without it, an error that says the model did not run gives
	// the estimate back (see usageRecorder.notRun).
	KeepFailed bool `json:"keep_failed,omitempty"`
}

// usageRecorder passes a response through to the client and, with read,
// feeds every byte of it, as the upstream sent it, to a usage reader. With
// filterUsage it takes the usage chunks the gateway asked for out of what
// the client receives.
type usageRecorder struct {
	http.ResponseWriter
	read        bool // read the usage: the response is settled
	filterUsage bool // the body was sent with include_usage added
	// usedHeader is settle.header, the response header with the usage;
	// usedValue its value when the response's header was written, before
	// the handlers this one runs inside change it (see finish).
	usedHeader  string
	usedValue   string
	wroteHeader bool
	code        int                   // the final status, from the first WriteHeader
	errorObject bool                  // the body is the provider's error object (see finish)
	streamError bool                  // the body is a stream that opened with an error event
	loadOnly    bool                  // the body is Ollama's answer to a load or unload (see finish)
	usage       *llm.UsageReader      // from the first WriteHeader
	filter      *llm.UsageChunkFilter // nil: the client gets every byte
}

// WriteHeader starts the usage reader for the final response's
// Content-Type and Content-Encoding.
func (rec *usageRecorder) WriteHeader(code int) {
	if !rec.wroteHeader && code >= 200 {
		rec.wroteHeader, rec.code = true, code
		hdr := rec.Header()
		ct, ce := hdr.Get("Content-Type"), strings.Join(hdr.Values("Content-Encoding"), ",")
		if rec.usedHeader != "" {
			rec.usedValue = hdr.Get(rec.usedHeader)
		}
		if rec.read {
			rec.usage = llm.NewUsageReader(ct, ce)
		}
		// An encoded stream cannot be cut without re-encoding it: the
		// upstream ignored the missing Accept-Encoding, and the client
		// sees the usage chunk.
		if rec.filterUsage && llm.IsIdentity(ce) && llm.IsEventStream(ct) {
			rec.filter = llm.NewUsageChunkFilter(rec.ResponseWriter)
			hdr.Del("Content-Length") // the filter shortens the body
		}
	}
	rec.ResponseWriter.WriteHeader(code)
}

// Write reads p for usage before the client gets it, so that usage that
// reached the gateway counts even when the client is gone.
func (rec *usageRecorder) Write(p []byte) (int, error) {
	if !rec.wroteHeader {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.usage != nil {
		rec.usage.Write(p)
	}
	if rec.filter != nil {
		if _, err := rec.filter.Write(p); err != nil {
			return 0, err
		}
		return len(p), nil
	}
	return rec.ResponseWriter.Write(p)
}

// notRun reports whether the request reached no model: the answer is a
// 429 (too many requests: refused before it ran, by the provider or a
// proxy before it, as Azure API Management's) or Anthropic's 529
// overloaded_error, whatever their body; or another error status with the
// provider's own error object (see llm.UsageReader.ErrorObject: OpenAI's,
// Anthropic's, Mistral's and vLLM's shapes), which
// says it did not run it. OpenAI and Anthropic bill no request that fails,
// and the SDKs retry 409, 429 and 5xx twice by default, so an estimate kept
// for each would charge one failed call three times. A proxy between the
// gateway and the model may answer an error after the model ran (and was
// billed): its own page (nginx's HTML 502, Envoy's plain-text 503
// "upstream connect error or disconnect/reset", Cloudflare's 52x) is not
// the provider's error object, and a timeout (408, 504, 522, 524) or 502
// is not one even in JSON; a proxy that answers such errors in the
// providers' shape needs settle { keep_failed }. Nor is a reverse_proxy
// failure, which writes no status here (it cannot tell whether an earlier
// try of lb_retries reached the model), nor an answer whose body was not
// read (settle header). An event stream whose first event is the
// provider's error object (llm.UsageReader.OpenedWithError: Anthropic's
// overloaded_error after a 200) did not run it either: nothing came
// before the error.
func (rec *usageRecorder) notRun() bool {
	switch rec.code {
	case http.StatusTooManyRequests, 529:
		return true
	case http.StatusRequestTimeout, http.StatusBadGateway, http.StatusGatewayTimeout, 522, 524:
		return false
	}
	return rec.code >= 400 && rec.errorObject || rec.streamError
}

// Unwrap lets http.ResponseController reach Flush and the rest.
func (rec *usageRecorder) Unwrap() http.ResponseWriter { return rec.ResponseWriter }

// finish writes what the filter holds back and returns the tokens the
// response reports: the header's with settle.header, else the body's.
// partial means the count is a floor: an Anthropic stream cut after
// message_start reports its input, and an output that had only begun.
func (rec *usageRecorder) finish(s *Settle) (used int64, status llm.Status, partial bool) {
	if rec.filter != nil {
		_ = rec.filter.Close()
		rec.filter = nil
	}
	if s.Header != "" {
		// The value the upstream sent with the status: the header map is
		// shared with the handlers this one runs inside, and a deferred
		// header operation of theirs (header -X-Tokens-Used, run before
		// token_bucket in Caddy's order, to keep the count from clients)
		// takes the field out as the status is written. Else the value
		// now: a trailer of that name, which comes after the body.
		v := strings.TrimSpace(rec.usedValue)
		if v == "" {
			v = strings.TrimSpace(rec.Header().Get(s.Header))
		}
		if v == "" {
			return 0, llm.NotReported, false
		}
		n, err := parseCost(v)
		if err != nil {
			return 0, llm.Invalid, false
		}
		return n, llm.Found, false
	}
	if rec.usage == nil {
		return 0, llm.NotReported, false
	}
	u, status := rec.usage.Result()
	rec.errorObject, rec.streamError = rec.usage.ErrorObject(), rec.usage.OpenedWithError()
	rec.loadOnly = rec.code < 300 && rec.usage.LoadOnly()
	rec.usage.Release()
	rec.usage = nil
	return u.Total(), status, u.Partial
}

// serveNext calls next for an allowed request: through the usage
// recorder, settling after the response, when Redis or the local store of
// on_redis_error local decided the request and it is charged in tokens
// limits; through the usage chunk filter alone when its body was sent with
// include_usage added but nothing is settled (on_redis_error allow, or a
// demoted identity's tier has no tokens limit), so the client still gets
// the stream it asked for; else directly.
// The settlement runs also when next panics (reverse_proxy aborts a
// response it cannot finish with http.ErrAbortHandler), then the panic
// goes on.
//
// Concurrency slots the request took are held until next returns (see
// slots), also when it panics.
func (h *Handler) serveNext(x *exchange, v *verdict, next caddyhttp.Handler) error {
	if s := h.holdSlots(v); s != nil {
		defer s.release()
	}
	switch {
	case h.Settle != nil && v.decided && v.req.hasTokens() && !x.est.noInference:
		// With settle.header the body is not read for usage.
		rec := &usageRecorder{ResponseWriter: x.w, read: h.Settle.Header == "", filterUsage: x.est.streamUsage, usedHeader: h.Settle.Header}
		defer h.settle(x.r, x.repl, v, rec)
		return next.ServeHTTP(rec, x.r)
	case x.est.streamUsage:
		rec := &usageRecorder{ResponseWriter: x.w, filterUsage: true}
		defer rec.finish(&Settle{}) // writes what the filter holds
		return next.ServeHTTP(rec, x.r)
	}
	return next.ServeHTTP(x.w, x.r)
}

// settle charges or gives back the difference between the request's
// estimate and the usage its response reports, after the response: in
// Redis, or in the local store for a request that on_redis_error local
// decided (in the buckets it was charged in, at their local_share). A
// request that reached no model (see notRun) and reports no usage is
// settled at 0 tokens: its estimate is given back. So is a call that
// Ollama answered by loading or unloading the model (llm.UsageReader.LoadOnly:
// /api/generate without a prompt, /api/chat without messages, which
// ollama run and other clients send to load the model first), whatever
// keep_failed says, since it is no error.
func (h *Handler) settle(r *http.Request, repl *caddy.Replacer, v *verdict, rec *usageRecorder) {
	used, status, partial := rec.finish(h.Settle)
	if status != llm.Found && (rec.loadOnly || !h.Settle.KeepFailed && rec.notRun()) {
		used, status, partial = 0, llm.Found, false
	}
	if status != llm.Found {
		countSettlement(status.String())
		if status == llm.Invalid || status == llm.Unreadable {
			h.logger.Warn("llm usage unreadable; the estimate stands",
				zap.String("status", status.String()), zap.String("content_encoding", rec.Header().Get("Content-Encoding")))
		}
		return // no usage to settle with: the estimate stands
	}
	st := v.req.adjustments(&v.d, used, partial, v.local)
	repl.Set("http.token_bucket.tokens_used", used)
	if len(st.keys) == 0 {
		countSettlement(settledOutcome)
		return
	}
	if v.local {
		h.local.Settle(st.keys, st.adj)
		h.settled(st, nil, false)
		return
	}
	st.id, _ = repl.GetString("http.request.uuid")
	// The client may be gone: the settlement is the gateway's own call.
	sent := time.Now()
	err := h.conn.settle(context.WithoutCancel(r.Context()), st.id, st.keys, st.adj)
	mayHaveRun := err != nil && !neverSent(err)
	if err != nil {
		h.landed(&st, err)
		if h.retrySettle(sent, st, mayHaveRun, err) {
			return
		}
	}
	h.settled(st, err, mayHaveRun)
}

// settlement is the settlement of a request: for each bucket whose
// charge differs from the usage, its key, the difference, and the index
// of its limit in the request (for the metrics).
type settlement struct {
	req   *request
	d     bucket.Decision // the decision that charged req
	local bool            // on_redis_error local decided it
	id    string          // the request's id, settle.lua's marker
	keys  []string
	adj   []bucket.Adjust
	at    []int
	used  int64  // the tokens the response reports
	done  []bool // nil, or which buckets a call settled in part settled
}

// neverSent reports whether err proves that a settlement never reached
// Redis: the breaker refused it, or no connection was made (see unsent);
// not one that Redis Cluster settled in part (bucket.PartialSettleError).
func neverSent(err error) bool {
	if errors.As(err, new(*bucket.PartialSettleError)) {
		return false
	}
	return errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests) || unsent(err)
}

// settleRetryWaits are the waits before each retry of a settlement whose
// call failed (Redis unreachable or restarting, the breaker open, a reply
// lost): about 36 s in all, the failovers of Sentinel and Cluster
// included. A retry of a call that ran in Redis changes nothing (settle.lua
// keeps a marker per request, bucket.SettleTTL), so a settlement lands
// exactly once: a retry is made only while that marker surely lives (see
// settleRetryable).
var settleRetryWaits = [...]time.Duration{time.Second, 5 * time.Second, 30 * time.Second}

// settleRetryable reports whether a retry of a settlement first sent at
// sent may be sent at at, for calls that take up to timeout: it must have
// run in Redis a timeout before the marker of the first call, which ran
// after sent, can expire. With a long redis timeout (10 s: the last retry
// would run some 66 s after the first call) the last retries are not
// made, and the estimate stands.
func settleRetryable(sent, at time.Time, timeout time.Duration) bool {
	return !at.Add(2 * timeout).After(sent.Add(bucket.SettleTTL))
}

// maxSettleRetries bounds the settlements this process retries at once:
// through a long outage each waits with its keys and adjustments. Past it,
// a settlement that fails keeps the estimate at once.
const maxSettleRetries = 10_000

var settleRetrying atomic.Int64

// retrySettle retries in the background, after settleRetryWaits, a
// settlement whose first call, sent at sent, failed with err, and reports
// whether it does. It holds the Redis client meanwhile (a reload closes it
// after its last hold).
func (h *Handler) retrySettle(sent time.Time, st settlement, mayHaveRun bool, err error) bool {
	if settleRetrying.Add(1) > maxSettleRetries || !h.conn.hold() {
		settleRetrying.Add(-1)
		return false
	}
	h.logger.Warn("settling llm token usage failed; retrying", zap.Int64("used", st.used), zap.Error(err))
	go func() {
		defer settleRetrying.Add(-1)
		defer h.conn.release()
		err := err
		for _, wait := range settleRetryWaits {
			if !settleRetryable(sent, time.Now().Add(wait), h.conn.timeout) {
				break
			}
			t := time.NewTimer(wait)
			<-t.C
			if err = h.conn.settle(context.Background(), st.id, st.keys, st.adj); err == nil {
				break
			}
			mayHaveRun = mayHaveRun || !neverSent(err)
			h.landed(&st, err)
		}
		h.settled(st, err, mayHaveRun)
	}()
	return true
}

// settled records the end of a settlement: failed with err, the estimate
// standing unless mayHaveRun (a call that failed may have run in Redis,
// its reply lost), or done, its buckets recorded (see applied), but those
// that a call settled in part recorded already.
func (h *Handler) settled(st settlement, err error, mayHaveRun bool) {
	switch {
	case err != nil && mayHaveRun:
		countSettlement(settleUnknownOutcome)
		h.logger.Warn("settling llm token usage failed; a call whose reply was lost may have applied it",
			zap.Int64("used", st.used), zap.Error(err))
		return
	case err != nil:
		countSettlement(settleFailedOutcome)
		h.logger.Warn("settling llm token usage failed; the estimate stands",
			zap.Int64("used", st.used), zap.Error(err))
		return
	}
	countSettlement(settledOutcome)
	if done := st.done; done != nil {
		st = st.only(func(i int) bool { return !done[i] })
	}
	h.applied(st)
}

// landed records the buckets that err, a settlement's failed call, names
// as settled (a *bucket.PartialSettleError: Redis Cluster settled some
// hash-tag groups), those not recorded before (see applied), and marks
// them done in st.
func (h *Handler) landed(st *settlement, err error) {
	var p *bucket.PartialSettleError
	if !errors.As(err, &p) {
		return
	}
	if st.done == nil {
		st.done = make([]bool, len(st.keys))
	}
	now := make([]bool, len(st.keys))
	for _, i := range p.Settled {
		now[i] = !st.done[i]
		st.done[i] = true
	}
	h.applied(st.only(func(i int) bool { return now[i] }))
}

// applied records buckets of a settlement as settled: their tokens in the
// metrics, and, for those given tokens back, the end of their cached
// denials (Redis decides again).
func (h *Handler) applied(st settlement) {
	h.metrics.settledTokens(st.req, &st.d, st.at, st.adj, st.local)
	if h.denials == nil || st.local {
		return
	}
	for i, k := range st.keys {
		if st.adj[i].Delta < 0 {
			h.denials.Forget(k)
		}
	}
}

// only returns st with the buckets i (in st.keys) for which keep(i).
func (st settlement) only(keep func(i int) bool) settlement {
	keys, adj, at := st.keys, st.adj, st.at
	st.keys, st.adj, st.at = nil, nil, nil
	for i := range keys {
		if keep(i) {
			st.keys, st.adj, st.at = append(st.keys, keys[i]), append(st.adj, adj[i]), append(st.at, at[i])
		}
	}
	return st
}

// adjustments returns the settlement of req, decided as d, when its
// response reports used tokens: for each tokens bucket whose charge
// differs, the difference. used ≥ 0, so a bucket is never given back more
// than it was charged; partial usage (a floor) is never given back at all.
// A shadow bucket that would have denied was not charged, and is not
// settled. local gives the local store's specs (local_share), for a
// request that on_redis_error local decided.
func (req *request) adjustments(d *bucket.Decision, used int64, partial, local bool) (st settlement) {
	for i, l := range req.limits {
		if !l.tokens || d.Buckets[i].Reason != bucket.Allowed {
			continue
		}
		delta := used - req.charged(i, local)
		if partial {
			delta = max(delta, 0)
		}
		if delta != 0 {
			a := bucket.Adjust{Spec: l.spec, Delta: delta}
			if local {
				a.Spec = l.local
			}
			if w := req.takes[i].Window; w != nil {
				a.Window, a.WindowEnd = w.ChargedIn(req.decidedAt, d.Buckets[i].FullMS)
			}
			st.keys, st.adj, st.at = append(st.keys, req.keys[i]), append(st.adj, a), append(st.at, i)
		}
	}
	// A copy of the decision, not a pointer into the verdict: the verdict
	// stays on the stack.
	st.req, st.d, st.local, st.used = req, *d, local, used
	return st
}
