package tokenbucket

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// These tests inject faults between the handler and Redis while the
// handler batches its calls (redis { pipeline on }, the default): a proxy
// loses the reply to a batch after Redis ran it, or holds a reply past the
// timeout, on a single server, behind Sentinel and in a Cluster. Each
// request is limited on its own user (capacity bfUserCap) and on one IP
// shared by all (capacity bfIPCap), one token back per hour: afterwards
// every bucket holds exactly the charges of the decisions Redis ran, never
// more than one per request, and on_redis_error (deny: 503) decided every
// request whose call failed. A request's user bucket is its own, so it is
// charged once exactly when its decision ran. The GETs that Redis ran
// (INFO commandstats; the test reads buckets with GETRANGE) count the
// buckets read: on a Cluster one per script (one per slot of a request);
// on one server, where a batch's decisions are one lua.Batch call that
// reads the shared IP bucket once, each decision's user bucket and at most
// one read of the IP bucket per decision.

const (
	bfUserCap = 10
	bfIPCap   = 1_000_000
	bfIP      = "198.51.100.9"
)

// bfTopology is a Redis reached through a fault-injecting proxy.
type bfTopology struct {
	name    string
	server  *redistest.Server // the real server, for INFO and reading buckets
	proxy   *redistest.Proxy
	cluster bool
	config  func(timeout time.Duration) *RedisConfig
}

func startBFTopology(t *testing.T, name string) *bfTopology {
	t.Helper()
	proxy := redistest.StartProxy(t)
	topo := &bfTopology{name: name, proxy: proxy}
	switch name {
	case "single":
		topo.server = redistest.Start(t)
		proxy.SetTarget(topo.server.Addr)
		topo.config = func(d time.Duration) *RedisConfig {
			return &RedisConfig{Address: []string{proxy.Addr}, Timeout: caddy.Duration(d)}
		}
	case "sentinel":
		topo.server = redistest.Start(t)
		proxy.SetTarget(topo.server.Addr)
		// The Sentinel monitors, and names to the client, the proxy.
		sentinels := redistest.StartSentinelsAt(t, proxy.Addr, 0, 1, redistest.SentinelConfig{
			MasterName: "bfmaster", Quorum: 1, DownAfter: time.Minute, FailoverTimeout: 2 * time.Minute})
		topo.config = func(d time.Duration) *RedisConfig {
			return &RedisConfig{Address: []string{sentinels[0].Addr}, Sentinel: "bfmaster", Timeout: caddy.Duration(d)}
		}
	case "cluster":
		// One node with every slot, announcing the proxy as its address:
		// the user and IP buckets of a request are on two slots, so each
		// request is two scripts in one pipeline (bucket.Sharded).
		topo.cluster = true
		topo.server = redistest.StartClusterNode(t, "--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", proxy.PortString())
		proxy.SetTarget(topo.server.Addr)
		if err := topo.server.Client(t).Do(context.Background(), "CLUSTER", "ADDSLOTSRANGE", 0, 16383).Err(); err != nil {
			t.Fatal(err)
		}
		(&redistest.Cluster{Nodes: []*redistest.Server{topo.server}}).WaitOK(t)
		topo.config = func(d time.Duration) *RedisConfig {
			return &RedisConfig{Address: []string{proxy.Addr}, Cluster: true, Timeout: caddy.Duration(d)}
		}
	default:
		t.Fatalf("topology %q", name)
	}
	return topo
}

// handler provisions a batching handler through the proxy with timeout and
// a breaker that never opens (every request reaches Redis).
func (topo *bfTopology) handler(t *testing.T, prefix string, timeout time.Duration) *bfHandler {
	t.Helper()
	return topo.handlerWithBreaker(t, prefix, timeout, 1<<30)
}

