package bucket

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// BenchmarkBatchedTake compares one decision on three buckets (one
// script call) against one local redis-server made three ways: plain, a
// client's own round trip per call, each on a pooled connection; batched,
// through Batched (concurrent calls share writes); autopipeline, through
// go-redis's AutoPipeliner (deferred face, half-duplex, each call a
// NoRetry command waited for until its context ends), the alternative
// Batched was measured against.
//
//   - serial: one caller; reports the latency's p50 and p99 (batching must
//     not cost latency at low load);
//   - parallel=50: 50 callers; reports decisions/s, the Redis CPU per
//     decision (INFO cpu, user + system, over the run), this process's CPU
//     per decision (the callers, the client, the loop) and the script's own
//     time per call (INFO commandstats).
//
// The modes run against the same server and the same buckets. go test
// -count repeats each sub-benchmark in a row; to alternate the modes on a
// busy machine, run the benchmark -count 1 in a loop.
func BenchmarkBatchedTake(b *testing.B) {
	srv := redistest.Start(b)
	ctx := context.Background()
	admin := srv.Client(b)
	keys, takes := perfRequest(NewKeyer("bench:batch:", ""), "client", 3, false)
	perfPrime(b, admin, keys, takes)
	for _, mode := range []string{"plain", "batched", "autopipeline"} {
		opt := srv.Options()
		opt.PoolSize = 64
		client := redis.NewClient(opt)
		b.Cleanup(func() { client.Close() })
		var sc redis.Scripter = client
		switch mode {
		case "batched":
			sc = NewBatched(client, BatchOptions{})
		case "autopipeline":
			sc = newAPScripter(b, client)
		}
		store := Redis{Client: sc}
		if _, err := store.Take(ctx, keys, takes); err != nil { // loads the script
			b.Fatal(err)
		}
		b.Run(mode+"/serial/buckets=3", func(b *testing.B) {
			lat := make([]time.Duration, 0, 1<<16)
			b.ReportAllocs()
			for b.Loop() {
				start := time.Now()
				d, err := store.Take(ctx, keys, takes)
				lat = append(lat, time.Since(start))
				if err != nil || !d.Allowed {
					b.Fatalf("Take = %v, %v", d.Allowed, err)
				}
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
		})
		b.Run(mode+"/parallel=50/buckets=3", func(b *testing.B) {
			before := benchRedisStats(b, admin)
			cpu := benchProcessCPU()
			start := time.Now()
			b.SetParallelism(perfParallelism())
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					d, err := store.Take(ctx, keys, takes)
					if err != nil || !d.Allowed {
						b.Errorf("Take = %v, %v", d.Allowed, err)
						return
					}
				}
			})
			elapsed := time.Since(start)
			cpu = benchProcessCPU() - cpu
			after := benchRedisStats(b, admin)
			n := float64(b.N)
			b.ReportMetric(n/elapsed.Seconds(), "decisions/s")
			b.ReportMetric((after.cpu-before.cpu)*1e6/n, "redis-cpu-µs/op")
			b.ReportMetric(float64(cpu.Microseconds())/n, "client-cpu-µs/op")
			if calls := after.calls - before.calls; calls > 0 {
				b.ReportMetric((after.usec-before.usec)/calls, "script-µs/call")
			}
		})
	}
}

// benchProcessCPU returns the CPU time (user and system) of this process:
// the callers, the client and the benchmark's own loop.
func benchProcessCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchStats is what a benchmark reads of Redis: its CPU time (user and
// system, seconds) and the EVALSHA calls with their total µs.
type benchStats struct{ cpu, calls, usec float64 }

func benchRedisStats(b *testing.B, c *redis.Client) benchStats {
	b.Helper()
	info, err := c.Info(context.Background(), "cpu", "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	var s benchStats
	for _, line := range strings.Split(info, "\r\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "used_cpu_sys", "used_cpu_user":
			f, _ := strconv.ParseFloat(v, 64)
			s.cpu += f
		case "cmdstat_evalsha":
			for _, kv := range strings.Split(v, ",") {
				name, val, _ := strings.Cut(kv, "=")
				f, _ := strconv.ParseFloat(val, 64)
				switch name {
				case "calls":
					s.calls = f
				case "usec":
					s.usec = f
				}
			}
		}
	}
	return s
}

// apScripter is the alternative that Batched was measured against:
// go-redis's AutoPipeliner (deferred face, half-duplex), each call
// submitted as a NoRetry command and waited for until its context ends.
type apScripter struct {
	client redis.UniversalClient
	ap     *redis.AutoPipeliner
}

func newAPScripter(b *testing.B, client redis.UniversalClient) apScripter {
	o := redis.DefaultAutoPipelineOptions()
	o.Unordered = true // stripes the queue; each caller waits for its own reply
	ap, err := client.AsyncAutoPipelineWithOptions(o)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ap.Close() })
	return apScripter{client, ap}
}

func (s apScripter) run(ctx context.Context, name, script string, keys []string, args []any) *redis.Cmd {
	c := newBatchCmd(ctx, name, script, keys, args)
	f := s.ap.Submit(ctx, c)
	if err := f.WaitContext(ctx); err != nil && ctx.Err() != nil {
		out := redis.NewCmd(ctx)
		out.SetErr(err)
		return out
	}
	return c.Cmd
}

func (s apScripter) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return s.run(ctx, "eval", script, keys, args)
}

func (s apScripter) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return s.run(ctx, "evalsha", sha1, keys, args)
}

func (s apScripter) EvalRO(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return s.run(ctx, "eval_ro", script, keys, args)
}

func (s apScripter) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return s.run(ctx, "evalsha_ro", sha1, keys, args)
}

func (s apScripter) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return s.client.ScriptExists(ctx, hashes...)
}

func (s apScripter) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return s.client.ScriptLoad(ctx, script)
}
