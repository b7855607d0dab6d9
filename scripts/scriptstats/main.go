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
// Peers and the floor, in the same turns: a 3-dimension decision made by
// go-redis/redis_rate v10 (one AllowN per dimension, 3 calls), by a
// classic hash-based token bucket script (one EVALSHA per dimension, see
// hashBucket), and the floor of any design that makes one unbatched round
// trip per decision, one PING. A call of these paths is one decision, so
// their figures are per decision, and they are compared with this
// project's "allow, 3 buckets, batched" (the same decision through
// bucket.Batched, as the gateway sends it by default: concurrent calls
// share one pipeline) in decisions/s and Redis CPU per decision, beside
// "allow, 3 buckets" (each call its own round trip, redis { pipeline off }).
//
// Redis Functions, in the same turns: the FCALL paths run the same code,
// lua.Source, loaded as a library function with FUNCTION LOAD, through
// the same bucket.Redis.Take (a Scripter that sends FCALL in place of
// EVALSHA), on the same keys as the EVALSHA path they are named after.
//
// Caller side: one goroutine makes PING, an empty script and each decision
// in turn, in an order shuffled every round, -samples rounds, and reports
// the p25, p50, p75 and p99 of each round trip (a peer's decision is its 3
// round trips), and the share of each path's round trips that took at most
// 1.5 times PING's p50.
//
// With -only, it makes -serial calls of the one path whose name starts
// with -only, one at a time, and prints nothing: scripts/bench.sh runs it
// against a redis-server under callgrind to count the instructions a call
// costs, a figure that does not move with the machine's load.
//
// It writes to keys under "scriptstats:" (and redis_rate's under
// "rate:scriptstats:") on the server at -addr, which it does not flush,
// and loads a function library named scriptstats: point it at a server of
// its own (scripts/bench.sh starts one). The output is Markdown, for
// BENCHMARKS.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/lua"
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

// hashBucket is the peer that keeps each bucket in a HASH, one call per
// bucket ("the seeds' hash script"): a classic token bucket written as the
// common hash-based Lua rate limiters write it (HMGET the tokens and the
// timestamp, refill by the time elapsed, take the cost, HSET both and
// PEXPIRE the key), the shape of the scripts of many gateways and blog
// posts; redis-cell answers the same one-key question natively with
// CL.THROTTLE, one call per key too. It reads the Redis clock with TIME,
// as this project's script and redis_rate's do (many such scripts take the
// caller's clock in ARGV instead and save that call). A call decides one
// bucket, so a 3-dimension request makes three calls, and they are not
// all-or-nothing.
//
// KEYS[1] the bucket; ARGV: capacity (tokens), rate (tokens per second),
// cost (tokens). Reply: {allowed (1 or 0), tokens left}.
var hashBucket = redis.NewScript(`
local key = KEYS[1]
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local state = redis.call('HMGET', key, 'tokens', 'timestamp')
local tokens = tonumber(state[1])
local last = tonumber(state[2])
if tokens == nil or last == nil then
  tokens, last = capacity, now
end
local elapsed = math.max(0, now - last)
tokens = math.min(capacity, tokens + elapsed * rate / 1000)
local allowed = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
end
redis.call('HSET', key, 'tokens', tokens, 'timestamp', now)
redis.call('PEXPIRE', key, math.ceil((capacity - tokens) / rate * 1000) + 1)
return {allowed, math.floor(tokens)}
`)

// functionName is the function that the library functionLibrary
// registers: lua.Source, this project's decision, unchanged, as the body
// of a function of KEYS and ARGV (a function gets them as arguments, a
// script as globals).
const functionName = "scriptstats_token_bucket"

var functionLibrary = "#!lua name=scriptstats\n" +
	"redis.register_function('" + functionName + "', function(KEYS, ARGV)\n" + lua.Source + "\nend)\n"

// fcaller is a redis.Scripter that runs every script call as an FCALL of
// one function: bucket.Redis.Take with it sends the same keys and
// arguments as with the client, and reads the reply the same way.
type fcaller struct {
	c  *redis.Client
	fn string
}

func (f fcaller) Eval(ctx context.Context, _ string, keys []string, args ...any) *redis.Cmd {
	return f.c.FCall(ctx, f.fn, keys, args...)
}

