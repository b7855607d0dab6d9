package tokenbucket

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// These tests run the handler against real Redis servers that they break:
// killed and restarted, hung with SIGSTOP, failed over by Sentinels,
// resharded in a Cluster, behind a wrong password or certificate. Every
// limit is one token per hour, so no token comes back during a test and
// every count is exact.

const foHour = 1.0 / 3600

// foTimeout is the redis timeout of tests that need every call to a live
// Redis to succeed, even on a loaded machine: a call that timed out after
// its script ran would be charged in Redis and decided by the fallback.
const foTimeout = 2 * time.Second

// foRedis is a single-server configuration with a fast breaker, so that
// tests see it open and close quickly, and the generous foTimeout.
func foRedis(addr string) *RedisConfig {
	return &RedisConfig{
		Address:         []string{addr},
		Timeout:         caddy.Duration(foTimeout),
		BreakerFailures: 3,
		BreakerCooldown: caddy.Duration(100 * time.Millisecond),
	}
}

// foHandler limits each X-User to capacity requests per hour.
func foHandler(rc *RedisConfig, policy string, capacity int64) *Handler {
	return &Handler{
		Redis:        rc,
		Dimensions:   []Dimension{{Name: "user", Identity: "{http.request.header.X-User}"}},
		Tiers:        []Tier{{Name: "default", Limits: []Limit{{Dimension: "user", Capacity: capacity, RefillRate: foHour}}}},
		OnRedisError: policy,
	}
}

// fromRedis reports whether Redis decided r: it carries the RateLimit
// headers, which degraded decisions omit.
func (r served) fromRedis() bool { return r.header.Get("RateLimit") != "" && !r.degraded }

var foRateLimitHeaders = []string{"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}

// foWantRedis checks a decision made by Redis: the status and, for a
// request that passed, the remaining tokens of X-RateLimit-Remaining.
func foWantRedis(t *testing.T, what string, r served, status int, remaining int64) {
	t.Helper()
	if r.status != status || r.degraded || r.header.Get("X-RateLimit-Remaining") != strconv.FormatInt(remaining, 10) {
		t.Errorf("%s: status %d, degraded %v, X-RateLimit-Remaining %q; want %d from redis with %d remaining (body %q)",
			what, r.status, r.degraded, r.header.Get("X-RateLimit-Remaining"), status, remaining, r.body)
	}
	if status == http.StatusTooManyRequests && r.header.Get("Retry-After") == "" {
		t.Errorf("%s: 429 without Retry-After", what)
	}
}

// foWantDegraded checks a decision made without Redis: the status, the
// degraded placeholder, and no RateLimit headers.
func foWantDegraded(t *testing.T, what string, r served, status int) {
	t.Helper()
	if r.status != status || !r.degraded {
		t.Errorf("%s: status %d, degraded %v; want %d, degraded (body %q)", what, r.status, r.degraded, status, r.body)
	}
	for _, name := range foRateLimitHeaders {
		if v := r.header.Values(name); len(v) != 0 {
			t.Errorf("%s: degraded response has %s %q", what, name, v)
		}
	}
}

// foBurstFromRedis sends capacity+2 requests as user and checks that Redis
// admits exactly capacity of them, counting down, and denies the rest.
func foBurstFromRedis(t *testing.T, h *Handler, user string, capacity int64) {
	t.Helper()
	for i := int64(0); i < capacity; i++ {
		foWantRedis(t, fmt.Sprintf("%s request %d", user, i+1), serveUser(h, user), http.StatusOK, capacity-1-i)
	}
	for i := 0; i < 2; i++ {
		foWantRedis(t, fmt.Sprintf("%s request over the limit", user), serveUser(h, user), http.StatusTooManyRequests, 0)
	}
}

// foWaitRedisDecides polls (the breaker's cooldown, a failover) until
// Redis decides a request of user again.
func foWaitRedisDecides(t *testing.T, h *Handler, user string, limit time.Duration) {
	t.Helper()
	redistest.WaitFor(t, limit, "decisions from redis", func() error {
		if r := serveUser(h, user); !r.fromRedis() {
			return fmt.Errorf("status %d, degraded %v", r.status, r.degraded)
		}
		return nil
	})
}

const foUnavailableBody = `{"error":"rate_limiter_unavailable","message":"the rate limiter cannot reach its store; retry shortly"}` + "\n"

// TestRedisKilledAndRestarted kills Redis mid-traffic and starts it again
// on the same port. While it is down, each on_redis_error policy holds:
// local keeps enforcing the limits from memory (exactly capacity, never a
// 5xx), allow passes everything, deny answers 503 (never 429), all without
// RateLimit headers and with {http.token_bucket.degraded}. After the
// restart the breaker closes and Redis decides again, reloading the script
// that the new process does not have (NOSCRIPT), also after SCRIPT FLUSH.
func TestRedisKilledAndRestarted(t *testing.T) {
	srv := redistest.Start(t)
	local := provisionHandler(t, foHandler(foRedis(srv.Addr), PolicyLocal, 3))
	allow := provisionHandler(t, foHandler(foRedis(srv.Addr), PolicyAllow, 3))
	deny := provisionHandler(t, foHandler(foRedis(srv.Addr), PolicyDeny, 3))
	if local.conn != allow.conn || allow.conn != deny.conn {
		t.Fatal("handlers with one redis config do not share one client")
	}

	// Background traffic on another identity, from before the kill to
	// after the restart: no request may fail.
	var bgStatus sync.Map // status → *atomic.Int64
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, _ := bgStatus.LoadOrStore(serveUser(local, "background").status, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			time.Sleep(time.Millisecond) // pacing the traffic, not timing a result
		}
	}()
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
			<-done
		}
	}()

	foBurstFromRedis(t, local, "before", 3)
	srv.Stop()

	t.Run("local", func(t *testing.T) {
		for i := 0; i < 3; i++ {
			foWantDegraded(t, fmt.Sprintf("request %d", i+1), serveUser(local, "down"), http.StatusOK)
		}
		for i := 0; i < 5; i++ {
			r := serveUser(local, "down")
			foWantDegraded(t, "request over the limit", r, http.StatusTooManyRequests)
			if r.header.Get("Retry-After") == "" {
				t.Error("local denial without Retry-After")
			}
		}
		if s := local.conn.breaker.State(); s == gobreaker.StateClosed {
			t.Errorf("breaker %v after 8 failed calls, want open (or half-open after its cooldown)", s)
		}
	})
	t.Run("allow", func(t *testing.T) {
		for i := 0; i < 10; i++ {
			r := serveUser(allow, "down")
			foWantDegraded(t, "allow", r, http.StatusOK)
			if !r.passed {
				t.Error("allow did not call the next handler")
			}
		}
	})
	t.Run("deny", func(t *testing.T) {
		for i := 0; i < 10; i++ {
			r := serveUser(deny, "down")
			foWantDegraded(t, "deny", r, http.StatusServiceUnavailable)
			if r.passed || r.body != foUnavailableBody || r.header.Get("Content-Type") != "application/json" {
				t.Errorf("deny: passed %v, body %q, content type %q", r.passed, r.body, r.header.Get("Content-Type"))
			}
		}
	})

	srv.Restart(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	foWaitRedisDecides(t, local, "poll", 10*time.Second)
	// The new process had no script: go-redis sent EVAL, which it does only
	// after EVALSHA failed with NOSCRIPT.
	if n := redistest.Calls(t, rdb, "eval"); n < 1 {
		t.Errorf("the restarted redis ran EVAL %d times, want at least once (the NOSCRIPT reload)", n)
	}

	t.Run("after_restart", func(t *testing.T) {
		foBurstFromRedis(t, local, "after", 3)
		foWantRedis(t, "allow", serveUser(allow, "after-allow"), http.StatusOK, 2)
		foWantRedis(t, "deny", serveUser(deny, "after-deny"), http.StatusOK, 2)
		if cached, err := rdb.ScriptExists(ctx, lua.TokenBucket.Hash()).Result(); err != nil || !cached[0] {
			t.Errorf("SCRIPT EXISTS = %v, %v; want the script loaded again", cached, err)
		}
	})
	t.Run("script_flush", func(t *testing.T) {
		evals := redistest.Calls(t, rdb, "eval")
		if err := rdb.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		foWantRedis(t, "first request after SCRIPT FLUSH", serveUser(local, "flushed"), http.StatusOK, 2)
		if n := redistest.Calls(t, rdb, "eval"); n == evals {
			t.Errorf("no EVAL after SCRIPT FLUSH: the request did not meet NOSCRIPT")
		}
	})

	close(stop)
	<-done
	counts := map[int]int64{}
	bgStatus.Range(func(k, v any) bool {
		counts[k.(int)] = v.(*atomic.Int64).Load()
		return true
	})
	t.Logf("background traffic through the kill and the restart: %v requests by status", counts)
	// 3 admitted by Redis, 3 by the local store, 3 by the restarted Redis,
	// which lost every bucket (no persistence).
	if len(counts) > 2 || counts[http.StatusOK] > 9 || counts[http.StatusTooManyRequests] == 0 {
		t.Errorf("background traffic: %v requests by status; want only 200 (at most 9) and 429", counts)
	}
}