// handlerWithBreaker is handler with a breaker that opens after failures
// in a row.
func (topo *bfTopology) handlerWithBreaker(t *testing.T, prefix string, timeout time.Duration, failures int) *bfHandler {
	t.Helper()
	rc := topo.config(timeout)
	rc.BreakerFailures = failures
	h := foClusterHandler(rc, PolicyDeny, bfUserCap, bfIPCap)
	h.KeyPrefix = prefix
	provisionHandler(t, h)
	var b *bucket.Batched
	switch s := h.conn.store.(type) {
	case bucket.Redis:
		b, _ = s.Client.(*bucket.Batched)
	case bucket.Sharded:
		b, _ = s.Client.(*bucket.Batched)
	}
	if b == nil {
		t.Fatalf("store %T does not batch", h.conn.store)
	}
	bh := &bfHandler{Handler: h, topo: topo, b: b, admin: topo.server.Client(t)}
	// One request first loads the script (EVALSHA, NOSCRIPT, EVAL), and
	// lua.Batch is loaded, so that the faults below meet the calls that
	// decide.
	if r := bh.serve("warm-up"); r.status != http.StatusOK || !r.fromRedis() {
		t.Fatalf("first request: %d, degraded %v", r.status, r.degraded)
	}
	if !topo.cluster {
		if err := lua.Batch.Load(context.Background(), bh.admin).Err(); err != nil {
			t.Fatal(err)
		}
	}
	return bh
}

type bfHandler struct {
	*Handler
	topo  *bfTopology
	b     *bucket.Batched
	admin *redis.Client
}

func (h *bfHandler) serve(user string) served { return serve(h.Handler, "X-User", user, "X-IP", bfIP) }

// charges returns the tokens taken from a bucket of capacity at key; 0
// when it has no state. It reads with GETRANGE, not GET: see above.
func (h *bfHandler) charges(t *testing.T, key string, capacity int64) int64 {
	t.Helper()
	v, err := h.admin.GetRange(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatalf("GETRANGE %s: %v", key, err)
	}
	if v == "" {
		return 0
	}
	n, _ := decodeTokens(t, v)
	return capacity - n
}

func (h *bfHandler) userCharges(t *testing.T, user string) int64 {
	return h.charges(t, h.keyer.Key("user", user, ""), bfUserCap)
}

func (h *bfHandler) ipCharges(t *testing.T) int64 {
	return h.charges(t, h.keyer.Key("ip", bfIP+"/32", ""), bfIPCap)
}

// settle waits until no call is queued or under way and the buckets that
// the server's scripts read (GET calls) stand still: every call sent has
// run. It returns that count.
func (h *bfHandler) settle(t *testing.T) int64 {
	t.Helper()
	var last int64 = -1
	redistest.WaitFor(t, 10*time.Second, "the calls to settle", func() error {
		if q, r := h.b.Pending(); q != 0 || r != 0 {
			return fmt.Errorf("%d queued, %d batches under way", q, r)
		}
		n := redistest.Calls(t, h.admin, "get")
		if n != last {
			last = n
			return fmt.Errorf("%d buckets read", n)
		}
		return nil
	})
	return last
}

// hold serves user with the proxy holding the reply to its call for d,
// and returns once the call has passed the proxy.
func (h *bfHandler) hold(t *testing.T, user string, d time.Duration) <-chan served {
	t.Helper()
	h.topo.proxy.DelayReplyTo("evalsha", d)
	out := make(chan served, 1)
	go func() { out <- h.serve(user) }()
	redistest.WaitFor(t, 10*time.Second, "the held call to pass the proxy", func() error {
		if h.topo.proxy.Armed() {
			return errors.New("not yet")
		}
		return nil
	})
	return out
}

// bucketsPerRequest is how many buckets one request's decision reads: its
// user's and the IP's.
const bucketsPerRequest = 2

// wantExact checks the charges after the requests of users: each user
// bucket charged at most once, and once for each request Redis allowed;
// the IP bucket charged once per decision that ran on it; and the buckets
// Redis read (read, every one allowing) accounted for by those charges.
func (h *bfHandler) wantExact(t *testing.T, users []string, results map[string]served, ipBefore, read int64) {
	t.Helper()
	var userSum int64
	for _, u := range users {
		n := h.userCharges(t, u)
		if n > 1 {
			t.Errorf("%s charged %d times, want at most 1", u, n)
		}
		if r := results[u]; r.fromRedis() && r.status == http.StatusOK && n != 1 {
			t.Errorf("%s allowed by redis but charged %d times", u, n)
		}
		userSum += n
	}
	ip := h.ipCharges(t) - ipBefore
	if h.topo.cluster {
		// A request's two scripts, one per slot, run or fail alone.
		if userSum+ip != read || ip > int64(len(users)) {
			t.Errorf("user buckets charged %d, ip bucket %d; redis read %d buckets: want every bucket read charged once",
				userSum, ip, read)
		}
	} else if userSum != ip || read < userSum || read > 2*userSum {
		t.Errorf("user buckets charged %d, ip bucket %d; redis read %d buckets: want the ip bucket charged once per "+
			"user bucket, and each decision that ran reading its user bucket and at most once the ip bucket", userSum, ip, read)
	}
}