func (f fcaller) EvalSha(ctx context.Context, _ string, keys []string, args ...any) *redis.Cmd {
	return f.c.FCall(ctx, f.fn, keys, args...)
}

func (f fcaller) EvalRO(ctx context.Context, _ string, keys []string, args ...any) *redis.Cmd {
	return f.c.FCallRO(ctx, f.fn, keys, args...)
}

func (f fcaller) EvalShaRO(ctx context.Context, _ string, keys []string, args ...any) *redis.Cmd {
	return f.c.FCallRO(ctx, f.fn, keys, args...)
}

func (f fcaller) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return f.c.ScriptExists(ctx, hashes...)
}

func (f fcaller) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return f.c.ScriptLoad(ctx, script)
}

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
	fmt.Println("A peer's call is a decision, its three calls; its figures are per decision.")
	fmt.Println()
	fmt.Println("| path | command | usec_per_call | lowest batch | 1 caller | of which nested commands | redis-server CPU µs/call | calls/s | target | |")
	fmt.Println("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
	sts := measure(ctx, c, paths, *calls, *clients, *batches)
	for i, st := range sts {
		p := paths[i]
		command := p.command
		if p.evals > 1 {
			command = strconv.Itoa(p.evals) + " × " + command
		}
		fmt.Printf("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %s | %s |\n", p.name, command, st.perCall, st.perCallMin,
			st.serial, st.nested, st.cpu, st.rate, targetText(p.target), verdict(st.perCall, p.target))
	}
	printPeers(paths, sts, *clients)
	printFunctions(paths, sts)

	fmt.Printf("\n### Caller side: one caller, %d round trips each, PING and the decisions interleaved, in an order shuffled every round\n\n", *samples)
	lat := latencies(ctx, c, paths, *samples)
	ping := lat[0]
	fmt.Printf("| round trip | p25 µs | p50 µs | p75 µs | p99 µs | p50 / PING p50 | share ≤ %.1f× PING p50 | p50 ≤ %.1f× PING | p99 ≤ %.0f µs |\n", targetP50X, targetP50X, targetP99)
	fmt.Println("|---|---:|---:|---:|---:|---:|---:|---|---|")
	fmt.Printf("| PING | %.1f | %.1f | %.1f | %.1f | 1.00 | %.0f%% | | |\n", ping.p25, ping.p50, ping.p75, ping.p99, 100*ping.within)
	for _, l := range lat[1:] {
		x := l.p50 / ping.p50
		fmt.Printf("| %s | %.1f | %.1f | %.1f | %.1f | %.2f | %.0f%% |", l.name, l.p25, l.p50, l.p75, l.p99, x, 100*l.within)
		if l.judged {
			fmt.Printf(" %s | %s |\n", yes(x <= targetP50X), yes(l.p99 <= targetP99))
		} else {
			fmt.Println(" | |")
		}
	}
}

// Targets of the comparison with the peers (issue 16): this project's
// 3-dimension decisions per second over the unbatched PING floor's and
// over redis_rate's.
const (
	targetOverFloor     = 1.0
	targetOverRedisRate = 3.0
	// Redis CPU per decision, batched, over the same decision unbatched
	// (redis { pipeline off }: each call its own round trip).
	targetCPUOverUnbatched = 0.6
)

