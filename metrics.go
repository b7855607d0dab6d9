package tokenbucket

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/llm"
)

// The collectors live for the whole process and are registered into the
// metrics registry of every config load (Caddy makes a new registry per
// load), as reverse_proxy's upstreams_healthy is: counters therefore
// continue across config reloads instead of restarting at zero, and the
// series of a tier removed by a reload keep their last value until the
// process restarts. No label carries an identity or a key: labels are tier
// and dimension names from the config and fixed value sets.
var tbMetrics = newCollectors()

// collectors are the token_bucket metrics, all named
// caddy_token_bucket_<name>.
type collectors struct {
	// decisions counts every request the handler saw, by its tier (the
	// penalty tier for a demoted identity) and what the client got:
	// allowed, denied (429), invalid_cost (400), invalid_body (400: the
	// body the cost is estimated from cannot be read as a request; 408
	// when it did not arrive within read_timeout, 413 over request_body's
	// max_size), skipped (no dimension of the tier had an identity, so no
	// bucket applied) or unavailable (503: on_redis_error deny).
	// It counts decisions made by Redis and by on_redis_error alike;
	// local_decisions_total is the on_redis_error share.
	decisions *prometheus.CounterVec
	// denials counts denied requests by tier and the dimension whose
	// bucket decided the denial.
	denials *prometheus.CounterVec
	// charged counts tokens charged by tier, dimension and unit (requests,
	// tokens or concurrent; a calendar quota's as requests-per-day,
	// tokens-per-month, ...): on allowed requests, and by settlements
	// whose usage was above the estimate. refunded counts tokens given
	// back: by settlements whose usage was below the charge (a call the
	// provider refused: all of it), and to a request held by on_limit
	// wait whose client left. charged − refunded is what was charged in
	// the end (with settle, the usage reported), which a bucket follows
	// within its bounds: no deeper than minus its capacity, no fuller than
	// full. Each counts once per request and series, however many of its
	// limits (model-scoped, shadow) share it (see request.leads).
	charged, refunded *prometheus.CounterVec
	// local counts the decisions made without Redis by on_redis_error:
	// allowed (local store, or policy allow), denied (local store) or
	// unavailable (policy deny).
	local *prometheus.CounterVec
	// redisDuration is the time of each limiter call that reached Redis
	// (not those refused by an open breaker), failed ones included.
	redisDuration prometheus.Histogram
	// redisErrors counts failed limiter calls by kind.
	redisErrors *prometheus.CounterVec
	// breakerTransitions counts the circuit breaker's state changes by the
	// state entered.
	breakerTransitions *prometheus.CounterVec
	// breakerOpen is read from the live breakers at scrape time.
	breakerOpen breakerCollector
	// shadowDenials counts the would-be denials of shadow limits, by tier
	// and the dimension of the shadow limit; the requests were allowed.
	shadowDenials *prometheus.CounterVec
	// concurrent is the requests in flight that hold a slot of a
	// concurrency limit, taken through this process, by tier and
	// dimension (Redis holds the count across gateways).
	concurrent *prometheus.GaugeVec
	// waiting is the requests this process holds on a reservation
	// (on_limit wait).
	waiting prometheus.Gauge
	// settlements counts the settlements of LLM usage (settle) by
	// outcome: settled (the usage was read and applied), not_reported (no
	// usage in the response: the estimate stands), invalid (usage with a
	// negative, fractional or overflowing number), unreadable (an unknown
	// or corrupt Content-Encoding, or a compressed body that decodes past
	// llm.MaxDecodedBody and llm.MaxDecodeRatio), failed (every Redis call
	// failed before it was sent: the estimate stands), unknown (the calls
	// failed, and one of them may have run in Redis, its reply lost: the
	// usage may have been applied).
	settlements *prometheus.CounterVec

	localChildren  [numOutcomes]prometheus.Counter
	settleChildren map[string]prometheus.Counter
	errorChildren  map[string]prometheus.Counter
	transitions    [3]prometheus.Counter // by gobreaker.State
}

// Label values of redis_errors_total's kind.
const (
	errTimeout     = "timeout"
	errConnection  = "connection"
	errBreakerOpen = "breaker_open"
	errCanceled    = "canceled"
	errOther       = "other"
)

// outcome is a decisions_total outcome.
type outcome uint8