// foLatencies summarizes measured latencies for the log.
func foLatencies(d []time.Duration) string {
	if len(d) == 0 {
		return "none"
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return fmt.Sprintf("n=%d p50=%v p99=%v max=%v", len(s), s[len(s)/2], s[len(s)*99/100], s[len(s)-1])
}

// TestRedisHangs stops the Redis process with SIGSTOP: it accepts
// connections and never answers. Each request is decided by the fallback
// within the timeout plus a margin; after breaker_failures calls in a row
// the breaker opens and requests are decided at once, without waiting on
// Redis. When Redis continues, the breaker closes after its cooldown.
func TestRedisHangs(t *testing.T) {
	const timeout = 50 * time.Millisecond
	srv := redistest.Start(t)
	rc := &RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(timeout),
		BreakerFailures: 3, BreakerCooldown: caddy.Duration(time.Second)}
	h := provisionHandler(t, foHandler(rc, PolicyLocal, 1000))

	var up, hung, open []time.Duration
	for i := 0; i < 50; i++ {
		up = append(up, serveUser(h, "u").latency)
	}
	// A success resets the breaker's count of failures in a row (a loaded
	// machine may have made a call above miss the 50ms).
	foWaitRedisDecides(t, h, "u", 10*time.Second)

	srv.Pause(t)
	for i := 1; i <= 3; i++ {
		if s := h.conn.breaker.State(); s != gobreaker.StateClosed {
			t.Fatalf("breaker %v after %d failures, want closed", s, i-1)
		}
		r := serveUser(h, "u")
		foWantDegraded(t, "request to a hung redis", r, http.StatusOK)
		hung = append(hung, r.latency)
	}
	if s := h.conn.breaker.State(); s != gobreaker.StateOpen {
		t.Fatalf("breaker %v after 3 failures, want open", s)
	}
	for i := 0; i < 200; i++ {
		r := serveUser(h, "u")
		foWantDegraded(t, "request with the breaker open", r, http.StatusOK)
		open = append(open, r.latency)
	}
	// Concurrent requests while the breaker is open: none waits either.
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				r := serveUser(h, "concurrent")
				mu.Lock()
				open = append(open, r.latency)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()

	t.Logf("redis up:                     %s", foLatencies(up))
	t.Logf("redis hung, breaker closed:   %s (timeout %v)", foLatencies(hung), timeout)
	t.Logf("redis hung, breaker open:     %s", foLatencies(open))
	for _, d := range slices.Concat(hung, open) {
		if d >= 10*timeout {
			t.Errorf("a request took %v while redis hung, want < %v", d, 10*timeout)
		}
	}

	srv.Resume(t)
	foWaitRedisDecides(t, h, "resumed", 10*time.Second)
}

// TestClientGoneNotDecided serves a request whose client has gone (its
// context canceled) under each on_redis_error policy: the limiter call
// ends canceled before Redis answers, and no policy applies. The handler
// returns the 499 that reverse_proxy logs for a client gone, does not call
// the next handler, leaves the local store empty and sets no degraded
// placeholder.
func TestClientGoneNotDecided(t *testing.T) {
	srv := redistest.Start(t)
	for _, policy := range []string{PolicyLocal, PolicyAllow, PolicyDeny} {
		t.Run(policy, func(t *testing.T) {
			rc := &RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(time.Minute)}
			h := provisionHandler(t, foHandler(rc, policy, 10))
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			r := serveCtx(ctx, h, "192.0.2.1:1234", "X-User", "gone-"+policy)
			if r.status != statusClientClosedRequest || !errors.Is(r.err, context.Canceled) || r.passed || r.degraded {
				t.Errorf("status %d, err %v, passed %v, degraded %v; want 499 with context.Canceled, not passed, not degraded",
					r.status, r.err, r.passed, r.degraded)
			}
			if h.local == nil {
				if policy == PolicyLocal {
					t.Error("on_redis_error local without a local store")
				}
			} else if n := h.local.Len(); n != 0 {
				t.Errorf("the local store holds %d buckets, want 0", n)
			}
			foWantRedis(t, "the next request", serveUser(h, "gone-"+policy), http.StatusOK, 9)
		})
	}
}

// TestClientGoneReleasesSlot: a request's call took a concurrency slot in
// Redis, but its client went away before the answer was read (the call ran
// and its reply was lost to the request). The handler does not decide the
// request, and releases the slot at once instead of holding it until its
// lease lapses.
func TestClientGoneReleasesSlot(t *testing.T) {
	srv := redistest.Start(t)
	rc := &RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(time.Minute)}
	h := foHandler(rc, PolicyLocal, 10)
	h.Tiers[0].Limits = append(h.Tiers[0].Limits, Limit{Dimension: "user", Capacity: 2, Unit: UnitConcurrent})
	provisionHandler(t, h)
	ctx, cancel := context.WithCancel(context.Background())
	req := httptest.NewRequestWithContext(ctx, http.MethodGet, "http://gateway.test/", nil)
	req.Header.Set("X-User", "gone")
	rec := httptest.NewRecorder()
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
	var x exchange
	h.build(&x, rec, req)
	// The call that ran in Redis: it took one of the two slots.
	if d, err := h.conn.take(context.Background(), x.req.keys, x.req.takes); err != nil || !d.Allowed {
		t.Fatalf("take: %+v, %v", d, err)
	}
	slots := x.req.keys[1]
	if n := srv.Client(t).ZCard(context.Background(), slots).Val(); n != 1 {
		t.Fatalf("%d leases held after the take, want 1", n)
	}
	cancel() // the client goes
	v := h.decideDegraded(&x, fmt.Errorf("running token bucket script: %w", context.Canceled), x.req)
	if !v.gone || v.decided || v.local {
		t.Errorf("verdict %+v, want gone, not decided", v)
	}
	if n := srv.Client(t).ZCard(context.Background(), slots).Val(); n != 0 {
		t.Errorf("%d leases held after the client went away, want 0", n)
	}
}

// foTally counts the outcomes of the requests sent during a failover.
type foTally struct {
	redisAllowed, redisDenied, localAllowed, localDenied, failed map[string]int
	firstDegraded, lastDegraded                                  time.Time
}

func newFoTally() *foTally {
	return &foTally{redisAllowed: map[string]int{}, redisDenied: map[string]int{},
		localAllowed: map[string]int{}, localDenied: map[string]int{}, failed: map[string]int{}}
}

func (c *foTally) add(id string, r served) {
	switch {
	case r.status != http.StatusOK && r.status != http.StatusTooManyRequests:
		c.failed[id]++
	case r.degraded:
		if c.firstDegraded.IsZero() {
			c.firstDegraded = time.Now()
		}
		c.lastDegraded = time.Now()
		if r.status == http.StatusOK {
			c.localAllowed[id]++
		} else {
			c.localDenied[id]++
		}
	case r.status == http.StatusOK:
		c.redisAllowed[id]++
	default:
		c.redisDenied[id]++
	}
}

func foSum(m map[string]int) (n int) {
	for _, v := range m {
		n += v
	}
	return n
}

