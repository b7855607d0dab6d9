// Package tokenbucket is a Caddy HTTP handler that rate-limits requests with
// token buckets kept in Redis, for API gateways and above all LLM inference
// backends: per tier, along several identity dimensions at once (user, API
// key, client IP, any placeholder), all decided in one atomic Lua script so
// that no two gateways can both spend the last token.
//
// The module is http.handlers.token_bucket; its Caddyfile directive is
// token_bucket, ordered after forward_auth.
package tokenbucket

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Values of on_deny.
const (
	DenyRespond = "respond"
	DenyError   = "error"
)

// Handler rate-limits requests with token buckets in Redis. For each request
// it resolves the tier, then each dimension's identity, and decides all of
// the tier's buckets for those identities in one Redis round trip: the
// request passes to the next handler only if every bucket has the tokens, and
// only then is any bucket charged. A denial is a 429 with Retry-After and the
// IETF RateLimit headers.
type Handler struct {
	// Redis says how to reach Redis (default 127.0.0.1:6379).
	Redis *RedisConfig `json:"redis,omitempty"`

	// KeyPrefix starts every Redis key (default "rl:"). It must not contain
	// '{' or '}'. Keys are <key_prefix>{<dimension>:<id>} followed by the
	// limit's unit (:tokens, :concurrent), a quota's period (:day, :week,
	// :month), :shadow and a model scope (:m:<model id>) as they apply, and
	// demote's :demoted and :denials; see the README's list and
	// bucket.Keyer for <id>.
	KeyPrefix string `json:"key_prefix,omitempty"`

	// KeySecret, when set, makes <id> an HMAC-SHA-256 of the identity under
	// this secret instead of a plain SHA-256, so that a reader of Redis
	// cannot test guesses of an identity. Placeholders work
	// ("{env.TOKEN_BUCKET_KEY_SECRET}"): an unknown placeholder is a config
	// error, and one that evaluates empty (an unset variable) means no
	// secret, with a warning logged at load. Changing it starts every
	// bucket afresh.
	KeySecret string `json:"key_secret,omitempty"`

	// Dimensions are the identities along which requests are limited, in
	// order. A request is limited in each dimension that its tier has a
	// limit for and whose identity resolves.
	Dimensions []Dimension `json:"dimensions,omitempty"`

	// IPv4Prefix is the number of leading bits kept of an identity that is
	// an IPv4 address, so one bucket covers a network (default 32: one
	// address). 1 to 32.
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`

	// IPv6Prefix is the same for IPv6 (default 64: one /64, the block an
	// ISP hands a single subscriber, so rotating addresses inside it does
	// not escape the limit). 1 to 128.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	// TierFrom is a placeholder template giving the request's tier name,
	// e.g. "{tier}" set by a map from the API key. Never point it at a raw
	// client header: a client could name its own tier. Empty (the default)
	// means every request is in default_tier.
	TierFrom string `json:"tier_from,omitempty"`

	// DefaultTier is the tier of requests whose tier_from is empty or names
	// no tier (default: the first tier).
	DefaultTier string `json:"default_tier,omitempty"`

	// Tiers are the named sets of limits. At least one.
	Tiers []Tier `json:"tiers,omitempty"`

	// Cost is what a request costs in limits of unit "tokens": an integer
	// from 0 to 2^53-1, or a placeholder template that gives one per request
	// (e.g. "{http.request.header.X-Estimated-Tokens}"). Default 1. A request
	// whose cost is not such an integer gets 400 invalid_cost. Limits of
	// unit "requests" always cost 1.
	Cost string `json:"cost,omitempty"`

	// Estimate, when set, makes the cost of "tokens" limits an estimate of
	// the LLM tokens of an OpenAI- or Anthropic-style JSON request body,
	// instead of Cost. See Estimate.
	Estimate *Estimate `json:"estimate,omitempty"`

	// Settle, when set, reads the actual LLM token usage from the response
	// and charges or gives back the difference from the estimate against
	// the same "tokens" buckets, once per request; a bucket may go into
	// debt, which blocks later requests until refill repays it. See Settle.
	Settle *Settle `json:"settle,omitempty"`

	// OpenAIHeaders adds the rate-limit headers that OpenAI clients parse:
	// x-ratelimit-limit-requests, x-ratelimit-remaining-requests,
	// x-ratelimit-reset-requests and the same three for -tokens (reset as a
	// duration such as "6m0s"), for the most constrained bucket of each
	// unit. (x-should-retry: false on a cost that can never fit is sent
	// whatever this says.)
	OpenAIHeaders bool `json:"openai_headers,omitempty"`

	// ErrorFormat is the shape of the JSON bodies of this handler's 429,
	// 400, 408 and 503 answers: "json" (the default; this handler's own,
	// see README), "openai" ({"error":{"message","type","param","code"}},
	// as OpenAI's API, so that the openai SDKs read error.code
	// "rate_limit_exceeded" and error.type "requests" or "tokens") or
	// "anthropic" ({"type":"error","error":{"type":"rate_limit_error",
	// "message"}}, as Anthropic's API). Messages name the limit, the wait
	// and the tier, never an identity.
	ErrorFormat string `json:"error_format,omitempty"`

	// Shadow puts every limit of the handler in shadow mode (see
	// Limit.Shadow): decided and charged, never enforced. For trying a
	// new configuration on live traffic before enforcing it.
	Shadow bool `json:"shadow,omitempty"`

	// ConcurrencyLease is how long a concurrency slot (unit "concurrent")
	// is held without word from its gateway (default 10m): the gateway
	// renews the lease of a response still being written every half lease,
	// so a long stream keeps its slot, and a gateway that dies frees its
	// slots when their leases lapse.
	ConcurrencyLease caddy.Duration `json:"concurrency_lease,omitempty"`

	// QuotaTimezone is the IANA time zone (e.g. "Europe/Berlin") whose
	// calendar the quotas (limits with a period) count in: days start at
	// its midnight, with its daylight-saving changes (a day may be 23 or
	// 25 hours). Default UTC.
	QuotaTimezone string `json:"quota_timezone,omitempty"`

	// OnLimit is what happens to a request its buckets deny: "reject" (the
	// default) answers 429; "wait" holds a request that its token buckets
	// would allow within MaxWait: the decision charges them at once (they
	// go below zero by at most what refills in MaxWait) and the request
	// goes on after the wait, so that waiting clients on every gateway are
	// served in the order they arrived, at exactly the refill rate. A
	// request that would need longer is denied at once, with a Retry-After
	// of the time until it would be held no longer than MaxWait. A client
	// that leaves while held gets its tokens back. Quotas and concurrency
	// limits never hold a request.
	OnLimit string `json:"on_limit,omitempty"`

	// MaxWait is the longest hold of on_limit wait: 1ms to 1m. Required
	// with on_limit wait (there is no default), not allowed without it.
	MaxWait caddy.Duration `json:"max_wait,omitempty"`

	// MaxWaiting bounds the requests this gateway holds at once with
	// on_limit wait (default 1000); beyond it, a request that would be
	// held is denied as with reject, so that a flood cannot pile up
	// goroutines. A held request keeps up to 1 MiB of its body in memory
	// (read ahead, so that a client that leaves is seen), so the default
	// bounds held bodies at about 1 GiB.
	MaxWaiting int `json:"max_waiting,omitempty"`

	// Demote moves an identity that keeps hammering while limited to a
	// stricter tier for a while. See Demote.
	Demote *Demote `json:"demote,omitempty"`

	// OnRedisError says what happens when Redis fails or does not answer in
	// time: "local" (the default) decides from buckets in this process's
	// memory with the same limits; "allow" lets the request through; "deny"
	// answers 503. Responses decided this way carry no RateLimit headers and
	// set {http.token_bucket.degraded} to "true".
	OnRedisError string `json:"on_redis_error,omitempty"`

	// LocalBuckets bounds the buckets held in memory for on_redis_error
	// local (default 500000, about 90 MB); the least recently used bucket
	// is forgotten first.
	LocalBuckets int `json:"local_buckets,omitempty"`

	// LocalShare scales every limit for on_redis_error local: with N
	// gateways, set it to 1/N so that together they admit about what the
	// shared Redis would (default 1: each gateway enforces the full limits
	// alone). Capacity becomes ⌊capacity·share⌋ (at least 1) and the refill
	// rate refill·share. 0 < local_share ≤ 1; a share that scales a refill
	// rate below what the in-process store can hold (under about 10^-10
	// tokens a second for a capacity of 1) is a config error.
	LocalShare float64 `json:"local_share,omitempty"`

	// DenyCache bounds the in-process cache of denials (default 100000
	// buckets; -1 turns it off). After Redis denies a bucket a cost, further
	// requests for that bucket and cost are denied in-process, with the
	// shrinking Retry-After, until the wait Redis gave has passed: a client
	// retrying in a tight loop costs Redis one call per Retry-After window.
	// It never allows a request and never denies one Redis would allow,
	// except that tokens given back by a refund are seen only when the
	// cached denial lapses. A denial holds only under the limit it was made
	// under, so an identity whose tier changed goes to Redis again (keys do
	// not name the tier). Off whenever Demote is set, whose denials must
	// all reach Redis to be counted: a size given with Demote is a load
	// error. See bucket.DenyCache.
	DenyCache int `json:"deny_cache,omitempty"`

	// OnDeny says how a denial is answered: "respond" (the default) writes
	// the 429 with its JSON body; "error" returns a Caddy error with status
	// 429 (or 400 for an invalid cost) so that handle_errors renders it. The
	// headers and placeholders are set either way.
	OnDeny string `json:"on_deny,omitempty"`

	// AuditOptions configure the audit log of denials: audit,
	// audit_window, audit_client_ip, audit_buckets.
	AuditOptions

	logger    *zap.Logger
	keyer     bucket.Keyer
	idSources []idSource // per dimension: where a template that is one placeholder reads it
	tierSrc   idSource   // the same for tier_from
	tiers     map[string]*tier
	deflt     *tier
	cost      int64 // -1: evaluate the Cost template per request
	conn      *conn
	local     *bucket.Local
	denials   *bucket.DenyCache
	demote    *demotion
	metrics   *handlerMetrics
	audit     *auditor
	poolKey   string
	// sharedKeys are the keys of what h holds in shared.
	sharedKeys []string
	now        func() time.Time
	// modelFirst: the request's buckets depend on its model (a limit
	// scoped by models, or a template naming {http.token_bucket.model}),
	// so the body is read before they are built.
	modelFirst bool
	leaseMS    int64 // ConcurrencyLease in milliseconds
	quotaLoc   *time.Location
	windows    *[4]atomic.Pointer[bucket.Windows] // by bucket.Period: the quota windows around now
	maxWaitMS  int64                              // on_limit wait: MaxWait in milliseconds; 0: reject
	waiting    *atomic.Int64                      // requests held by on_limit wait
	adminOrder string                             // its place in the admin API's list (see handlers)
}

// store decides a request's buckets; bucket.Redis and bucket.Local are
// stores.
type store interface {
	Take(ctx context.Context, keys []string, takes []bucket.Take) (bucket.Decision, error)
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.token_bucket",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision compiles the configuration (see compile) and takes a shared
// Redis client.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := h.compile(); err != nil {
		return err
	}
	if h.KeySecret != "" && !h.keyer.Keyed() {
		// Only placeholders evaluate empty: the template holds no secret.
		h.logger.Warn("key_secret evaluated empty: identities are hashed with plain SHA-256, so a reader of Redis can test guesses of them",
			zap.String("key_secret", h.KeySecret))
	}
	if err := h.provisionObservability(ctx); err != nil {
		return err
	}
	r, err := h.Redis.resolve()
	if err != nil {
		return err
	}
	c, key, err := acquire(ctx, r, h.logger)
	if err != nil {
		return fmt.Errorf("connecting to redis: %w", err)
	}
	h.conn, h.poolKey = c, key
	h.provisionShared()
	registerHandler(h)
	return nil
}

// shared holds what the handlers of one Redis configuration and
// key_prefix share in this process, and keep across config reloads as
// their buckets in Redis are kept: the count of requests held by on_limit
// wait (which each one's max_waiting bounds), and, per local_buckets, the
// on_redis_error local store, whose buckets would otherwise be full again
// after every reload during an outage.
var shared = caddy.NewUsagePool()

// pooled is a value in shared.
type pooled[T any] struct{ v T }

func (pooled[T]) Destruct() error { return nil }

// provisionShared takes h's waiting count and local store from shared.
func (h *Handler) provisionShared() {
	h.waiting = loadShared(h, "waiting", func() *atomic.Int64 { return new(atomic.Int64) })
	if h.OnRedisError == PolicyLocal {
		h.local = loadShared(h, "local "+strconv.Itoa(h.LocalBuckets), func() *bucket.Local {
			return bucket.NewLocal(h.LocalBuckets, h.now)
		})
	}
}

// loadShared returns the value of what (made by make if no other handler
// holds it) for h's Redis and key_prefix; Cleanup gives it back.
func loadShared[T any](h *Handler, what string, make func() T) T {
	key := what + "\x00" + h.poolKey + "\x00" + h.KeyPrefix
	v, _, _ := shared.LoadOrNew(key, func() (caddy.Destructor, error) { return pooled[T]{make()}, nil })
	h.sharedKeys = append(h.sharedKeys, key)
	return v.(pooled[T]).v
}

// Validate checks the configuration; it has no side effects.
func (h *Handler) Validate() error { return h.validate() }

// Cleanup gives back the shared Redis client and what h holds in shared.
func (h *Handler) Cleanup() error {
	unregisterHandler(h)
	for _, k := range h.sharedKeys {
		_, _ = shared.Delete(k)
	}
	if h.poolKey == "" {
		return nil
	}
	h.conn.dropLogger(h.logger)
	_, err := conns.Delete(h.poolKey)
	return err
}

// ServeHTTP limits one request, in four stages: build resolves its tier
// and buckets; decide decides them (deny cache, Redis, the demotion rule,
// on_redis_error) and returns a verdict without writing anything; record
// sets the placeholders and counts the verdict in the metrics and the
// audit log; respond answers it: next (and the settlement after it), a
// 429, a 400 or 408 for a cost that cannot be had, or a 503.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	// A config reload may drop this handler's Redis client while the
	// request, its stream and its settlement go on: keep it open till then.
	if h.conn.hold() {
		defer h.conn.release()
	}
	var x exchange
	h.build(&x, w, r)
	var v verdict
	h.decide(&x, &v)
	h.record(&x, &v)
	return h.respond(&x, &v, next)
}

var errDenied = errors.New("rate limit exceeded")

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
