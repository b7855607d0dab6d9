package tokenbucket

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// The handler benchmarks run ServeHTTP as Caddy would, with a replacer and
// vars on the request and Redis on a local redis-server, for one client
// sending the same request over and over. The request, its replacer and
// the recorder are reused, so what is measured (time and allocations) is
// the handler's own work plus the Redis round trip; Caddy's per-request
// setup is not in it. scripts/bench.sh measures the whole server with wrk.

// perfDimensions are the identities of a gateway: the user and the API
// key from headers, the client address. The first n are used.
var perfDimensions = []Dimension{
	{Name: "api_key", Identity: "{http.request.header.X-API-Key}"},
	{Name: "user", Identity: "{http.request.header.X-User}"},
	{Name: "ip", Identity: "{http.vars.client_ip}"},
}

// Limits: roomy never denies in a benchmark (and a charged bucket stays
// short of full, so its state stays in Redis); tight is a client over its
// limit, one token an hour.
var (
	perfRoomy = Limit{Capacity: 1_000_000, RefillRate: 1}
	perfTight = Limit{Capacity: 1, RefillRate: 1.0 / 3600}
)

// Outcomes of the handler benchmarks.
const (
	perfAllow     = "allow"      // every bucket allows: Redis, then next
	perfDenyRedis = "deny-redis" // the api_key bucket denies, decided by Redis (deny cache off)
	perfDenyCache = "deny-cache" // the same denial, answered by the deny cache
)

// BenchmarkHandlerServe is the handler's ServeHTTP for one and three
// dimensions: allowed, denied by Redis, and denied from the deny cache.
func BenchmarkHandlerServe(b *testing.B) {
	srv := redistest.Start(b)
	client := srv.Client(b)
	for _, outcome := range []string{perfAllow, perfDenyRedis, perfDenyCache} {
		for _, dims := range []int{1, 3} {
			name := outcome + "/dims=" + strconv.Itoa(dims)
			b.Run(name, func(b *testing.B) {
				h := perfHandler(b, srv.Addr, client, name, outcome, dims)
				w, r := perfRequest()
				next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
				if err := perfServe(h, w, r, next, outcome); err != nil { // the deny cache learns here
					b.Fatal(err)
				}
				calls := redistest.Calls(b, client, "evalsha")
				b.ReportAllocs()
				for b.Loop() {
					if err := perfServe(h, w, r, next, outcome); err != nil {
						b.Fatal(err)
					}
				}
				perfCheckCalls(b, outcome, redistest.Calls(b, client, "evalsha")-calls)
				perfCheckKeys(b, client, h.KeyPrefix, dims)
			})
		}
	}
}