// TestSentinelFailover runs a master, a replica and three Sentinels, sends
// traffic on several identities, kills the master mid-traffic and keeps
// sending while the Sentinels promote the replica. With on_redis_error
// local no request fails. Redis admits exactly each bucket's capacity over
// the whole run, since the new master has every bucket; the local store
// admits at most one capacity more per identity while Redis is away (the
// extra admissions, logged). After the failover the new master decides,
// with the RateLimit headers.
func TestSentinelFailover(t *testing.T) {
	const capacity = 10
	master := redistest.Start(t)
	replica := redistest.StartReplica(t, master)
	sentinels := redistest.StartSentinels(t, master, 1, 3, redistest.SentinelConfig{
		MasterName: "mymaster", Quorum: 2, DownAfter: 500 * time.Millisecond, FailoverTimeout: 2 * time.Second})
	addrs := make([]string, len(sentinels))
	for i, s := range sentinels {
		addrs[i] = s.Addr
	}
	rc := &RedisConfig{Address: addrs, Sentinel: "mymaster", Timeout: caddy.Duration(foTimeout),
		BreakerFailures: 3, BreakerCooldown: caddy.Duration(100 * time.Millisecond)}
	h := provisionHandler(t, foHandler(rc, PolicyLocal, capacity))
	ids := []string{"id0", "id1", "id2", "id3", "id4"}
	ctx := context.Background()

	tally := newFoTally()
	var redisAfterKill atomic.Int64
	var killed atomic.Bool
	const roundsBeforeKill = 3
	stop, done := make(chan struct{}), make(chan struct{})
	held, resume := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for round := 0; ; round++ {
			if round == roundsBeforeKill { // the test kills the master between two rounds
				close(held)
				select {
				case <-resume:
				case <-stop:
					return
				}
			}
			select {
			case <-stop:
				return
			default:
			}
			for _, id := range ids {
				r := serveUser(h, id)
				tally.add(id, r)
				if killed.Load() && r.fromRedis() {
					redisAfterKill.Add(1)
				}
			}
			time.Sleep(2 * time.Millisecond) // pacing the traffic, not timing a result
		}
	}()
	stopTraffic := func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		<-done
	}
	defer stopTraffic()

	// Between two rounds of traffic: every write so far is on the replica
	// (so no admission is lost to asynchronous replication), then the
	// master dies.
	<-held
	if n, err := master.Client(t).Do(ctx, "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT 1 = %d, %v; want the replica to have every write", n, err)
	}
	killedAt := time.Now()
	master.Stop()
	killed.Store(true)
	close(resume)

	redistest.WaitFor(t, 20*time.Second, "the sentinels to promote the replica", func() error {
		a, err := redistest.MasterAddr(ctx, sentinels[0], "mymaster")
		if err == nil && a != replica.Addr {
			err = fmt.Errorf("master is %s", a)
		}
		return err
	})
	promotedAt := time.Now()
	redistest.WaitFor(t, 10*time.Second, "decisions from the new master", func() error {
		if redisAfterKill.Load() < int64(20*len(ids)) {
			return fmt.Errorf("%d decisions from redis since the kill", redisAfterKill.Load())
		}
		return nil
	})
	stopTraffic()

	admitted := foSum(tally.redisAllowed) + foSum(tally.localAllowed)
	t.Logf("killed the master at 0s; the sentinels promoted the replica at %v; degraded decisions from %v to %v",
		promotedAt.Sub(killedAt).Round(time.Millisecond), tally.firstDegraded.Sub(killedAt).Round(time.Millisecond),
		tally.lastDegraded.Sub(killedAt).Round(time.Millisecond))
	t.Logf("requests: %d; redis allowed %d, redis denied %d, local allowed %d, local denied %d, failed %d",
		foSum(tally.redisAllowed)+foSum(tally.redisDenied)+foSum(tally.localAllowed)+foSum(tally.localDenied)+foSum(tally.failed),
		foSum(tally.redisAllowed), foSum(tally.redisDenied), foSum(tally.localAllowed), foSum(tally.localDenied), foSum(tally.failed))
	t.Logf("admitted %d, exact %d (%d identities × capacity %d): %d extra admissions, all by the local store during the outage",
		admitted, capacity*len(ids), len(ids), capacity, admitted-capacity*len(ids))
	if n := foSum(tally.failed); n != 0 {
		t.Errorf("%d requests failed during the failover, want 0", n)
	}
	if tally.firstDegraded.IsZero() {
		t.Error("no request was decided without redis: the failover was not exercised")
	}
	for _, id := range ids {
		if n := tally.redisAllowed[id]; n != capacity {
			t.Errorf("%s: redis admitted %d over the run, want exactly its capacity %d", id, n, capacity)
		}
		if n := tally.localAllowed[id]; n > capacity {
			t.Errorf("%s: the local store admitted %d, more than its capacity %d", id, n, capacity)
		}
	}
	newMaster := replica.Client(t)
	for _, id := range ids {
		key := h.keyer.Key("user", id, "")
		if n, err := newMaster.Exists(ctx, key).Result(); err != nil || n != 1 {
			t.Errorf("new master: EXISTS %s = %d, %v", key, n, err)
		}
	}
	foWantRedis(t, "after failover", serveUser(h, "fresh"), http.StatusOK, capacity-1)
	if n, err := newMaster.Exists(ctx, h.keyer.Key("user", "fresh", "")).Result(); err != nil || n != 1 {
		t.Errorf("the decision after the failover was not written to the new master: %d, %v", n, err)
	}
}

var foItemRE = regexp.MustCompile(`"([A-Za-z0-9_-]+)";r=(\d+)`)

// foRemaining returns the r= of each item of r's RateLimit header, by name.
func foRemaining(r served) map[string]string {
	out := map[string]string{}
	for _, m := range foItemRE.FindAllStringSubmatch(r.header.Get("RateLimit"), -1) {
		out[m[1]] = m[2]
	}
	return out
}

// foClusterHandler limits X-User to userCap and X-IP to ipCap requests per
// hour, in a Redis Cluster.
func foClusterHandler(rc *RedisConfig, policy string, userCap, ipCap int64) *Handler {
	return &Handler{
		Redis: rc,
		Dimensions: []Dimension{
			{Name: "user", Identity: "{http.request.header.X-User}"},
			{Name: "ip", Identity: "{http.request.header.X-IP}"},
		},
		Tiers: []Tier{{Name: "default", Limits: []Limit{
			{Dimension: "user", Capacity: userCap, RefillRate: foHour},
			{Dimension: "ip", Capacity: ipCap, RefillRate: foHour},
		}}},
		OnRedisError: policy,
	}
}

// TestClusterExactBurstAcrossSlots runs the handler on a three-master
// Redis Cluster with a user and an IP limit whose keys live on different
// nodes: each user gets exactly its capacity, and a request the user
// bucket denies leaves the IP bucket on the other node uncharged (the
// refund), so the IP's count is exactly the admitted requests.
func TestClusterExactBurstAcrossSlots(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	rc := &RedisConfig{Address: cluster.Addrs(), Cluster: true, Timeout: caddy.Duration(foTimeout)}
	h := provisionHandler(t, foClusterHandler(rc, PolicyDeny, 5, 100))
	const ip = "203.0.113.7"
	ipKey := h.keyer.Key("ip", ip+"/32", "")
	ipNode := cluster.NodeOf(t, ipKey)

	users := 0
	for i := 0; users < 4; i++ {
		user := "user" + strconv.Itoa(i)
		if cluster.NodeOf(t, h.keyer.Key("user", user, "")) == ipNode {
			continue // keep every request on two nodes
		}
		users++
		for n := 0; n < 5; n++ {
			r := serve(h, "X-User", user, "X-IP", ip)
			got := foRemaining(r)
			wantIP := strconv.Itoa(100 - 5*(users-1) - n - 1)
			if r.status != http.StatusOK || got["user"] != strconv.Itoa(4-n) || got["ip"] != wantIP {
				t.Errorf("%s request %d: %d %v; want 200 user r=%d ip r=%s", user, n+1, r.status, got, 4-n, wantIP)
			}
		}
		for n := 0; n < 3; n++ {
			// Redis and the deny cache both report the denying bucket
			// alone; the ip bucket's refund is checked below.
			r := serve(h, "X-User", user, "X-IP", ip)
			got := foRemaining(r)
			if _, ip := got["ip"]; r.status != http.StatusTooManyRequests || got["user"] != "0" || ip {
				t.Errorf("%s request %d over the limit: %d %v; want 429 user r=0 alone", user, n+1, r.status, got)
			}
		}
	}
	if got := storedTokens(t, ipNode.Client(t), ipKey); got != 100-5*4 {
		t.Errorf("ip bucket holds %d tokens after 20 admitted requests and refunded denials, want 80", got)
	}
}

// TestClusterFailedSlotRefunded: a request's user bucket is on one node
// and its ip bucket on another, which dies, or stalls. The request cannot
// be decided (503 by on_redis_error deny), so the user bucket, charged by
// the node that answered, is given back: six failed requests leave it as
// one admitted request left it. (A stalled node also makes go-redis's
// cluster pipeline give up on every command of the pipeline when its
// retry outlives the context: the answered ones keep their replies.)
func TestClusterFailedSlotRefunded(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func(t *testing.T, s *redistest.Server)
	}{
		{"killed", func(_ *testing.T, s *redistest.Server) { s.Stop() }},
		{"stalled", func(t *testing.T, s *redistest.Server) { s.Pause(t); t.Cleanup(func() { s.Resume(t) }) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cluster := redistest.StartCluster(t, 3)
			rc := &RedisConfig{Address: cluster.Addrs(), Cluster: true, Timeout: caddy.Duration(300 * time.Millisecond), BreakerFailures: 100}
			h := provisionHandler(t, foClusterHandler(rc, PolicyDeny, 5, 100))
			userKey := h.keyer.Key("user", "u1", "")
			userNode := cluster.NodeOf(t, userKey)
			ip := ""
			for i := 0; ip == ""; i++ {
				if a := "198.51.100." + strconv.Itoa(i); cluster.NodeOf(t, h.keyer.Key("ip", a+"/32", "")) != userNode {
					ip = a
				}
			}
			ipNode := cluster.NodeOf(t, h.keyer.Key("ip", ip+"/32", ""))
			if r := serve(h, "X-User", "u1", "X-IP", ip); r.status != http.StatusOK || foRemaining(r)["user"] != "4" {
				t.Fatalf("first request: %d %v; want 200 with user r=4", r.status, foRemaining(r))
			}
			tc.fail(t, ipNode)
			for i := 0; i < 6; i++ {
				if r := serve(h, "X-User", "u1", "X-IP", ip); r.status != http.StatusServiceUnavailable || !r.degraded {
					t.Fatalf("request %d with the ip's node down: %d, degraded %v; want 503 by on_redis_error deny", i+1, r.status, r.degraded)
				}
			}
			if got := storedTokens(t, userNode.Client(t), userKey); got != 4 {
				t.Errorf("user bucket holds %d tokens after 1 admitted request and 6 that failed on the ip's node, want 4", got)
			}
		})
	}
}

