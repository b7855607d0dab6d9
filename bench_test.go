package tokenbucket

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// BenchmarkDecision measures one request through Handler.ServeHTTP against
// a local redis-server, as Caddy's server calls it (a fresh Replacer and
// request vars per request, via caddyhttp.PrepareRequest, and a recorder):
//
//   - baseline: that per-request setup and the next handler, without the
//     limiter; subtract it to get the limiter's own cost;
//   - allow_1_bucket, allow_3_buckets: allowed decisions on one bucket and
//     on three (user, API key, IP; one script call), with capacities no
//     benchmark can drain, so every iteration is allowed;
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
	for _, bc := range []struct {
		name      string
		limits    []Limit // nil: no limiter
		denyCache int
		status    int
	}{
		{"baseline", nil, 0, http.StatusOK},
		{"allow_1_bucket", huge("user"), 0, http.StatusOK},
		{"allow_3_buckets", huge("user", "api_key", "ip"), 0, http.StatusOK},
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