// Outcomes of a request; see collectors.decisions.
const (
	outcomeAllowed outcome = iota
	outcomeDenied
	outcomeInvalidCost
	outcomeInvalidBody
	outcomeSkipped
	outcomeUnavailable
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"allowed", "denied", "invalid_cost", "invalid_body", "skipped", "unavailable"}

// redisDurationBuckets suit calls that take a fraction of a millisecond on
// a healthy network, up to the 50ms default timeout and beyond.
var redisDurationBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1}

func newCollectors() *collectors {
	const ns, sub = "caddy", "token_bucket"
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: name, Help: help}, labels)
	}
	m := &collectors{
		decisions: counter("decisions_total",
			"Requests decided by token_bucket, by tier and outcome (allowed, denied, invalid_cost, invalid_body, skipped, unavailable), whether Redis or on_redis_error decided.",
			"tier", "outcome"),
		denials: counter("denials_total",
			"Requests denied by token_bucket, by tier and the dimension whose bucket denied.",
			"tier", "dimension"),
		charged: counter("tokens_charged_total",
			"Tokens charged, by tier, dimension and unit (requests, tokens, concurrent, or a quota's: requests-per-day, tokens-per-month, ...): on allowed requests, and by settlements whose usage was above the estimate; once per request and series, however many limits (model-scoped, shadow) share it.",
			"tier", "dimension", "unit"),
		refunded: counter("tokens_refunded_total",
			"Tokens given back, by tier, dimension and unit: by settlements whose usage was below the charge, and to held requests whose client left; tokens_charged_total minus this is what was charged in the end (with settle, the usage reported), which a bucket follows within its bounds (from minus its capacity to full).",
			"tier", "dimension", "unit"),
		local: counter("local_decisions_total",
			"Requests decided without Redis by on_redis_error, by outcome (allowed, denied, unavailable).",
			"outcome"),
		redisDuration: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub,
			Name:    "redis_call_duration_seconds",
			Help:    "Duration of token_bucket's limiter calls to Redis (one Lua script run each), failed ones included.",
			Buckets: redisDurationBuckets}),
		redisErrors: counter("redis_errors_total",
			"Failed limiter calls to Redis, by kind (timeout, connection, breaker_open, canceled, other).",
			"kind"),
		breakerTransitions: counter("breaker_transitions_total",
			"State changes of the Redis circuit breakers, by the state entered (open, half_open, closed).",
			"to"),
		breakerOpen: breakerCollector{desc: prometheus.NewDesc(prometheus.BuildFQName(ns, sub, "breaker_open"),
			"Shared Redis clients whose circuit breaker is open or half-open, so that on_redis_error decides: 0 or 1 with one Redis configuration.",
			nil, nil)},
		shadowDenials: counter("shadow_denials_total",
			"Requests that a shadow limit would have denied (they were allowed), by tier and the dimension of the shadow limit.",
			"tier", "dimension"),
		concurrent: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "concurrent_requests",
			Help: "Requests in flight holding a slot of a concurrency limit (unit concurrent), taken through this process, by tier and dimension."},
			[]string{"tier", "dimension"}),
		waiting: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "waiting",
			Help: "Requests held on a reservation by on_limit wait in this process, every handler together (each bounded by its max_waiting)."}),
		settlements: counter("settlements_total",
			"Settlements of LLM token usage after the response, by outcome (settled, not_reported, invalid, unreadable, failed, unknown).",
			"outcome"),
		errorChildren: make(map[string]prometheus.Counter),
	}
	for _, o := range []outcome{outcomeAllowed, outcomeDenied, outcomeUnavailable} {
		m.localChildren[o] = m.local.WithLabelValues(outcomeNames[o])
	}
	m.settleChildren = make(map[string]prometheus.Counter)
	for _, o := range []string{settledOutcome, settleFailedOutcome, settleUnknownOutcome, llm.NotReported.String(), llm.Invalid.String(), llm.Unreadable.String()} {
		m.settleChildren[o] = m.settlements.WithLabelValues(o)
	}
	for _, kind := range []string{errTimeout, errConnection, errBreakerOpen, errCanceled, errOther} {
		m.errorChildren[kind] = m.redisErrors.WithLabelValues(kind)
	}
	for _, s := range []gobreaker.State{gobreaker.StateClosed, gobreaker.StateHalfOpen, gobreaker.StateOpen} {
		m.transitions[s] = m.breakerTransitions.WithLabelValues(breakerState(s))
	}
	return m
}