// TestClusterMasterFailover: the master of alice's slot dies and its
// replica takes over. The readiness probe reports the cluster unavailable
// while the slot has no master (every master must answer), and the
// gateway decides alice's requests on the new master within a couple of
// seconds of the takeover, not after go-redis's 60 s default reload of the
// slot map, with alice's bucket as the old master left it.
func TestClusterMasterFailover(t *testing.T) {
	timeout := []string{"--cluster-node-timeout", "1000"}
	cluster := redistest.StartCluster(t, 3, timeout...)
	rc := func() *RedisConfig {
		return &RedisConfig{Address: cluster.Addrs(), Cluster: true, Timeout: caddy.Duration(200 * time.Millisecond), BreakerFailures: 1 << 20}
	}
	h := provisionHandler(t, foClusterHandler(rc(), PolicyDeny, 5, 100))
	ready := foReady(t, &Ready{Redis: rc()})
	key := h.keyer.Key("user", "alice", "")
	master := cluster.NodeOf(t, key)
	replica := cluster.AddReplica(t, master, timeout...)
	for _, want := range []string{"4", "3"} {
		if r := serveUser(h, "alice"); r.status != http.StatusOK || foRemaining(r)["user"] != want {
			t.Fatalf("alice before the failover: %d %v; want 200 with user r=%s", r.status, foRemaining(r), want)
		}
	}
	if n, err := master.Client(t).Wait(context.Background(), 1, 5*time.Second).Result(); err != nil || n != 1 {
		t.Fatalf("WAIT 1: %d, %v", n, err)
	}
	if r := serve(ready); r.status != http.StatusOK {
		t.Fatalf("probe before the failover: %d %s", r.status, r.body)
	}

	master.Stop()
	for i := 0; i < 5; i++ { // the cluster takes a node timeout (1 s) to notice
		if r := serve(ready); r.status != http.StatusServiceUnavailable {
			t.Errorf("probe %d with a master down: %d %s; want 503", i+1, r.status, r.body)
		}
	}
	rcl := replica.Client(t)
	redistest.WaitFor(t, 20*time.Second, "the replica to take over", func() error {
		role, err := rcl.Do(context.Background(), "ROLE").Slice()
		if err == nil && role[0] != "master" {
			err = fmt.Errorf("role %v", role[0])
		}
		return err
	})
	var r served
	redistest.WaitFor(t, 3*time.Second, "alice decided by the new master", func() error {
		if r = serveUser(h, "alice"); r.status != http.StatusOK {
			return fmt.Errorf("%d %s", r.status, r.body)
		}
		return nil
	})
	if got := foRemaining(r)["user"]; got != "2" {
		t.Errorf("alice on the new master: user r=%s, want 2", got)
	}
	if got := storedTokens(t, rcl, key); got != 2 {
		t.Errorf("alice's bucket on the new master holds %d tokens, want 2", got)
	}
	redistest.WaitFor(t, 3*time.Second, "the probe to report ready", func() error {
		if r := serve(ready); r.status != http.StatusOK {
			return fmt.Errorf("%d %s", r.status, r.body)
		}
		return nil
	})
}

// TestClusterLostReplyNotReplayed loses the reply to a script call in a
// Redis Cluster: the script ran, the connection closed before its reply
// came back. go-redis's ClusterClient retries such a command (EOF) even
// with MaxRetries -1 unless it is marked NoRetry, which would run the
// script again and charge the buckets twice for a request that is then
// admitted once. The call must fail instead (on_redis_error decides) and
// every bucket be charged once.
func TestClusterLostReplyNotReplayed(t *testing.T) {
	proxy := redistest.StartProxy(t)
	node := redistest.StartClusterNode(t, "--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", proxy.PortString())
	proxy.SetTarget(node.Addr)
	if err := node.Client(t).Do(context.Background(), "CLUSTER", "ADDSLOTSRANGE", 0, 16383).Err(); err != nil {
		t.Fatal(err)
	}
	(&redistest.Cluster{Nodes: []*redistest.Server{node}}).WaitOK(t)
	rc := &RedisConfig{Address: []string{proxy.Addr}, Cluster: true, Timeout: caddy.Duration(foTimeout),
		BreakerFailures: 100}
	h := provisionHandler(t, foClusterHandler(rc, PolicyDeny, 10, 10))
	rdb := node.Client(t)

	for _, tc := range []struct {
		name    string
		headers []string // one slot group, or two (a pipeline)
		keys    []string
	}{
		{"one_slot", []string{"X-User", "solo"}, []string{h.keyer.Key("user", "solo", "")}},
		{"two_slots", []string{"X-User", "pair", "X-IP", "198.51.100.1"},
			[]string{h.keyer.Key("user", "pair", ""), h.keyer.Key("ip", "198.51.100.1/32", "")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if r := serve(h, tc.headers...); r.status != http.StatusOK || !r.fromRedis() {
				t.Fatalf("first request: %d, degraded %v", r.status, r.degraded)
			}
			lost := proxy.Lost()
			proxy.LoseReplyTo("evalsha")
			r := serve(h, tc.headers...)
			if proxy.Lost() != lost+1 {
				t.Fatalf("the proxy lost %d replies, want 1", proxy.Lost()-lost)
			}
			if r.status != http.StatusServiceUnavailable || !r.degraded {
				t.Errorf("request whose reply was lost: %d, degraded %v; want 503 by on_redis_error deny", r.status, r.degraded)
			}
			for _, key := range tc.keys {
				if got := storedTokens(t, rdb, key); got != 8 {
					t.Errorf("%s holds %d tokens after one request and one whose reply was lost, want 8 (charged once each)", key, got)
				}
			}
		})
	}
}

