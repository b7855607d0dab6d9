package bucket

import (
	"context"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// The limits of the benchmarks. perfRoomy never denies within a
// benchmark (a million tokens, one a second back), and a bucket charged
// from it keeps its state in Redis for as long as it is short of full, so
// each call reads and writes real state rather than a missing key.
// perfTight is a client over its limit: one token, one an hour back.
var (
	perfRoomy = perfSpec(1_000_000, "1/s")
	perfTight = perfSpec(1, "1/1h")
)

func perfSpec(capacity int64, rate string) Spec {
	r, err := ParseRate(rate)
	if err != nil {
		panic(err)
	}
	s, err := Limit{Capacity: capacity, Rate: r}.Spec()
	if err != nil {
		panic(err)
	}
	return s
}

// perfDims are the dimensions of a request, as a gateway limits them.
var perfDims = []string{"api_key", "user", "ip"}

// perfRequest returns the keys and takes of one client's request on n
// buckets; with deny, the first bucket is perfTight and the request is
// denied once primed.
func perfRequest(k Keyer, client string, n int, deny bool) ([]string, []Take) {
	keys := make([]string, n)
	takes := make([]Take, n)
	for i := range n {
		keys[i] = k.Key(perfDims[i], client, "")
		takes[i] = Take{Spec: perfRoomy, Cost: 1}
	}
	if deny {
		takes[0].Spec = perfTight
	}
	return keys, takes
}

// perfPrime charges each bucket on its own (so that a tight bucket does
// not stop the others) until it has state that outlives the benchmark: a
// tight bucket is emptied, a roomy one is 10000 tokens short (2h45m to
// refill).
func perfPrime(b *testing.B, c redis.Scripter, keys []string, takes []Take) {
	b.Helper()
	for i, k := range keys {
		t := Take{Spec: takes[i].Spec, Cost: min(takes[i].Spec.Capacity, 10_000)}
		if _, err := (Redis{Client: c}).Take(context.Background(), []string{k}, []Take{t}); err != nil {
			b.Fatalf("priming %s: %v", k, err)
		}
	}
}

// BenchmarkDecide is the pure model deciding an allowed request: the
// reference the script is held to, and the work the in-process store does
// per request while Redis is away.
func BenchmarkDecide(b *testing.B) {
	for _, n := range []int{1, 3} {
		b.Run("buckets="+strconv.Itoa(n), func(b *testing.B) {
			_, takes := perfRequest(NewKeyer("bench:", ""), "client", n, false)
			states := make([]State, n)
			charged := make([]bool, n)
			now := time.Now().UnixMicro()
			b.ReportAllocs()
			for b.Loop() {
				now++
				for i := range states {
					states[i], charged[i] = State{Units: 500_000 * perfRoomy.Scale, Scale: perfRoomy.Scale, Last: now - 1000}, false
				}
				if d := Decide(now, takes, states, charged); !d.Allowed {
					b.Fatal("denied")
				}
			}
		})
	}
}

// BenchmarkKeyerKey is the key of one bucket: a SHA-256 (or HMAC-SHA-256)
// of the identity, encoded, with the prefix and the dimension.
func BenchmarkKeyerKey(b *testing.B) {
	for _, c := range []struct{ name, secret string }{{"sha256", ""}, {"hmac", "a-bench-secret"}} {
		b.Run(c.name, func(b *testing.B) {
			k := NewKeyer("rl:", c.secret)
			identity := "sk-live-0123456789abcdefghijklmnopqrstuv"
			b.ReportAllocs()
			for b.Loop() {
				if key := k.Key("api_key", identity, ""); len(key) == 0 {
					b.Fatal("empty key")
				}
			}
		})
	}
}

// BenchmarkDenyCacheCheck is the in-process answer to a client already over
// its limit (hit), and the price every other request pays for the cache
// (miss), alone and from 50 goroutines at once.
func BenchmarkDenyCacheCheck(b *testing.B) {
	const remembered = 10_000
	c := NewDenyCache(0, nil)
	k := NewKeyer("rl:", "")
	hits := make([]string, remembered)
	misses := make([]string, remembered)
	start := time.Now()
	for i := range hits {
		hits[i] = k.Key("api_key", "denied-"+strconv.Itoa(i), "")
		misses[i] = k.Key("api_key", "allowed-"+strconv.Itoa(i), "")
		c.Remember(hits[i], perfTight, 1, start, int64(time.Hour/time.Millisecond), 0)
	}
	for _, tc := range []struct {
		name string
		keys []string
		hit  bool
	}{{"hit", hits, true}, {"miss", misses, false}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if _, _, ok := c.Check(tc.keys[i%remembered], perfTight, 1); ok != tc.hit {
					b.Fatalf("Check = %v, want %v", ok, tc.hit)
				}
				i++
			}
		})
		b.Run(tc.name+"/parallel", func(b *testing.B) {
			b.SetParallelism(perfParallelism())
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					if _, _, ok := c.Check(tc.keys[i%remembered], perfTight, 1); ok != tc.hit {
						b.Errorf("Check = %v, want %v", ok, tc.hit)
						return
					}
					i++
				}
			})
		})
	}
}