// register adds the collectors to reg. A collector already registered, by
// another token_bucket handler of the same config, is reused; a nil
// registry (no metrics in this context) registers nothing.
func (m *collectors) register(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{m.decisions, m.denials, m.charged, m.refunded, m.local,
		m.redisDuration, m.redisErrors, m.breakerTransitions, m.breakerOpen, m.settlements, m.shadowDenials, m.concurrent, m.waiting} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) && are.ExistingCollector == c {
				continue
			}
			return fmt.Errorf("registering token_bucket metrics: %w", err)
		}
	}
	return nil
}

// breakerCollector reports caddy_token_bucket_breaker_open from the
// breakers of the shared Redis clients at scrape time, so the value is
// right across reloads and for clients shared by several handlers.
type breakerCollector struct{ desc *prometheus.Desc }

// Describe implements prometheus.Collector.
func (b breakerCollector) Describe(ch chan<- *prometheus.Desc) { ch <- b.desc }

// Collect implements prometheus.Collector.
func (b breakerCollector) Collect(ch chan<- prometheus.Metric) {
	open := 0
	conns.Range(func(_, v any) bool {
		if c, ok := v.(*conn); ok && c.breaker.State() != gobreaker.StateClosed {
			open++
		}
		return true
	})
	ch <- prometheus.MustNewConstMetric(b.desc, prometheus.GaugeValue, float64(open))
}

// observeRedisCall records the duration of a limiter call that started at
// start; call it deferred.
func observeRedisCall(start time.Time) {
	tbMetrics.redisDuration.Observe(time.Since(start).Seconds())
}

// Outcomes of settlements_total besides llm.Status names.
const (
	settledOutcome       = "settled"
	settleFailedOutcome  = "failed"
	settleUnknownOutcome = "unknown"
)

// countSettlement counts a settlement by outcome: settled, failed,
// unknown, or the llm.Status of a response whose usage could not be used.
func countSettlement(outcome string) {
	tbMetrics.settleChildren[outcome].Inc()
}

// breakerChanged counts a breaker's state change. It runs inside the
// breaker's lock: it must not call the breaker.
func breakerChanged(to gobreaker.State) {
	if int(to) < len(tbMetrics.transitions) {
		tbMetrics.transitions[to].Inc()
	}
}

// countRedisError counts a failed limiter call and returns its kind.
func countRedisError(err error) string {
	kind := redisErrorKind(err)
	tbMetrics.errorChildren[kind].Inc()
	return kind
}

// redisErrorKind classifies a limiter call's error: breaker_open when the
// breaker refused the call (open, or half-open with its probe in flight),
// canceled when the client went away, timeout when the call ran out of
// time, connection when no connection could be made or it broke, and
// other for the rest (error replies, malformed replies).
func redisErrorKind(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
		return errBreakerOpen
	case errors.Is(err, context.Canceled):
		return errCanceled
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, redis.ErrPoolTimeout),
		errors.As(err, &ne) && ne.Timeout():
		return errTimeout
	case errors.As(err, &ne), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, redis.ErrClosed), errors.Is(err, redis.ErrPoolExhausted),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return errConnection
	}
	return errOther
}

// handlerMetrics are one handler's metric children, resolved at Provision
// so that the request path only adds to them: no label lookup, no
// formatting. A nil *handlerMetrics counts nothing.
type handlerMetrics struct {
	tiers  map[*tier]*[numOutcomes]prometheus.Counter
	limits map[*limit]limitMetrics
}

type limitMetrics struct {
	denials  prometheus.Counter // or, for a shadow limit, shadow_denials_total
	charged  prometheus.Counter
	refunded prometheus.Counter
	inUse    prometheus.Gauge // concurrency limits only
}

// limit returns l's metric children; none (nil fields) when m is nil.
func (m *handlerMetrics) limit(l *limit) limitMetrics {
	if m == nil {
		return limitMetrics{}
	}
	return m.limits[l]
}

