// Command scriptstats measures what each path of lua/token_bucket.lua costs
// Redis, and what one decision costs a single caller.
//
//	go run ./scripts/scriptstats -addr 127.0.0.1:6379
//
// Redis side: for each path (one bucket allowed, three allowed, one
// denied, three denied, and for scale a plain INCR, an empty script and
// scripts that run only the Redis commands of a decision) it
// makes -calls calls from -clients goroutines in -batches batches, the
// paths taking turns batch by batch; before each batch it runs CONFIG
// RESETSTAT, after it reads INFO commandstats and INFO cpu. usec_per_call is the time Redis spent executing the command
// (for a script, with the GET, SET and TIME it runs), not the round trip;
// redis-server's CPU time per call adds reading, parsing and replying. Each
// figure is the median over the batches; the target is checked against
// it. Then 5000 calls of each path from one caller, one at a time (also
// in turns), give usec_per_call without the other clients. Decisions go through bucket.Redis.Take, as the
// handler sends them.
//
// Caller side: one goroutine alternates PING and each decision, -samples
// times, and reports the p50 and p99 of each round trip.
//
// With -only, it makes -serial calls of the one path whose name starts
// with -only, one at a time, and prints nothing: scripts/bench.sh runs it
// against a redis-server under callgrind to count the instructions a call
// costs, a figure that does not move with the machine's load.
//
// It writes to keys under "scriptstats:" on the server at -addr, which it
// does not flush: point it at a server of its own (scripts/bench.sh starts
// one). The output is Markdown, for BENCHMARKS.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/bucket"
)

// Targets, in microseconds.
const (
	targetAllow1 = 6.0
	targetAllow3 = 12.0
	targetDeny   = 4.0
	targetP99    = 300.0 // one decision, single caller
	targetP50X   = 1.5   // one decision's p50 over PING's
)

// Baseline scripts: noop is the fixed price of EVALSHA; readFloor and
// writeFloor run only the Redis commands of a one-bucket denial (TIME,
// GET) and allowance (TIME, GET, SET PX), the least any script deciding a
// bucket in Redis pays, so that what the decision script adds to them is
// its own Lua work.
var (
	noop       = redis.NewScript("return 0")
	readFloor  = redis.NewScript("redis.call('TIME') redis.call('GET', KEYS[1]) return 0")
	writeFloor = redis.NewScript("redis.call('TIME') local v = redis.call('GET', KEYS[1]) " +
		"redis.call('SET', KEYS[1], v, 'PX', 3600000) return 0")
)

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "redis-server `host:port` (a server of its own: keys are left behind)")
	calls := flag.Int("calls", 100_000, "calls per path under load")
	clients := flag.Int("clients", 50, "concurrent callers under load")
	batches := flag.Int("batches", 20, "batches the calls of a path are split in, each measured on its own")
	samples := flag.Int("samples", 20_000, "round trips per path for the single-caller latency")
	only := flag.String("only", "", "make -serial calls of the path whose name starts with `prefix`, and nothing else")
	serial := flag.Int("serial", 1000, "calls of the -only path")
	flag.Parse()

	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: *addr, PoolSize: *clients + 4, MaxRetries: -1,
		ReadTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second})
	defer c.Close()
	if err := c.Ping(ctx).Err(); err != nil {
		fail("redis at %s: %v", *addr, err)
	}
	if *only != "" {
		callOnly(ctx, c, *only, *serial)
		return
	}
	paths := newPaths(ctx, c, *clients)

	fmt.Printf("### Redis side: µs per call, %d calls from %d clients in %d batches (medians over the batches)\n\n",
		*calls, *clients, *batches)
	fmt.Println("| path | command | usec_per_call | lowest batch | 1 caller | of which nested GET+SET+TIME | redis-server CPU µs/call | calls/s | target | |")
	fmt.Println("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
	for i, st := range measure(ctx, c, paths, *calls, *clients, *batches) {
		p := paths[i]
		fmt.Printf("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %s | %s |\n", p.name, p.command, st.perCall, st.perCallMin,
			st.serial, st.nested, st.cpu, st.rate, targetText(p.target), verdict(st.perCall, p.target))
	}

	fmt.Printf("\n### Caller side: one caller, %d round trips each, PING and the decisions interleaved\n\n", *samples)
	lat := latencies(ctx, c, paths, *samples)
	ping := lat[0]
	fmt.Printf("| round trip | p50 µs | p99 µs | p50 / PING p50 | p50 ≤ %.1f× PING | p99 ≤ %.0f µs |\n", targetP50X, targetP99)
	fmt.Println("|---|---:|---:|---:|---|---|")
	fmt.Printf("| PING | %.1f | %.1f | 1.00 | | |\n", ping.p50, ping.p99)
	for _, l := range lat[1:] {
		x := l.p50 / ping.p50
		fmt.Printf("| %s | %.1f | %.1f | %.2f | %s | %s |\n", l.name, l.p50, l.p99, x, yes(x <= targetP50X), yes(l.p99 <= targetP99))
	}
}

