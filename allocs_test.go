//go:build !race

// The race detector's sync.Pool drops what is put back at random, and
// allocates: allocation counts are read without it.

package tokenbucket

import (
	"net/http"
	"runtime"
	"strconv"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// TestHandlerAllocations bounds the heap allocations of one request
// through ServeHTTP, on the paths BenchmarkHandlerServe measures, at what
// they are today (BENCHMARKS.md): a change that makes a request allocate
// more (a value that starts escaping to the heap, a closure, a map) fails
// here rather than only in a benchmark that nobody reads. The deny cache's
// answer is the cheap 429 a client retrying in a loop gets; its bytes are
// bounded too (a struct that grows past its size class shows there first).
func TestHandlerAllocations(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	for _, tc := range []struct {
		outcome  string
		dims     int
		max      float64
		maxBytes uint64 // 0: not bounded
	}{
		{perfAllow, 1, 27, 0},
		{perfAllow, 3, 36, 0},
		{perfDenyRedis, 1, 28, 0},
		{perfDenyRedis, 3, 37, 0},
		{perfDenyCache, 1, 7, 968},
		{perfDenyCache, 3, 10, 1512},
	} {
		name := tc.outcome + "/dims=" + strconv.Itoa(tc.dims)
		t.Run(name, func(t *testing.T) {
			h := perfHandler(t, srv.Addr, client, "allocs:"+name, tc.outcome, tc.dims)
			w, r := perfRequest()
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			var err error
			allocs := testing.AllocsPerRun(200, func() {
				if e := perfServe(h, w, r, next, tc.outcome); e != nil && err == nil {
					err = e
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			if allocs > tc.max {
				t.Errorf("%v allocations a request, want at most %v", allocs, tc.max)
			}
			if tc.maxBytes == 0 {
				return
			}
			const runs = 1000
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for range runs {
				_ = perfServe(h, w, r, next, tc.outcome)
			}
			runtime.ReadMemStats(&after)
			if b := (after.TotalAlloc - before.TotalAlloc) / runs; b > tc.maxBytes {
				t.Errorf("%d bytes allocated a request, want at most %d", b, tc.maxBytes)
			}
		})
	}
}