// TestLocalStoreMillionIdentities fills a default-bounded local store with
// a million distinct identities, as a flood of spoofed IPs or random API
// keys would while Redis is down: it never holds more than its bound and
// its heap stays bounded (under the race detector: 200,000 identities
// into a store of 100,000, to keep the run short).
func TestLocalStoreMillionIdentities(t *testing.T) {
	identities, bound := 1_000_000, bucket.DefaultLocalBuckets
	if foRace {
		identities, bound = 200_000, 100_000
	}
	rate, _ := bucket.ParseRate("1/h")
	spec, err := bucket.Limit{Capacity: 10, Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	keyer := bucket.NewKeyer("rl:", "")
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	before := ms.HeapAlloc

	l := bucket.NewLocal(bound, nil)
	takes := []bucket.Take{{Spec: spec, Cost: 1}}
	keys := make([]string, 1)
	ctx := context.Background()
	for i := 0; i < identities; i++ {
		keys[0] = keyer.Key("ip", "10."+strconv.Itoa(i>>16)+"."+strconv.Itoa(i>>8&255)+"."+strconv.Itoa(i&255), "")
		if d, _ := l.Take(ctx, keys, takes); !d.Allowed {
			t.Fatalf("identity %d denied on its first request", i)
		}
		if i%50_000 == 0 && l.Len() > bound {
			t.Fatalf("%d buckets held, bound %d", l.Len(), bound)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&ms)
	heap := int64(ms.HeapAlloc) - int64(before)
	n := l.Len()
	t.Logf("local store after %d identities: %d buckets, heap +%.1f MB, %d bytes per bucket (key %d bytes)",
		identities, n, float64(heap)/(1<<20), heap/int64(n), len(keys[0]))
	if n != bound {
		t.Errorf("store holds %d buckets, want its bound %d", n, bound)
	}
	// About 100 MB at the default bound: 183 bytes a bucket measured (196
	// under the race detector, at its smaller bound), with a 30-byte key.
	if limit := int64(bound) * 220; heap > limit { // 105 MiB at the default bound
		t.Errorf("store heap %d MB, want < %d MB (220 bytes a bucket)", heap>>20, limit>>20)
	}
	runtime.KeepAlive(l)
}

// TestLocalStoreConcurrentBound spends one bucket from many goroutines
// while others flood the store with new identities past its bound: the
// store never exceeds the bound, and the race detector sees no race.
func TestLocalStoreConcurrentBound(t *testing.T) {
	const bound = 1000
	rate, _ := bucket.ParseRate("1/h")
	spec, _ := bucket.Limit{Capacity: 5, Rate: rate}.Spec()
	l := bucket.NewLocal(bound, nil)
	ctx := context.Background()
	var wg sync.WaitGroup
	var over atomic.Int64
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 5000; i++ {
				keys := []string{"k" + strconv.Itoa(g) + ":" + strconv.Itoa(i), "shared"}
				if _, err := l.Take(ctx, keys, []bucket.Take{{Spec: spec, Cost: 1}, {Spec: spec, Cost: 0}}); err != nil {
					t.Error(err)
					return
				}
				if l.Len() > bound {
					over.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if over.Load() != 0 || l.Len() != bound {
		t.Errorf("store exceeded its bound %d times; holds %d, want %d", over.Load(), l.Len(), bound)
	}
}

// foCaptureLogs provisions h with the logger writing to a file instead of
// stderr (the handler's logger writes to stderr when no Caddy config
// sets up logging), and returns a function that reads what was logged.
func foCaptureLogs(t *testing.T, dir string, h *Handler) func() string {
	t.Helper()
	f, err := os.CreateTemp(dir, "log")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	stderr := os.Stderr
	os.Stderr = f
	defer func() { os.Stderr = stderr }()
	provisionHandler(t, h)
	return func() string {
		b, err := os.ReadFile(f.Name())
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
}

// TestRedisAuth runs Redis with requirepass and an ACL user. A wrong or
// missing password is a Redis failure: on_redis_error decides (local
// admits from memory, deny answers 503). The right password through an
// {env.*} placeholder, and an ACL user in a URL, work. No password appears
// in the logs or in a configuration error.
func TestRedisAuth(t *testing.T) {
	srv := redistest.Start(t, "--requirepass", "s3cret", "--user", "alice", "on", ">alicepw", "~*", "+@all")
	with := func(mod func(*RedisConfig)) *RedisConfig {
		rc := foRedis(srv.Addr)
		mod(rc)
		return rc
	}
	var logs []func() string
	logDir := t.TempDir()

	t.Run("wrong_password_local", func(t *testing.T) {
		h := foHandler(with(func(rc *RedisConfig) { rc.Password = "not-s3cret" }), PolicyLocal, 2)
		logs = append(logs, foCaptureLogs(t, logDir, h))
		foWantDegraded(t, "request 1", serveUser(h, "u"), http.StatusOK)
		foWantDegraded(t, "request 2", serveUser(h, "u"), http.StatusOK)
		foWantDegraded(t, "request 3", serveUser(h, "u"), http.StatusTooManyRequests)
	})
	t.Run("wrong_password_deny", func(t *testing.T) {
		h := foHandler(with(func(rc *RedisConfig) { rc.Password = "s3cret-not" }), PolicyDeny, 2)
		logs = append(logs, foCaptureLogs(t, logDir, h))
		r := serveUser(h, "u")
		foWantDegraded(t, "deny", r, http.StatusServiceUnavailable)
		if r.body != foUnavailableBody {
			t.Errorf("body %q", r.body)
		}
	})
	t.Run("no_password", func(t *testing.T) {
		h := provisionHandler(t, foHandler(foRedis(srv.Addr), PolicyDeny, 2))
		foWantDegraded(t, "no password", serveUser(h, "u"), http.StatusServiceUnavailable)
	})
	t.Run("env_placeholder", func(t *testing.T) {
		t.Setenv("REDIS_PASSWORD", "s3cret")
		h := foHandler(with(func(rc *RedisConfig) { rc.Password = "{env.REDIS_PASSWORD}" }), PolicyDeny, 2)
		logs = append(logs, foCaptureLogs(t, logDir, h))
		foWantRedis(t, "right password", serveUser(h, "u"), http.StatusOK, 1)
	})
	t.Run("acl_user_in_url", func(t *testing.T) {
		t.Setenv("REDIS_URL", "redis://alice:alicepw@"+srv.Addr+"/0")
		rc := with(func(rc *RedisConfig) { rc.Address, rc.URL = nil, "{env.REDIS_URL}" })
		h := foHandler(rc, PolicyDeny, 2)
		logs = append(logs, foCaptureLogs(t, logDir, h))
		foWantRedis(t, "acl user", serveUser(h, "v"), http.StatusOK, 1)
	})
	t.Run("bad_url_error_hides_password", func(t *testing.T) {
		// A URL that does not parse: Caddy logs the provisioning error.
		t.Setenv("REDIS_URL", "redis://alice:s3cret@"+srv.Addr+"x/0")
		rc := with(func(rc *RedisConfig) { rc.Address, rc.URL = nil, "{env.REDIS_URL}" })
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		err := foHandler(rc, PolicyDeny, 2).Provision(ctx)
		if err == nil || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("provisioning with a malformed URL: %v; want an error without the password", err)
		}
		// A literal URL is checked at load time (caddy validate).
		rc = &RedisConfig{URL: "redis://alice:s3cret@" + srv.Addr, Address: []string{srv.Addr}}
		if err := rc.validate(); err == nil || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("validating a URL with an address: %v; want an error without the password", err)
		}
		// A URL that does not fit its topology fails when it is resolved.
		rc = &RedisConfig{URL: "redis://alice:s3cret@" + srv.Addr + "?master_name=m", Cluster: true}
		if _, err := rc.resolve(); err == nil || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("resolving a Sentinel URL with cluster: %v; want an error without the password", err)
		}
	})

	var all strings.Builder
	for _, read := range logs {
		all.WriteString(read())
	}
	text := all.String()
	if !strings.Contains(text, "WRONGPASS") || !strings.Contains(text, "redis call failed") {
		t.Errorf("the logs do not show the failed calls; the capture is broken:\n%s", text)
	}
	for _, secret := range []string{"s3cret", "alicepw"} {
		if strings.Contains(text, secret) {
			t.Errorf("a password (%s) is in the logs:\n%s", secret, text)
		}
	}
}

// TestRedisTLS runs Redis with TLS only, under a CA made by the test. The
// handler decides through it when given the CA (tls_ca, or a rediss:// URL
// with tls_ca). With the system roots, or another CA, the server's
// certificate does not verify and on_redis_error decides; that holds while
// a handler with the right CA for the same address is running too.
func TestRedisTLS(t *testing.T) {
	files := redistest.NewTLSFiles(t)
	other := redistest.NewTLSFiles(t)
	srv := redistest.StartTLS(t, files)
	tlsConf := func(mod func(*RedisConfig)) *RedisConfig {
		rc := foRedis(srv.Addr)
		mod(rc)
		return rc
	}

	good := provisionHandler(t, foHandler(tlsConf(func(rc *RedisConfig) { rc.TLSCA = files.CA }), PolicyDeny, 3))
	foWantRedis(t, "tls_ca", serveUser(good, "u"), http.StatusOK, 2)

	url := provisionHandler(t, foHandler(tlsConf(func(rc *RedisConfig) {
		rc.Address, rc.URL, rc.TLSCA = nil, "rediss://"+srv.Addr+"/0", files.CA
	}), PolicyDeny, 3))
	foWantRedis(t, "rediss:// with tls_ca", serveUser(url, "u"), http.StatusOK, 1)

	system := provisionHandler(t, foHandler(tlsConf(func(rc *RedisConfig) { rc.TLS = true }), PolicyDeny, 3))
	r := serveUser(system, "u")
	foWantDegraded(t, "tls with the system roots", r, http.StatusServiceUnavailable)

	wrong := provisionHandler(t, foHandler(tlsConf(func(rc *RedisConfig) { rc.TLSCA = other.CA }), PolicyLocal, 3))
	foWantDegraded(t, "tls_ca of another CA", serveUser(wrong, "u"), http.StatusOK)

	plain := provisionHandler(t, foHandler(foRedis(srv.Addr), PolicyDeny, 3))
	foWantDegraded(t, "no tls", serveUser(plain, "u"), http.StatusServiceUnavailable)

	foWantRedis(t, "tls_ca again", serveUser(good, "u"), http.StatusOK, 0)
}

// foReady provisions a readiness handler.
func foReady(t *testing.T, rd *Ready) *Ready {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := rd.Provision(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		rd.Cleanup()
		cancel()
	})
	return rd
}

// TestReadiness probes token_bucket_ready: 200 "ready" while Redis
// answers, 503 "unavailable" once it is stopped, and 200 "degraded" then
// with allow_degraded; the breaker state it reports is the handlers', and
// while that breaker is open the probe is 503 (or "degraded") even once
// Redis answers again, as the handlers still decide without it.
func TestReadiness(t *testing.T) {
	srv := redistest.Start(t)
	rc := func() *RedisConfig {
		rc := foRedis(srv.Addr)
		rc.BreakerCooldown = caddy.Duration(time.Hour) // stays open once open
		return rc
	}
	strict := foReady(t, &Ready{Redis: rc()})
	lenient := foReady(t, &Ready{Redis: rc(), AllowDegraded: true})
	h := provisionHandler(t, foHandler(rc(), PolicyLocal, 3))

	want := func(what string, rd *Ready, status int, body string) {
		t.Helper()
		r := serve(rd)
		if r.status != status || r.body != body || r.header.Get("Content-Type") != "application/json" {
			t.Errorf("%s: %d %q (%s); want %d %q", what, r.status, r.body, r.header.Get("Content-Type"), status, body)
		}
		if r.passed {
			t.Errorf("%s: the probe called the next handler", what)
		}
	}
	want("up", strict, http.StatusOK, `{"status":"ready","redis":"up","breaker":"closed"}`+"\n")
	want("up, allow_degraded", lenient, http.StatusOK, `{"status":"ready","redis":"up","breaker":"closed"}`+"\n")

	srv.Stop()
	want("down", strict, http.StatusServiceUnavailable, `{"status":"unavailable","redis":"down","breaker":"closed"}`+"\n")
	want("down, allow_degraded", lenient, http.StatusOK, `{"status":"degraded","redis":"down","breaker":"closed"}`+"\n")
	for i := 0; i < 3; i++ {
		serveUser(h, "u")
	}
	want("down, breaker open", strict, http.StatusServiceUnavailable, `{"status":"unavailable","redis":"down","breaker":"open"}`+"\n")

	want("down, breaker open, allow_degraded", lenient, http.StatusOK, `{"status":"degraded","redis":"down","breaker":"open"}`+"\n")

	// Redis answers again, but the breaker stays open for its cooldown
	// (an hour here): the handlers decide by on_redis_error until then.
	srv.Restart(t)
	redistest.WaitFor(t, 5*time.Second, "the probe to see redis again", func() error {
		if r := serve(strict); r.body != `{"status":"unavailable","redis":"up","breaker":"open"}`+"\n" {
			return fmt.Errorf("%d %s", r.status, r.body)
		}
		return nil
	})
	want("up, breaker open", strict, http.StatusServiceUnavailable, `{"status":"unavailable","redis":"up","breaker":"open"}`+"\n")
	want("up, breaker open, allow_degraded", lenient, http.StatusOK, `{"status":"degraded","redis":"up","breaker":"open"}`+"\n")
	if r := serveUser(h, "v"); r.status != http.StatusOK || !r.degraded {
		t.Errorf("a request while the breaker is open: status %d, degraded %v; want 200 from the local store", r.status, r.degraded)
	}
}

// TestTimedOutCallReleasesSlots: a call whose reply comes after the
// timeout ran in Redis all the same, taking alice's only concurrency slot
// (`user 1 concurrent`) under the request's lease. Whatever on_redis_error
// then decides (200 from the local store, 200 allow, 503 deny), the slot
// is given back, not held for the 10-minute concurrency_lease, and alice's
// next request, with nothing in flight, is allowed by Redis.
func TestTimedOutCallReleasesSlots(t *testing.T) {
	for _, tc := range []struct {
		policy string
		status int
	}{{PolicyLocal, http.StatusOK}, {PolicyAllow, http.StatusOK}, {PolicyDeny, http.StatusServiceUnavailable}} {
		t.Run(tc.policy, func(t *testing.T) {
			srv := redistest.Start(t)
			proxy := redistest.StartProxy(t)
			proxy.SetTarget(srv.Addr)
			h := foHandler(&RedisConfig{Address: []string{proxy.Addr}, Timeout: caddy.Duration(100 * time.Millisecond), BreakerFailures: 100}, tc.policy, 1000)
			h.Tiers[0].Limits = append(h.Tiers[0].Limits, Limit{Dimension: "user", Capacity: 1, Unit: UnitConcurrent})
			provisionHandler(t, h)
			if r := serveUser(h, "warm"); !r.fromRedis() || r.status != http.StatusOK {
				t.Fatalf("warm-up: status %d, from Redis %v", r.status, r.fromRedis())
			}
			proxy.DelayReplyTo("evalsha", 2*time.Second)
			if r := serveUser(h, "alice"); r.status != tc.status || !r.degraded {
				t.Fatalf("the call that times out: status %d, degraded %v; want %d by on_redis_error %s", r.status, r.degraded, tc.status, tc.policy)
			}
			cceWaitCard(t, srv.Client(t), cceKey("alice"), 0, "the slot the timed-out call took, given back")
			if r := serveUser(h, "alice"); !r.fromRedis() || r.status != http.StatusOK {
				t.Errorf("alice, nothing in flight: status %d, from Redis %v (%q); want 200 from Redis", r.status, r.fromRedis(), r.body)
			}
		})
	}
}

// TestStalledCallReleasesSlots: Redis stalls (SIGSTOP) under alice's
// call, which times out, as the release sent after it does; both wait in
// Redis's sockets and run once it resumes, taking alice's only slot and
// giving it back. (Had the release reached Redis first and succeeded, the
// call would hold the slot for its lease: nothing tells the gateway so.)
func TestStalledCallReleasesSlots(t *testing.T) {
	srv := redistest.Start(t)
	h := foHandler(&RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(100 * time.Millisecond), BreakerFailures: 100}, PolicyLocal, 1000)
	h.Tiers[0].Limits = append(h.Tiers[0].Limits, Limit{Dimension: "user", Capacity: 1, Unit: UnitConcurrent})
	provisionHandler(t, h)
	if r := serveUser(h, "warm"); !r.fromRedis() {
		t.Fatalf("warm-up: status %d, not from Redis", r.status)
	}
	srv.Pause(t)
	if r := serveUser(h, "alice"); r.status != http.StatusOK || !r.degraded {
		t.Fatalf("alice while Redis stalls: status %d, degraded %v; want 200 from the local store", r.status, r.degraded)
	}
	srv.Resume(t)
	cceWaitCard(t, srv.Client(t), cceKey("alice"), 0, "alice's slot, given back after Redis resumed")
	if r := serveUser(h, "alice"); !r.fromRedis() || r.status != http.StatusOK {
		t.Errorf("alice, nothing in flight: status %d, from Redis %v (%q); want 200 from Redis", r.status, r.fromRedis(), r.body)
	}
}