// callOnly makes n calls, one at a time, of the path whose name starts
// with prefix.
func callOnly(ctx context.Context, c *redis.Client, prefix string, n int) {
	for _, p := range newPaths(ctx, c, 1) {
		if !strings.HasPrefix(p.name, prefix) {
			continue
		}
		for range n {
			if err := p.call(ctx, 0); err != nil {
				fail("%s: %v", p.name, err)
			}
		}
		return
	}
	fail("no path starts with %q", prefix)
}

// path is one kind of call: a decision (keys, takes) or a plain command.
type path struct {
	name    string
	command string  // the command whose stats are read
	target  float64 // µs per call; 0: none
	keys    [][]string
	takes   []bucket.Take // per bucket, shared by every client
	allowed bool
	evals   int // calls of command per call of the path (0: 1)
	call    func(ctx context.Context, client int) error
}

// leased reports whether the path takes a concurrency slot.
func (p *path) leased() bool {
	return slices.ContainsFunc(p.takes, func(t bucket.Take) bool { return t.Lease > 0 })
}

// newPaths builds the paths, each client with its own identity, and primes
// every bucket so that it has state in Redis: roomy buckets (a million
// tokens, one a second back) are 10000 tokens short and never deny; the
// api_key bucket of a deny path (one token an hour) is empty.
func newPaths(ctx context.Context, c *redis.Client, clients int) []*path {
	roomy, tight := spec(1_000_000, "1/s"), spec(1, "1/1h")
	keyer := bucket.NewKeyer("scriptstats:", "")
	store := bucket.Redis{Client: c}
	decision := func(name string, n int, deny bool, target float64, edit ...func(*path)) *path {
		p := &path{name: name, command: "evalsha", target: target, allowed: !deny}
		for i := range n {
			t := bucket.Take{Spec: roomy, Cost: 1}
			if deny && i == 0 {
				t.Spec = tight
			}
			p.takes = append(p.takes, t)
		}
		for _, e := range edit {
			e(p)
		}
		for cl := range clients {
			var keys []string
			for i, dim := range []string{"api_key", "user", "ip", "model"}[:n] {
				k := keyer.Key(dim, name+"-"+strconv.Itoa(cl), "")
				prime := bucket.Take{Spec: p.takes[i].Spec, Cost: min(p.takes[i].Spec.Capacity, 10_000)}
				if p.takes[i].Lease > 0 {
					keys = append(keys, k+":concurrent") // starts empty, as a key with no request in flight
					continue
				}
				if _, err := store.Take(ctx, []string{k}, []bucket.Take{prime}); err != nil {
					fail("priming %s: %v", k, err)
				}
				keys = append(keys, k)
			}
			p.keys = append(p.keys, keys)
		}
		p.call = func(ctx context.Context, cl int) error {
			d, err := store.Take(ctx, p.keys[cl], p.takes)
			if err == nil && d.Allowed != p.allowed {
				err = fmt.Errorf("%s: allowed %v", p.name, d.Allowed)
			}
			return err
		}
		if p.leased() {
			// A request that holds a slot: the decision that takes it
			// and the release after the response, two calls.
			p.evals = 2
			var seq atomic.Int64
			p.call = func(ctx context.Context, cl int) error {
				takes := slices.Clone(p.takes)
				id := strconv.FormatInt(seq.Add(1), 36)
				for i := range takes {
					takes[i].LeaseID = id
				}
				d, err := store.Take(ctx, p.keys[cl], takes)
				if err == nil && !d.Allowed {
					err = fmt.Errorf("%s: denied", p.name)
				}
				if err == nil {
					_, err = store.Release(ctx, p.keys[cl][len(takes)-1:], id)
				}
				return err
			}
		}
		return p
	}
	shadow := func(p *path) { p.takes[len(p.takes)-1].Shadow = true }
	concurrent := func(p *path) {
		p.takes[len(p.takes)-1] = bucket.Take{Spec: bucket.ConcurrencySpec(1_000_000), Cost: 1, Lease: 600_000}
	}
	for _, s := range []*redis.Script{noop, readFloor, writeFloor} {
		if err := s.Load(ctx, c).Err(); err != nil {
			fail("loading a script: %v", err)
		}
	}
	floor := func(name string, s *redis.Script) *path {
		keys := make([]string, clients)
		for cl := range keys {
			keys[cl] = "scriptstats:floor:" + strconv.Itoa(cl)
			if err := c.Set(ctx, keys[cl], bucket.EncodeState(roomy.Full()), time.Hour).Err(); err != nil {
				fail("SET: %v", err)
			}
		}
		return &path{name: name, command: "evalsha", call: func(ctx context.Context, cl int) error {
			return s.EvalSha(ctx, c, keys[cl:cl+1]).Err()
		}}
	}
	return []*path{
		{name: "INCR (baseline)", command: "incr", call: func(ctx context.Context, cl int) error {
			return c.Incr(ctx, "scriptstats:incr:"+strconv.Itoa(cl)).Err()
		}},
		{name: "empty script (baseline)", command: "evalsha", call: func(ctx context.Context, _ int) error {
			return noop.EvalSha(ctx, c, nil).Err()
		}},
		floor("TIME+GET script (floor of a 1-bucket deny)", readFloor),
		floor("TIME+GET+SET script (floor of a 1-bucket allow)", writeFloor),
		decision("allow, 1 bucket", 1, false, targetAllow1),
		decision("allow, 3 buckets", 3, false, targetAllow3),
		decision("allow, 3 buckets, 1 of them in shadow", 3, false, targetAllow3, shadow),
		decision("allow, 3 buckets + 1 per model", 4, false, 0),
		decision("allow, 3 buckets + a concurrency slot, taken and released", 4, false, 0, concurrent),
		decision("deny, 1 bucket", 1, true, targetDeny),
		decision("deny, 3 buckets", 3, true, targetDeny),
	}
}