// BenchmarkHandlerServeParallel is ServeHTTP from 50 goroutines at once, each
// with its own request, for three dimensions.
func BenchmarkHandlerServeParallel(b *testing.B) {
	srv := redistest.Start(b)
	client := srv.Client(b)
	for _, outcome := range []string{perfAllow, perfDenyCache} {
		name := "parallel/" + outcome + "/dims=3"
		b.Run(outcome+"/dims=3", func(b *testing.B) {
			h := perfHandler(b, srv.Addr, client, name, outcome, 3)
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			w, r := perfRequest()
			if err := perfServe(h, w, r, next, outcome); err != nil {
				b.Fatal(err)
			}
			p := runtime.GOMAXPROCS(0)
			b.SetParallelism((50 + p - 1) / p)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				w, r := perfRequest()
				for pb.Next() {
					if err := perfServe(h, w, r, next, outcome); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// perfHandler provisions a handler on the Redis at addr with its own key
// prefix, and primes its buckets so that each has state in Redis: a tight
// bucket is emptied, a roomy one is 10000 tokens short.
func perfHandler(b testing.TB, addr string, client *redis.Client, name, outcome string, dims int) *Handler {
	b.Helper()
	h := &Handler{
		Redis:      &RedisConfig{Address: []string{addr}, Timeout: caddy.Duration(time.Second), PoolSize: 64},
		KeyPrefix:  "bench:" + name + ":",
		Dimensions: slices.Clone(perfDimensions[:dims]),
		Tiers:      []Tier{{Name: "bench"}},
	}
	for _, d := range h.Dimensions {
		l := perfRoomy
		if outcome != perfAllow && d.Name == "api_key" {
			l = perfTight
		}
		l.Dimension = d.Name
		h.Tiers[0].Limits = append(h.Tiers[0].Limits, l)
	}
	if outcome == perfDenyRedis {
		h.DenyCache = -1
	}
	provisionHandler(b, h)

	// The keys as the handler builds them (bucket.Keyer; the address is
	// masked to its /32).
	keyer := bucket.NewKeyer(h.KeyPrefix, "")
	ids := map[string]string{"api_key": "sk-bench-0123456789abcdef", "user": "user-42", "ip": "203.0.113.7/32"}
	for _, l := range h.Tiers[0].Limits {
		rate, err := bucket.RateFromFloat(l.RefillRate)
		if err != nil {
			b.Fatal(err)
		}
		spec, err := bucket.Limit{Capacity: l.Capacity, Rate: rate}.Spec()
		if err != nil {
			b.Fatal(err)
		}
		key := keyer.Key(l.Dimension, ids[l.Dimension], "")
		t := []bucket.Take{{Spec: spec, Cost: min(l.Capacity, 10_000)}}
		if _, err := (bucket.Redis{Client: client}).Take(context.Background(), []string{key}, t); err != nil {
			b.Fatalf("priming %s: %v", key, err)
		}
	}
	return h
}

// perfRequest returns a recorder and a request from client
// 203.0.113.7 with its replacer and vars, as Caddy's server prepares them.
func perfRequest() (*httptest.ResponseRecorder, *http.Request) {
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	r.Header.Set("X-API-Key", "sk-bench-0123456789abcdef")
	r.Header.Set("X-User", "user-42")
	vars := map[string]any{caddyhttp.ClientIPVarKey: "203.0.113.7"}
	r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, vars))
	caddyhttp.NewTestReplacer(r) // caddy.NewReplacer with the http.* placeholders, under caddy.ReplacerCtxKey
	return httptest.NewRecorder(), r
}

// perfServe serves one request and checks that it had the outcome: a
// decision that fell back to on_redis_error would measure the wrong path.
func perfServe(h *Handler, w *httptest.ResponseRecorder, r *http.Request, next caddyhttp.Handler, outcome string) error {
	w.Body.Reset()
	if err := h.ServeHTTP(w, r, next); err != nil {
		return fmt.Errorf("ServeHTTP: %w", err)
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if v, _ := repl.Get("http.token_bucket.degraded"); v != nil {
		return errors.New("a decision fell back to on_redis_error")
	}
	want := "denied"
	if outcome == perfAllow {
		want = "allowed"
	}
	if v, _ := repl.Get("http.token_bucket.decision"); v != want {
		return fmt.Errorf("decision %v, want %s", v, want)
	}
	return nil
}

// perfCheckCalls checks that the deny cache answered without Redis and
// that every other outcome went to Redis.
func perfCheckCalls(b *testing.B, outcome string, calls int64) {
	b.Helper()
	switch {
	case outcome == perfDenyCache && calls != 0:
		b.Fatalf("%d EVALSHA calls with the deny cache answering, want 0", calls)
	case outcome != perfDenyCache && calls < int64(b.N):
		b.Fatalf("%d EVALSHA calls for %d requests", calls, b.N)
	}
}

// perfCheckKeys checks that the handler's buckets are the ones perfHandler
// primed: a key of another form (the masked address written differently,
// say) would be a bucket without state, cheaper to decide.
func perfCheckKeys(b *testing.B, c *redis.Client, prefix string, dims int) {
	b.Helper()
	keys, err := c.Keys(context.Background(), prefix+"*").Result()
	if err != nil {
		b.Fatal(err)
	}
	if len(keys) != dims {
		b.Fatalf("%d keys under %q, want the %d primed ones: %q", len(keys), prefix, dims, keys)
	}
}

// BenchmarkDecision measures one request through Handler.ServeHTTP against
// a local redis-server, as Caddy's server calls it (a fresh Replacer and
// request vars per request, via caddyhttp.PrepareRequest, and a recorder):
//
//   - baseline: that per-request setup and the next handler, without the
//     limiter; subtract it to get the limiter's own cost;
//   - allow_1_bucket, allow_3_buckets: allowed decisions on one bucket and
//     on three (user, API key, IP; one script call), with capacities no
//     benchmark can drain, so every iteration is allowed;
//   - allow_3_buckets+shadow, +quota, +concurrent: the same with a fourth
//     limit: a bucket in shadow, a monthly quota, or a concurrency limit
//     (its slot taken by the decision and released after next, a second
//     script call);
//   - deny_redis: a denial decided by Redis (deny_cache off);
//   - deny_cached: the same denial answered from the in-process deny cache.
func BenchmarkDecision(b *testing.B) {
	srv := redistest.Start(b)
	rdb := srv.Client(b)
	huge := func(dims ...string) []Limit {
		var ls []Limit
		for _, d := range dims {
			// 1e6 tokens/s is one unit per microsecond at scale 1, so a
			// capacity of 2^50 is exact and never runs out here.
			ls = append(ls, Limit{Dimension: d, Capacity: 1 << 50, RefillRate: 1e6})
		}
		return ls
	}
	empty := []Limit{{Dimension: "user", Capacity: 1, RefillRate: 1.0 / 86400}}
	// with returns huge("user", "api_key", "ip") and one more limit.
	with := func(l Limit) []Limit { return append(huge("user", "api_key", "ip"), l) }
	for _, bc := range []struct {
		name      string
		limits    []Limit // nil: no limiter
		denyCache int
		status    int
	}{
		{"baseline", nil, 0, http.StatusOK},
		{"allow_1_bucket", huge("user"), 0, http.StatusOK},
		{"allow_3_buckets", huge("user", "api_key", "ip"), 0, http.StatusOK},
		{"allow_3_buckets+shadow", with(Limit{Dimension: "user", Capacity: 1 << 50, RefillRate: 1e6, Shadow: true}), 0, http.StatusOK},
		{"allow_3_buckets+quota", with(Limit{Dimension: "user", Capacity: 1 << 50, Period: "month"}), 0, http.StatusOK},
		{"allow_3_buckets+concurrent", with(Limit{Dimension: "user", Capacity: 1 << 50, Unit: UnitConcurrent}), 0, http.StatusOK},
		{"deny_redis", empty, -1, http.StatusTooManyRequests},
		{"deny_cached", empty, 0, http.StatusTooManyRequests},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var h caddyhttp.MiddlewareHandler = passThrough{}
			if bc.limits != nil {
				h = benchHandler(b, srv.Addr, bc.limits, bc.denyCache)
			}
			if err := rdb.FlushAll(context.Background()).Err(); err != nil {
				b.Fatal(err)
			}
			if bc.status == http.StatusTooManyRequests {
				benchServe(b, h, http.StatusOK) // spend the one token
			}
			b.ReportAllocs()
			for b.Loop() {
				benchServe(b, h, bc.status)
			}
		})
	}
}

// benchHandler provisions a handler on the user, api_key and ip
// dimensions with one tier of limits.
func benchHandler(b *testing.B, addr string, limits []Limit, denyCache int) *Handler {
	b.Helper()
	h := &Handler{
		Redis: &RedisConfig{Address: []string{addr}, Timeout: caddy.Duration(time.Second)},
		Dimensions: []Dimension{
			{Name: "user", Identity: "{http.request.header.X-User}"},
			{Name: "api_key", Identity: "{http.request.header.X-Api-Key}"},
			{Name: "ip", Identity: "{http.vars.client_ip}"},
		},
		Tiers:        []Tier{{Name: "bench", Limits: limits}},
		OnRedisError: PolicyDeny, // a Redis failure would show as 503, never as a fast allow
		DenyCache:    denyCache,
		AuditOptions: AuditOptions{Audit: new(bool)}, // off: the denial log is not what is measured
	}
	return provisionHandler(b, h)
}

// passThrough is a middleware that only calls next: the baseline.
type passThrough struct{}

func (passThrough) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	return next.ServeHTTP(w, r)
}

var benchNext = caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
})