// BenchmarkRedisTake is one decision in Redis through bucket.Redis: the
// EVALSHA round trip to a local redis-server, with the encoding of the
// arguments and the parsing of the reply. Serially it is the latency of one
// decision; in parallel (50 goroutines) the throughput of one client.
func BenchmarkRedisTake(b *testing.B) {
	srv := redistest.Start(b)
	opt := srv.Options()
	opt.PoolSize = 64
	client := redis.NewClient(opt)
	b.Cleanup(func() { client.Close() })
	store := Redis{Client: client}
	keyer := NewKeyer("bench:", "")
	for _, outcome := range []string{"allow", "deny"} {
		for _, n := range []int{1, 3} {
			name := outcome + "/buckets=" + strconv.Itoa(n)
			keys, takes := perfRequest(keyer, name, n, outcome == "deny")
			perfPrime(b, client, keys, takes)
			want := outcome == "allow"
			b.Run(name, func(b *testing.B) {
				ctx := context.Background()
				b.ReportAllocs()
				for b.Loop() {
					d, err := store.Take(ctx, keys, takes)
					if err != nil || d.Allowed != want {
						b.Fatalf("Take = %v, %v; want allowed %v", d.Allowed, err, want)
					}
				}
			})
			b.Run(name+"/parallel", func(b *testing.B) {
				b.SetParallelism(perfParallelism())
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					ctx := context.Background()
					for pb.Next() {
						d, err := store.Take(ctx, keys, takes)
						if err != nil || d.Allowed != want {
							b.Errorf("Take = %v, %v; want allowed %v", d.Allowed, err, want)
							return
						}
					}
				})
			})
		}
	}
}

// perfClients is the number of goroutines that the parallel benchmarks
// run, like the 50 connections of scripts/bench.sh.
const perfClients = 50

// perfParallelism is the b.SetParallelism that runs perfClients
// goroutines.
func perfParallelism() int {
	p := runtime.GOMAXPROCS(0)
	return (perfClients + p - 1) / p
}

// BenchmarkKeysOfOneIdentity builds the keys of an identity's requests
// and tokens buckets: hashed for each key (Key), and hashed once (Hash,
// KeyOf), as the handler does.
func BenchmarkKeysOfOneIdentity(b *testing.B) {
	const identity = "sk-live-0123456789abcdef0123456789"
	for _, secret := range []string{"", "s3cret"} {
		k := NewKeyer("rl:", secret)
		name := "sha256"
		if secret != "" {
			name = "hmac"
		}
		b.Run(name+"/key_each", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = k.Key("api_key", identity, "")
				_ = k.Key("api_key", identity, "tokens")
			}
		})
		b.Run(name+"/hash_once", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				id := k.Hash(identity)
				_ = k.KeyOf("api_key", &id, "", "")
				_ = k.KeyOf("api_key", &id, "tokens", "")
			}
		})
	}
}