func spec(capacity int64, rate string) bucket.Spec {
	r, err := bucket.ParseRate(rate)
	if err != nil {
		fail("%v", err)
	}
	s, err := bucket.Limit{Capacity: capacity, Rate: r}.Spec()
	if err != nil {
		fail("%v", err)
	}
	return s
}

// stats are a path's figures, each the median over its batches.
type stats struct {
	perCall    float64 // usec_per_call of the command: its time inside Redis
	perCallMin float64 // the lowest batch's: the least disturbed by other processes
	nested     float64 // usec of GET, SET and TIME (run by the script) per call of the command
	cpu        float64 // redis-server CPU time (user+sys) per call: the command, parsing and I/O
	rate       float64 // calls per second
	serial     float64 // usec_per_call with one caller, one call at a time
}

// samples are a path's figures, one per batch.
type samples struct {
	per, nested, cpu, rate, serial []float64
}

// measure makes calls calls of each path from clients goroutines, in
// batches, each after a CONFIG RESETSTAT; then, as many rounds, serialCalls
// calls of each path from one caller. The paths take turns batch by batch,
// so that a change in the machine's load (other jobs, the CPU's clock)
// falls on all of them alike rather than on one. A batch in which Redis
// lost its CPU mid-command reads high; the median and the lowest batch are
// robust to a few such.
func measure(ctx context.Context, c *redis.Client, paths []*path, calls, clients, batches int) []stats {
	for _, p := range paths {
		for cl := range clients { // warm every connection
			if err := p.call(ctx, cl); err != nil {
				fail("%s: %v", p.name, err)
			}
		}
	}
	all := make([]samples, len(paths))
	for range batches {
		for i, p := range paths {
			resetStats(ctx, c)
			cpu0 := readInfo(ctx, c).cpu
			elapsed := run(ctx, p, calls/batches, clients)
			in := readInfo(ctx, c)
			n := callsOf(in, p)
			s := &all[i]
			s.per = append(s.per, in.usec[p.command]/n)
			if p.command == "evalsha" {
				s.nested = append(s.nested, (in.usec["get"]+in.usec["set"]+in.usec["time"])/n)
			}
			s.cpu = append(s.cpu, (in.cpu-cpu0)*1e6/n)
			s.rate = append(s.rate, float64(calls/batches)/elapsed.Seconds())
		}
	}
	for range batches {
		for i, p := range paths {
			resetStats(ctx, c)
			for range serialCalls / batches {
				if err := p.call(ctx, 0); err != nil {
					fail("%s: %v", p.name, err)
				}
			}
			in := readInfo(ctx, c)
			all[i].serial = append(all[i].serial, in.usec[p.command]/callsOf(in, p))
		}
	}
	out := make([]stats, len(paths))
	for i, s := range all {
		out[i] = stats{perCall: median(s.per), perCallMin: slices.Min(s.per), nested: median(s.nested),
			cpu: median(s.cpu), rate: median(s.rate), serial: median(s.serial)}
	}
	return out
}