// TestReleaseAfterOpenBreaker: alice's stream holds her only slot when
// Redis stalls and one timed-out call opens the breaker (breaker_failures
// 1). Redis comes back, and the stream ends while the breaker is still
// open, which refuses the release; it is sent again once the cooldown has
// passed, rather than leaving the slot taken for the rest of its
// 10-minute lease.
func TestReleaseAfterOpenBreaker(t *testing.T) {
	srv := redistest.Start(t)
	h := foHandler(&RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(100 * time.Millisecond),
		BreakerFailures: 1, BreakerCooldown: caddy.Duration(time.Second)}, PolicyLocal, 1000)
	h.Tiers[0].Limits = append(h.Tiers[0].Limits, Limit{Dimension: "user", Capacity: 1, Unit: UnitConcurrent})
	provisionHandler(t, h)
	key := cceKey("alice")

	endStream := foStream(t, h, "alice")
	cceWaitCard(t, srv.Client(t), key, 1, "alice's slot, taken")

	srv.Pause(t)
	if r := serveUser(h, "bob"); !r.degraded {
		t.Fatalf("bob while Redis stalls: status %d, not degraded", r.status)
	}
	srv.Resume(t)
	if s := h.conn.breaker.State(); s != gobreaker.StateOpen {
		t.Fatalf("breaker %v after a failed call, want open", s)
	}
	endStream()
	cceWaitCard(t, srv.Client(t), key, 0, "alice's slot, given back once the breaker let the release through")
	// And bob's, whose timed-out call ran once Redis resumed: its release is
	// retried too. (Left running, it would go on calling this test's Redis,
	// stopped, for the rest of the lease, in the metrics of later tests.)
	cceWaitCard(t, srv.Client(t), cceKey("bob"), 0, "bob's slot, given back once the breaker let the release through")
}

// TestRenewalRetriedBeforeLeaseLapses: alice's stream holds her only slot
// under a 4 s lease, renewed every 2 s. Redis stalls over the first
// renewal, which times out and opens the breaker (breaker_failures 1,
// cooldown 300 ms); Redis comes back. The renewal is tried again within
// the cooldown, not a half lease later when the lease has lapsed, so the
// lease is extended while the stream goes on.
func TestRenewalRetriedBeforeLeaseLapses(t *testing.T) {
	srv := redistest.Start(t)
	h := foHandler(&RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(100 * time.Millisecond),
		BreakerFailures: 1, BreakerCooldown: caddy.Duration(300 * time.Millisecond)}, PolicyLocal, 1000)
	h.Tiers[0].Limits = append(h.Tiers[0].Limits, Limit{Dimension: "user", Capacity: 1, Unit: UnitConcurrent})
	h.ConcurrencyLease = caddy.Duration(4 * time.Second)
	provisionHandler(t, h)
	rdb, key := srv.Client(t), cceKey("alice")

	defer foStream(t, h, "alice")()
	leases := rdb.ZRangeWithScores(context.Background(), key, 0, -1).Val()
	if len(leases) != 1 {
		t.Fatalf("leases %v, want alice's one", leases)
	}
	first := leases[0].Score

	srv.Pause(t)
	redistest.WaitFor(t, 10*time.Second, "the renewal to fail and open the breaker", func() error {
		if s := h.conn.breaker.State(); s != gobreaker.StateOpen {
			return fmt.Errorf("breaker %v", s)
		}
		return nil
	})
	srv.Resume(t)
	redistest.WaitFor(t, 10*time.Second, "the lease renewed after the failed renewal", func() error {
		leases := rdb.ZRangeWithScores(context.Background(), key, 0, -1).Val()
		if len(leases) != 1 || leases[0].Score <= first {
			return fmt.Errorf("leases %v, first lease until %v", leases, first)
		}
		return nil
	})
}