// printPeers prints the comparison of this project's 3-dimension decision
// with the peers' and the PING floor: decisions per second and Redis CPU
// per decision, and their ratios.
func printPeers(paths []*path, sts []stats, clients int) {
	var ours, floor int = -1, -1
	var rows []int
	for i, p := range paths {
		switch p.role {
		case roleOurs:
			ours = i
		case roleUnbatched, rolePipelined, rolePeer:
			rows = append(rows, i)
		case roleFloor:
			floor = i
		}
	}
	if ours < 0 || floor < 0 {
		return
	}
	rows = append(append([]int{ours}, rows...), floor)
	fmt.Printf("\n### Peers and the floor: 3-dimension decisions, every bucket allowing, %d callers (medians over the batches)\n\n", clients)
	fmt.Println("A decision decides all three dimensions: this project's is one EVALSHA, batched with the concurrent")
	fmt.Println("callers' as the gateway sends it by default (redis { pipeline on }: one lua.Batch call for the batch;")
	fmt.Println("on a Cluster, one EVALSHA per decision in one pipeline), or each on its own (pipeline off);")
	fmt.Println("a peer's is one call per dimension, the floor's one PING (the least that any design making one")
	fmt.Println("unbatched round trip per decision pays). Ratios: the row's figure over this project's and over the")
	fmt.Println("floor's, of the medians; in brackets, the median of the ratios batch by batch (the paths took turns,")
	fmt.Println("so each batch's pair ran seconds apart).")
	fmt.Println()
	fmt.Println("| design | Redis calls per decision | decisions/s | ÷ this project | ÷ PING floor | redis-server CPU µs per decision | ÷ this project | ÷ PING floor | µs executing commands per decision |")
	fmt.Println("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	o, f := sts[ours], sts[floor]
	for _, i := range rows {
		p, st := paths[i], sts[i]
		name := p.name
		switch p.role {
		case roleOurs:
			name = "this project: " + name + " (pipeline on, the default)"
		case roleUnbatched:
			name = "this project: " + name + ", unbatched (pipeline off)"
		case rolePipelined:
			name = "this project: " + name + " (each call its own EVALSHA, as on a Cluster)"
		}
		fmt.Printf("| %s | %d | %.0f | %.2f [%.2f] | %.2f [%.2f] | %.2f | %.2f [%.2f] | %.2f [%.2f] | %.2f |\n", name, max(1, p.evals), st.rate,
			st.rate/o.rate, pairedRatio(st.batches.rate, o.batches.rate), st.rate/f.rate, pairedRatio(st.batches.rate, f.batches.rate),
			st.cpu, st.cpu/o.cpu, pairedRatio(st.batches.cpu, o.batches.cpu), st.cpu/f.cpu, pairedRatio(st.batches.cpu, f.batches.cpu),
			st.perCall)
	}
	fmt.Println()
	fmt.Println("| this project's decision (batched) against | decisions/s, × | redis-server CPU per decision, × | target | |")
	fmt.Println("|---|---:|---:|---|---|")
	for _, i := range rows[1:] {
		p, st := paths[i], sts[i]
		x, cpu := pairedRatio(o.batches.rate, st.batches.rate), pairedRatio(o.batches.cpu, st.batches.cpu)
		name, target, verdict := p.name, "", ""
		switch {
		case p.role == roleUnbatched:
			name = "the same decision, unbatched"
			target, verdict = fmt.Sprintf("Redis CPU ≤ %.1f×", targetCPUOverUnbatched), yes(cpu <= targetCPUOverUnbatched)
		case p.role == rolePipelined:
			name = "the same decisions, batched but not merged (as on a Cluster)"
		case p.role == roleFloor:
			target, verdict = fmt.Sprintf("decisions/s ≥ %.1f×", targetOverFloor), yes(x >= targetOverFloor)
		case strings.HasPrefix(p.name, "redis_rate"):
			target, verdict = fmt.Sprintf("decisions/s ≥ %.0f×", targetOverRedisRate), yes(x >= targetOverRedisRate)
		}
		fmt.Printf("| %s | %.2f | %.2f | %s | %s |\n", name, x, cpu, target, verdict)
	}
}

// printFunctions prints each FCALL path against the EVALSHA path of the
// same decision on the same keys.
func printFunctions(paths []*path, sts []stats) {
	at := map[*path]int{}
	for i, p := range paths {
		at[p] = i
	}
	first := true
	for i, p := range paths {
		if p.pair == nil {
			continue
		}
		if first {
			first = false
			fmt.Println("\n### Redis Functions: FCALL against EVALSHA, the same code (lua.Source as a library function) on the same keys")
			fmt.Println()
			fmt.Println("Medians over the batches; ÷: FCALL's over EVALSHA's, the median of the ratios batch by batch.")
			fmt.Println()
			fmt.Println("| decision | usec_per_call EVALSHA | FCALL | ÷ | redis-server CPU µs/call EVALSHA | FCALL | ÷ | 1 caller EVALSHA | FCALL | ÷ | calls/s EVALSHA | FCALL | ÷ |")
			fmt.Println("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
		}
		e, f := sts[at[p.pair]], sts[i]
		fmt.Printf("| %s | %.2f | %.2f | %.3f | %.2f | %.2f | %.3f | %.2f | %.2f | %.3f | %.0f | %.0f | %.3f |\n", p.pair.name,
			e.perCall, f.perCall, pairedRatio(f.batches.per, e.batches.per),
			e.cpu, f.cpu, pairedRatio(f.batches.cpu, e.batches.cpu),
			e.serial, f.serial, pairedRatio(f.batches.serial, e.batches.serial),
			e.rate, f.rate, pairedRatio(f.batches.rate, e.batches.rate))
	}
}

// callOnly makes n calls, one at a time, of the path whose name starts
// with prefix.
func callOnly(ctx context.Context, c *redis.Client, prefix string, n int) {
	for _, m := range batchModes {
		if strings.HasPrefix(m.name, prefix) {
			name, call := m.name, batchCall(ctx, c, m.merge, m.shared)
			for range n {
				if err := call(); err != nil {
					fail("%s: %v", name, err)
				}
			}
			return
		}
	}
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

// callOnly's batches: batchOf "allow, 3 buckets" decisions, each on keys
// of its own (many clients) or all on the same three (one client's
// concurrent requests, whose buckets lua.Batch reads and writes once per
// call), sent as bucket.Batched sends the calls of concurrent requests, in
// one lua.Batch call or, as on a Cluster, in a pipeline of
// lua.TokenBucket calls. Deterministic, unlike the batches that concurrent
// callers form, so that an instruction count is per decision of a batch
// of batchOf.
const batchOf = 50

var batchModes = []struct {
	name          string
	merge, shared bool
}{
	{"batch of 50 decisions, one lua.Batch call", true, false},
	{"batch of 50 decisions, pipelined", false, false},
	{"batch of 50 decisions on 3 shared buckets, one lua.Batch call", true, true},
	{"batch of 50 decisions on 3 shared buckets, pipelined", false, true},
}

// batchCall returns a call that sends one batch of batchOf decisions, on
// the same three buckets when shared.
func batchCall(ctx context.Context, c *redis.Client, merge, shared bool) func() error {
	var allow *path
	for _, p := range newPaths(ctx, c, batchOf) {
		if p.name == "allow, 3 buckets" {
			allow = p
		}
	}
	bc := redis.NewClient(&redis.Options{Addr: c.Options().Addr, MaxRetries: -1,
		ReadTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second})
	b := bucket.NewBatched(bc, bucket.BatchOptions{NoMerge: !merge})
	args := bucket.ScriptArgs(allow.takes)
	return func() error {
		pipe := b.Pipeline()
		for cl := range batchOf {
			keys := allow.keys[cl]
			if shared {
				keys = allow.keys[0]
			}
			lua.TokenBucket.EvalSha(ctx, pipe, keys, args...)
		}
		_, err := pipe.Exec(ctx)
		return err
	}
}

// path is one kind of call: a decision (keys, takes) or a plain command.
type path struct {
	name    string
	command string  // the command whose stats are read
	target  float64 // µs per call; 0: none
	keys    [][]string
	takes   []bucket.Take // per bucket, shared by every client
	allowed bool
	evals   int  // calls of command per call of the path (0: 1)
	merges  bool // concurrent calls may share one call of command (lua.Batch)
	call    func(ctx context.Context, client int) error
	role    role
	latency bool  // in the caller-side latency table
	pair    *path // of an FCALL path: the EVALSHA path of the same decision, on the same keys
}

// role is what a path stands for in the comparison with the peers.
type role uint8

const (
	roleOther     role = iota
	roleOurs           // this project's 3-dimension decision, allowed, batched (the default)
	roleUnbatched      // the same, each call on its own (redis { pipeline off })
	rolePipelined      // the same, batched, each call its own EVALSHA in the pipeline (as on a Cluster)
	rolePeer           // another design's 3-dimension decision, allowed
	roleFloor          // one PING per decision
)

// leased reports whether the path takes a concurrency slot.
func (p *path) leased() bool {
	return slices.ContainsFunc(p.takes, func(t bucket.Take) bool { return t.Lease > 0 })
}

// newPaths builds the paths, each client with its own identity, and primes
// every bucket so that it has state in Redis: roomy buckets (a million
// tokens, one a second back) are 10000 tokens short and never deny; the
// api_key bucket of a deny path (one token an hour) is empty. The peers'
// buckets are primed the same way, with their own calls.
func newPaths(ctx context.Context, c *redis.Client, clients int) []*path {
	roomy, tight := spec(1_000_000, "1/s"), spec(1, "1/1h")
	keyer := bucket.NewKeyer("scriptstats:", "")
	store := bucket.Redis{Client: c}
	// takeCall is a decision path's call through store.
	takeCall := func(p *path, store bucket.Redis) func(context.Context, int) error {
		if !p.leased() {
			return func(ctx context.Context, cl int) error {
				d, err := store.Take(ctx, p.keys[cl], p.takes)
				if err == nil && d.Allowed != p.allowed {
					err = fmt.Errorf("%s: allowed %v", p.name, d.Allowed)
				}
				return err
			}
		}
		// A request that holds a slot: the decision that takes it and the
		// release after the response, two calls.
		var seq atomic.Int64
		return func(ctx context.Context, cl int) error {
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
				prime := p.takes[i] // a quota keeps its windows
				prime.Cost, prime.MaxWaitMS = min(prime.Spec.Capacity, 10_000), 0
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
		p.call = takeCall(p, store)
		if p.leased() {
			p.evals = 2
		} else {
			p.latency = true // one round trip
		}
		return p
	}
	shadow := func(p *path) { p.takes[len(p.takes)-1].Shadow = true }
	concurrent := func(p *path) {
		p.takes[len(p.takes)-1] = bucket.Take{Spec: bucket.ConcurrencySpec(1_000_000), Cost: 1, Lease: 600_000}
	}
	month := bucket.WindowsAt(bucket.Month, time.UTC, time.Now())
	quota := func(p *path) {
		p.takes[len(p.takes)-1] = bucket.Take{Spec: bucket.QuotaSpec(1 << 50), Cost: 1, Window: &month}
	}
	// on_limit wait: every bucket may reserve (none needs to here).
	waits := func(p *path) {
		for i := range p.takes {
			p.takes[i].MaxWaitMS = 5000
		}
	}
	unbatched := func(p *path) { p.role = roleUnbatched }
	for _, s := range []*redis.Script{noop, readFloor, writeFloor, hashBucket} {
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
	paths := []*path{
		{name: "INCR (baseline)", command: "incr", call: func(ctx context.Context, cl int) error {
			return c.Incr(ctx, "scriptstats:incr:"+strconv.Itoa(cl)).Err()
		}},
		{name: "empty script (baseline)", command: "evalsha", latency: true, call: func(ctx context.Context, _ int) error {
			return noop.EvalSha(ctx, c, nil).Err()
		}},
		floor("TIME+GET script (floor of a 1-bucket deny)", readFloor),
		floor("TIME+GET+SET script (floor of a 1-bucket allow)", writeFloor),
		decision("allow, 1 bucket", 1, false, targetAllow1),
		decision("allow, 3 buckets", 3, false, targetAllow3, unbatched),
		decision("allow, 3 buckets, 1 of them in shadow", 3, false, targetAllow3, shadow),
		decision("allow, 3 buckets + 1 per model", 4, false, 0),
		decision("allow, 3 buckets + a concurrency slot, taken and released", 4, false, 0, concurrent),
		decision("allow, 3 buckets + 1 monthly quota", 4, false, 0, quota),
		decision("allow, 3 buckets, on_limit wait", 3, false, 0, waits),
		decision("deny, 1 bucket", 1, true, targetDeny),
		decision("deny, 3 buckets", 3, true, targetDeny),
	}

	// The gateway's default: the same decision through bucket.Batched
	// (redis { pipeline on }), on a client of its own as the gateway's,
	// with retries off. Calls that meet a batch under way share the next,
	// merged into one lua.Batch call. Then the same with each call of a
	// batch its own EVALSHA in the pipeline, as on a Redis Cluster.
	batchedOn := func(name string, r role, opt bucket.BatchOptions) *path {
		bc := redis.NewClient(&redis.Options{Addr: c.Options().Addr, PoolSize: clients + 4, MaxRetries: -1,
			ReadTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second})
		p := decision(name, 3, false, 0)
		p.role, p.merges = r, !opt.NoMerge
		p.call = takeCall(p, bucket.Redis{Client: bucket.NewBatched(bc, opt)})
		return p
	}
	paths = append(paths,
		batchedOn("allow, 3 buckets, batched", roleOurs, bucket.BatchOptions{}),
		batchedOn("allow, 3 buckets, batched, pipelined", rolePipelined, bucket.BatchOptions{NoMerge: true}))

	// The same decisions as FCALLs of lua.Source loaded as a function,
	// on the same keys. Redis before 7.0 has no functions: the paths are
	// left out.
	if err := c.FunctionLoadReplace(ctx, functionLibrary).Err(); err != nil {
		fmt.Fprintf(os.Stderr, "scriptstats: FUNCTION LOAD failed, no FCALL paths (Redis Functions need Redis 7): %v\n", err)
	} else {
		fstore := bucket.Redis{Client: fcaller{c: c, fn: functionName}}
		for _, p := range slices.Clone(paths) {
			switch p.name {
			case "allow, 1 bucket", "allow, 3 buckets", "deny, 1 bucket", "deny, 3 buckets":
				q := *p
				q.name, q.command, q.target, q.role, q.pair = "FCALL "+p.name, "fcall", 0, roleOther, p
				q.call = takeCall(&q, fstore)
				paths = append(paths, &q)
			}
		}
	}

	// The peers, each bucket as roomy as this project's: a million tokens,
	// one a second back, primed 10000 short.
	peer := func(name, tag string, take func(ctx context.Context, key string, cost int) error) *path {
		keys := make([][]string, clients)
		for cl := range keys {
			for _, dim := range []string{"api_key", "user", "ip"} {
				k := "scriptstats:" + tag + ":" + dim + ":" + strconv.Itoa(cl)
				if err := take(ctx, k, 10_000); err != nil {
					fail("priming %s: %v", k, err)
				}
				keys[cl] = append(keys[cl], k)
			}
		}
		return &path{name: name, command: "evalsha", evals: 3, role: rolePeer, latency: true,
			call: func(ctx context.Context, cl int) error {
				for _, k := range keys[cl] {
					if err := take(ctx, k, 1); err != nil {
						return fmt.Errorf("%s: %w", name, err)
					}
				}
				return nil
			}}
	}
	limiter := redis_rate.NewLimiter(c)
	rateLimit := redis_rate.Limit{Rate: 1, Period: time.Second, Burst: 1_000_000}
	paths = append(paths,
		peer("redis_rate v10: 3 × AllowN", "redis_rate", func(ctx context.Context, key string, cost int) error {
			r, err := limiter.AllowN(ctx, key, rateLimit, cost)
			if err == nil && r.Allowed != cost {
				err = fmt.Errorf("%s denied", key)
			}
			return err
		}),
		peer("hash script: 3 × EVALSHA", "hash", func(ctx context.Context, key string, cost int) error {
			v, err := hashBucket.EvalSha(ctx, c, []string{key}, 1_000_000, 1, cost).Int64Slice()
			if err == nil && (len(v) != 2 || v[0] != 1) {
				err = fmt.Errorf("%s denied: %v", key, v)
			}
			return err
		}),
		&path{name: "PING (floor: one round trip per decision)", command: "ping", role: roleFloor,
			call: func(ctx context.Context, _ int) error { return c.Ping(ctx).Err() }},
	)
	return paths
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
	nested     float64 // usec of the commands the script runs (GET, SET, TIME, ...) per call of the command
	cpu        float64 // redis-server CPU time (user+sys) per call: the command, parsing and I/O
	rate       float64 // calls per second
	serial     float64 // usec_per_call with one caller, one call at a time
	batches    samples // the figures of each batch, for ratios batch by batch
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
			n := callsOf(in, p, calls/batches)
			s := &all[i]
			s.per = append(s.per, in.usec[p.command]/n)
			s.nested = append(s.nested, nestedUsec(in, p)/n)
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
			all[i].serial = append(all[i].serial, in.usec[p.command]/callsOf(in, p, serialCalls/batches))
		}
	}
	out := make([]stats, len(paths))
	for i, s := range all {
		out[i] = stats{perCall: median(s.per), perCallMin: slices.Min(s.per), nested: median(s.nested),
			cpu: median(s.cpu), rate: median(s.rate), serial: median(s.serial), batches: s}
	}
	return out
}

// nestedUsec is the time of the commands that a path's scripts ran: every
// command but the path's own and those of the measurement and of
// connecting (INFO, CONFIG RESETSTAT, HELLO, CLIENT).
func nestedUsec(in info, p *path) float64 {
	t := 0.0
	for cmd, usec := range in.usec {
		switch {
		case cmd == p.command, cmd == "info", cmd == "hello",
			strings.HasPrefix(cmd, "config"), strings.HasPrefix(cmd, "client"):
		default:
			t += usec
		}
	}
	return t
}

// pairedRatio is the median over the batches of a's figure over b's in the
// same round of turns, which ran seconds apart: a change in the machine's
// load between rounds falls on both.
func pairedRatio(a, b []float64) float64 {
	r := make([]float64, 0, len(a))
	for i := range min(len(a), len(b)) {
		if b[i] != 0 {
			r = append(r, a[i]/b[i])
		}
	}
	return median(r)
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

// callsOf returns the path's calls (decisions) of a batch that INFO
// counts: its command's calls over the commands each makes. A path whose
// concurrent calls Redis may merge (p.merges: a batch of decisions in one
// lua.Batch call) made made calls, which INFO counts as fewer.
func callsOf(in info, p *path, made int) float64 {
	n := in.calls[p.command]
	if n == 0 {
		fail("INFO commandstats has no calls of %s", p.command)
	}
	if p.merges {
		return float64(made)
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
	name               string
	p25, p50, p75, p99 float64
	// within is the share of the round trips that took at most targetP50X
	// times PING's p50: the p50 target is met when it is at least one half.
	// Where round trips fall in two modes (the host wakes an idle CPU
	// quickly or slowly), it shows how near the line a p50 stands.
	within float64
	judged bool // held to the targets: this project's decisions, not the peers' or the empty script's
}

// latencies measures PING and each decision from one caller, interleaved
// so that each sees the same conditions, in an order shuffled on every
// round: a fixed order would give each path the same predecessor every
// time, and a round trip's latency may depend on what ran before it.
func latencies(ctx context.Context, c *redis.Client, paths []*path, samples int) []latency {
	var decisions []*path
	for _, p := range paths {
		if p.latency {
			decisions = append(decisions, p)
		}
	}
	times := make([][]time.Duration, 1+len(decisions))
	order := make([]int, len(times)) // 0: PING; j > 0: decisions[j-1]
	for j := range order {
		order[j] = j
	}
	rng := rand.New(rand.NewPCG(1, 2)) // the same orders in every run
	for i := -1000; i < samples; i++ { // the first 1000 warm up
		rng.Shuffle(len(order), func(a, b int) { order[a], order[b] = order[b], order[a] })
		for _, j := range order {
			t0 := time.Now()
			var err error
			if j == 0 {
				err = c.Ping(ctx).Err()
			} else {
				err = decisions[j-1].call(ctx, 0)
			}
			d := time.Since(t0)
			if err != nil {
				fail("round trip %d of %v (0: PING): %v", j, order, err)
			}
			if i >= 0 {
				times[j] = append(times[j], d)
			}
		}
	}
	out := make([]latency, len(times))
	for i, ts := range times {
		slices.Sort(ts)
		l := latency{name: "PING"}
		if i > 0 {
			p := decisions[i-1]
			l.name, l.judged = p.name, p.role != rolePeer && p.takes != nil // the empty script has none
		}
		at := func(q float64) float64 { return float64(ts[int(q*float64(len(ts)-1))]) / 1e3 }
		l.p25, l.p50, l.p75, l.p99 = at(0.25), at(0.50), at(0.75), at(0.99)
		out[i] = l
	}
	line := time.Duration(targetP50X * out[0].p50 * 1e3)
	for i, ts := range times {
		n, _ := slices.BinarySearch(ts, line+1) // the round trips ≤ line
		out[i].within = float64(n) / float64(len(ts))
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