// TestBatchFaults injects faults under batching on each topology.
func TestBatchFaults(t *testing.T) {
	for _, name := range []string{"single", "sentinel", "cluster"} {
		t.Run(name, func(t *testing.T) {
			topo := startBFTopology(t, name)
			t.Run("lost_batch", func(t *testing.T) { bfLostBatch(t, topo) })
			t.Run("delayed_reply", func(t *testing.T) { bfDelayedReply(t, topo) })
			t.Run("concurrent_faults", func(t *testing.T) { bfConcurrentFaults(t, topo) })
		})
	}
}

// bfLostBatch: a call is under way (its reply held); 20 requests queue
// behind it and go as one batch, whose reply the proxy loses after Redis
// ran it. Every request of the batch is decided by on_redis_error (503),
// at once rather than at the timeout; the held request is allowed by
// Redis; no script runs twice.
func bfLostBatch(t *testing.T, topo *bfTopology) {
	bfLoseBatch(t, topo.handler(t, "bf:lost:", 5*time.Second))
}

// bfLoseBatch runs bfLostBatch's scenario on h.
func bfLoseBatch(t *testing.T, h *bfHandler) {
	topo := h.topo
	ipBefore, before := h.ipCharges(t), h.settle(t)
	lost := topo.proxy.Lost()
	held := h.hold(t, "held", 300*time.Millisecond)
	users := make([]string, 20)
	results := map[string]served{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range users {
		users[i] = "lost-" + strconv.Itoa(i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := h.serve(users[i])
			mu.Lock()
			results[users[i]] = r
			mu.Unlock()
		}()
	}
	waitPending(t, h.b, len(users), 1) // the requests queued behind the held one
	topo.proxy.LoseReplyTo("evalsha")  // the next write of a script: the batch
	wg.Wait()
	if r := <-held; r.status != http.StatusOK || !r.fromRedis() {
		t.Errorf("held request: %d, degraded %v; want allowed by redis", r.status, r.degraded)
	}
	if n := topo.proxy.Lost() - lost; n != 1 {
		t.Fatalf("the proxy lost %d replies, want 1", n)
	}
	for _, u := range users {
		if r := results[u]; r.status != http.StatusServiceUnavailable || !r.degraded || r.latency > 2*time.Second {
			t.Errorf("%s: %d, degraded %v, in %v; want 503 from on_redis_error deny, at once", u, r.status, r.degraded, r.latency)
		}
	}
	read := h.settle(t) - before
	var batchRan int64 // the lost batch's decisions that Redis ran: their user buckets charged
	for _, u := range users {
		batchRan += h.userCharges(t, u)
	}
	t.Logf("redis read %d buckets and ran %d of the lost batch's %d decisions", read, batchRan, len(users))
	if batchRan == 0 || h.userCharges(t, "held") != 1 {
		t.Errorf("the lost batch ran %d decisions, held charged %d; want the held request charged once and the lost batch run",
			batchRan, h.userCharges(t, "held"))
	}
	h.wantExact(t, append(users, "held"), results, ipBefore, read)
}

// bfDelayedReply: the proxy holds a request's reply past the timeout. The
// request is decided by on_redis_error (503) at the timeout; its scripts
// ran once and are never sent again, even after the held reply comes; the
// next request on the same bucket finds it charged once. The requests
// queued behind the held call meanwhile go in the next batch, each
// charged at most once (bucket's TestBatchedDelayedReply shows that those
// whose timeout ends in the queue are never sent).
func bfDelayedReply(t *testing.T, topo *bfTopology) {
	const timeout = 300 * time.Millisecond
	h := topo.handler(t, "bf:late:", timeout)
	ipBefore, before := h.ipCharges(t), h.settle(t)
	delayed := topo.proxy.Delayed()
	held := h.hold(t, "late", 4*timeout)
	// Requests that queue behind the held call.
	users := []string{"late"}
	results := map[string]served{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 0; i < 5; i++ {
		u := "queued-" + strconv.Itoa(i)
		users = append(users, u)
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := h.serve(u)
			mu.Lock()
			results[u] = r
			mu.Unlock()
		}()
	}
	r := <-held
	wg.Wait()
	results["late"] = r
	if r.status != http.StatusServiceUnavailable || !r.degraded || r.latency > 3*timeout {
		t.Errorf("held request: %d, degraded %v, in %v; want 503 from on_redis_error at the %v timeout",
			r.status, r.degraded, r.latency, timeout)
	}
	redistest.WaitFor(t, 10*time.Second, "the held reply to come", func() error {
		if topo.proxy.Delayed() == delayed {
			return errors.New("not yet")
		}
		return nil
	})
	read := h.settle(t) - before
	if n := h.userCharges(t, "late"); n != 1 {
		t.Errorf("late charged %d times, want 1: its scripts ran, once", n)
	}
	queuedCharged := int64(0)
	for _, u := range users[1:] {
		queuedCharged += h.userCharges(t, u)
		if r := results[u]; r.status != http.StatusOK && !r.degraded {
			t.Errorf("%s: %d, want allowed or decided by on_redis_error", u, r.status)
		}
	}
	t.Logf("redis read %d buckets; the %d requests queued behind the held one were charged %d", read, len(users)-1, queuedCharged)
	h.wantExact(t, users, results, ipBefore, read)
	if r := h.serve("late"); r.fromRedis() {
		if got := foRemaining(r)["user"]; got != strconv.Itoa(bfUserCap-2) {
			t.Errorf("the next request on late: user r=%s, want %d (charged once before)", got, bfUserCap-2)
		}
	}
}

// bfConcurrentFaults: 50 clients send 20 requests each while the proxy
// loses the reply to a batch, or holds one past the timeout, in turn: each
// fault is armed once Redis has allowed a request after the last one met
// its batch, so that faults and answered batches alternate however fast
// the machine runs. Every request is allowed by Redis or decided by
// on_redis_error; afterwards the charges are exactly the scripts Redis
// ran, never more than one per request.
func bfConcurrentFaults(t *testing.T, topo *bfTopology) {
	const (
		timeout  = 100 * time.Millisecond
		clients  = 50
		requests = 20
	)
	h := topo.handler(t, "bf:load:", timeout)
	ipBefore, before := h.ipCharges(t), h.settle(t)
	lost, delayed := topo.proxy.Lost(), topo.proxy.Delayed()

	stop, chaosDone := make(chan struct{}), make(chan struct{})
	var allowed atomic.Int64 // requests allowed by Redis so far
	// await polls until cond holds; false when the load is over first.
	await := func(cond func() bool) bool {
		for !cond() {
			select {
			case <-stop:
				return false
			case <-time.After(time.Millisecond): // polling; nothing is timed by it
			}
		}
		return true
	}
	go func() {
		defer close(chaosDone)
		for i := 0; ; i++ {
			seen := allowed.Load()
			if !await(func() bool { return allowed.Load() > seen }) {
				return
			}
			if i%2 == 0 {
				topo.proxy.LoseReplyTo("evalsha")
			} else {
				topo.proxy.DelayReplyTo("evalsha", 3*timeout/2)
			}
			if !await(func() bool { return !topo.proxy.Armed() }) {
				return
			}
		}
	}()
	users := make([]string, 0, clients*requests)
	results := make(map[string]served, clients*requests)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < requests; i++ {
				u := "load-" + strconv.Itoa(c) + "-" + strconv.Itoa(i)
				r := h.serve(u)
				if r.status == http.StatusOK && r.fromRedis() {
					allowed.Add(1)
				}
				mu.Lock()
				users, results[u] = append(users, u), r
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(stop)
	<-chaosDone
	topo.proxy.Disarm()
	read := h.settle(t) - before

	byOutcome := map[string]int{}
	for _, u := range users {
		r := results[u]
		switch {
		case r.status == http.StatusOK && r.fromRedis():
			byOutcome["allowed by redis"]++
		case r.status == http.StatusServiceUnavailable && r.degraded:
			byOutcome["on_redis_error"]++
		default:
			byOutcome["other"]++
			t.Errorf("%s: %d, degraded %v; want allowed by redis or 503 from on_redis_error", u, r.status, r.degraded)
		}
	}
	t.Logf("%d requests: %v; %d replies lost, %d held past the timeout; redis read %d buckets",
		len(users), byOutcome, topo.proxy.Lost()-lost, topo.proxy.Delayed()-delayed, read)
	if byOutcome["on_redis_error"] == 0 || byOutcome["allowed by redis"] == 0 ||
		topo.proxy.Lost() == lost || topo.proxy.Delayed() == delayed {
		t.Errorf("faults not exercised: %v, %d lost, %d held", byOutcome, topo.proxy.Lost()-lost, topo.proxy.Delayed()-delayed)
	}
	if read > int64(len(users))*bucketsPerRequest {
		t.Errorf("redis read %d buckets for %d requests: more than one decision per request", read, len(users))
	}
	h.wantExact(t, users, results, ipBefore, read)
}

// TestBatchBreakerCountsABatchOnce: a batch whose reply is lost is one
// failure for the circuit breaker, not one per request in it: after a
// lost batch of 20 requests the breaker (3 failures in a row) is still
// closed and Redis decides the next request.
func TestBatchBreakerCountsABatchOnce(t *testing.T) {
	topo := startBFTopology(t, "single")
	h := topo.handlerWithBreaker(t, "bf:breaker:", 5*time.Second, 3)
	bfLoseBatch(t, h)
	if s := h.conn.breaker.State(); s != gobreaker.StateClosed {
		t.Errorf("breaker %v after one lost batch, want closed", s)
	}
	foWantRedis(t, "the request after the lost batch", serve(h.Handler, "X-User", "after", "X-IP", bfIP), http.StatusOK, bfUserCap-1)
}

// TestBatchPipelineConfig: redis { pipeline on|off } in the Caddyfile and
// JSON; the default batches; off gives each call its own round trip (the
// client itself as the store's), and on and off are two clients.
func TestBatchPipelineConfig(t *testing.T) {
	for _, tc := range []struct {
		line string
		want *bool
		err  string
	}{
		{"", nil, ""},
		{"pipeline on", new(true), ""},
		{"pipeline off", new(false), ""},
		{"pipeline yes", nil, `invalid redis pipeline "yes": must be on or off`},
		{"pipeline", nil, "wrong argument count"},
	} {
		h := new(Handler)
		d := caddyfile.NewTestDispenser("token_bucket {\n\tredis {\n\t\taddress 127.0.0.1:6379\n\t\t" + tc.line +
			"\n\t}\n\tdimension user {http.request.header.X-User}\n\ttier free {\n\t\tuser 10 1/s\n\t}\n}")
		err := h.UnmarshalCaddyfile(d)
		switch {
		case tc.err != "":
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: %v; want an error with %q", tc.line, err, tc.err)
			}
		case err != nil:
			t.Errorf("%q: %v", tc.line, err)
		case (h.Redis.Pipeline == nil) != (tc.want == nil) || (tc.want != nil && *h.Redis.Pipeline != *tc.want):
			t.Errorf("%q: pipeline %v, want %v", tc.line, h.Redis.Pipeline, tc.want)
		}
	}

	srv := redistest.Start(t)
	on := provisionHandler(t, foHandler(&RedisConfig{Address: []string{srv.Addr}}, PolicyDeny, 3))
	off := provisionHandler(t, foHandler(&RedisConfig{Address: []string{srv.Addr}, Pipeline: new(false)}, PolicyDeny, 3))
	if !DefaultPipeline {
		on, off = off, on
	}
	if s, ok := on.conn.store.(bucket.Redis); !ok {
		t.Errorf("store %T", on.conn.store)
	} else if _, ok := s.Client.(*bucket.Batched); !ok {
		t.Errorf("pipeline on: the store's client is %T, want *bucket.Batched", s.Client)
	}
	if s, ok := off.conn.store.(bucket.Redis); !ok || s.Client != redis.Scripter(off.conn.client) {
		t.Errorf("pipeline off: the store is %T over %T, want the client itself", off.conn.store, off.conn.client)
	}
	if on.conn == off.conn {
		t.Error("pipeline on and off share one client")
	}
	for _, h := range []*Handler{on, off} {
		foBurstFromRedis(t, h, "u"+strconv.FormatBool(h == on), 3)
	}
}