// foStream sends user's request through h, as serveUser does, to a next
// handler that holds it, as a stream would, until the returned func ends
// it; it returns once next holds the request. The func fails t if
// ServeHTTP returned an error.
func foStream(t *testing.T, h *Handler, user string) (end func()) {
	t.Helper()
	streaming, stop, done := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		req := httptest.NewRequest(http.MethodGet, "http://gateway.test/", nil)
		req.RemoteAddr = "192.0.2.1:1234"
		req.Header.Set("X-User", user)
		rec := httptest.NewRecorder()
		req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
		done <- h.ServeHTTP(rec, req, caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
			close(streaming)
			<-stop
			w.WriteHeader(http.StatusOK)
			return nil
		}))
	}()
	<-streaming
	return func() {
		close(stop)
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
}

// TestLocalStateAcrossReloads: Caddy provisions a reloaded config's
// handler before it cleans up the old one. While Redis is down, the new
// handler goes on from the old one's local store (alice, who spent her 3
// requests, is still denied) and shares its count of held requests; a
// handler with another key_prefix has its own.
func TestLocalStateAcrossReloads(t *testing.T) {
	rc := func() *RedisConfig {
		return &RedisConfig{Address: []string{"127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}, Timeout: caddy.Duration(foTimeout)}
	}
	down := rc()
	same := func() *RedisConfig { c := *down; return &c }
	old := foHandler(same(), PolicyLocal, 3)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := old.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if r := serveUser(old, "alice"); r.status != http.StatusOK || !r.degraded {
			t.Fatalf("alice's request %d: %d, degraded %v; want 200 from the local store", i+1, r.status, r.degraded)
		}
	}
	reloaded := provisionHandler(t, foHandler(same(), PolicyLocal, 3))
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if r := serveUser(reloaded, "alice"); r.status != http.StatusTooManyRequests || !r.degraded {
		t.Errorf("alice after the reload: %d, degraded %v; want 429 from the local store she spent", r.status, r.degraded)
	}
	if reloaded.waiting != old.waiting {
		t.Error("the reloaded handler counts held requests apart from the old one's")
	}
	other := foHandler(same(), PolicyLocal, 3)
	other.KeyPrefix = "other:"
	provisionHandler(t, other)
	if r := serveUser(other, "alice"); r.status != http.StatusOK || !r.degraded {
		t.Errorf("alice under another key_prefix: %d, degraded %v; want 200 from a store of its own", r.status, r.degraded)
	}
	if other.waiting == reloaded.waiting {
		t.Error("handlers with different key prefixes share a count of held requests")
	}
}

// TestReleaseOutlivesItsConfig: alice's call times out while Redis
// stalls, and the config is unloaded (a reload) before the release of the
// slot the call may have taken has gone through. The release keeps the
// Redis client open until it succeeds, once Redis is back; the client is
// closed after it.
func TestReleaseOutlivesItsConfig(t *testing.T) {
	srv := redistest.Start(t)
	h := foHandler(&RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(100 * time.Millisecond), BreakerFailures: 100}, PolicyLocal, 1000)
	h.Tiers[0].Limits = append(h.Tiers[0].Limits, Limit{Dimension: "user", Capacity: 1, Unit: UnitConcurrent})
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if r := serveUser(h, "warm"); !r.fromRedis() {
		t.Fatalf("warm-up: status %d, not from Redis", r.status)
	}
	srv.Pause(t)
	if r := serveUser(h, "alice"); r.status != http.StatusOK || !r.degraded {
		t.Fatalf("alice while Redis stalls: status %d, degraded %v; want 200 from the local store", r.status, r.degraded)
	}
	if err := h.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if n := h.conn.users.Load(); n < 1 {
		t.Fatalf("the client has %d users once its config is gone, with a release under way; want it held", n)
	}
	srv.Resume(t)
	cceWaitCard(t, srv.Client(t), cceKey("alice"), 0, "alice's slot, given back after the reload")
	redistest.WaitFor(t, 10*time.Second, "the client to be closed", func() error {
		if n := h.conn.users.Load(); n != 0 {
			return fmt.Errorf("%d users", n)
		}
		return nil
	})
}