// provisionObservability registers the metrics in the config's registry,
// resolves this handler's metric children and sets up the audit log.
func (h *Handler) provisionObservability(ctx caddy.Context) error {
	if err := tbMetrics.register(ctx.GetMetricsRegistry()); err != nil {
		return err
	}
	m := &handlerMetrics{
		tiers:  make(map[*tier]*[numOutcomes]prometheus.Counter, len(h.tiers)),
		limits: make(map[*limit]limitMetrics),
	}
	for _, t := range h.tiers {
		var outcomes [numOutcomes]prometheus.Counter
		for o := range outcomes {
			outcomes[o] = tbMetrics.decisions.WithLabelValues(t.name, outcomeNames[o])
		}
		m.tiers[t] = &outcomes
		for i := range t.limits {
			l := &t.limits[i]
			unit := unitName(l)
			if l.period != 0 {
				unit += "-per-" + l.period.String() // a quota's charges apart from its unit's bucket
			}
			lm := limitMetrics{
				denials:  tbMetrics.denials.WithLabelValues(t.name, l.dimension),
				charged:  tbMetrics.charged.WithLabelValues(t.name, l.dimension, unit),
				refunded: tbMetrics.refunded.WithLabelValues(t.name, l.dimension, unit),
			}
			if l.shadow {
				lm.denials = tbMetrics.shadowDenials.WithLabelValues(t.name, l.dimension)
			}
			if l.concurrent {
				lm.inUse = tbMetrics.concurrent.WithLabelValues(t.name, l.dimension)
			}
			m.limits[l] = lm
		}
	}
	h.metrics = m
	h.audit = h.newAuditor()
	return nil
}

// charges counts what d, which allowed req, charged its limits (local:
// in the local store): in tokens_charged_total, or with refund, given
// back in full, in tokens_refunded_total. Each series counts the charge of
// the limit that leads it (see request.leads), so that it is what was
// admitted.
func (m *handlerMetrics) charges(req *request, d *bucket.Decision, local, refund bool) {
	if m == nil {
		return
	}
	for i, l := range req.limits {
		c := req.charged(i, local)
		if c <= 0 || d.Buckets[i].Reason != bucket.Allowed || !req.leads(d, i, local) {
			continue
		}
		lm := m.limits[l]
		counter := lm.charged
		if refund {
			counter = lm.refunded
		}
		if counter != nil {
			counter.Add(float64(c))
		}
	}
}

// settledTokens counts a settlement of req that landed: adj[k] adjusted
// limit at[k], and the limits that lead their series count the usage
// above their charge in tokens_charged_total, below it in
// tokens_refunded_total.
func (m *handlerMetrics) settledTokens(req *request, d *bucket.Decision, at []int, adj []bucket.Adjust, local bool) {
	if m == nil {
		return
	}
	for k, i := range at {
		if !req.leads(d, i, local) {
			continue
		}
		lm := m.limits[req.limits[i]]
		switch delta := adj[k].Delta; {
		case delta > 0 && lm.charged != nil:
			lm.charged.Add(float64(delta))
		case delta < 0 && lm.refunded != nil:
			lm.refunded.Add(float64(-delta))
		}
	}
}

// count counts a request's outcome; local marks a decision made by
// on_redis_error.
func (m *handlerMetrics) count(t *tier, o outcome, local bool) {
	if m == nil {
		return
	}
	if c := m.tiers[t]; c != nil {
		c[o].Inc()
	}
	if local {
		tbMetrics.localChildren[o].Inc()
	}
}

// observe records a decision of the Redis or the local store: the
// outcome, the charges of an allowed request, or the denial and its audit
// entry, and the would-be denials of shadow limits with theirs.
func (h *Handler) observe(r *http.Request, t *tier, req *request, d *bucket.Decision, local bool) {
	m := h.metrics
	if m == nil {
		return
	}
	if d.ShadowDenied && d.Allowed { // what shadow limits alone would have denied
		for i, b := range d.Buckets {
			if b.Shadow && b.Reason != bucket.Allowed {
				if lm := m.limits[req.limits[i]]; lm.denials != nil {
					lm.denials.Inc()
				}
				h.audit.denied(r, t, req, d, i, local)
			}
		}
	}
	if d.Allowed {
		m.count(t, outcomeAllowed, local)
		m.charges(req, d, local, false)
		return
	}
	m.count(t, outcomeDenied, local)
	if lm := m.limits[req.limits[d.Deciding]]; lm.denials != nil {
		lm.denials.Inc()
	}
	h.audit.denied(r, t, req, d, d.Deciding, local)
}
