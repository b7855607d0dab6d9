package tokenbucket

import (
	"context"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// BenchmarkBatchHandler is the handler's ServeHTTP deciding allowed
// requests on three dimensions (one script call each) against one local
// redis-server, with redis { pipeline off } and on:
//
//   - serial: one client; reports the latency's p50 and p99 (batching must
//     not cost latency at low load);
//   - parallel=50: 50 clients at once; reports decisions/s, the Redis CPU
//     per decision (INFO cpu, user + system) and this process's CPU per
//     decision (the handler, the client and the benchmark's loop).
//
// Both settings run against the same server. go test -count repeats each
// sub-benchmark in a row; to alternate the settings on a busy machine, run
// the benchmark -count 1 in a loop.
func BenchmarkBatchHandler(b *testing.B) {
	srv := redistest.Start(b)
	admin := srv.Client(b)
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	for _, mode := range []string{"off", "on"} {
		on := mode == "on"
		b.Run("pipeline="+mode+"/serial/dims=3", func(b *testing.B) {
			h := benchPipelineHandler(b, srv.Addr, on)
			w, r := perfRequest()
			if err := perfServe(h, w, r, next, perfAllow); err != nil {
				b.Fatal(err)
			}
			lat := make([]time.Duration, 0, 1<<16)
			b.ReportAllocs()
			for b.Loop() {
				start := time.Now()
				err := perfServe(h, w, r, next, perfAllow)
				lat = append(lat, time.Since(start))
				if err != nil {
					b.Fatal(err)
				}
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
		})
		b.Run("pipeline="+mode+"/parallel=50/dims=3", func(b *testing.B) {
			h := benchPipelineHandler(b, srv.Addr, on)
			w, r := perfRequest()
			if err := perfServe(h, w, r, next, perfAllow); err != nil {
				b.Fatal(err)
			}
			p := runtime.GOMAXPROCS(0)
			b.SetParallelism((50 + p - 1) / p)
			before, cpu := benchRedisCPU(b, admin), benchProcessCPU()
			start := time.Now()
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				w, r := perfRequest()
				for pb.Next() {
					if err := perfServe(h, w, r, next, perfAllow); err != nil {
						b.Error(err)
						return
					}
				}
			})
			elapsed, cpu := time.Since(start), benchProcessCPU()-cpu
			redisCPU := benchRedisCPU(b, admin) - before
			n := float64(b.N)
			b.ReportMetric(n/elapsed.Seconds(), "decisions/s")
			b.ReportMetric(redisCPU.Seconds()*1e6/n, "redis-cpu-µs/op")
			b.ReportMetric(float64(cpu.Microseconds())/n, "gateway-cpu-µs/op")
		})
	}
}

// benchPipelineHandler provisions a handler on the three dimensions of
// perfRequest, with limits no benchmark drains, pipeline on or off.
func benchPipelineHandler(b *testing.B, addr string, pipeline bool) *Handler {
	b.Helper()
	h := &Handler{
		Redis: &RedisConfig{Address: []string{addr}, Timeout: caddy.Duration(time.Second), PoolSize: 64,
			Pipeline: &pipeline},
		KeyPrefix:  "bench:pipeline-" + strconv.FormatBool(pipeline) + ":",
		Dimensions: slices.Clone(perfDimensions),
		Tiers:      []Tier{{Name: "bench"}},
	}
	for _, d := range h.Dimensions {
		l := perfRoomy
		l.Dimension = d.Name
		h.Tiers[0].Limits = append(h.Tiers[0].Limits, l)
	}
	return provisionHandler(b, h)
}

// benchRedisCPU returns the CPU time (user + system) of the server at c.
func benchRedisCPU(b *testing.B, c *redis.Client) time.Duration {
	b.Helper()
	info, err := c.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var s float64
	for _, line := range strings.Split(info, "\r\n") {
		if k, v, _ := strings.Cut(line, ":"); k == "used_cpu_sys" || k == "used_cpu_user" {
			f, _ := strconv.ParseFloat(v, 64)
			s += f
		}
	}
	return time.Duration(s * float64(time.Second))
}

// benchProcessCPU returns the CPU time (user + system) of this process.
func benchProcessCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