// TestBreakerLogsToNewestConfig: configs that share a Redis client log
// its breaker's changes through the newest of them still loaded. Config B
// takes the client and then fails to load (Caddy cleans it up): A goes on
// logging. Config C replaces A: C logs from then on.
func TestBreakerLogsToNewestConfig(t *testing.T) {
	r, err := (&RedisConfig{Address: []string{"127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))},
		Timeout: caddy.Duration(foTimeout), BreakerFailures: 1, BreakerCooldown: caddy.Duration(50 * time.Millisecond)}).resolve()
	if err != nil {
		t.Fatal(err)
	}
	type config struct {
		logger *zap.Logger
		logs   *observer.ObservedLogs
	}
	load := func() (config, *conn, string) {
		core, logs := observer.New(zap.InfoLevel)
		cfg := config{zap.New(core), logs}
		c, key, err := acquire(context.Background(), r, cfg.logger)
		if err != nil {
			t.Fatal(err)
		}
		return cfg, c, key
	}
	unload := func(cfg config, c *conn, key string) {
		c.dropLogger(cfg.logger)
		if _, err := conns.Delete(key); err != nil {
			t.Fatal(err)
		}
	}
	const opened = "redis circuit breaker opened"
	a, c, key := load()
	b, cb, _ := load()
	if cb != c {
		t.Fatal("the two configs got two clients")
	}
	if n := a.logs.FilterMessageSnippet("redis is not answering yet").Len(); n != 1 || b.logs.Len() != 0 {
		t.Errorf("startup warnings: %d by the first config, %d entries by the second; want 1 and 0 (pinged once)", n, b.logs.Len())
	}
	unload(b, c, key) // its load failed
	if _, err := c.take(context.Background(), []string{"rl:{user:x}"}, testTakes(t)); err == nil {
		t.Fatal("a call to no server succeeded")
	}
	if na, nb := a.logs.FilterMessageSnippet(opened).Len(), b.logs.FilterMessageSnippet(opened).Len(); na != 1 || nb != 0 {
		t.Errorf("%q logged %d times by the loaded config and %d by the one whose load failed; want 1 and 0", opened, na, nb)
	}

	cfgC, _, _ := load()
	unload(a, c, key) // replaced by C
	defer unload(cfgC, c, key)
	redistest.WaitFor(t, 10*time.Second, "the breaker to open again after its cooldown", func() error {
		_, _ = c.take(context.Background(), []string{"rl:{user:x}"}, testTakes(t))
		if cfgC.logs.FilterMessageSnippet(opened).Len() == 0 {
			return errors.New("not yet")
		}
		return nil
	})
	if n := a.logs.FilterMessageSnippet(opened).Len(); n != 1 {
		t.Errorf("%q logged %d times by the replaced config, want 1 (before it was replaced)", opened, n)
	}
}

// TestBreakerLogsDegradedModeEnterAndExit: the breaker's opening is a
// warning that degraded mode begins, and its closing, once a probe after
// the cooldown finds Redis answering, a warning that it is over; each
// once.
func TestBreakerLogsDegradedModeEnterAndExit(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t)
	proxy.SetTarget("127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))) // nothing listens
	r, err := (&RedisConfig{Address: []string{proxy.Addr}, Timeout: caddy.Duration(foTimeout),
		BreakerFailures: 1, BreakerCooldown: caddy.Duration(50 * time.Millisecond)}).resolve()
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	logger := zap.New(core)
	c, key, err := acquire(context.Background(), r, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		c.dropLogger(logger)
		if _, err := conns.Delete(key); err != nil {
			t.Error(err)
		}
	}()
	const opened, closed = "redis circuit breaker opened: degraded", "redis circuit breaker closed: degraded mode over"
	if _, err := c.take(context.Background(), []string{"rl:{user:x}"}, testTakes(t)); err == nil {
		t.Fatal("a call through a proxy to no server succeeded")
	}
	if n, m := logs.FilterMessageSnippet(opened).Len(), logs.FilterMessageSnippet(closed).Len(); n != 1 || m != 0 {
		t.Fatalf("Redis away: %q logged %d times, %q %d; want 1 and 0", opened, n, closed, m)
	}
	proxy.SetTarget(srv.Addr)
	redistest.WaitFor(t, 10*time.Second, "a probe after the cooldown to reach Redis", func() error {
		_, err := c.take(context.Background(), []string{"rl:{user:x}"}, testTakes(t))
		return err
	})
	entries := logs.FilterMessageSnippet(closed).All()
	if len(entries) != 1 || entries[0].Level != zap.WarnLevel || entries[0].ContextMap()["from"] != "half_open" {
		t.Fatalf("Redis back: %q logged %v, want once, a warning, from half_open", closed, entries)
	}
	if n := logs.FilterMessageSnippet(opened).Len(); n != 1 {
		t.Errorf("%q logged %d times in all, want 1", opened, n)
	}
}

// TestUnsent: which failed calls are known never to have reached Redis,
// so took no concurrency slot to release.
func TestUnsent(t *testing.T) {
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	read := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"dial", dial, true},
		{"wrapped dial", fmt.Errorf("running token bucket script: %w", dial), true},
		{"pool timeout", redis.ErrPoolTimeout, true},
		{"client closed", fmt.Errorf("x: %w", redis.ErrClosed), true},
		{"every sentinel refused", fmt.Errorf("redis: all sentinels specified in configuration are unreachable: %w", errors.Join(dial, dial)), true},
		{"two slot groups, one unsent", errors.Join(fmt.Errorf("g0: %w", dial), fmt.Errorf("g1: %w", context.DeadlineExceeded)), false},
		{"read", read, false},
		{"timeout", context.DeadlineExceeded, false},
		{"EOF", io.EOF, false},
		{"error reply", redis.Nil, false},
		{"nil", nil, false},
	} {
		if got := unsent(tc.err); got != tc.want {
			t.Errorf("%s (%v): unsent %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
	// As go-redis reports a refused connection.
	r, err := (&RedisConfig{Address: []string{"127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}, Timeout: caddy.Duration(foTimeout)}).resolve()
	if err != nil {
		t.Fatal(err)
	}
	c := newConn(r)
	defer c.Destruct()
	if _, err := c.take(context.Background(), []string{"rl:{user:x}"}, testTakes(t)); !unsent(err) {
		t.Errorf("a call to no server: %v, not unsent", err)
	}
}

// TestLocalShareCostAboveLocalCapacity: with Redis down, a tokens limit of
// 1000 decided locally at local_share 0.25 holds 250. A request of cost
// 600, which Redis would allow, takes the full local bucket, and the next
// one is rate limited with the wait of 250 tokens at a quarter of 1 an
// hour, not told cost_exceeds_capacity (which
// the SDKs take as "do not retry"); a cost above the limit's own capacity
// is.
func TestLocalShareCostAboveLocalCapacity(t *testing.T) {
	at := time.Unix(1_796_000_000, 0) // the local store's clock stands still: the wait is exact
	h := provisionHandler(t, &Handler{
		now:          func() time.Time { return at },
		Redis:        &RedisConfig{Address: []string{"127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}, Timeout: caddy.Duration(foTimeout)},
		Dimensions:   []Dimension{{Name: "user", Identity: "{http.request.header.X-User}"}},
		Tiers:        []Tier{{Name: "default", Limits: []Limit{{Dimension: "user", Capacity: 1000, RefillRate: foHour, Unit: UnitTokens}}}},
		Cost:         "{http.request.header.X-Cost}",
		LocalShare:   0.25,
		OnRedisError: PolicyLocal,
	})
	charged := tbMetrics.charged.WithLabelValues("default", "user", UnitTokens)
	before := testutil.ToFloat64(charged)
	for _, tc := range []struct {
		cost, status int
		body         string
	}{
		{600, http.StatusOK, ""},
		{600, http.StatusTooManyRequests, `{"error":"rate_limit_exceeded","retry_after":3600000,"retry_after_ms":3600000000,"tier":"default","dimension":"user"}` + "\n"},
		{1001, http.StatusTooManyRequests, `{"error":"cost_exceeds_capacity","cost":1001,"capacity":1000,"tier":"default","dimension":"user"}` + "\n"},
	} {
		r := serve(h, "X-User", "alice", "X-Cost", strconv.Itoa(tc.cost))
		if r.status != tc.status || !r.degraded || r.body != tc.body {
			t.Errorf("cost %d: %d, degraded %v, %q; want %d from the local store, %q", tc.cost, r.status, r.degraded, r.body, tc.status, tc.body)
		}
	}
	if got := testutil.ToFloat64(charged) - before; got != 250 {
		t.Errorf("tokens_charged_total grew by %v, want 250 (what the local store charged)", got)
	}
}

// TestClientGoneWhileDecided: alice's client goes away while Redis decides
// her request (its reply held up by the network), and the reply, an
// allowance, comes back all the same. No answer will be read: the request
// is not decided (499, next not called) and what the decision charged, a
// token and her only concurrency slot, is given back.
func TestClientGoneWhileDecided(t *testing.T) {
	for _, pipeline := range []bool{true, false} {
		t.Run("pipeline_"+strconv.FormatBool(pipeline), func(t *testing.T) { clientGoneWhileDecided(t, pipeline) })
	}
}

func clientGoneWhileDecided(t *testing.T, pipeline bool) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t)
	proxy.SetTarget(srv.Addr)
	h := foHandler(&RedisConfig{Address: []string{proxy.Addr}, Timeout: caddy.Duration(foTimeout), Pipeline: &pipeline}, PolicyDeny, 5)
	h.Tiers[0].Limits = append(h.Tiers[0].Limits, Limit{Dimension: "user", Capacity: 1, Unit: UnitConcurrent})
	provisionHandler(t, h)
	if r := serveUser(h, "alice"); !r.fromRedis() || r.status != http.StatusOK {
		t.Fatalf("first request: status %d, from Redis %v", r.status, r.fromRedis())
	}
	proxy.DelayReplyTo("evalsha", 300*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan served, 1)
	go func() { done <- serveCtx(ctx, h, "192.0.2.1:1234", "X-User", "alice") }()
	redistest.WaitFor(t, 5*time.Second, "the call to be sent", func() error {
		if proxy.Armed() {
			return errors.New("not yet")
		}
		return nil
	})
	cancel()
	r := <-done
	if r.status != statusClientClosedRequest || r.passed {
		t.Errorf("the request whose client left: status %d, passed on %v; want 499, not passed on", r.status, r.passed)
	}
	rdb := srv.Client(t)
	if got := storedTokens(t, rdb, h.keyer.Key("user", "alice", "")); got != 4 {
		t.Errorf("alice's bucket holds %d tokens, want 4 (the first request's charge alone)", got)
	}
	if n := cceCard(t, rdb, cceKey("alice")); n != 0 {
		t.Errorf("alice holds %d slots with nothing served, want 0", n)
	}
}

// TestEveryFailedCallCounted: redis_errors_total counts every failed call
// through the breaker by kind, not only decisions: a settlement, a lease's
// renewal or release and a refund that fail open the breaker too.
func TestEveryFailedCallCounted(t *testing.T) {
	r, err := (&RedisConfig{Address: []string{"127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}, Timeout: caddy.Duration(foTimeout), BreakerFailures: 100}).resolve()
	if err != nil {
		t.Fatal(err)
	}
	c := newConn(r)
	defer c.Destruct()
	ctx := context.Background()
	spec := testTakes(t)[0].Spec
	before := testutil.ToFloat64(tbMetrics.errorChildren[errConnection])
	calls := map[string]error{
		"settle":  c.settle(ctx, "req-1", []string{"rl:{user:x}"}, []bucket.Adjust{{Spec: spec, Delta: 1}}),
		"renew":   func() error { _, err := c.lease(ctx, []string{"rl:{user:x}:concurrent"}, "lease-1", 1000); return err }(),
		"release": func() error { _, err := c.lease(ctx, []string{"rl:{user:x}:concurrent"}, "lease-1", 0); return err }(),
		"refund":  c.refund(ctx, []string{"rl:{user:x}"}, testTakes(t)),
	}
	for name, err := range calls {
		if err == nil {
			t.Errorf("%s against no server succeeded", name)
		}
	}
	if got := testutil.ToFloat64(tbMetrics.errorChildren[errConnection]) - before; got != 4 {
		t.Errorf("redis_errors_total{kind=\"connection\"} grew by %v for 4 failed calls, want 4", got)
	}
}

// TestGiveBackOfNothingMakesNoCall: a client that leaves after a decision
// that charged it nothing (costs of 0) is given nothing back without a
// Redis call, so the give-back holds with the circuit breaker open, rather
// than failing and logging that the client stays charged.
func TestGiveBackOfNothingMakesNoCall(t *testing.T) {
	rc := &RedisConfig{Address: []string{"127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}, Timeout: caddy.Duration(foTimeout), BreakerFailures: 1}
	h := provisionHandler(t, foHandler(rc, PolicyDeny, 5))
	if r := serveUser(h, "alice"); r.status != http.StatusServiceUnavailable {
		t.Fatalf("with Redis down: %d, want 503", r.status)
	}
	if st := h.conn.breaker.State(); st != gobreaker.StateOpen {
		t.Fatalf("breaker %v, want open", st)
	}
	x := &exchange{inputs: inputs{r: httptest.NewRequest(http.MethodGet, "/", nil)}}
	req := &request{keys: []string{"k1", "k2"}, takes: []bucket.Take{{Cost: 0}, {Cost: 0}}}
	d := &bucket.Decision{Allowed: true, Buckets: []bucket.Result{{Reason: bucket.Allowed}, {Reason: bucket.Allowed}}}
	if !h.giveBack(x, req, d) {
		t.Error("giving back nothing failed")
	}
}