var benchServer = &caddyhttp.Server{}

// benchServe sends one request through h and checks its status.
func benchServe(b *testing.B, h caddyhttp.MiddlewareHandler, status int) {
	req := httptest.NewRequest(http.MethodGet, "http://gateway.test/v1/chat/completions", nil)
	req.Header.Set("X-User", "bench-user")
	req.Header.Set("X-Api-Key", "sk-bench-0123456789")
	rec := httptest.NewRecorder()
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, benchServer)
	if err := h.ServeHTTP(rec, req, benchNext); err != nil {
		b.Fatalf("ServeHTTP: %v", err)
	}
	if rec.Code != status {
		b.Fatalf("status %d, want %d: %s", rec.Code, status, rec.Body)
	}
}

// BenchmarkServeHTTP measures one decision through the handler: by Redis,
// and with Redis hung and the breaker open (the local store decides).
func BenchmarkServeHTTP(b *testing.B) {
	srv := redistest.Start(b)
	// A timeout long enough that a busy machine never turns a Redis
	// decision into a local one; opening the breaker below costs 3 of them.
	rc := &RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(time.Second),
		BreakerFailures: 3, BreakerCooldown: caddy.Duration(time.Hour)}
	h := provisionHandler(b, foHandler(rc, PolicyLocal, 1<<20))
	h.logger = zap.NewNop() // the timeouts that open the breaker are expected
	b.Run("redis", func(b *testing.B) {
		for b.Loop() {
			if r := serveUser(h, "bench"); !r.fromRedis() {
				b.Fatalf("not decided by redis: %d", r.status)
			}
		}
	})
	srv.Pause(b)
	for h.conn.breaker.State() != gobreaker.StateOpen {
		serveUser(h, "bench")
	}
	b.Run("redis_hung_breaker_open", func(b *testing.B) {
		for b.Loop() {
			if r := serveUser(h, "bench"); !r.degraded || r.status != http.StatusOK {
				b.Fatalf("status %d, degraded %v", r.status, r.degraded)
			}
		}
	})
}