// serialCalls is how many calls of each path one caller makes, one at a
// time: the command's time without 49 other clients' keys and buffers
// competing for the CPU's caches.
const serialCalls = 5000

func resetStats(ctx context.Context, c *redis.Client) {
	if err := c.ConfigResetStat(ctx).Err(); err != nil {
		fail("CONFIG RESETSTAT: %v", err)
	}
}

// callsOf returns the path's calls (requests) that INFO counts: its
// command's calls over the commands each makes.
func callsOf(in info, p *path) float64 {
	n := in.calls[p.command]
	if n == 0 {
		fail("INFO commandstats has no calls of %s", p.command)
	}
	return n / float64(max(1, p.evals))
}

// run makes calls calls of p from clients goroutines and returns the time
// they took.
func run(ctx context.Context, p *path, calls, clients int) time.Duration {
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	start := time.Now()
	for cl := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := cl; i < calls; i += clients {
				if err := p.call(ctx, cl); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	if err := <-errs; err != nil {
		fail("%s: %v", p.name, err)
	}
	return elapsed
}

// info is what INFO cpu and INFO commandstats say.
type info struct {
	cpu   float64            // used_cpu_user + used_cpu_sys, seconds
	usec  map[string]float64 // per command
	calls map[string]float64 // per command
}

func readInfo(ctx context.Context, c *redis.Client) info {
	text, err := c.Info(ctx, "cpu", "commandstats").Result()
	if err != nil {
		fail("INFO: %v", err)
	}
	in := info{usec: map[string]float64{}, calls: map[string]float64{}}
	for _, line := range strings.Split(text, "\n") {
		name, fields, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok {
			continue
		}
		if name == "used_cpu_user" || name == "used_cpu_sys" {
			v, _ := strconv.ParseFloat(fields, 64)
			in.cpu += v
			continue
		}
		cmd, ok := strings.CutPrefix(name, "cmdstat_")
		if !ok {
			continue
		}
		for _, f := range strings.Split(fields, ",") {
			k, v, _ := strings.Cut(f, "=")
			n, _ := strconv.ParseFloat(v, 64)
			switch k {
			case "usec":
				in.usec[cmd] = n
			case "calls":
				in.calls[cmd] = n
			}
		}
	}
	return in
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	v = slices.Clone(v)
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// latency is a round trip's percentiles in µs.
type latency struct {
	name     string
	p50, p99 float64
}

// latencies measures PING and each decision from one caller, interleaved
// so that each sees the same conditions.
func latencies(ctx context.Context, c *redis.Client, paths []*path, samples int) []latency {
	var decisions []*path
	for _, p := range paths {
		if p.keys != nil && !p.leased() { // one round trip each
			decisions = append(decisions, p)
		}
	}
	times := make([][]time.Duration, 1+len(decisions))
	for i := -1000; i < samples; i++ { // the first 1000 warm up
		t0 := time.Now()
		if err := c.Ping(ctx).Err(); err != nil {
			fail("PING: %v", err)
		}
		if i >= 0 {
			times[0] = append(times[0], time.Since(t0))
		}
		for j, p := range decisions {
			t0 := time.Now()
			if err := p.call(ctx, 0); err != nil {
				fail("%s: %v", p.name, err)
			}
			if i >= 0 {
				times[j+1] = append(times[j+1], time.Since(t0))
			}
		}
	}
	out := make([]latency, len(times))
	for i, ts := range times {
		slices.Sort(ts)
		name := "PING"
		if i > 0 {
			name = decisions[i-1].name
		}
		at := func(q float64) float64 { return float64(ts[int(q*float64(len(ts)-1))]) / 1e3 }
		out[i] = latency{name: name, p50: at(0.50), p99: at(0.99)}
	}
	return out
}

func targetText(t float64) string {
	if t == 0 {
		return ""
	}
	return "≤ " + strconv.FormatFloat(t, 'f', -1, 64)
}

func verdict(v, target float64) string {
	if target == 0 {
		return ""
	}
	return yes(v <= target)
}

func yes(ok bool) string {
	if ok {
		return "meets"
	}
	return "**short**"
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "scriptstats: "+format+"\n", args...)
	os.Exit(1)
}
